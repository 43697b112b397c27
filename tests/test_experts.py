"""Dropless dispatch (sort + ragged_dot) == the loop-over-experts reference, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe import router
from moe.dispatch import experts, kernels


def _inputs(seed=0, T=40, D=12, E=8, F=10, K=3):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (T, D))
    w_router = jax.random.normal(ks[1], (D, E))
    ws = [jax.random.normal(ks[2], (E, D, F)) * 0.3, jax.random.normal(ks[3], (E, D, F)) * 0.3,
          jax.random.normal(ks[4], (E, F, D)) * 0.3]
    return x, w_router, ws, K


def _loss(fn, x, w_router, ws, K):
    # Route inside the loss so gradients flow through the gates into the router too.
    _, ids, gates = router.route(x, w_router, jnp.zeros(w_router.shape[1]), top_k=K)
    y = fn(x, ids, gates, *ws)
    return jnp.sum(jnp.sin(y) * jnp.arange(y.size).reshape(y.shape) / y.size)


# Compiled whole: run op by op, each distinct operation would be compiled on its own.
DROPLESS, REFERENCE = jax.jit(experts.dropless), jax.jit(experts.reference)
GRAD = jax.jit(jax.grad(_loss, argnums=(1, 2, 3)), static_argnums=(0, 4))


def test_dropless_equals_reference_values_and_grads():
    x, w_router, ws, K = _inputs()
    _, ids, gates = router.route(x, w_router, jnp.zeros(8), top_k=K)
    np.testing.assert_allclose(DROPLESS(x, ids, gates, *ws), REFERENCE(x, ids, gates, *ws), rtol=1e-5, atol=1e-5)
    g_fast = GRAD(experts.dropless, x, w_router, ws, K)
    g_ref = GRAD(experts.reference, x, w_router, ws, K)
    for a, b in zip(jax.tree.leaves(g_fast), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_dropless_with_empty_experts():
    x, _, ws, _ = _inputs(seed=1)
    ids = jnp.zeros((40, 2), jnp.int32).at[:, 1].set(5)  # only experts 0 and 5 get tokens
    gates = jnp.full((40, 2), 0.5)
    np.testing.assert_allclose(DROPLESS(x, ids, gates, *ws), REFERENCE(x, ids, gates, *ws), rtol=1e-5, atol=1e-5)


def test_blocked_and_ragged_grouped_matmuls_agree_with_reference():
    """Both dropless grouped-matmul implementations (whichever the backend picks), values and gradients."""
    x, w_router, ws, K = _inputs(seed=2, T=70)
    for grouped in (kernels.grouped_swiglu_ragged,
                    lambda *a, **kw: kernels.grouped_swiglu_blocked(*a, block=8, **kw)):  # small blocks: many boundaries
        fn = lambda *a, g=grouped: experts.dropless(*a, grouped=g)
        _, ids, gates = router.route(x, w_router, jnp.zeros(8), top_k=K)
        np.testing.assert_allclose(jax.jit(fn)(x, ids, gates, *ws), REFERENCE(x, ids, gates, *ws), rtol=1e-5,
                                   atol=1e-5)
        g_fast = GRAD(fn, x, w_router, ws, K)
        g_ref = GRAD(experts.reference, x, w_router, ws, K)
        for a, b in zip(jax.tree.leaves(g_fast), jax.tree.leaves(g_ref)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_blocked_grouped_matmul_zeroes_padding_rows_like_ragged_dot():
    x, _, ws, _ = _inputs(seed=3, T=30)
    sizes = jnp.asarray([5, 0, 7, 3, 0, 0, 6, 1], jnp.int32)  # 22 of 30 rows belong to a group
    ragged = jax.jit(kernels.grouped_swiglu_ragged)(x, sizes, *ws)
    blocked = jax.jit(kernels.grouped_swiglu_blocked, static_argnames="block")(x, sizes, *ws, block=4)
    np.testing.assert_allclose(blocked, ragged, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(blocked[22:]).max()) == 0.0


@pytest.mark.parametrize("K", [1, 2, 3])
def test_dropless_gather_permute_equals_scatter(K):
    """permute="gather" (custom VJPs that only gather) == autodiff's scatter-adds, values and every gradient,
    with uneven and empty experts."""
    T, D, E, F = 10, 6, 4, 5
    ks = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(ks[0], (T, D))
    # K distinct experts per token among the first 3: expert 3 gets none
    ids = jax.vmap(lambda k: jax.random.choice(k, 3, (K,), replace=False))(jax.random.split(ks[1], T))
    gates = jax.random.uniform(ks[2], (T, K))
    ws = (jax.random.normal(ks[3], (E, D, F)), jax.random.normal(ks[4], (E, D, F)),
          jax.random.normal(ks[4], (E, F, D)))

    def value_and_grads(permute):
        loss = lambda x, g, *w: jnp.sum(jnp.sin(experts.dropless(x, ids, g, *w, grouped="ragged_dot",
                                                                 permute=permute)))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(x, gates, *ws)

    (got, got_g), (want, want_g) = value_and_grads("gather"), value_and_grads("scatter")
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_positions_per_end_is_searchsorted():
    """The loop-free count of ends <= each position: equal ends (empty groups), ends at 0 and past n included."""
    rng = np.random.default_rng(0)
    for n, E in [(1, 1), (7, 3), (50, 8), (300, 64)]:
        ends = np.sort(rng.integers(0, n + 5, E))
        ends[: E // 3] = 0
        want = np.searchsorted(ends, np.arange(n), side="right")
        np.testing.assert_array_equal(kernels.positions_per_end(jnp.asarray(ends), n), want)
