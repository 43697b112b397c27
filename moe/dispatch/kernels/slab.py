"""`slab` grouped SwiGLU (`execution.grouped_matmul="slab"`): exact for any routing, near dense cost when balanced.

A *layout* splits every expert's rows (already sorted by expert) in two:
- its first C rows go to its **slab** of C rows, and the experts run as `[E, C, D] x [E, D, F]` batched matmuls
  with the weights used in place (no weight gather, no weight scatter-add in the backward pass);
- the rows past C **spill** into S blocks of b rows (each expert's spill padded to whole blocks), run as
  `[S, b, D] x [S, D, F]` with each block's expert weights gathered (their gradients summed back per expert).
Rows move by gathers both ways (sorted row <-> slot is a bijection on the used rows, so even the transposes are
gathers). A layout is exact when the spill fits its S blocks. The layouts tried are static (`layouts`): slabs
of C = the mean rows per expert with spill budgets of `SPILL_FRACTIONS` of the rows, pure slabs
(`SLAB_FACTORS` x the mean, no spill), and the padded-block fallback (C = 0: every row in blocks, enough for
any routing). `default_layout_sets` picks them per backend: spill layouts on CPU; pure slabs of 1.25 - 3 x the
mean and a fallback of larger blocks elsewhere, where a spill block's gathered weights cost more than its rows
(see the constants below). The cheapest layout that fits runs, picked on the data by one `lax.switch`; their
costs are static. Balanced or not, the rows computed stay close to N: the busiest experts overflow into a few
blocks instead of sizing every expert's slab (at 64 experts and the router's initialization, ~1.2 N rows
against 1.5-2 N for slabs alone).

The VJP is written by hand (`jax.custom_vjp`): differentiating a `lax.switch` makes XLA carry every branch's
residuals and cost ~2x here. Every branch's forward keeps only the gate/up pre-activations, in sorted-row order
([N, F] whichever layout ran; the backward moves them and x back into its slots), so no backward recomputes a
forward matmul. `grouped_swiglu_layout` (one layout, plain autodiff) and the loop reference are what the
hand-written gradient is tested against (tests/test_grouped_kernels.py).
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe.dispatch import platform
from moe.dispatch.kernels.common import group_of_rows, positions_per_end, saved, scale_rows, swiglu_batched

SPILL_FRACTIONS = (1 / 16, 1 / 8, 3 / 16, 1 / 4, 1 / 2)  # spill budgets tried beside mean-sized slabs, x N rows
SLAB_FACTORS = (1.25,)  # pure slabs tried, as multiples of the mean rows per expert N / E
# Off the CPU: pure slabs, then the fallback, no spill layouts. At GPU widths a 64-row spill block gathers
# ~15x its rows' bytes in weights (configs/gpu_1b.py), a cost SPILL_ROW_COST (fitted on CPU) does not see, and
# 512-row spill blocks run no faster than slabs. On a GPU a slab of f x the mean rows costs about f / 4 of the
# 512-row fallback (forward + backward, 64 experts), so slabs beat the fallback while the busiest expert holds
# up to ~3.5x the mean rows: the pure slabs tried go up to 3x, which fits most layers of a freshly initialized
# configs/gpu_1b.py at 64 experts (busiest expert 2-2.6x the mean).
NO_SPILL_SLAB_FACTORS = (1.25, 1.5, 2.0, 2.5, 3.0)
NO_SPILL_BLOCK = 64
# The all-blocks fallback runs when the routing is collapsed (a young router). On CPU its blocks have 64 rows,
# whatever the spill blocks' size: faster there than 32-row blocks on a collapsed 64-expert routing.
FALLBACK_BLOCK = 64
# Off the CPU the fallback's blocks are larger (`fallback_block_rows`): each block gathers its expert's
# weights, 3 x D x F values for its b rows, so at configs/gpu_1b.py's widths a 64-row block moves ~15x its
# rows' bytes in weights and its matmuls run memory-bound, while a 512-row block does ~256 FLOPs per byte of
# gathered weight, above an H100's or H200's bf16 ridge (~200-300): on a skewed 64-expert routing 512-row
# blocks run ~5x faster than 64-row ones (`benchmarks.moe_layer --routing skewed`, gpu_report's fallback
# section). The fallback runs on routings past every pure slab (a young or collapsed router).
GPU_FALLBACK_BLOCK_MAX = 512
# A spill row's cost against a slab row's: its block's weights are gathered (and their gradients summed back).
# On XLA:CPU the blocks' matmuls run at the slabs' rate, and the weight gather and segment sums add ~25% (the
# default train step's profile at 64 experts).
SPILL_ROW_COST = 1.25


def default_layout_sets(backend: str) -> tuple[tuple[float, ...], tuple[float, ...], int, int]:
    """(spill fractions, slab factors, spill block rows, fallback block rows; 0: `spill_block_rows` /
    `fallback_block_rows`) for a backend: spill layouts and 64-row fallback blocks on CPU, pure slabs and larger
    fallback blocks elsewhere."""
    if backend == "cpu":
        return SPILL_FRACTIONS, SLAB_FACTORS, 0, FALLBACK_BLOCK
    return (), NO_SPILL_SLAB_FACTORS, NO_SPILL_BLOCK, 0


class Layout(NamedTuple):
    capacity: int  # C: slab rows per expert (0: no slab)
    spill_blocks: int  # S: blocks for the rows past each expert's slab (0: no spill)
    block: int  # b: rows per spill block

    def cost(self, n_experts: int) -> float:
        return n_experts * self.capacity + SPILL_ROW_COST * self.spill_blocks * self.block


def _quarter_mean_rows(N: int, E: int, lo: int, hi: int) -> int:
    """The power of 2 at or below a quarter of the mean rows per expert, clamped to [lo, hi]."""
    return int(min(hi, max(lo, 2 ** math.floor(math.log2(max(N / E / 4, 1))))))


def spill_block_rows(N: int, E: int) -> int:
    """About a quarter of the mean rows per expert, a power of 2 in [16, 64]: small enough that an expert just past
    its slab pads little, large enough for the batched matmul to stay efficient."""
    return _quarter_mean_rows(N, E, 16, 64)


def fallback_block_rows(N: int, E: int) -> int:
    """The fallback's block rows off the CPU: a power of 2 in [64, GPU_FALLBACK_BLOCK_MAX], at most a quarter of the
    mean rows per expert, so padding every expert to whole blocks adds under N / 4 rows (E x (b - 1)) where the
    rows allow more than 64."""
    return _quarter_mean_rows(N, E, 64, GPU_FALLBACK_BLOCK_MAX)


def layouts(N: int, E: int, fractions=SPILL_FRACTIONS, factors=SLAB_FACTORS, block: int = 0,
            fallback_block: int = FALLBACK_BLOCK) -> tuple[Layout, ...]:
    """The static layouts for N sorted rows and E experts, cheapest first; the last (the padded-block fallback, in
    blocks of `fallback_block` rows; 0: `fallback_block_rows`) fits any routing. Spill blocks have `block` rows
    (0: `spill_block_rows`). Slab sizes are rounded up to 8 rows, at most N. Spill layouts are kept only where
    cheaper than the fallback; pure slabs always (each is the fallback's alternative when its routing fits)."""
    b, fb = block or spill_block_rows(N, E), fallback_block or fallback_block_rows(N, E)
    round8 = lambda rows: min(N, -(-math.ceil(rows) // 8) * 8)
    fallback = Layout(0, -(-(N + E * (fb - 1)) // fb), fb)
    spills = {Layout(round8(N / E), math.ceil(f * N / b), b) for f in fractions}
    candidates = {lay for lay in spills if lay.cost(E) < fallback.cost(E)}
    candidates |= {Layout(round8(f * N / E), 0, b) for f in factors}
    return (*sorted(candidates, key=lambda lay: (lay.cost(E), lay)), fallback)


def fits(group_sizes_E, lay: Layout):
    """Whether every row past its expert's slab finds a place in the layout's spill blocks."""
    over_E = jnp.maximum(group_sizes_E - lay.capacity, 0)
    return jnp.sum(-(-over_E // lay.block)) <= lay.spill_blocks


class _Maps(NamedTuple):
    src_ExC: jax.Array  # the sorted row in slab slot (e, c); N where empty
    slab_N: jax.Array  # sorted row n's slab slot e * C + c; E * C (out of range) if not in a slab
    src_J: jax.Array  # the sorted row in spill slot j (block j // b); N where empty
    spill_N: jax.Array  # sorted row n's spill slot; S * b (out of range) if not spilled
    expert_S: jax.Array  # each spill block's expert (trailing empty blocks: the last expert)


def _maps(group_sizes_E, N: int, lay: Layout) -> _Maps:
    """Where each sorted row goes in the layout, and back. Rows past sum(group_sizes) go nowhere (output 0)."""
    C, S, b = lay
    E = group_sizes_E.shape[0]
    group_N, offset_N, start_E = group_of_rows(group_sizes_E, N)  # group_N == E past the groups
    in_group_N = group_N < E
    slot_C = jnp.arange(C)
    src_ExC = jnp.where(slot_C < group_sizes_E[:, None], start_E[:, None] + slot_C, N)
    slab_N = jnp.where(in_group_N & (offset_N < C), group_N * C + offset_N, E * C)
    over_E = jnp.maximum(group_sizes_E - C, 0)
    padded_E = -(-over_E // b) * b
    spill_end_E = jnp.cumsum(padded_E)
    spill_start_E = spill_end_E - padded_E
    g_N = jnp.minimum(group_N, E - 1)
    spill_N = jnp.where(in_group_N & (offset_N >= C), spill_start_E[g_N] + offset_N - C, S * b)
    slot_J = jnp.arange(S * b)
    expert_J = jnp.minimum(positions_per_end(spill_end_E, S * b), E - 1)
    offset_J = slot_J - spill_start_E[expert_J]
    # slots past the last spill fall to the last expert with offset_J >= its padded spill: empty
    src_J = jnp.where(offset_J < over_E[expert_J], start_E[expert_J] + C + offset_J, N)
    return _Maps(src_ExC, slab_N, src_J, spill_N, expert_J[::b])


def _gather(a_RxD, idx):
    return jnp.take(a_RxD, idx, axis=0, mode="fill", fill_value=0)


def _to_sorted_rows(maps: _Maps, slab, spill):
    """Rows of the slab ([E, C, W]) and spill ([S, b, W]) results back in sorted-row order ([N, W]; 0 where unused)."""
    out = 0
    if slab is not None:
        out = out + _gather(slab.reshape(-1, slab.shape[-1]), maps.slab_N)
    if spill is not None:
        out = out + _gather(spill.reshape(-1, spill.shape[-1]), maps.spill_N)
    return out


def _slot_scales(scale_N, idx, shape):
    """The rows' scales in the slots of idx (0 in empty slots), in `shape`; None stays None (no scale)."""
    return None if scale_N is None else _gather(scale_N, idx).reshape(shape)


def _layout_fwd(lay: Layout, x_NxD, group_sizes_E, scale_N, *ws):
    """The layout's forward: (y [N, D], and the gate and up pre-activations [N, F]), in sorted-row order. scale_N:
    each row's scale of its SwiGLU product before the down projection (None: 1)."""
    C, S, b = lay
    E = group_sizes_E.shape[0]
    maps = _maps(group_sizes_E, x_NxD.shape[0], lay)
    slab = spill = (None, None, None)
    if C:
        slab = swiglu_batched(_gather(x_NxD, maps.src_ExC), *ws,
                                      scale=_slot_scales(scale_N, maps.src_ExC, (E, C)))
    if S:
        x_SxbxD = _gather(x_NxD, maps.src_J).reshape(S, b, -1)
        spill = swiglu_batched(x_SxbxD, *(w[maps.expert_S] for w in ws),
                                       scale=_slot_scales(scale_N, maps.src_J, (S, b)))
    y_NxD, a_NxF, b_NxF = (_to_sorted_rows(maps, r, p) for r, p in zip(slab, spill))
    return y_NxD, (a_NxF, b_NxF)


def grouped_swiglu_layout(x_NxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, layout: Layout,
                          row_scale=None):
    """One layout's forward, plain autodiff: exact only when the layout fits the groups (`fits`)."""
    return _layout_fwd(layout, x_NxD, group_sizes_E, row_scale, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)[0]


def _swiglu_bwd(dy_BxCxD, x_BxCxD, a_BxCxF, b_BxCxF, s_BxC, w_gate_BxDxF, w_up_BxDxF, w_down_BxFxD):
    """swiglu_batched's gradients (dx, dw_gate, dw_up, dw_down, and the rows' scales' ds [B, C, 1], None
    without s; a trailing axis of 1 makes them rows for `_to_sorted_rows`) from its saved pre-activations: no
    forward matmul is recomputed."""
    sig_a = jax.nn.sigmoid(a_BxCxF)
    silu_a = a_BxCxF * sig_a
    h_BxCxF = silu_a * b_BxCxF
    dw_down = jnp.einsum("ecf,ecd->efd", scale_rows(h_BxCxF, s_BxC), dy_BxCxD)
    dh_BxCxF = jnp.einsum("ecd,efd->ecf", dy_BxCxD, w_down_BxFxD)  # d(s h)
    ds_BxCx1 = None
    if s_BxC is not None:  # d s = <h, d(s h)>; d h = s d(s h)
        ds_BxCx1 = jnp.sum(h_BxCxF.astype(jnp.float32) * dh_BxCxF.astype(jnp.float32), -1, keepdims=True)
        dh_BxCxF = scale_rows(dh_BxCxF, s_BxC)
    db_BxCxF = dh_BxCxF * silu_a
    da_BxCxF = dh_BxCxF * b_BxCxF * sig_a * (1 + a_BxCxF * (1 - sig_a))  # silu'(a) = s + a s (1 - s)
    dw_gate = jnp.einsum("ecd,ecf->edf", x_BxCxD, da_BxCxF)
    dw_up = jnp.einsum("ecd,ecf->edf", x_BxCxD, db_BxCxF)
    dx_BxCxD = (jnp.einsum("ecf,edf->ecd", da_BxCxF, w_gate_BxDxF)
                + jnp.einsum("ecf,edf->ecd", db_BxCxF, w_up_BxDxF))
    return dx_BxCxD, dw_gate, dw_up, dw_down, ds_BxCx1


WEIGHT_SUMS = ("scatter", "matmul")


def weight_sum_for(backend: str) -> str:
    """How the blocks' weight gradients are summed per expert (`sum_per_expert`): a scatter-add on CPU (the
    faster there), a matmul elsewhere (no atomics, so the gradient is the same bit for bit run after run; f32
    sums)."""
    return "scatter" if backend == "cpu" else "matmul"


def sum_per_expert(dw_SxDxF, expert_S, E: int, how: str):
    """Each block's weight gradient added into its expert's: [S, D, F] -> [E, D, F].
    scatter: `jax.ops.segment_sum`. The blocks come in expert order, but saying so (indices_are_sorted=True)
    sends XLA:GPU to a scatter emitter that unrolls each [D, F] update into every thread: a ~20 MB PTX kernel
    that ptxas does not compile within 9 minutes at configs/gpu_1b.py's widths; unsorted it compiles in well
    under a second, and runs at the same speed on XLA:CPU. On a GPU the scatter-add's atomics add in whatever
    order the threads run, so the gradient changes in its last bits from run to run.
    matmul: the blocks' one-hot expert matrix [S, E] contracted with the blocks' gradients, accumulated in f32:
    deterministic; 2 E S D F FLOPs (0.06 TFLOP per layer backward at configs/gpu_1b.py's 64 experts and 448
    fallback blocks: ~0.1 ms at an H100's bf16 peak)."""
    if how == "scatter":
        return jax.ops.segment_sum(dw_SxDxF, expert_S, E, indices_are_sorted=False)
    onehot_SxE = jax.nn.one_hot(expert_S, E, dtype=dw_SxDxF.dtype)
    return jnp.einsum("se,sdf->edf", onehot_SxE, dw_SxDxF, preferred_element_type=jnp.float32).astype(dw_SxDxF.dtype)


def _layout_bwd(lay: Layout, weight_sum: str, dy_NxD, res, x_NxD, group_sizes_E, scale_N, *ws):
    """The layout's gradients (dx, dw_gate, dw_up, dw_down, and d scale_N, None without scales) from the saved
    sorted-row pre-activations; the spill blocks' weight gradients summed per expert by `weight_sum`
    (`sum_per_expert`)."""
    C, S, b = lay
    E = group_sizes_E.shape[0]
    maps = _maps(group_sizes_E, x_NxD.shape[0], lay)
    rows = (dy_NxD, x_NxD, *res)  # rows past the groups are in no slot, so they add to no gradient
    dx_slab = dx_spill = ds_slab = ds_spill = None
    dws = [0, 0, 0]
    if C:
        dx_slab, *dws, ds_slab = _swiglu_bwd(*(_gather(r, maps.src_ExC) for r in rows),
                                             _slot_scales(scale_N, maps.src_ExC, (E, C)), *ws)
    if S:
        spilled = (_gather(r, maps.src_J).reshape(S, b, -1) for r in rows)
        dx_spill, *dws_S, ds_spill = _swiglu_bwd(*spilled, _slot_scales(scale_N, maps.src_J, (S, b)),
                                                 *(w[maps.expert_S] for w in ws))
        dws = [dw + sum_per_expert(dw_S, maps.expert_S, E, weight_sum) for dw, dw_S in zip(dws, dws_S)]
    ds_N = None if scale_N is None else _to_sorted_rows(maps, ds_slab, ds_spill)[:, 0]
    return _to_sorted_rows(maps, dx_slab, dx_spill), *dws, ds_N


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
def grouped_swiglu_layouts(lays: tuple[Layout, ...], weight_sum: str = "scatter"):
    """The exact grouped SwiGLU (x, group_sizes, scale, w_gate, w_up, w_down) running the first of `lays` that fits
    (the last must fit any routing); scale: each row's scale (fp32 [N]) of its SwiGLU product before the down
    projection, or None. The blocks' weight gradients are summed per expert by `weight_sum` (`sum_per_expert`)."""
    def index(group_sizes_E):  # the first (cheapest) layout that fits; the last fits any routing (sum <= N)
        return jnp.argmax(jnp.stack([fits(group_sizes_E, lay) for lay in lays[:-1]] + [jnp.array(True)]))

    def switch(parts, group_sizes_E, *args):
        if len(parts) == 1:
            return parts[0](*args)
        return jax.lax.switch(index(group_sizes_E), [_uniform(p) for p in parts], *args)

    @jax.custom_vjp
    def slab(x_NxD, group_sizes_E, scale_N, *ws):
        return fwd(x_NxD, group_sizes_E, scale_N, *ws)[0]

    def fwd(x_NxD, group_sizes_E, scale_N, *ws):
        parts = [functools.partial(_layout_fwd, lay) for lay in lays]
        y_NxD, res = switch(parts, group_sizes_E, x_NxD, group_sizes_E, scale_N, *ws)
        # The gate / up pre-activations kept under remat_policy="save_moe" (x_NxD is a gather, cheaply rerun).
        return y_NxD, (jax.tree.map(saved, res), x_NxD, group_sizes_E, scale_N, ws)

    def bwd(saved, dy_NxD):
        res, x_NxD, group_sizes_E, scale_N, ws = saved
        parts = [functools.partial(_layout_bwd, lay, weight_sum) for lay in lays]
        dx, dwg, dwu, dwd, ds = switch(parts, group_sizes_E, dy_NxD, res, x_NxD, group_sizes_E, scale_N, *ws)
        grads = [_reduce_like(g, p) for g, p in zip((dx, dwg, dwu, dwd), (x_NxD, *ws))]
        return grads[0], None, None if ds is None else _reduce_like(ds, scale_N), *grads[1:]

    slab.defvjp(fwd, bwd)
    return slab


def grouped_swiglu_slab(x_NxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, fractions=None, factors=None,
                        block: int = 0, fallback_block: int | None = None, weight_sum: str | None = None,
                        row_scale=None, platform_name: str | None = None):
    """Exact grouped SwiGLU (rows past sum(group_sizes) give 0): see the module docstring. fractions / factors /
    block: the spill budgets, pure slab sizes and spill block rows tried (None, 0: `default_layout_sets` of this
    backend); fallback_block: the fallback's block rows (None: this backend's; 0: `fallback_block_rows`);
    weight_sum: how blocks' weight gradients are summed per expert (None: `weight_sum_for` this backend);
    row_scale: each row's scale of its SwiGLU product before the down projection (fp32 [N]; `scale_rows`)."""
    backend = platform_name or platform.current()
    default_fractions, default_factors, default_block, default_fallback = default_layout_sets(backend)
    fractions = default_fractions if fractions is None else fractions
    factors = default_factors if factors is None else factors
    fallback_block = default_fallback if fallback_block is None else fallback_block
    lays = layouts(x_NxD.shape[0], group_sizes_E.shape[0], fractions, factors, block or default_block, fallback_block)
    weight_sum = weight_sum or weight_sum_for(backend)
    if weight_sum not in WEIGHT_SUMS:
        raise ValueError(f"weight_sum {weight_sum!r}: one of {', '.join(WEIGHT_SUMS)}")
    return grouped_swiglu_layouts(lays, weight_sum)(x_NxD, group_sizes_E, row_scale, w_gate_ExDxF, w_up_ExDxF,
                                                    w_down_ExFxD)
