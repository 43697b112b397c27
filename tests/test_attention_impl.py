"""The fused attention path (`execution.attention_impl`: jax.nn.dot_product_attention) and the blockwise einsum
path equal the einsum reference, logits and gradients, for every mask mode with packed segments and grouped-query
heads. "xla" is the same call as "cudnn" with another implementation, so on CPU this checks everything around the
kernel: layouts, GQA head order, scale, mask and is_causal. The kernel itself is compared on a GPU (skipped
elsewhere)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe import Execution
from moe.attention import causal_blocks, rope, softmax_attention
from moe.dispatch import platform
from tests.model_fixtures import tiny_model

L = 12
# Both sides of every comparison route the same way; ragged_dot compiles in a fraction of slab's time (its seven
# layouts), and the experts' kernels are tested on their own.
EXPERTS = "ragged_dot"


def _loss_and_grads(impl, mask, dtype="float32", L=L):
    graphdef, state = nnx.split(tiny_model(mask=mask))
    ex = Execution(attention_impl=impl, dtype=dtype, grouped_matmul=EXPERTS)
    tokens = jax.random.randint(jax.random.key(1), (2, L), 0, 61)
    a, b = 5 * L // 12, 9 * L // 12  # two documents; trailing padding
    segments = jnp.asarray([[1] * a + [2] * (L - a), [1] * b + [0] * (L - b)])
    prefix = jnp.asarray([4, 6])

    def loss(state):
        logits = nnx.merge(graphdef, state)(tokens, execution=ex, segment_ids_BxL=segments, prefix_len_B=prefix)[0]
        return jnp.mean(jax.nn.log_softmax(logits)[..., 3] * (segments > 0)), logits

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(state)


@pytest.mark.parametrize("mask", ["causal", "prefix", "mixed"])  # mixed: a per-head mask
def test_fused_attention_equals_einsum(mask):
    (_, want_logits), want_grads = _loss_and_grads("einsum", mask)
    (_, got_logits), got_grads = _loss_and_grads("xla", mask)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mask", ["causal", "prefix"])  # prefix: not causal, so one block (the einsum path)
def test_blockwise_attention_equals_einsum(mask):
    """96 positions: three query blocks of 32 under a causal mask, each against only the keys up to its end;
    documents and padding cross the block boundaries."""
    assert causal_blocks(96) == 3
    model, tokens = tiny_model(mask=mask), jnp.zeros((1, 96), jnp.int32)

    def matmuls(impl):
        ex = Execution(attention_impl=impl, grouped_matmul=EXPERTS)
        jaxpr = jax.make_jaxpr(lambda t: model(t, execution=ex, prefix_len_B=jnp.asarray([4]))[0])
        return str(jaxpr(tokens)).count("dot_general")

    # The causal model runs 3 blocks x 2 attention matmuls per layer instead of 2; the prefix model runs einsum.
    assert matmuls("blockwise") - matmuls("einsum") == (4 * model.cfg.n_layers if mask == "causal" else 0)
    (_, want_logits), want_grads = _loss_and_grads("einsum", mask, L=96)
    (_, got_logits), got_grads = _loss_and_grads("blockwise", mask, L=96)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_causal_blocks():
    assert [causal_blocks(n) for n in (12, 64, 96, 100, 256, 2048)] == [1, 2, 3, 2, 4, 4]


def _relative_error(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12)


def test_cudnn_config_runs_off_gpu_as_xla():
    """A bf16 run trained with attention_impl=cudnn loads and runs on a machine without cuDNN (analysis on a
    laptop): the call falls back to the XLA implementation, bit for bit."""
    if platform.attention_impl("cudnn") == "cudnn":
        pytest.skip("this machine has cuDNN: test_cudnn_equals_einsum_on_gpu covers it")
    (_, xla_logits), xla_grads = _loss_and_grads("xla", "causal", dtype="bfloat16")
    (_, cudnn_logits), cudnn_grads = _loss_and_grads("cudnn", "causal", dtype="bfloat16")
    np.testing.assert_array_equal(cudnn_logits, xla_logits)
    for a, b in zip(jax.tree.leaves(cudnn_grads), jax.tree.leaves(xla_grads), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(platform.attention_impl("cudnn") != "cudnn", reason="needs an NVIDIA GPU with cuDNN")
@pytest.mark.parametrize("mask", ["causal", "prefix", "mixed"])
def test_cudnn_equals_einsum_on_gpu(mask):
    """The cuDNN kernel itself (bf16), against the einsum reference in bf16: logits and gradients agree to bf16
    rounding (cuDNN keeps the probabilities in higher precision than the einsum path's bf16 cast)."""
    (_, want_logits), want_grads = _loss_and_grads("einsum", mask, dtype="bfloat16")
    (_, got_logits), got_grads = _loss_and_grads("cudnn", mask, dtype="bfloat16")
    assert _relative_error(got_logits, want_logits) < 2e-2
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        assert _relative_error(a, b) < 5e-2


def test_softmax_attention_normalizing_the_output_equals_normalizing_the_probabilities():
    """The training path divides exp(logits - max) v by the row sum; the probabilities path is the plain
    softmax then v. Values and gradients agree, with grouped-query heads, a holed mask and a fully masked row."""
    ks = jax.random.split(jax.random.key(0), 4)
    B, L, N, G, Dh = 2, 7, 2, 3, 8
    q = jax.random.normal(ks[0], (B, L, N, G, Dh))
    k, v = (jax.random.normal(kk, (B, L, N, Dh)) for kk in ks[1:3])
    mask = jax.random.bernoulli(ks[3], 0.6, (B, 1, L, L)).at[1, 0, 4].set(False)
    cotangent = jax.random.normal(jax.random.key(5), (B, L, N, G, Dh))

    def run(return_probs):
        def f(q, k, v):
            return jnp.sum(softmax_attention(q, k, v, mask, return_probs)[0] * cotangent)
        return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

    (got, got_grads), (want, want_grads) = run(False), run(True)
    assert softmax_attention(q, k, v, mask)[1] is None
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rot_dim", [None, 4])
def test_rope_turns_each_pair_by_its_angle(rot_dim):
    """rope against the textbook rotate-half form x cos + [-x2, x1] sin (partial rotary: the tail passes
    through), and the property it exists for: q . k depends only on the distance between their positions."""
    ks = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(ks[0], (2, 5, 3, 8))
    pos = jnp.asarray([[0, 1, 2, 3, 4], [7, 3, 11, 0, 2]])
    R = rot_dim or 8
    inv_freq = 1.0 / (1e4 ** (jnp.arange(0, R, 2) / R))
    angles = jnp.concatenate([pos[..., None] * inv_freq] * 2, -1)[:, :, None, :]
    x_rot = x[..., :R]
    rotated = jnp.concatenate([-x_rot[..., R // 2:], x_rot[..., :R // 2]], -1)
    want = jnp.concatenate([x_rot * jnp.cos(angles) + rotated * jnp.sin(angles), x[..., R:]], -1)
    np.testing.assert_allclose(rope(x, pos, 1e4, rot_dim), want, rtol=1e-5, atol=1e-6)

    q, k = jax.random.normal(ks[1], (2, 1, 1, 1, 8))  # [B, L, H, Dh] each
    dot = lambda i, j: jnp.sum(rope(q, jnp.asarray([[i]]), 1e4, rot_dim) * rope(k, jnp.asarray([[j]]), 1e4, rot_dim))
    np.testing.assert_allclose(dot(3, 1), dot(12, 10), rtol=1e-4)
    assert abs(dot(3, 1) - dot(3, 2)) > 1e-3
