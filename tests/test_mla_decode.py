"""MLA decoding from the latent cache (moe/mla.py): the absorbed form and the naive reference equal the uncached
forward from any cache slot and under prefix masks; generation works, also from a run trained sharded with
train.loop and decoded by train.generate, whose memory check counts the latent cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe import decoding
from moe.accounting import kv_cache_bytes_per_token
from plumbing.errors import UserError
from rundir import open_run
from tests.conftest import tiny_config
from tests.model_fixtures import forward_fn, ragged_execution, tiny_model
from tests.test_mla import MLA_MODEL
from train import generate as train_generate
from train import generation
from train.loop import run

# The cached MLA forms (moe/mla.py), the routed experts on ragged_dot (the attention is the subject)
ABSORBED, NAIVE = ragged_execution(), ragged_execution(attention_impl="einsum")


def test_init_cache_holds_the_latent():
    cache = decoding.init_cache(tiny_model(**MLA_MODEL).cfg, 2, 9, "bfloat16")
    assert [{k: (v.shape, v.dtype) for k, v in layer.items()} for layer in cache] == [
        {"latent": ((2, 9, 16), jnp.bfloat16), "k_rope": ((2, 9, 4), jnp.bfloat16)}] * MLA_MODEL["n_layers"]


@nnx.jit(static_argnames=("ex", "P1", "P2"))
def _turns(model, tokens, ex, P1, P2):
    """Prefill [0, P1), prefill [P1, P1 + P2) on top of that cache, then one-token steps to the end."""
    B, L = tokens.shape
    cache = decoding.init_cache(model.cfg, B, L)
    first, cache = decoding.prefill(model, tokens[:, :P1], cache, execution=ex)
    second, cache = decoding.prefill(model, tokens[:, P1:P1 + P2], cache, start=P1, execution=ex)
    steps = []
    for i in range(P1 + P2, L):
        logits_i, cache = decoding.step(model, tokens[:, i:i + 1], i, cache, execution=ex)
        steps.append(logits_i)
    return jnp.concatenate([first, second, jnp.stack(steps, 1)], 1)


@pytest.mark.parametrize("P1,P2", [(1, 4), (4, 3), (6, 1)])
def test_cached_decoding_equals_the_uncached_forward_from_any_slot(P1, P2):
    """Both cached forms against the uncached (expanded, blockwise) forward, fp32, within 1e-5 relative; and the
    absorbed form against the naive one."""
    model = tiny_model(**MLA_MODEL)
    tokens = jax.random.randint(jax.random.key(P1), (2, 9), 0, 64)
    full = forward_fn(**MLA_MODEL)(tokens)
    absorbed, naive = _turns(model, tokens, ABSORBED, P1, P2), _turns(model, tokens, NAIVE, P1, P2)
    scale = float(np.abs(full).max())
    np.testing.assert_allclose(absorbed / scale, full / scale, rtol=0, atol=1e-5)
    np.testing.assert_allclose(naive / scale, full / scale, rtol=0, atol=1e-5)
    np.testing.assert_allclose(absorbed, naive, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask", ["prefix", "mixed"])
def test_prefix_masks_decode_like_the_full_forward(mask):
    """The whole prompt is a bidirectional prefix (per head for mixed), then causal steps."""
    model = tiny_model(**MLA_MODEL, mask=mask)
    B, P, L = 2, 5, 9
    tokens = jax.random.randint(jax.random.key(7), (B, L), 0, 64)
    prefix = jnp.full((B,), P, jnp.int32)
    full = forward_fn(**MLA_MODEL, mask=mask)(tokens, None, prefix)

    @nnx.jit
    def cached(model, tokens):
        logits_p, cache = decoding.prefill(model, tokens[:, :P], decoding.init_cache(model.cfg, B, L),
                                           execution=ABSORBED)
        steps = []
        for i in range(P, L):
            logits_i, cache = decoding.step(model, tokens[:, i:i + 1], i, cache, prefix, execution=ABSORBED)
            steps.append(logits_i)
        return jnp.concatenate([logits_p, jnp.stack(steps, 1)], 1)

    np.testing.assert_allclose(cached(model, tokens), full, rtol=1e-5, atol=1e-5)


def test_greedy_generate_follows_the_full_forward():
    model = tiny_model(**MLA_MODEL)
    prompt = jax.random.randint(jax.random.key(4), (2, 4), 0, 64)
    new = decoding.generate(model, prompt, jax.random.key(0), max_new_tokens=5, execution=ABSORBED)
    logits = forward_fn(**MLA_MODEL)(jnp.concatenate([prompt, new], 1))
    np.testing.assert_array_equal(new, jnp.argmax(logits[:, 3:-1], -1))
    bf16 = decoding.generate(model, prompt, jax.random.key(0), max_new_tokens=5,
                           execution=ABSORBED.replace(dtype="bfloat16"))
    assert bf16.shape == new.shape and bool(jnp.all((bf16 >= 0) & (bf16 < 64)))


def test_train_generate_on_an_mla_run(tmp_path, monkeypatch, capsys):
    """A tiny MoE run with MLA (no query compression, interleaved RoPE) trains on a (data, fsdp, tensor) mesh,
    and train.generate decodes its checkpoint; the cache check counts the latent, not keys and values."""
    c = tiny_config(**{"train.steps": 2, "checkpoint.every": 2, "eval.every": 100, "log.every": 1,
                       "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    c.model.update(attention="mla", kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                   rope_interleave=True)
    metrics = run(c, tmp_path / "run", log=lambda *a: None)
    assert np.isfinite(metrics["loss"])
    new = train_generate.main(["--workdir", str(tmp_path / "run"), "--prompt", "The", "--max_new_tokens", "3"])
    assert len(new) <= 3 and capsys.readouterr().out.startswith("The")

    model = open_run(str(tmp_path / "run"), None).model
    need = kv_cache_bytes_per_token(model.cfg) * 100
    assert need == 2 * (32 + 8) * 4 * 100  # < the 2 * 2 * 2 * 16 * 4 * 100 bytes of the tiny config's GQA
    monkeypatch.setattr(generation, "device_memory_bytes", lambda device: need)
    generation.check_cache_fits(model, 100)
    monkeypatch.setattr(generation, "device_memory_bytes", lambda device: need - 1)
    with pytest.raises(UserError, match="KV cache"):
        generation.check_cache_fits(model, 100)
