"""The grouped SwiGLUs that dropless / expert_parallel can run (`execution.grouped_matmul`) == the plain
`jax.lax.ragged_dot` version and the loop reference, values and gradients (weights included), with uneven and
empty groups and padding rows past sum(group_sizes): `slab` (each of its branches forced), `blocked`, and
`tokamax` (its `xla` implementation through tokamax's own VJP on CPU; the GPU kernels in the GPU-only test); with
row scales (dropless's gates before the down projection) too."""

import builtins
import functools
import types

import jax
import jax.extend.core  # jaxprs_in_params (jax.core lost it in JAX 0.11)
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import kernel_accuracy
from moe import router
from moe.dispatch import experts, kernels
from moe.dispatch.kernels import slab, tokamax_swiglu

N, D, E, F = 48, 12, 6, 10
SIZES = {
    "balanced": [7, 8, 6, 9, 8, 10],  # fits the smallest slab
    "skewed": [30, 0, 2, 0, 9, 7],  # no slab holds 30 rows: the padded-block fallback
    "empty_and_padding": [5, 0, 7, 3, 0, 6],  # 21 of 48 rows in groups, the rest padding
    "skewed_and_padding": [20, 0, 2, 0, 5, 1],  # the fallback with 20 padding rows
}


def _inputs(dtype=jnp.float32, n=N, d=D, f=F):
    return kernel_accuracy.inputs(dtype, n, d, f, E)


_value_and_grads = kernel_accuracy.value_and_grads
# Dropless (gates before the down projection) against the loop reference (gates after it) is an identity of real
# arithmetic: compare it in true fp32. A GPU's default fp32 matmul is TF32 (10-bit mantissa), whose roundings
# differ between the two orders by ~1e-3 relative (H200, GPU run 7).
FP32_MATMULS = jax.default_matmul_precision("highest")


def _assert_matches_ragged_dot(fn, sizes, rtol=1e-5, atol=1e-5):
    x, ws = _inputs()
    (got_loss, got_grads), got_y = _value_and_grads(fn, sizes, x, ws)
    (want_loss, want_grads), want_y = _value_and_grads(kernels.grouped_swiglu_ragged, sizes, x, ws)
    np.testing.assert_allclose(got_y, want_y, rtol=rtol, atol=atol)
    assert float(jnp.abs(got_y[sum(sizes):]).max(initial=0.0)) == 0.0  # padding rows give exactly 0
    np.testing.assert_allclose(got_loss, want_loss, rtol=rtol, atol=atol)
    for a, b in zip(got_grads, want_grads):  # d/dx, d/dw_gate, d/dw_up, d/dw_down
        np.testing.assert_allclose(a, b, rtol=10 * rtol, atol=10 * atol)


def test_slab_layouts_are_static_cheapest_first_ending_with_the_fallback():
    lays = slab.layouts(8192, 64)  # the default train step's 2 x 4,096 rows over 64 experts
    costs = [lay.cost(64) for lay in lays]
    assert costs == sorted(costs)
    assert {lay.block for lay in lays[:-1]} == {32}  # spill blocks: a quarter of the mean 128 rows per expert
    assert lays[-1].block == 64  # the fallback's blocks
    assert all(lay.capacity % 8 == 0 and lay.capacity <= 8192 for lay in lays)
    assert (128, 16, 32) in lays and (160, 0, 32) in lays  # mean slabs + N / 16 spill; a 1.25x slab, no spill
    C, S, b = lays[-1]  # the padded-block fallback: every row in blocks, room for any routing
    assert C == 0 and S * b >= 8192 + 64 * (b - 1)
    assert slab.layouts(10, 2, (), (4.0,), block=8)[0].capacity == 10  # never more than N


def test_spill_layouts_are_the_default_on_cpu_only():
    assert slab.default_layout_sets("cpu") == (slab.SPILL_FRACTIONS, slab.SLAB_FACTORS, 0,
                                                       slab.FALLBACK_BLOCK)
    # elsewhere pure slabs of 1.25 / 1.5 / 2 / 2.5 / 3 x the mean 128 rows, all kept, then fallback blocks of 64
    # rows at this size (a quarter of the mean: 32, raised to 64)
    lays = slab.layouts(8192, 64, *slab.default_layout_sets("gpu"))
    assert lays == ((160, 0, 64), (192, 0, 64), (256, 0, 64), (320, 0, 64), (384, 0, 64), (0, 191, 64))
    # configs/gpu_1b.py's 16 x 2048 tokens, top-6: 512-row fallback blocks (compute-bound weight gathers), whose
    # padding stays under N / 4 at 64 experts
    N = 16 * 2048 * 6
    for E in (8, 64):
        C, S, b = slab.layouts(N, E, *slab.default_layout_sets("gpu"))[-1]
        assert (C, b) == (0, 512) and S == -(-(N + E * (b - 1)) // b) and E * (b - 1) < N / 4
    assert slab.fallback_block_rows(N, 64) == 512 and slab.fallback_block_rows(6 * 8, 64) == 64


def test_a_layout_fits_when_its_spill_blocks_hold_the_rows_past_the_slabs():
    sizes = jnp.asarray([7, 8, 6, 9, 8, 10])  # rows past 8: 0 0 0 1 0 2 -> one 4-row block each for two experts
    assert bool(slab.fits(sizes, slab.Layout(8, 2, 4)))
    assert not bool(slab.fits(sizes, slab.Layout(8, 1, 4)))
    assert not bool(slab.fits(sizes, slab.Layout(9, 0, 4)))
    assert bool(slab.fits(sizes, slab.Layout(10, 0, 4)))


@pytest.mark.parametrize("case", sorted(SIZES))
def test_slab_equals_ragged_dot(case):
    _assert_matches_ragged_dot(slab.grouped_swiglu_slab, SIZES[case])


LAYOUTS = slab.layouts(N, E, block=4, fallback_block=4)  # slabs of 8 rows + 1, 2, 3, 6 spill blocks; a 16-row slab; blocks


@pytest.mark.parametrize("weight_sum", slab.WEIGHT_SUMS)
@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: f"C{lay.capacity}-S{lay.spill_blocks}")
def test_slab_each_layout_equals_ragged_dot(lay, weight_sum):
    """Each layout (slab only, slab + spill, blocks only) through the hand-written VJP: run where it fits the
    routing, the fallback where it does not; every layout fits at least one case. The blocks' weight gradients
    summed per expert by a scatter-add (CPU) or a one-hot matmul (elsewhere)."""
    layouts_fn = slab.grouped_swiglu_layouts((lay, LAYOUTS[-1]), weight_sum)
    fn = lambda x, gs, *ws: layouts_fn(x, gs, None, *ws)  # no row scales
    fit = [bool(slab.fits(jnp.asarray(s), lay)) for s in SIZES.values()]
    assert any(fit)
    assert {lay.spill_blocks > 0 for lay in LAYOUTS} == {True, False} and LAYOUTS[-1].capacity == 0
    for sizes in SIZES.values():
        _assert_matches_ragged_dot(fn, sizes)


def _scatters(jaxpr):
    """Every scatter-add equation in a jaxpr, its sub-jaxprs (switch branches, custom VJPs) included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scatter-add":
            yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _scatters(sub)


def test_slab_backward_sums_block_weight_gradients_with_an_unsorted_scatter_or_a_matmul():
    """The blocks' weight gradients are summed per expert by a scatter-add that must not claim sorted indices:
    XLA:GPU's sorted-scatter emitter unrolls each [D, F] update into every thread, a kernel ptxas does not
    compile within minutes at model widths. Off the CPU a one-hot matmul sums them instead:
    no scatter-add of weights at all (no atomics: the same gradient bit for bit, run after run)."""
    x, ws = _inputs()
    sizes = jnp.asarray(SIZES["skewed"])

    def weight_scatters(how):
        grad = jax.grad(lambda *a: slab.grouped_swiglu_slab(a[0], sizes, *a[1:], weight_sum=how).sum(),
                        argnums=(0, 1, 2, 3))
        scatters = list(_scatters(jax.make_jaxpr(grad)(x, *ws).jaxpr))
        return [e for e in scatters if e.invars[2].aval.ndim == 3]  # [blocks, D, F] updates

    weight_sums = weight_scatters("scatter")
    assert weight_sums and not any(e.params["indices_are_sorted"] for e in weight_sums)
    assert weight_scatters("matmul") == []
    assert slab.weight_sum_for("cpu") == "scatter" and slab.weight_sum_for("gpu") == "matmul"
    with pytest.raises(ValueError, match="weight_sum"):
        slab.grouped_swiglu_slab(x, sizes, *ws, weight_sum="atomic")


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_slab_in_bf16_is_as_close_to_the_fp32_truth_as_ragged_dot_in_bf16(backend):
    """bf16 in and out, with each backend's layouts (CPU's spill layouts sum the weight gradients of slab and spill
    parts in bf16; GPU's pure slabs): per output, the error against the fp32 truth is within ragged_dot's own bf16
    error (+25%, +0.02 of the largest entry), and finite. Both errors are ~1% at these inputs, so the slack
    dominates: this catches a wrong row or a precision loss of several bf16 ulps, not an error twice ragged_dot's
    (the slack stays until these inputs' errors are known on a GPU)."""
    fractions, factors, block, fallback = slab.default_layout_sets(backend)
    slab_fn = functools.partial(slab.grouped_swiglu_slab, fractions=fractions, factors=factors, block=block,
                                fallback_block=fallback, weight_sum=slab.weight_sum_for(backend))
    x, ws = kernel_accuracy.inputs(jnp.bfloat16)
    for sizes in SIZES.values():
        got = kernel_accuracy.relative_errors(slab_fn, sizes, x, ws)
        ref = kernel_accuracy.relative_errors(kernels.grouped_swiglu_ragged, sizes, x, ws)
        assert (got <= 1.25 * ref + 0.02).all(), f"y, dx, dw_gate, dw_up, dw_down: {got} vs ragged_dot {ref}"


@pytest.mark.parametrize("lay", [(8, 2, 4), (8, 6, 4), (0, 24, 4), (16, 0, 4)], ids=str)
def test_layout_autodiff_is_the_twin_of_the_hand_written_gradient(lay):
    """One layout under plain autodiff (its forward maps alone) == ragged_dot where it fits."""
    lay = slab.Layout(*lay)
    for sizes in SIZES.values():
        if bool(slab.fits(jnp.asarray(sizes), lay)):
            _assert_matches_ragged_dot(functools.partial(slab.grouped_swiglu_layout, layout=lay), sizes)


@pytest.mark.parametrize("case", sorted(SIZES))
def test_blocked_equals_ragged_dot(case):
    _assert_matches_ragged_dot(functools.partial(kernels.grouped_swiglu_blocked, block=4), SIZES[case])


def _scaled(fn):
    """fn(x, group_sizes, *ws, row_scale=s) as a function of (x, group_sizes, *ws, s)."""
    return lambda x, gs, *args: fn(x, gs, *args[:3], row_scale=args[3])


def _slab_branch(lay):  # one slab layout (its fallback where it does not fit), with row scales, by its own VJP
    fn = slab.grouped_swiglu_layouts((lay, LAYOUTS[-1]), slab.weight_sum_for("cpu"))
    return lambda x, gs, *args: fn(x, gs, args[3], *args[:3])


SCALED = {"ragged_dot": _scaled(kernels.grouped_swiglu_ragged), "slab": _scaled(slab.grouped_swiglu_slab),
          "blocked": _scaled(functools.partial(kernels.grouped_swiglu_blocked, block=4)),
          "tokamax": _scaled(tokamax_swiglu.grouped_swiglu_tokamax),
          **{f"slab_C{lay.capacity}-S{lay.spill_blocks}": _slab_branch(lay) for lay in LAYOUTS}}


@pytest.mark.parametrize("name", sorted(SCALED))
def test_row_scales_scale_each_rows_output(name):
    """With row_scale (dropless's gates, applied to each row's SwiGLU product before the down projection), every
    grouped SwiGLU is s_n x its unscaled output (the down projection is linear), in values and in the gradients
    of x, the weights and the scales themselves; padding rows still give 0."""
    if name == "tokamax" and not tokamax_swiglu.available():
        pytest.skip(tokamax_swiglu.INSTALL_HINT)
    x, ws = _inputs()
    s = jax.random.uniform(jax.random.key(7), (N,), jnp.float32, 0.1, 2.0)
    want_fn = lambda x, gs, *args: args[3][:, None] * kernels.grouped_swiglu_ragged(x, gs, *args[:3])
    for sizes in SIZES.values():
        (got_loss, got_g), got_y = _value_and_grads(SCALED[name], sizes, x, (*ws, s))
        (want_loss, want_g), want_y = _value_and_grads(want_fn, sizes, x, (*ws, s))
        np.testing.assert_allclose(got_y, want_y, rtol=1e-5, atol=1e-5)
        assert float(jnp.abs(got_y[sum(sizes):]).max(initial=0.0)) == 0.0
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-5)
        assert len(got_g) == 5
        for a, b in zip(got_g, want_g, strict=True):  # d/dx, d/dw_gate, d/dw_up, d/dw_down, d/ds
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("grouped", ["slab", "ragged_dot", "blocked"])
@pytest.mark.parametrize("permute", ["scatter", "gather"])
def test_dropless_gates_gradient_equals_the_loop_reference(grouped, permute):
    """dropless applies the gates inside the experts: its gradients for x, the gates and the weights equal the loop
    reference's, which weights each expert's output."""
    x, ws = _inputs()
    _, ids, gates = router.route(x, jax.random.normal(jax.random.key(5), (D, E)), jnp.zeros(E), top_k=2)
    loss = lambda fn, x, gates, *ws: jnp.sum(jnp.sin(fn(x, ids, gates, *ws)))
    fn = functools.partial(experts.dropless, grouped=grouped, permute=permute)
    grads = lambda f: jax.jit(jax.grad(functools.partial(loss, f), argnums=(0, 1, 2, 3, 4)))(x, gates, *ws)
    with FP32_MATMULS:
        for a, b in zip(grads(fn), grads(experts.reference)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("platform_name", ["cpu", "cuda", "tpu"])
def test_auto_is_slab_on_cpu_and_gpu_with_that_platforms_layouts(platform_name):
    fn = kernels.grouped_swiglu_for("auto", platform_name)
    if platform_name == "tpu":
        assert fn is kernels.grouped_swiglu_ragged
    else:
        assert fn.func is slab.grouped_swiglu_slab and fn.keywords == {"platform_name": platform_name}
    assert kernels.grouped_swiglu_for("blocked", platform_name) is kernels.grouped_swiglu_blocked


needs_tokamax = pytest.mark.skipif(not tokamax_swiglu.available(), reason=tokamax_swiglu.INSTALL_HINT)


@needs_tokamax
@pytest.mark.parametrize("case", sorted(SIZES))
def test_tokamax_equals_ragged_dot(case):
    """tokamax's best implementation for this backend (`xla` on CPU) with its own VJP (the weight gradient is its
    ragged-contracting dot), values and gradients."""
    _assert_matches_ragged_dot(tokamax_swiglu.grouped_swiglu_tokamax, SIZES[case])


@needs_tokamax
def test_tokamax_dropless_equals_loop_reference():
    x, ws = _inputs()
    w_router = jax.random.normal(jax.random.key(5), (D, E))

    def loss(fn, x, w_router, ws):
        _, ids, gates = router.route(x, w_router, jnp.zeros(E), top_k=2)
        return jnp.sum(jnp.sin(fn(x, ids, gates, *ws)))

    tok = functools.partial(experts.dropless, grouped="tokamax")
    with FP32_MATMULS:
        got = jax.jit(jax.value_and_grad(functools.partial(loss, tok), argnums=(0, 1, 2)))(x, w_router, ws)
        want = jax.jit(jax.value_and_grad(functools.partial(loss, experts.reference), argnums=(0, 1, 2)))(
            x, w_router, ws)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_tokamax_missing_is_a_one_line_error(monkeypatch):
    real_import = builtins.__import__

    def no_tokamax(name, *a, **k):
        if name == "tokamax":
            raise ImportError("No module named 'tokamax'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tokamax)
    x, ws = _inputs()
    with pytest.raises(ImportError, match=r"pip install") as e:
        kernels.grouped_swiglu_for("tokamax")(x, jnp.asarray(SIZES["balanced"], jnp.int32), *ws)
    assert "\n" not in str(e.value)


def _on_nvidia_gpu() -> bool:
    try:
        return any("NVIDIA" in d.device_kind for d in jax.devices("gpu"))
    except RuntimeError:
        return False


# The GPU kernels' shapes (benchmarks/kernel_accuracy.py): Mosaic-GPU copies rows with TMA, whose strides must be
# multiples of 16 bytes (the CPU tests' 12 x 10 fails with "async_copy requires all GMEM strides ... multiple of 16
# bytes"). Same three cases, 256 rows of width 128.
GPU_SIZES = kernel_accuracy.CASES


def _tokamax_has(implementation: str) -> bool:
    tokamax_swiglu.available()  # imports tokamax the way the model does
    # optional package (skipped without it); private, but the only list of what registered
    from tokamax._src.ops.ragged_dot import api

    return {"mosaic": "mosaic_gpu"}.get(implementation, implementation) in api.IMPLEMENTATIONS


@needs_tokamax
@pytest.mark.parametrize("implementation", ["xla", "triton", "mosaic"])
@pytest.mark.parametrize("case", sorted(GPU_SIZES))
def test_tokamax_kernel_bf16_error_is_ragged_dots(implementation, case):
    """tokamax's kernels (Pallas Triton, Mosaic-GPU on Hopper+; `xla` anywhere), bf16 in / fp32 accumulation: their
    error against the fp32 truth, values and gradients, is XLA ragged_dot's own bf16 error (+25%, +0.02 of the
    largest entry), and finite. Not compared to bf16 ragged_dot directly: two bf16 paths round differently
    (benchmarks/kernel_accuracy.py)."""
    on_gpu = _on_nvidia_gpu()
    if implementation != "xla" and not on_gpu:
        pytest.skip("needs an NVIDIA GPU (JAX_PLATFORMS=cuda)")
    if implementation == "mosaic" and float(getattr(jax.devices("gpu")[0], "compute_capability", 0)) < 9:
        pytest.skip("tokamax's Mosaic-GPU kernel needs sm90 (Hopper) or later")
    if not _tokamax_has(implementation):  # tokamax registers its Triton kernel only with jax-triton installed
        pytest.skip(f"tokamax has no {implementation} ragged_dot here (Triton: needs jax-triton, triton>=3.7)")
    fn = functools.partial(tokamax_swiglu.grouped_swiglu_tokamax, implementation=implementation)
    x, ws = kernel_accuracy.inputs(jnp.bfloat16)
    with jax.default_device(jax.devices("gpu" if on_gpu else "cpu")[0]):
        got = kernel_accuracy.relative_errors(fn, GPU_SIZES[case], x, ws)
        xla_bf16 = kernel_accuracy.relative_errors(kernels.grouped_swiglu_ragged, GPU_SIZES[case], x, ws)
    assert np.isfinite(got).all(), f"non-finite output or gradient: relative errors {got}"
    assert (got <= 1.25 * xla_bf16 + 0.02).all(), f"y, dx, dw_gate, dw_up, dw_down: {got} vs ragged_dot {xla_bf16}"


def _ragged_dot_with_garbage_padding(a_NxK, w_ExKxM, group_sizes_E, **_):
    """A stand-in for a GPU kernel that leaves rows past the last group unwritten (NaN here), in its output and in
    its input gradient, and whose weight gradient reads those rows as if they were the last group's (a kernel
    working tile by tile would): what tokamax's Mosaic-GPU ragged dot does on a Hopper GPU."""
    valid_Nx1 = (jnp.arange(a_NxK.shape[0]) < group_sizes_E.sum())[:, None]
    garbage = lambda a: jnp.where(valid_Nx1, a, jnp.nan)

    @jax.custom_vjp
    def dot(a, w):
        return garbage(jax.lax.ragged_dot(a, w, group_sizes_E))

    def bwd(res, ct):
        a, w = res
        everything = group_sizes_E.at[-1].add(a.shape[0] - group_sizes_E.sum())
        dw = jax.vjp(lambda w: jax.lax.ragged_dot(a, w, everything), w)[1](ct)[0]
        return garbage(jax.lax.ragged_dot(ct, jnp.swapaxes(w, 1, 2), group_sizes_E)), dw

    dot.defvjp(lambda a, w: (dot(a, w), (a, w)), bwd)
    return dot(a_NxK, w_ExKxM)


@pytest.mark.parametrize("case", sorted(SIZES))
def test_tokamax_wrapper_masks_a_kernels_garbage_padding_rows(case, monkeypatch):
    """Exact values and gradients through a kernel that writes nothing to padding rows (no tokamax needed)."""
    monkeypatch.setattr(tokamax_swiglu, "_tokamax",
                        lambda: types.SimpleNamespace(ragged_dot=_ragged_dot_with_garbage_padding))
    _assert_matches_ragged_dot(tokamax_swiglu.grouped_swiglu_tokamax, SIZES[case])


def test_tma_alignment_rule():
    """The widths tokamax's Mosaic-GPU kernel takes (16-byte row strides) and the ones it refuses."""
    assert tokamax_swiglu.tma_aligned(jnp.bfloat16, 1024, 320)  # configs/gpu_1b.py
    assert not tokamax_swiglu.tma_aligned(jnp.bfloat16, D, F)  # 24- and 20-byte rows
    assert tokamax_swiglu.tma_aligned(jnp.float32, 12, 8) and not tokamax_swiglu.tma_aligned(jnp.float32, 10)
