"""What every grouped SwiGLU backend shares: the name remat keeps their residuals by, the row scales, batched
SwiGLU and the row <-> group bookkeeping. Rows are token copies sorted by expert; group e holds expert e's rows."""

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


def scale_rows(h_xF, scale_x):
    """h's rows times their scales (fp32, one per row: h's shape without its last axis; None: h as is), multiplied
    in fp32 and rounded once to h's dtype: the gates applied to each row's SwiGLU product before the down
    projection (`dropless`)."""
    if scale_x is None:
        return h_xF
    return (h_xF.astype(jnp.float32) * scale_x[..., None]).astype(h_xF.dtype)


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
    while loop of log2(E) steps, among the largest XLA ops of the train step on a GPU; on XLA:CPU this costs no
    more than searchsorted."""
    marks = jnp.zeros(n + 1, jnp.int32).at[jnp.clip(ends_G, 0, n)].add(1)
    return jnp.cumsum(marks)[:n]


def group_of_rows(sizes_G, n_rows: int):
    """(group_R, offset_R, start_G): group of each of n_rows consecutive rows laid out group after group (the
    number of groups for rows past the last group) and its row within its group."""
    end_G = jnp.cumsum(sizes_G)
    start_G = end_G - sizes_G
    group_R = positions_per_end(end_G, n_rows)
    offset_R = jnp.arange(n_rows) - jnp.append(start_G, end_G[-1])[group_R]
    return group_R, offset_R, start_G
