"""`slab` grouped SwiGLU (`execution.grouped_matmul="slab"`): exact, and close to dense cost when routing is balanced.

Every expert's rows (already sorted by expert) go to a slab of C rows, and the experts run as [E, C, D] x [E, D, F]
batched matmuls: the weights are used in place (no per-block weight gather, so no weight scatter-add in the
backward pass), and rows move by gathers both ways (sorted row <-> slab slot is a bijection on the used rows,
so even the transposes are gathers). It is exact only while max(group_sizes) <= C, so C is picked on the data:
the smallest of the static slab sizes ceil(f * N / E), f in `factors`, that holds the largest group, else the
padded-block path (experts.grouped_swiglu_blocked), exact for any routing. The choice is one `lax.switch`.

The VJP is written by hand (`jax.custom_vjp`): differentiating a `lax.switch` makes XLA carry every branch's
residuals and cost ~2x here; every branch's forward keeps only the gate/up pre-activations, in sorted-row order
([N, F] whichever branch ran, so no branch pads them to the largest slab: ~7% faster at 8 experts on XLA:CPU;
the backward moves them and x back into its slab or blocks), so no backward recomputes a forward matmul. The
fallback matters in practice: a young router collapses (MaxVio 3-7 in the default run's first 40 steps), and
saving its pre-activations made that step x1.07 faster (docs/performance.md).
`grouped_swiglu_padded` (plain autodiff) and the loop reference are what the hand-written gradient is tested
against (tests/test_grouped_kernels.py).
"""

import functools
import math

import jax
import jax.numpy as jnp

from moe import experts

SLAB_FACTORS = (1.25, 1.5, 2.0)  # slab sizes tried, as multiples of the mean rows per expert N / E


def capacities(N: int, E: int, factors=SLAB_FACTORS) -> tuple[int, ...]:
    """The static slab sizes: ceil(f * N / E) rounded up to 8 rows, at most N."""
    return tuple(sorted({min(N, -(-math.ceil(f * N / E) // 8) * 8) for f in factors}))


def _layout(group_sizes_E, N: int, C: int):
    """src_ExC: the sorted row in slot (e, c) (N where empty); dest_N: the slot e * C + c of sorted row n (E * C
    for rows past sum(group_sizes) or past the slab). Each is the other's inverse on the used rows."""
    E = group_sizes_E.shape[0]
    start_E = jnp.cumsum(group_sizes_E) - group_sizes_E
    slot_C = jnp.arange(C)
    src_ExC = jnp.where(slot_C < group_sizes_E[:, None], start_E[:, None] + slot_C, N)
    group_N, offset_N, _ = experts._group_of_rows(group_sizes_E, N)
    dest_N = jnp.where((group_N < E) & (offset_N < C), group_N * C + offset_N, E * C)
    return src_ExC, dest_N


def _gather(a_RxD, idx):
    return jnp.take(a_RxD, idx, axis=0, mode="fill", fill_value=0)


def grouped_swiglu_padded(x_NxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, capacity: int):
    """One slab of `capacity` rows per expert, plain autodiff. Exact only when max(group_sizes) <= capacity."""
    N, D = x_NxD.shape
    E = group_sizes_E.shape[0]
    src_ExC, dest_N = _layout(group_sizes_E, N, capacity)
    y_ExCxD = experts.swiglu_batched(_gather(x_NxD, src_ExC), w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)[0]
    return _gather(y_ExCxD.reshape(E * capacity, D), dest_N)


def _swiglu_bwd(dy_BxCxD, x_BxCxD, a_BxCxF, b_BxCxF, w_gate_BxDxF, w_up_BxDxF, w_down_BxFxD):
    """experts.swiglu_batched's gradients (dx, dw_gate, dw_up, dw_down) from its saved pre-activations: no forward matmul
    is recomputed."""
    sig_a = jax.nn.sigmoid(a_BxCxF)
    silu_a = a_BxCxF * sig_a
    dw_down = jnp.einsum("ecf,ecd->efd", silu_a * b_BxCxF, dy_BxCxD)
    dh_BxCxF = jnp.einsum("ecd,efd->ecf", dy_BxCxD, w_down_BxFxD)
    db_BxCxF = dh_BxCxF * silu_a
    da_BxCxF = dh_BxCxF * b_BxCxF * sig_a * (1 + a_BxCxF * (1 - sig_a))  # silu'(a) = s + a s (1 - s)
    dw_gate = jnp.einsum("ecd,ecf->edf", x_BxCxD, da_BxCxF)
    dw_up = jnp.einsum("ecd,ecf->edf", x_BxCxD, db_BxCxF)
    dx_BxCxD = (jnp.einsum("ecf,edf->ecd", da_BxCxF, w_gate_BxDxF)
                + jnp.einsum("ecf,edf->ecd", db_BxCxF, w_up_BxDxF))
    return dx_BxCxD, dw_gate, dw_up, dw_down


def _slab_fwd(C, x_NxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD):
    N, D = x_NxD.shape
    E = group_sizes_E.shape[0]
    F = w_gate_ExDxF.shape[-1]
    src_ExC, dest_N = _layout(group_sizes_E, N, C)
    y_ExCxD, a_ExCxF, b_ExCxF = experts.swiglu_batched(_gather(x_NxD, src_ExC), w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
    # the pre-activations saved in sorted-row order: the same shape whatever slab ran (no padding to the largest)
    rows = lambda r: _gather(r.reshape(E * C, F), dest_N)
    return _gather(y_ExCxD.reshape(E * C, D), dest_N), (rows(a_ExCxF), rows(b_ExCxF))


def _slab_bwd(C, dy_NxD, res, x_NxD, group_sizes_E, *ws):
    N, D = dy_NxD.shape
    E = group_sizes_E.shape[0]
    src_ExC, dest_N = _layout(group_sizes_E, N, C)
    x_ExCxD, a_ExCxF, b_ExCxF = (_gather(r, src_ExC) for r in (x_NxD, *res))
    dy_ExCxD = _gather(dy_NxD, src_ExC)  # transpose of the output gather (a bijection on used rows)
    dx_ExCxD, *dws = _swiglu_bwd(dy_ExCxD, x_ExCxD, a_ExCxF, b_ExCxF, *ws)
    return _gather(dx_ExCxD.reshape(E * C, D), dest_N), *dws


def _blocked_fwd(block, x_NxD, group_sizes_E, *ws):
    """The fallback for any routing: experts.grouped_swiglu_blocked's padded blocks, saving the same sorted-row
    pre-activations as a slab branch (so its backward pass recomputes no forward matmul either)."""
    y_NxD, a_NxF, b_NxF = experts.blocked_swiglu_rows(x_NxD, group_sizes_E, *ws, block=block)
    return y_NxD, (a_NxF, b_NxF)


def _blocked_bwd(block, dy_NxD, res, x_NxD, group_sizes_E, *ws):
    N, D = x_NxD.shape
    E = group_sizes_E.shape[0]
    n_blocks, dest_N, used_N, expert_B = experts.padded_blocks(group_sizes_E, N, block)
    # rows past the groups get a zero output gradient, so they add nothing to any weight's gradient
    dy_NxD = jnp.where(used_N[:, None], dy_NxD, 0)
    to_blocks = lambda r: (jnp.zeros((n_blocks * block, r.shape[-1]), r.dtype).at[dest_N].set(r)
                           .reshape(n_blocks, block, -1))
    dx_BxSxD, *dws_B = _swiglu_bwd(to_blocks(dy_NxD), *(to_blocks(r) for r in (x_NxD, *res)),
                                   *(w[expert_B] for w in ws))
    # each block's weight gradient added into its expert's (blocks come in expert order)
    dws = [jax.ops.segment_sum(dw_B, expert_B, E, indices_are_sorted=True) for dw_B in dws_B]
    return jnp.where(used_N[:, None], dx_BxSxD.reshape(n_blocks * block, D)[dest_N], 0), *dws


def _uniform(branch):
    """The branch with every output made to vary like all its inputs together: inside shard_map, `lax.switch`
    needs equal varying-axes types on all branches (a zeros residual would otherwise be 'invariant'). Outside
    shard_map nothing varies and the branch runs as is (the `+ 0` would be a needless pass over every output)."""
    def wrapped(*args):
        leaves = jax.tree.leaves(args)
        if not any(_varying(a) for a in leaves):
            return branch(*args)
        zero = sum(jnp.ravel(a)[0].astype(jnp.float32) for a in leaves) * 0
        return jax.tree.map(lambda o: o + zero.astype(o.dtype), branch(*args))
    return wrapped


def _varying(a) -> frozenset:
    """The mesh axes `a` varies on inside shard_map (`aval.vma` in older JAX, `aval.mat.varying` in newer)."""
    t = jax.typeof(a)
    if hasattr(t, "vma"):
        return frozenset(t.vma)
    mat = getattr(t, "mat", None) or getattr(t, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()))


def _reduce_like(g, primal):
    """The cotangent summed over the mesh axes it varies on and its primal does not (inside shard_map: weights
    replicated over the token axes get their gradient summed over them, as autodiff's pvary transpose does)."""
    extra = tuple(sorted(_varying(g) - _varying(primal)))
    return jax.lax.psum(g, extra) if extra else g


@functools.cache
def _slab_fn(caps: tuple[int, ...], block: int):
    def index(group_sizes_E):  # the smallest slab that holds the largest group; len(caps): none does
        return jnp.searchsorted(jnp.asarray(caps, jnp.int32), group_sizes_E.max())

    @jax.custom_vjp
    def slab(x_NxD, group_sizes_E, *ws):
        return fwd(x_NxD, group_sizes_E, *ws)[0]

    def fwd(x_NxD, group_sizes_E, *ws):
        branches = [functools.partial(_slab_fwd, C) for C in caps] + [functools.partial(_blocked_fwd, block)]
        y_NxD, res = jax.lax.switch(index(group_sizes_E), [_uniform(b) for b in branches], x_NxD, group_sizes_E, *ws)
        return y_NxD, (res, x_NxD, group_sizes_E, ws)

    def bwd(saved, dy_NxD):
        res, x_NxD, group_sizes_E, ws = saved
        branches = [functools.partial(_slab_bwd, C) for C in caps] + [functools.partial(_blocked_bwd, block)]
        dx, dwg, dwu, dwd = jax.lax.switch(index(group_sizes_E), [_uniform(b) for b in branches], dy_NxD, res,
                                           x_NxD, group_sizes_E, *ws)
        grads = [_reduce_like(g, p) for g, p in zip((dx, dwg, dwu, dwd), (x_NxD, *ws))]
        return grads[0], None, *grads[1:]

    slab.defvjp(fwd, bwd)
    return slab


def grouped_swiglu_slab(x_NxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, factors=SLAB_FACTORS,
                        block: int = 64):
    """Exact grouped SwiGLU (rows past sum(group_sizes) give 0): see the module docstring."""
    caps = capacities(x_NxD.shape[0], group_sizes_E.shape[0], factors)
    if not caps:
        return experts.grouped_swiglu_blocked(x_NxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, block)
    return _slab_fn(caps, block)(x_NxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
