"""Routed-expert computation: sum_k g_{t,k} * SwiGLU_{e_{t,k}}(x_t).

`dropless` is the fast path (sort token copies by expert, grouped matmul: per-expert slabs + batched matmuls on CPU
and GPU, `jax.lax.ragged_dot` on TPU);
`capacity` is GShard-style (one-hot dispatch/combine einsums around batched matmuls, at most C tokens per
expert and group, the rest dropped); `reference` is the plain loop over experts both are tested against. All take
  x_TxD, ids_TxK (chosen experts), gates_TxK (fp32), and expert weights w_gate/w_up [E,D,F], w_down [E,F,D].
The expert-parallel (shard_map + all_to_all) path is in moe/expert_parallel.py.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# The name of the routed experts' residuals: what a block rematerialized with execution.remat_policy="save_moe"
# keeps (moe/model.py). The rest of the block (attention, norms, router, shared experts) is recomputed.
SAVED = "moe_experts"


def saved(x):
    """x named as a routed-expert residual (a no-op unless a remat policy saves the name)."""
    return checkpoint_name(x, SAVED)


def swiglu(x, w_gate, w_up, w_down):
    return jnp.dot(jax.nn.silu(jnp.dot(x, w_gate)) * jnp.dot(x, w_up), w_down)


def reference(x_TxD, ids_TxK, gates_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD):
    """Every expert on every token, weighted by its gate (0 where not chosen). O(E) compute: tests only."""
    E = w_gate_ExDxF.shape[0]
    y_TxD = jnp.zeros(x_TxD.shape, jnp.float32)
    for e in range(E):
        g_T = jnp.where(ids_TxK == e, gates_TxK, 0.0).sum(-1)
        out_TxD = swiglu(x_TxD, w_gate_ExDxF[e], w_up_ExDxF[e], w_down_ExFxD[e])
        y_TxD = y_TxD + g_T[:, None] * out_TxD.astype(jnp.float32)
    return y_TxD.astype(x_TxD.dtype)


def scale_rows(h_xF, scale_x):
    """h's rows times their scales (fp32, one per row: h's shape without its last axis; None: h as is), multiplied
    in fp32 and rounded once to h's dtype: the gates applied to each row's SwiGLU product before the down
    projection (`dropless`)."""
    if scale_x is None:
        return h_xF
    return (h_xF.astype(jnp.float32) * scale_x[..., None]).astype(h_xF.dtype)


def grouped_swiglu_ragged(x_NxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, row_scale=None):
    """SwiGLU of expert e on rows of group e (rows sorted by expert) with `jax.lax.ragged_dot`; row_scale (fp32
    [N], or None) scales each row's product before the down projection (`scale_rows`)."""
    a_NxF = saved(jax.lax.ragged_dot(x_NxD, w_gate_ExDxF, group_sizes_E))
    h_NxF = jax.nn.silu(a_NxF) * saved(jax.lax.ragged_dot(x_NxD, w_up_ExDxF, group_sizes_E))
    return jax.lax.ragged_dot(scale_rows(h_NxF, row_scale), w_down_ExFxD, group_sizes_E)


def swiglu_batched(x_BxSxD, w_gate_BxDxF, w_up_BxDxF, w_down_BxFxD, scale=None):
    """Batched SwiGLU (b: an expert's slab, a padded block with its expert's weights, ...): (y, and the gate and
    up pre-activations, which hand-written backward passes save instead of recomputing them). scale: the rows'
    scales [B, S] of their product before the down projection (`scale_rows`; None: 1)."""
    a_BxSxF = saved(jnp.einsum("bsd,bdf->bsf", x_BxSxD, w_gate_BxDxF))
    b_BxSxF = saved(jnp.einsum("bsd,bdf->bsf", x_BxSxD, w_up_BxDxF))
    h_BxSxF = scale_rows(jax.nn.silu(a_BxSxF) * b_BxSxF, scale)
    return jnp.einsum("bsf,bfd->bsd", h_BxSxF, w_down_BxFxD), a_BxSxF, b_BxSxF


def positions_per_end(ends_G, n: int):
    """For each position r in [0, n): how many of the ascending ends_G are <= r (== jnp.searchsorted(ends_G,
    arange(n), side="right")), by a cumsum over n positions of E marks. searchsorted's default method is a
    while loop of log2(E) steps, which the H200 profile of the train step listed among its largest XLA ops
    (docs/performance.md, GPU run 6); on XLA:CPU this costs 0.7-0.8 ms at 196,608 rows, searchsorted 0.6-2.0."""
    marks = jnp.zeros(n + 1, jnp.int32).at[jnp.clip(ends_G, 0, n)].add(1)
    return jnp.cumsum(marks)[:n]


def _group_of_rows(sizes_G, n_rows: int):
    """(group_R, offset_R, start_G): group of each of n_rows consecutive rows laid out group after group (the
    number of groups for rows past the last group) and its row within its group."""
    end_G = jnp.cumsum(sizes_G)
    start_G = end_G - sizes_G
    group_R = positions_per_end(end_G, n_rows)
    offset_R = jnp.arange(n_rows) - jnp.append(start_G, end_G[-1])[group_R]
    return group_R, offset_R, start_G


def grouped_swiglu_blocked(x_NxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, block: int = 64,
                           row_scale=None):
    """The same grouped SwiGLU with plain batched matmuls: each expert's rows are padded to whole blocks of
    `block` rows and every block is multiplied by its expert's weights (gathered per block).

    Exact, like ragged_dot, for any group sizes, at the cost of a static bound of N + E * (block - 1) rows
    computed and one weight gather per block (a scatter-add in the backward pass). `slab` (moe/grouped_slab.py)
    puts most rows in per-expert slabs with the weights in place and only the rest in such blocks. (A version
    moving rows by gathers instead of the scatter below measured 1.3x slower at 64 experts on XLA:CPU under
    autodiff, whose backward then scatter-adds: kept as is. `slab`'s hand-written VJP gathers both ways, and
    there gathers are the faster: docs/performance.md, "sixth session".)
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


def _slab(*args, **kw):
    from moe.grouped_slab import grouped_swiglu_slab  # own file: the exact balanced-routing fast path

    return grouped_swiglu_slab(*args, **kw)


def _tokamax(*args, **kw):
    from moe.grouped_kernels import grouped_swiglu_tokamax  # optional dependency, imported on use

    return grouped_swiglu_tokamax(*args, **kw)


GROUPED_SWIGLU = {"ragged_dot": grouped_swiglu_ragged, "blocked": grouped_swiglu_blocked,
                  "slab": _slab, "tokamax": _tokamax}


def grouped_swiglu_for(grouped_matmul: str = "auto"):
    """The grouped SwiGLU by name (`execution.grouped_matmul`). auto, by measurement (docs/performance.md): `slab`
    on CPU (XLA:CPU lowers ragged_dot -- and tokamax, whose only CPU implementation is ragged_dot -- densely over
    all experts) and on GPU (H200, configs/gpu_1b.py at 8 experts: train step 265 ms against tokamax's 315 and
    ragged_dot's 606); `ragged_dot` elsewhere (TPU: not measured). A callable is returned as is (a grouped SwiGLU
    of the same signature: (x_NxD, group_sizes_E, w_gate, w_up, w_down, row_scale=None), row_scale scaling each
    row's SwiGLU product before the down projection, as `dropless` passes its gates)."""
    if callable(grouped_matmul):
        return grouped_matmul
    if grouped_matmul == "auto":
        grouped_matmul = "slab" if jax.default_backend() in ("cpu", "gpu") else "ragged_dot"
    return GROUPED_SWIGLU[grouped_matmul]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def permute_copies(x_TxD, order_N, inverse_N, K: int):
    """x's rows in sorted-copy order (row n is token order_N[n] // K), with a VJP that gathers: token t's gradient
    is the sum of its K copies' rows, which sit at inverse_N[t*K : t*K+K]. Autodiff of the plain take would
    scatter-add N rows into T (atomics on GPU)."""
    return jnp.take(x_TxD, order_N // K, axis=0)


def _permute_fwd(x_TxD, order_N, inverse_N, K):
    return permute_copies(x_TxD, order_N, inverse_N, K), inverse_N


def _permute_bwd(K, inverse_N, dx_NxD):
    T = inverse_N.shape[0] // K
    d_TxKxD = jnp.take(dx_NxD, inverse_N, axis=0).reshape(T, K, -1)
    return d_TxKxD.astype(jnp.float32).sum(1).astype(dx_NxD.dtype), None, None


permute_copies.defvjp(_permute_fwd, _permute_bwd)


@jax.custom_vjp
def permute_rows(a_NxD, perm_N, inverse_N):
    """a's rows in the order perm_N (row n is a[perm_N[n]]), with a VJP that gathers by the inverse permutation
    (the transpose of a permutation is its inverse) instead of scatter-adding."""
    return jnp.take(a_NxD, perm_N, axis=0)


def _permute_rows_fwd(a_NxD, perm_N, inverse_N):
    return permute_rows(a_NxD, perm_N, inverse_N), inverse_N


def _permute_rows_bwd(inverse_N, d_NxD):
    return jnp.take(d_NxD, inverse_N, axis=0), None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def take_copies(x_TxD, order_N, inverse_N, K: int, permute: str):
    """x's rows for the sorted token copies (row n: token order_N[n] // K); its backward by `permute`'s rule
    (scatter: autodiff's scatter-add; gather: `permute_copies`)."""
    if permute == "gather":
        return permute_copies(x_TxD, order_N, inverse_N, K)
    return jnp.take(x_TxD, order_N // K, axis=0)


def take_rows(a_NxD, perm_N, inverse_N, permute: str):
    """a's rows in the order perm_N (a permutation; inverse_N its inverse); its backward by `permute`'s rule."""
    if permute == "gather":
        return permute_rows(a_NxD, perm_N, inverse_N)
    return jnp.take(a_NxD, perm_N, axis=0)


PERMUTES = ("scatter", "gather")


def permute_for(permute: str = "auto") -> str:
    """`execution.permute_grad` by name; auto, by measurement (docs/performance.md): scatter on CPU (the
    gathers made the layer 12-16% slower there), gather elsewhere (H200, gpu_1b's widths: the dispatch alone,
    forward + backward, 0.55 ms against the scatter-adds' 4.05; TPU not measured)."""
    if permute == "auto":
        return "scatter" if jax.default_backend() == "cpu" else "gather"
    if permute not in PERMUTES:
        raise ValueError(f"permute {permute!r}: one of auto, {', '.join(PERMUTES)}")
    return permute


def dropless(x_TxD, ids_TxK, gates_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, grouped="auto",
             constrain=lambda a, names: a, permute="auto"):
    """Sort the T*K token copies by expert and run each expert on exactly its tokens (no capacity, no drops).
    grouped: a `grouped_swiglu_for` name, or the grouped SwiGLU function itself. constrain: `Execution.constrain`
    when XLA partitions this over a mesh. permute: how the backward pass moves rows: "scatter" (autodiff of the
    gathers: scatter-adds), "gather" (permute_copies / permute_rows: gathers only; the same numbers up to the
    order of the K-copy sum) or "auto" (`permute_for`). The A/B is `benchmarks.moe_layer --dispatch
    dropless:scatter,dropless:gather`."""
    permute = permute_for(permute)
    T, K = ids_TxK.shape
    E = w_gate_ExDxF.shape[0]
    flat_ids_N = ids_TxK.reshape(-1)  # N = T*K token copies
    order_N = saved(jnp.argsort(flat_ids_N, stable=True))
    # Undo the sort with a gather by the inverse permutation; the inverse is a scatter of N integers, not a
    # second sort.
    inverse_N = saved(jnp.zeros_like(order_N).at[order_N].set(jnp.arange(order_N.shape[0], dtype=order_N.dtype),
                                                               unique_indices=True))
    x_NxD = take_copies(x_TxD, order_N, inverse_N, K, permute)
    # Every device needs every group size. Left to XLA's sharding propagation they may come out split along
    # `expert` (like the weights they index), and XLA:CPU then partitioned the padded-block fallback inside slab's
    # lax.switch wrongly (the last expert's rows came out 0; tests/test_sharding.py): pinned replicated.
    group_sizes_E = constrain(jnp.bincount(flat_ids_N, length=E).astype(jnp.int32), (None,))
    grouped_fn = grouped if callable(grouped) else grouped_swiglu_for(grouped)
    # Each copy's gate scales its SwiGLU product before the down projection (`scale_rows`), so the combine is a
    # plain sum and the gates' gradient, <h, dy W_down^T>, comes from what the backward pass has anyway. Scaling the
    # outputs instead needs the experts' output rows in the backward pass: under remat_policy="save_moe" the largest
    # residual of configs/gpu_1b.py's step (5.6 GiB of 19.3 planned at 8 experts; docs/performance.md).
    scale_N = take_rows(gates_TxK.astype(jnp.float32).reshape(-1, 1), order_N, inverse_N, permute)[:, 0]
    # Under remat_policy="save_moe" the backward pass reruns the gather into x_NxD (cheap), not the experts.
    y_sorted_NxD = grouped_fn(x_NxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, row_scale=scale_N)
    y_TxKxD = take_rows(y_sorted_NxD, inverse_N, order_N, permute).reshape(T, K, -1)
    return y_TxKxD.astype(jnp.float32).sum(1).astype(x_TxD.dtype)


def expert_capacity(S: int, K: int, E: int, capacity_factor: float) -> int:
    """Slots per expert and group of S tokens: ceil(cf * S * K / E), at most S (top-k experts are distinct, so
    one expert never gets more than S copies: cf >= E / K can drop nothing)."""
    return max(1, min(S, math.ceil(capacity_factor * S * K / E)))


def capacity_slots(ids_GxSxK, E: int, C: int):
    """Slot of each token copy in its expert's buffer, GShard priority: all first choices of the group before
    any second choice, then by position. Returns (slot_GxSxK, keep_GxSxK); kept iff slot < C."""
    G, S, K = ids_GxSxK.shape
    onehot_GxKSxE = jax.nn.one_hot(jnp.swapaxes(ids_GxSxK, 1, 2).reshape(G, K * S), E, dtype=jnp.int32)
    slot_GxKS = ((jnp.cumsum(onehot_GxKSxE, axis=1) - 1) * onehot_GxKSxE).sum(-1)
    slot_GxSxK = jnp.swapaxes(slot_GxKS.reshape(G, K, S), 1, 2)
    return slot_GxSxK, slot_GxSxK < C


def capacity_with_stats(x_TxD, ids_TxK, gates_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *,
                        capacity_factor: float = 1.25, group_size: int | None = None):
    """GShard dispatch: (y_TxD, keep_TxK). Tokens form groups of `group_size` (default: all T) with
    C = expert_capacity(group_size, ...) slots per expert each; copies past C are dropped (keep False).
    The dispatch tensor is [G, S, E, C]: memory and einsum FLOPs grow with S * E * C, so keep groups short."""
    T, K = ids_TxK.shape
    E = w_gate_ExDxF.shape[0]
    S = group_size or T
    G = T // S
    C = expert_capacity(S, K, E, capacity_factor)
    ids_GxSxK = ids_TxK.reshape(G, S, K)
    slot_GxSxK, keep_GxSxK = capacity_slots(ids_GxSxK, E, C)
    # [G,S,K,E] x [G,S,K,C] summed over K: each (token, expert) pair has at most one slot.
    where_GxSxKxE = jax.nn.one_hot(ids_GxSxK, E, dtype=jnp.float32) * keep_GxSxK[..., None]
    slot_GxSxKxC = jax.nn.one_hot(slot_GxSxK, C, dtype=jnp.float32)
    dispatch_GxSxExC = jnp.einsum("gske,gskc->gsec", where_GxSxKxE, slot_GxSxKxC)
    combine_GxSxExC = jnp.einsum("gske,gskc,gsk->gsec", where_GxSxKxE, slot_GxSxKxC,
                                 gates_TxK.reshape(G, S, K))
    dt = x_TxD.dtype
    x_GxSxD = x_TxD.reshape(G, S, -1)
    # The dispatched rows, pre-activations and expert outputs are kept under remat_policy="save_moe".
    x_ExGCxD = saved(jnp.einsum("gsec,gsd->egcd", dispatch_GxSxExC.astype(dt), x_GxSxD).reshape(E, G * C, -1))
    h_ExGCxF = jax.nn.silu(saved(jnp.einsum("end,edf->enf", x_ExGCxD, w_gate_ExDxF))) * saved(jnp.einsum(
        "end,edf->enf", x_ExGCxD, w_up_ExDxF))
    y_ExGxCxD = saved(jnp.einsum("enf,efd->end", h_ExGCxF, w_down_ExFxD).reshape(E, G, C, -1))
    y_GxSxD = jnp.einsum("gsec,egcd->gsd", combine_GxSxExC, y_ExGxCxD.astype(jnp.float32))
    return y_GxSxD.reshape(T, -1).astype(dt), keep_GxSxK.reshape(T, K)


def capacity(x_TxD, ids_TxK, gates_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, capacity_factor=1.25,
             group_size=None):
    return capacity_with_stats(x_TxD, ids_TxK, gates_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD,
                               capacity_factor=capacity_factor, group_size=group_size)[0]
