"""Gated DeltaNet (moe/gdn.py): the mixer equals a float64 NumPy transcription of its formulas (grouped
projections, causal conv + SiLU, l2-normed q/k, the gated delta rule token by token, the gated RMSNorm); a model
with Gated DeltaNet layers beside gated attention continues from its decoding cache exactly as the whole sequence
at once, and packed rows restart the state at each segment."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe import ModelConfig, Transformer
from moe.attention import BlockInputs
from moe.decoding.generate import init_cache
from moe.gdn import GatedDeltaNet, delta_rule, delta_rule_chunked
from tests.model_fixtures import ragged_execution

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=48,
                  first_k_dense=0, n_routed_experts=4, top_k=2, moe_d_ff=16, router="softmax", shared_d_ff=24,
                  shared_expert_gate=True, qk_norm="head", rope_fraction=0.25, attn_output_gate=True,
                  norm_offset=True, linear_layers="0,1", gdn_key_heads=2, gdn_value_heads=4, gdn_key_dim=8,
                  gdn_value_dim=6, gdn_conv_kernel=4, init_std=0.3)
EX = ragged_execution()
RESOLVED = EX.resolved()


def _silu(x):
    return x / (1 + np.exp(-x))


def reference(p, x, cfg):
    """One row [T, D] through the formulas of moe/gdn.py's docstring, float64, token by token."""
    Hk, Hv, Dk, Dv, K = cfg.gdn_key_heads, cfg.gdn_value_heads, cfg.gdn_key_dim, cfg.gdn_value_dim, cfg.gdn_conv_kernel
    r, T = Hv // Hk, x.shape[0]
    qkvz = np.einsum("td,dge->tge", x, p["w_qkvz"])
    q, k, v, z = qkvz[..., :Dk], qkvz[..., Dk:2 * Dk], qkvz[..., 2 * Dk:2 * Dk + r * Dv], qkvz[..., 2 * Dk + r * Dv:]
    ba = np.einsum("td,dge->tge", x, p["w_ba"])
    b, a = ba[..., :r].reshape(T, Hv), ba[..., r:].reshape(T, Hv)
    chans = np.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], -1)
    padded = np.concatenate([np.zeros((K - 1, chans.shape[1])), chans])
    y = _silu(np.stack([(padded[t:t + K] * p["conv"].T).sum(0) for t in range(T)]))
    q = y[:, :Hk * Dk].reshape(T, Hk, Dk)
    k = y[:, Hk * Dk:2 * Hk * Dk].reshape(T, Hk, Dk)
    v = y[:, 2 * Hk * Dk:].reshape(T, Hv, Dv)
    q = np.repeat(q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6), r, 1) / np.sqrt(Dk)
    k = np.repeat(k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6), r, 1)
    beta = 1 / (1 + np.exp(-b))
    g = -np.exp(p["A_log"]) * np.log1p(np.exp(a + p["dt_bias"]))
    S, o = np.zeros((Hv, Dk, Dv)), np.zeros((T, Hv, Dv))
    for t in range(T):
        for j in range(Hv):
            S[j] *= np.exp(g[t, j])
            S[j] += np.outer(k[t, j], beta[t, j] * (v[t, j] - k[t, j] @ S[j]))
            o[t, j] = q[t, j] @ S[j]
    o = o / np.sqrt((o * o).mean(-1, keepdims=True) + cfg.norm_eps) * p["out_norm"] * _silu(z.reshape(T, Hv, Dv))
    return np.einsum("thv,hvd->td", o, p["wo"])


@functools.partial(nnx.jit, static_argnames="impl")
def _mix(mixer, x_BxLxD, impl="blockwise"):
    """The mixer alone: its chunked rule, or with attention_impl "einsum" the token-by-token reference."""
    B, L, _ = x_BxLxD.shape
    inputs = BlockInputs(jnp.zeros((B, L), jnp.int32), jnp.ones((B, 1, L, L), bool), jnp.ones((B, L), bool))
    return mixer(x_BxLxD, inputs, RESOLVED.replace(attention_impl=impl))[0]


def _mixer(seed):
    with nnx.use_eager_sharding(False):
        return GatedDeltaNet(CFG, nnx.Rngs(seed))


@pytest.mark.parametrize("impl", ["blockwise", "einsum"])
def test_mixer_equals_its_formulas(impl):
    mixer = _mixer(0)
    rng = np.random.default_rng(0)
    for name in ("dt_bias", "A_log", "out_norm"):  # away from their initial constants
        getattr(mixer, name).set_value(jnp.asarray(rng.normal(0, 0.5, getattr(mixer, name).shape), jnp.float32))
    x = rng.normal(size=(2, 9, CFG.d_model)).astype(np.float32)
    ours = np.asarray(_mix(mixer, jnp.asarray(x), impl))
    p = {k: np.asarray(v, np.float64) for k, v in nnx.state(mixer, nnx.Param).flat_state()}
    p = {k[0] if isinstance(k, tuple) else k: v for k, v in p.items()}
    want = np.stack([reference(p, row.astype(np.float64), CFG) for row in x])
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


@nnx.jit
def _whole(model, tokens):
    return model(tokens, execution=EX)[0]


@nnx.jit
def _cached(model, tokens):
    """Tokens [0, 4) as one prefill, [4, 6) as a continuation of it (the chunked rule from the cached state, the
    conv from the cached inputs), then one token at a time (the recurrent rule)."""
    B, L = tokens.shape
    cache, outs = init_cache(model.cfg, B, L), []
    for i, j in [(0, 4), (4, 6)] + [(i, i + 1) for i in range(6, L)]:
        out, aux = model(tokens[:, i:j], execution=EX.for_decoding(), cache=cache, cache_index=i,
                         positions_BxL=jnp.broadcast_to(jnp.arange(i, j, dtype=jnp.int32), (B, j - i)))
        outs.append(out)
        cache = aux.cache
    return jnp.concatenate(outs, 1)


def test_cached_decoding_equals_the_whole_sequence():
    model = Transformer(CFG, nnx.Rngs(1))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 8)))
    whole = np.asarray(_whole(model, tokens))
    np.testing.assert_allclose(np.asarray(_cached(model, tokens)), whole, rtol=1e-5, atol=1e-5 * np.abs(whole).max())


@nnx.jit
def _packed(model, tokens, segments, positions):
    return model(tokens, execution=EX, segment_ids_BxL=segments, positions_BxL=positions)[0]


def test_packed_rows_restart_at_each_segment():
    """A row holding two documents gives each the logits it has alone (state and conv restart, padding inert)."""
    model = Transformer(CFG, nnx.Rngs(2))
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, CFG.vocab_size, 5), rng.integers(0, CFG.vocab_size, 6)
    row = jnp.asarray(np.concatenate([a, b, [0]])[None])
    segments = jnp.asarray([[1] * 5 + [2] * 6 + [0]])
    positions = jnp.asarray([list(range(5)) + list(range(6)) + [0]])
    packed = np.asarray(_packed(model, row, segments, positions))[0]
    alone_b = np.asarray(_packed(model, jnp.asarray(np.concatenate([b, [0] * 6])[None]),
                                 jnp.asarray([[1] * 6 + [0] * 6]), jnp.asarray([list(range(6)) + [0] * 6])))[0]
    np.testing.assert_allclose(packed[5:11], alone_b[:6], rtol=1e-5, atol=1e-5 * np.abs(alone_b).max())
    whole_a = np.asarray(_whole(model, jnp.asarray(a[None])))[0]
    np.testing.assert_allclose(packed[:5], whole_a, rtol=1e-5, atol=1e-5 * np.abs(whole_a).max())


def test_gradients_reach_every_parameter():
    """The recurrence is differentiable end to end: every Gated DeltaNet parameter gets a finite, non-zero
    gradient."""
    mixer = _mixer(3)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(1, 7, CFG.d_model)), jnp.float32)
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(_mix(m, x) ** 2)))(mixer)  # _mix traced inside: one program
    for name, g in nnx.state(grads, nnx.Param).flat_state():
        g = np.asarray(g[...] if hasattr(g, "value") else g)
        assert np.isfinite(g).all() and np.abs(g).max() > 0, name


def _rule_inputs(seed, L, H=3, Dk=5, Dv=4):
    rng = np.random.default_rng(seed)
    q, k = (rng.normal(size=(2, L, H, Dk)) for _ in range(2))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)  # l2-normed, as the mixer feeds them
    return [jnp.asarray(x, jnp.float32) for x in (
        q / np.sqrt(Dk), k, rng.normal(size=(2, L, H, Dv)), rng.uniform(0, 1, (2, L, H)),
        -rng.uniform(0, 0.5, (2, L, H)), rng.normal(size=(2, H, Dk, Dv)))]


@jax.jit
def _both_rules(q, k, v, beta, g, state, start):
    """(recurrent, chunked) outputs and final states, and the gradients of one scalar of each w.r.t. every input."""
    def loss(rule, *args):
        o, S = rule(*args)
        w_o, w_S = jnp.cos(jnp.arange(o.size)).reshape(o.shape), jnp.sin(jnp.arange(S.size)).reshape(S.shape)
        return jnp.sum(o * w_o) + jnp.sum(S * w_S), (o, S)

    recurrent = lambda q, k, v, beta, g, state: delta_rule(q, k, v, beta, jnp.where(start[..., None], 0.0, jnp.exp(g)),
                                                           state)
    chunked = lambda q, k, v, beta, g, state: delta_rule_chunked(q, k, v, beta, g, state, start, chunk=16)
    args = (q, k, v, beta, g, state)
    return [jax.grad(lambda *a, rule=rule: loss(rule, *a), argnums=tuple(range(6)), has_aux=True)(*args)
            for rule in (recurrent, chunked)]


def test_chunked_rule_equals_the_recurrence_values_and_gradients():
    """Over 40 tokens in chunks of 16 (the last one padded), from a non-zero state, with restarts inside a chunk and
    on a chunk's first token."""
    start = np.zeros((2, 40), bool)
    start[0, [5, 16, 33]] = True
    (g_rec, (o_rec, S_rec)), (g_chk, (o_chk, S_chk)) = _both_rules(*_rule_inputs(4, 40), jnp.asarray(start))
    np.testing.assert_allclose(np.asarray(o_chk), np.asarray(o_rec), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(S_chk), np.asarray(S_rec), rtol=1e-4, atol=1e-5)
    for name, a, b in zip(("q", "k", "v", "beta", "g", "state"), g_chk, g_rec):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4, err_msg=name)
