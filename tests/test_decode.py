"""KV-cache decoding == the full-sequence forward at every position; sampling sanity."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe import decoding
from tests.model_fixtures import forward_fn, ragged_execution, tiny_model

EX = ragged_execution()  # decoding is the subject, not the experts' kernel


@functools.partial(nnx.jit, static_argnums=2)
def prefill_then_steps(model, tokens_BxL, P: int, prefix_len_B=None):
    """Logits [B, L, V]: the first P tokens prefilled into a cache of L slots, then one decoding step per token, in
    a loop over traced slot indices as generate runs it (one compiled step, not L - P unrolled ones)."""
    B, L = tokens_BxL.shape
    logits_p, cache = decoding.prefill(model, tokens_BxL[:, :P], decoding.init_cache(model.cfg, B, L),
                                     execution=EX)

    def one(cache, i):
        logits_i, cache = decoding.step(model, jax.lax.dynamic_slice_in_dim(tokens_BxL, i, 1, axis=1), i, cache,
                                      prefix_len_B, execution=EX)
        return cache, logits_i

    _, steps = jax.lax.scan(one, cache, jnp.arange(P, L))
    return jnp.concatenate([logits_p, jnp.moveaxis(steps, 0, 1)], 1)


@pytest.mark.parametrize("mode", ["causal", "prefix", "mixed"])
def test_cached_logits_equal_full_forward(mode):
    """Prefix and mixed masks: the prompt is the prefix (bidirectional once), then generation is causal."""
    model = tiny_model(mask=mode)
    B, P, L = 2, 5, 11
    tokens = jax.random.randint(jax.random.key(3), (B, L), 0, 61)
    prefix = jnp.full((B,), P, jnp.int32) if mode != "causal" else None
    full = forward_fn(mask=mode)(tokens, None, prefix)

    np.testing.assert_allclose(prefill_then_steps(model, tokens, P, prefix), full, rtol=1e-5, atol=1e-5)


def test_cached_logits_equal_the_blockwise_full_forward():
    """64 positions: the full forward runs the default blockwise attention (2 query blocks), the cached prefill
    and steps the einsum one over cache slots."""
    model = tiny_model()
    B, P, L = 1, 60, 64
    tokens = jax.random.randint(jax.random.key(4), (B, L), 0, 61)
    full = forward_fn()(tokens)

    np.testing.assert_allclose(prefill_then_steps(model, tokens, P), full, rtol=1e-5, atol=1e-5)


def test_prefill_continues_from_any_slot():
    """A second turn prefilled at slot P1 on top of the first turn's cache gives the full forward's logits
    (KV-cache reuse across turns); prefix masks refuse to extend a cached prompt."""
    model = tiny_model()
    B, P1, P2, L = 2, 4, 3, 9
    tokens = jax.random.randint(jax.random.key(5), (B, L), 0, 61)
    full = forward_fn()(tokens)

    @nnx.jit
    def turns(model, tokens):
        cache = decoding.init_cache(model.cfg, B, L)
        first, cache = decoding.prefill(model, tokens[:, :P1], cache, execution=EX)
        second, cache = decoding.prefill(model, tokens[:, P1:P1 + P2], cache, start=P1, execution=EX)
        last, _ = decoding.step(model, tokens[:, P1 + P2:P1 + P2 + 1], P1 + P2, cache, execution=EX)
        return first, second, last

    first, second, last = turns(model, tokens)
    np.testing.assert_allclose(first, full[:, :P1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(second, full[:, P1:P1 + P2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(last, full[:, P1 + P2], rtol=1e-5, atol=1e-5)
    prefix_model = tiny_model(mask="prefix")
    with pytest.raises(ValueError, match="start=0"):
        decoding.prefill(prefix_model, tokens[:, :2], decoding.init_cache(prefix_model.cfg, B, L), start=2)


def test_cached_forward_refuses_packed_rows():
    """The cache does not know the segments of earlier slots, so segment_ids with a cache is an error, never a
    silently unmasked attention across documents."""
    model = tiny_model()
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="segment_ids"):
        model(tokens, segment_ids_BxL=jnp.ones((1, 4), jnp.int32), cache=decoding.init_cache(model.cfg, 1, 8),
              cache_index=0)


def test_greedy_generate_follows_argmax_of_full_forward():
    model = tiny_model()
    prompt = jax.random.randint(jax.random.key(4), (2, 4), 0, 61)
    new = decoding.generate(model, prompt, jax.random.key(0), max_new_tokens=6, execution=EX)
    seq = jnp.concatenate([prompt, new], 1)
    logits = forward_fn()(seq)
    np.testing.assert_array_equal(new, jnp.argmax(logits[:, 3:-1], -1))


def test_sampling_top_p_and_temperature():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 400)
    draws = np.asarray(jax.vmap(lambda k: decoding.sample(logits, k, 1.0, 0.7))(keys))[:, 0]
    assert set(draws.tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.8: the nucleus is the top two tokens
    assert int(decoding.sample(logits, keys[0], 0.0, 1.0)[0]) == 0
    draws = np.asarray(jax.vmap(lambda k: decoding.sample(logits, k, 1.0, 1.0))(keys))[:, 0]
    assert abs(np.mean(draws == 0) - 0.5) < 0.08


def test_a_bidirectional_model_is_refused_by_every_generator():
    """Every position of a bidirectional model attends to later ones: its cached logits could never equal the
    full forward's, so decoding refuses rather than return tokens."""
    model = tiny_model(mask="bidirectional")
    prompt = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="bidirectional"):
        decoding.generate(model, prompt, jax.random.key(0), max_new_tokens=2)
    with pytest.raises(ValueError, match="bidirectional"):
        next(decoding.generate_chunks(model, prompt, jax.random.key(0), max_new_tokens=2))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_chunks_yield_generates_tokens(temperature):
    """The chunked decoder (what train.generate runs, so that Ctrl-C stops between chunks) makes the same tokens
    as the one-call `generate`, sampling included."""
    model = tiny_model()
    prompt = jax.random.randint(jax.random.key(5), (2, 3), 0, 61)
    want = decoding.generate(model, prompt, jax.random.key(7), max_new_tokens=9, temperature=temperature,
                            execution=EX)
    chunks = list(decoding.generate_chunks(model, prompt, jax.random.key(7), max_new_tokens=9, chunk=3,
                                           temperature=temperature, execution=EX))
    assert [c.shape[1] for c in chunks] == [1, 3, 3, 2]
    np.testing.assert_array_equal(jnp.concatenate(chunks, 1), want)
