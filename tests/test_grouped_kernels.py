"""The grouped SwiGLUs that dropless / expert_parallel can run (`execution.grouped_matmul`) == the plain
`jax.lax.ragged_dot` version and the loop reference, values and gradients (weights included), with uneven and
empty groups and padding rows past sum(group_sizes): `slab` (each of its branches forced), `blocked`, and
`tokamax` (its `xla` implementation through tokamax's own VJP on CPU; the GPU kernels in the GPU-only test)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe import experts, grouped_kernels, grouped_slab

N, D, E, F = 48, 12, 6, 10
SIZES = {
    "balanced": [7, 8, 6, 9, 8, 10],  # fits the smallest slab
    "skewed": [30, 0, 2, 0, 9, 7],  # no slab holds 30 rows: the padded-block fallback
    "empty_and_padding": [5, 0, 7, 3, 0, 6],  # 21 of 48 rows in groups, the rest padding
}


def _inputs(dtype=jnp.float32, n=N, d=D, f=F):
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (n, d), dtype)
    ws = (jax.random.normal(ks[1], (E, d, f)) * 0.3, jax.random.normal(ks[2], (E, d, f)) * 0.3,
          jax.random.normal(ks[3], (E, f, d)) * 0.3)
    return x, tuple(w.astype(dtype) for w in ws)


def _value_and_grads(fn, sizes, x, ws):
    n, d = x.shape
    gs = jnp.asarray(sizes, jnp.int32)
    weight_N = jnp.arange(n * d, dtype=jnp.float32).reshape(n, d) / (n * d)
    loss = lambda x, *w: jnp.sum(jnp.sin(fn(x, gs, *w).astype(jnp.float32)) * weight_N)
    # fp32 products in full precision on every backend (GPUs default to TF32): these tests compare algorithms.
    with jax.default_matmul_precision("highest"):
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, *ws), jax.jit(fn)(x, gs, *ws)


def _assert_matches_ragged_dot(fn, sizes, rtol=1e-5, atol=1e-5):
    x, ws = _inputs()
    (got_loss, got_grads), got_y = _value_and_grads(fn, sizes, x, ws)
    (want_loss, want_grads), want_y = _value_and_grads(experts.grouped_swiglu_ragged, sizes, x, ws)
    np.testing.assert_allclose(got_y, want_y, rtol=rtol, atol=atol)
    assert float(jnp.abs(got_y[sum(sizes):]).max(initial=0.0)) == 0.0  # padding rows give exactly 0
    np.testing.assert_allclose(got_loss, want_loss, rtol=rtol, atol=atol)
    for a, b in zip(got_grads, want_grads):  # d/dx, d/dw_gate, d/dw_up, d/dw_down
        np.testing.assert_allclose(a, b, rtol=10 * rtol, atol=10 * atol)


def test_slab_capacities_are_static_multiples_of_8():
    assert grouped_slab.capacities(2048, 64) == (40, 48, 64)  # 1.25, 1.5, 2 x the mean 32 rows
    assert grouped_slab.capacities(N, E) == (16,)  # the three round up to one size
    assert grouped_slab.capacities(10, 2, (8.0,)) == (10,)  # never more than N


@pytest.mark.parametrize("case", sorted(SIZES))
def test_slab_equals_ragged_dot(case):
    _assert_matches_ragged_dot(grouped_slab.grouped_swiglu_slab, SIZES[case])


@pytest.mark.parametrize("factors", [(), (1.0,), (4.0,), (1.0, 2.0, 4.0)])
def test_slab_each_branch_equals_ragged_dot(factors):
    """No slab (blocked only), a slab too small for the largest group (fallback), a slab holding every group, and
    three slab sizes (8, 16, 32 rows) whose first, second and last branch the three cases take."""
    fn = functools.partial(grouped_slab.grouped_swiglu_slab, factors=factors, block=4)
    for sizes in SIZES.values():
        _assert_matches_ragged_dot(fn, sizes)


def test_padded_is_the_autodiff_twin_of_the_slab_branch():
    cap = max(max(s) for s in SIZES.values())
    _assert_matches_ragged_dot(functools.partial(grouped_slab.grouped_swiglu_padded, capacity=cap),
                               SIZES["skewed"])


@pytest.mark.parametrize("case", sorted(SIZES))
def test_blocked_equals_ragged_dot(case):
    _assert_matches_ragged_dot(functools.partial(experts.grouped_swiglu_blocked, block=4), SIZES[case])


def test_auto_is_slab_on_cpu():
    assert jax.default_backend() != "cpu" or experts.grouped_swiglu_for("auto") is experts.GROUPED_SWIGLU["slab"]


needs_tokamax = pytest.mark.skipif(not grouped_kernels.available(), reason=grouped_kernels.INSTALL_HINT)


@needs_tokamax
@pytest.mark.parametrize("case", sorted(SIZES))
def test_tokamax_equals_ragged_dot(case):
    """tokamax's best implementation for this backend (`xla` on CPU) with its own VJP (the weight gradient is its
    ragged-contracting dot), values and gradients."""
    _assert_matches_ragged_dot(grouped_kernels.grouped_swiglu_tokamax, SIZES[case])


@needs_tokamax
def test_tokamax_dropless_equals_loop_reference():
    from moe import router

    x, ws = _inputs()
    w_router = jax.random.normal(jax.random.key(5), (D, E))

    def loss(fn, x, w_router, ws):
        _, ids, gates = router.route(x, w_router, jnp.zeros(E), top_k=2)
        return jnp.sum(jnp.sin(fn(x, ids, gates, *ws)))

    tok = functools.partial(experts.dropless, grouped="tokamax")
    got = jax.jit(jax.value_and_grad(functools.partial(loss, tok), argnums=(0, 1, 2)))(x, w_router, ws)
    want = jax.jit(jax.value_and_grad(functools.partial(loss, experts.reference), argnums=(0, 1, 2)))(
        x, w_router, ws)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_tokamax_missing_is_a_one_line_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tokamax(name, *a, **k):
        if name == "tokamax":
            raise ImportError("No module named 'tokamax'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tokamax)
    x, ws = _inputs()
    with pytest.raises(ImportError, match=r"pip install") as e:
        experts.grouped_swiglu_for("tokamax")(x, jnp.asarray(SIZES["balanced"], jnp.int32), *ws)
    assert "\n" not in str(e.value)


def _on_nvidia_gpu() -> bool:
    try:
        return any("NVIDIA" in d.device_kind for d in jax.devices("gpu"))
    except RuntimeError:
        return False


# The GPU kernels' shapes: Mosaic-GPU copies rows with TMA, whose strides must be multiples of 16 bytes (D and F
# multiples of 8 in bf16; the CPU tests' 12 x 10 fails with "async_copy requires all GMEM strides ... multiple of
# 16 bytes", seen on an H200). Same three cases, 256 rows.
GPU_N, GPU_D, GPU_F = 256, 128, 128
GPU_SIZES = {
    "balanced": [40, 45, 38, 44, 42, 47],
    "skewed": [160, 0, 12, 0, 50, 34],
    "empty_and_padding": [30, 0, 40, 20, 0, 36],  # 126 of 256 rows in groups
}


def _tokamax_has(implementation: str) -> bool:
    grouped_kernels.available()  # imports tokamax the way the model does
    from tokamax._src.ops.ragged_dot import api  # private, but the only list of what registered

    return {"mosaic": "mosaic_gpu"}.get(implementation, implementation) in api.IMPLEMENTATIONS


@needs_tokamax
@pytest.mark.skipif(not _on_nvidia_gpu(), reason="needs an NVIDIA GPU (JAX_PLATFORMS=cuda)")
@pytest.mark.parametrize("implementation", ["triton", "mosaic"])
@pytest.mark.parametrize("case", sorted(GPU_SIZES))
def test_tokamax_gpu_kernel_equals_ragged_dot_bf16(implementation, case):
    """The Pallas GPU kernels themselves (Mosaic-GPU needs Hopper or later), bf16 in / fp32 accumulation,
    against jax.lax.ragged_dot with the same dtypes; values and gradients at bf16 tolerance."""
    if implementation == "mosaic" and float(getattr(jax.devices("gpu")[0], "compute_capability", 0)) < 9:
        pytest.skip("tokamax's Mosaic-GPU kernel needs sm90 (Hopper) or later")
    if not _tokamax_has(implementation):  # tokamax registers its Triton kernel only with jax-triton installed
        pytest.skip(f"tokamax has no {implementation} ragged_dot here (Triton: needs jax-triton, triton>=3.7)")
    fn = functools.partial(grouped_kernels.grouped_swiglu_tokamax, implementation=implementation)
    x, ws = _inputs(jnp.bfloat16, GPU_N, GPU_D, GPU_F)
    with jax.default_device(jax.devices("gpu")[0]):
        (got_loss, got_grads), got_y = _value_and_grads(fn, GPU_SIZES[case], x, ws)
        (want_loss, want_grads), want_y = _value_and_grads(experts.grouped_swiglu_ragged, GPU_SIZES[case], x, ws)
    f32 = lambda a: np.asarray(a, np.float32)
    np.testing.assert_allclose(f32(got_y), f32(want_y), rtol=2e-2, atol=2e-2)
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_allclose(f32(a), f32(b), rtol=5e-2, atol=5e-2)


def test_tma_alignment_rule():
    """The widths tokamax's Mosaic-GPU kernel takes (16-byte row strides) and the ones it refuses."""
    assert grouped_kernels.tma_aligned(jnp.bfloat16, 1024, 320)  # configs/gpu_1b.py
    assert not grouped_kernels.tma_aligned(jnp.bfloat16, D, F)  # 24- and 20-byte rows
    assert grouped_kernels.tma_aligned(jnp.float32, 12, 8) and not grouped_kernels.tma_aligned(jnp.float32, 10)
