"""The chunked LM head + cross-entropy (moe/lm_loss.py) against all logits at once: values and gradients."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from moe import Execution, ModelConfig, Transformer
from moe.lm_loss import chunk_count, cross_entropy

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
        ce, _ = nnx.merge(graphdef, state).token_losses(tokens, targets, execution=Execution(loss_chunks=3))
        return ce.sum()

    (want, g_want), (got, g_got) = (jax.jit(jax.value_and_grad(f))(state) for f in (via_logits, via_chunks))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
