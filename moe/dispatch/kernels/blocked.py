"""`blocked` grouped SwiGLU (`execution.grouped_matmul="blocked"`): each expert's rows padded to whole blocks,
plain batched matmuls; and the padded-block layout `slab` falls back to."""

import jax.numpy as jnp

from moe.dispatch.kernels.common import positions_per_end, swiglu_batched


def grouped_swiglu_blocked(x_NxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, block: int = 64,
                           row_scale=None):
    """The same grouped SwiGLU with plain batched matmuls: each expert's rows are padded to whole blocks of
    `block` rows and every block is multiplied by its expert's weights (gathered per block).

    Exact, like ragged_dot, for any group sizes, at the cost of a static bound of N + E * (block - 1) rows
    computed and one weight gather per block (a scatter-add in the backward pass). `slab`
    (moe/dispatch/kernels/slab.py) puts most rows in per-expert slabs with the weights in place and only the rest in
    such blocks. (Rows move in by the scatter below, not by gathers: under autodiff a gather's backward is a
    scatter-add, and gathering here runs ~1.3x slower at 64 experts on XLA:CPU. `slab`'s hand-written VJP
    gathers both ways, where gathers are the faster.)
    """
    N, D = x_NxD.shape
    ws = (w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
    n_blocks, dest_N, used_N, expert_B = padded_blocks(group_sizes_E, N, block)
    x_BxSxD = jnp.zeros((n_blocks * block, D), x_NxD.dtype).at[dest_N].set(x_NxD).reshape(n_blocks, block, D)
    scale = None
    if row_scale is not None:
        scale = jnp.zeros(n_blocks * block, jnp.float32).at[dest_N].set(row_scale).reshape(n_blocks, block)
    y_BxSxD = swiglu_batched(x_BxSxD, *(w[expert_B] for w in ws), scale=scale)[0]
    return jnp.where(used_N[:, None], y_BxSxD.reshape(n_blocks * block, D)[dest_N], 0)


def padded_blocks(group_sizes_E, N: int, block: int):
    """The padded-block layout of N sorted rows: (n_blocks, dest_N, used_N, expert_B). Each expert's rows are
    padded to whole blocks; dest_N is sorted row n's padded slot, used_N whether it is in a group (rows past
    sum(group_sizes), which ragged_dot allows, form a last, unpadded group whose output the caller zeroes),
    expert_B the expert of each block (trailing empty blocks: the last expert's; their rows stay zero)."""
    E = group_sizes_E.shape[0]
    n_blocks = -(-(N + E * (block - 1)) // block)  # static bound on sum_e ceil(size_e / block)
    sizes_G = jnp.concatenate([group_sizes_E, (N - group_sizes_E.sum())[None]])
    padded_G = (-(-sizes_G // block) * block).at[E].set(sizes_G[E])
    start_G = jnp.cumsum(sizes_G) - sizes_G
    padded_start_G = jnp.cumsum(padded_G) - padded_G
    group_N = jnp.repeat(jnp.arange(E + 1), sizes_G, total_repeat_length=N)
    dest_N = padded_start_G[group_N] + jnp.arange(N) - start_G[group_N]
    # Block b belongs to the expert whose padded range holds its first row.
    # (The padded ends are whole blocks: counting them per block index is searchsorted at the blocks' first rows.)
    expert_B = jnp.minimum(positions_per_end(jnp.cumsum(padded_G[:E]) // block, n_blocks), E - 1)
    return n_blocks, dest_N, group_N < E, expert_B
