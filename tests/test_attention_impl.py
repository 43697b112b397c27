"""The fused attention path (`model.attention_impl`: jax.nn.dot_product_attention) equals the einsum reference,
logits and gradients, for every mask mode with packed segments and grouped-query heads. On CPU "cudnn" runs the
same call with the XLA implementation, so this checks everything around the kernel: layouts, GQA head order,
scale, mask and is_causal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe.layers import fused_attention_impl
from tests.model_fixtures import tiny_model

L = 12


def _loss_and_grads(impl, mask):
    graphdef, state = nnx.split(tiny_model(mask=mask, attention_impl=impl))
    tokens = jax.random.randint(jax.random.key(1), (2, L), 0, 61)
    segments = jnp.asarray([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3])  # two documents; trailing padding
    prefix = jnp.asarray([4, 6])

    def loss(state):
        logits = nnx.merge(graphdef, state)(tokens, segment_ids_BxL=segments, prefix_len_B=prefix)[0]
        return jnp.mean(jax.nn.log_softmax(logits)[..., 3] * (segments > 0)), logits

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(state)


@pytest.mark.parametrize("mask", ["causal", "prefix", "mixed"])  # mixed: a per-head mask
def test_fused_attention_equals_einsum(mask):
    (_, want_logits), want_grads = _loss_and_grads("einsum", mask)
    (_, got_logits), got_grads = _loss_and_grads("xla", mask)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_cudnn_runs_as_xla_off_gpu():
    assert fused_attention_impl("xla") == "xla"
    assert fused_attention_impl("cudnn") == ("cudnn" if jax.default_backend() == "gpu" else "xla")
