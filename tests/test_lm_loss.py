"""The chunked LM head + cross-entropy (moe/lm_loss.py) against all logits at once: values and gradients; the
fused weighted objective (gradient computed in the forward pass) against autodiff of the plain one."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from moe import ModelConfig, Transformer
from moe.lm_loss import chunk_count, cross_entropy, weighted_cross_entropy
from tests.model_fixtures import ragged_execution

B, L, D, V = 2, 12, 8, 40


def _inputs():
    kx, kw, kt = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(kx, (B, L, D)), jax.random.normal(kw, (D, V)),
            jax.random.randint(kt, (B, L), 0, V))


@pytest.mark.parametrize("L_, chunks, want", [(12, 1, 1), (12, 4, 4), (12, 5, 4), (12, 100, 12), (7, 3, 1),
                                              (256, 8, 8), (1, 8, 1)])
def test_chunk_count_is_the_largest_divisor_not_above(L_, chunks, want):
    assert chunk_count(L_, chunks) == want


@jax.jit
def _losses_and_grads(x, head, targets, weights):
    """Per chunk count (1, 3, 4, 5 -> 4, 12): ce [B, L] and d(sum(weights * ce)) / d(x, head)."""
    out = {}
    for chunks in (1, 3, 4, 5, 12):
        def loss(x, head, chunks=chunks):
            ce = cross_entropy(x, head, targets, chunks)
            return (ce * weights).sum(), ce
        (_, ce), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, head)
        out[chunks] = (ce, grads)
    return out


def test_chunked_cross_entropy_equals_all_logits_at_once():
    x, head, targets = _inputs()
    weights = jax.random.uniform(jax.random.key(3), (B, L))  # uneven per-token cotangents reach every chunk
    out = _losses_and_grads(x, head, targets, weights)
    want = optax.softmax_cross_entropy_with_integer_labels(x @ head, targets)
    ce1, (dx1, dh1) = out[1]
    np.testing.assert_allclose(ce1, want, rtol=1e-5, atol=1e-6)
    for chunks, (ce, (dx, dh)) in out.items():
        np.testing.assert_allclose(ce, ce1, rtol=1e-5, atol=1e-6, err_msg=f"chunks={chunks}")
        np.testing.assert_allclose(dx, dx1, rtol=1e-5, atol=1e-6, err_msg=f"chunks={chunks}")
        np.testing.assert_allclose(dh, dh1, rtol=1e-5, atol=1e-6, err_msg=f"chunks={chunks}")


def test_model_token_losses_equal_the_logits_cross_entropy():
    cfg = ModelConfig(vocab_size=V, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32,
                      n_routed_experts=4, top_k=2, moe_d_ff=8, first_k_dense=1)
    model = Transformer(cfg, nnx.Rngs(0))
    tokens, targets = jax.random.randint(jax.random.key(1), (2, B, L), 0, V)
    graphdef, state = nnx.split(model)

    def via_logits(state):
        logits, _ = nnx.merge(graphdef, state)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).sum()

    def via_chunks(state):
        ce, _ = nnx.merge(graphdef, state).token_losses(tokens, targets, execution=ragged_execution(loss_chunks=3))
        return ce.sum()

    def via_fused_objective(state):  # what the train step differentiates
        _, aux = nnx.merge(graphdef, state).token_losses(tokens, targets, execution=ragged_execution(loss_chunks=3),
                                                         loss_weights_BxL=jax.numpy.ones((B, L)))
        return aux["objective"]

    want, g_want = jax.jit(jax.value_and_grad(via_logits))(state)
    for f in (via_chunks, via_fused_objective):
        got, g_got = jax.jit(jax.value_and_grad(f))(state)
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f.__name__)
        for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=f.__name__)


@jax.jit
def _fused_and_autodiff(x, head, targets, weights):
    """Per chunk count: (objective, ce) and d objective / d(x, head, weights), fused; then autodiff of all logits."""
    out = {}
    for chunks in (1, 3, 4):
        fused = lambda x, head, w, chunks=chunks: weighted_cross_entropy(x, head, targets, w, chunks)
        out[chunks] = jax.value_and_grad(fused, argnums=(0, 1, 2), has_aux=True)(x, head, weights)

    def plain(x, head, w):
        ce = cross_entropy(x, head, targets)
        return (w * ce).sum(), ce

    return out, jax.value_and_grad(plain, argnums=(0, 1, 2), has_aux=True)(x, head, weights)


def test_fused_weighted_objective_equals_autodiff_of_all_logits():
    x, head, targets = _inputs()
    weights = jax.random.uniform(jax.random.key(3), (B, L)).at[0, :5].set(0.0)  # masked tokens, uneven weights
    out, ((want, want_ce), want_grads) = _fused_and_autodiff(x, head, targets, weights)
    for chunks, ((got, ce), grads) in out.items():
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"chunks={chunks}")
        np.testing.assert_allclose(ce, want_ce, rtol=1e-5, atol=1e-6, err_msg=f"chunks={chunks}")
        for name, a, b in zip(("x", "head", "weights"), grads, want_grads, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"d/d{name}, chunks={chunks}")
    assert float(abs(out[3][1][0][0, :5]).max()) == 0.0  # a zero-weight token gets no gradient


def test_fused_objective_keeps_no_logits_for_the_backward_pass():
    """The point of fusing: autodiff of the plain loss saves [B*L, V]-sized residuals; the fused one, chunked,
    creates nothing that large outside its chunk loop."""
    x, head, targets = _inputs()
    weights = jax.numpy.ones((B, L))

    def big_outputs(loss):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, head).jaxpr
        return [v.aval.shape for e in jaxpr.eqns for v in e.outvars if np.prod(v.aval.shape) >= B * L * V]

    fused = lambda x, head: weighted_cross_entropy(x, head, targets, weights, chunks=4)[0]
    plain = lambda x, head: (weights * cross_entropy(x, head, targets)).sum()
    assert big_outputs(plain) and not big_outputs(fused)


def test_ce_values_carry_no_gradient():
    x, head, targets = _inputs()
    weights = jax.numpy.ones((B, L))
    dx = jax.grad(lambda x: weighted_cross_entropy(x, head, targets, weights, 3)[1].sum())(x)
    assert float(abs(dx).max()) == 0.0
