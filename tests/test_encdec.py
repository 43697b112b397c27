"""experiments/encdec/model.py: the encoder sees the whole source, the decoder is causal, padding is invisible,
and the parameter count is the decoder-only model's plus an encoder and cross-attention."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.encdec.model import EncoderDecoder, n_params
from moe import Execution, ModelConfig, RoutingBias, Transformer
from tests.model_fixtures import TINY

B, S, T = 2, 7, 6


@functools.cache
def model_and_fwd():
    model = EncoderDecoder(ModelConfig(**TINY), nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(src, tgt, sseg, tseg):
        return nnx.merge(graphdef, state)(src, tgt, src_segment_ids_BxS=sseg, tgt_segment_ids_BxT=tseg)[0]

    return model, fwd


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    src = jnp.asarray(rng.integers(3, TINY["vocab_size"], (B, S)), jnp.int32)
    tgt = jnp.asarray(rng.integers(3, TINY["vocab_size"], (B, T)), jnp.int32)
    sseg = jnp.asarray([[1] * S, [1] * (S - 2) + [0, 0]], jnp.int32)  # row 1: 2 padded source tokens
    tseg = jnp.ones((B, T), jnp.int32)
    return src, tgt, sseg, tseg


@pytest.mark.slow  # compiles the tiny encoder-decoder (~40 s on the shared CPU; shared with the next test)
def test_decoder_is_causal():
    _, fwd = model_and_fwd()
    src, tgt, sseg, tseg = inputs()
    base = fwd(src, tgt, sseg, tseg)
    j = 3
    changed = fwd(src, tgt.at[:, j].set((tgt[:, j] + 1) % TINY["vocab_size"]), sseg, tseg)
    np.testing.assert_allclose(changed[:, :j], base[:, :j], atol=1e-6)
    assert np.abs(np.asarray(changed[:, j:] - base[:, j:])).max() > 1e-4


@pytest.mark.slow
def test_every_target_position_sees_the_whole_source_but_not_its_padding():
    _, fwd = model_and_fwd()
    src, tgt, sseg, tseg = inputs()
    base = fwd(src, tgt, sseg, tseg)
    last = fwd(src.at[0, S - 1].set((src[0, S - 1] + 1) % TINY["vocab_size"]), tgt, sseg, tseg)
    # the LAST source token changes the FIRST target position's logits: the encoder is not causal
    assert np.abs(np.asarray(last[0, 0] - base[0, 0])).max() > 1e-5
    np.testing.assert_allclose(last[1], base[1], atol=1e-6)  # rows are independent
    padded = fwd(src.at[1, S - 1].set(5), tgt, sseg, tseg)  # row 1's last source token is padding
    np.testing.assert_allclose(padded, base, atol=1e-6)


def test_parameter_count_is_decoder_only_plus_encoder_and_cross_attention():
    cfg = ModelConfig(**TINY)
    model, _ = model_and_fwd()
    dec_only = n_params(Transformer(cfg, nnx.Rngs(0)))
    D, H, N, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    cross = cfg.n_layers * (D * Dh * (2 * H + 2 * N) + D)  # weights + its norm
    blocks = dec_only - 2 * cfg.vocab_size * D - D  # the decoder-only model's blocks
    assert n_params(model) == dec_only + cross + blocks + D  # + the encoder's final norm


def test_decoder_ignores_cfg_mask():
    cfg = ModelConfig(**{**TINY, "mask": "prefix"})
    assert EncoderDecoder(cfg, nnx.Rngs(0), n_encoder_layers=1).cfg.mask == "causal"


@pytest.mark.slow  # compiles a second tiny encoder-decoder
def test_expert_load_rows_follow_the_routing_bias_leaves():
    """The train step updates bias leaf i from load row i: rows must come in the leaves' order (decoder first)."""
    cfg = ModelConfig(**{**TINY, "n_layers": 2, "first_k_dense": 0})
    model = EncoderDecoder(cfg, nnx.Rngs(1), n_encoder_layers=3)
    _, _, bias = nnx.split(model, nnx.Param, RoutingBias)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(bias)]
    assert [p.split("'")[1] for p in paths] == ["decoder"] * 2 + ["encoder"] * 3
    src, tgt, sseg, tseg = inputs()
    tseg = tseg.at[1, T - 2:].set(0)  # 10 valid target tokens against 12 valid source tokens
    _, aux = model(src, tgt, src_segment_ids_BxS=sseg, tgt_segment_ids_BxT=tseg)
    per_row = np.asarray(aux["expert_load"]).sum(-1)  # every valid token's top-k choices
    K = cfg.top_k
    np.testing.assert_allclose(per_row, [int(tseg.sum()) * K] * 2 + [int(sseg.sum()) * K] * 3)
    assert aux["dropped_frac"].shape == (5,)


@pytest.mark.parametrize("impl", ["blockwise", "xla"])
def test_encoder_stays_bidirectional_under_every_attention_impl(impl):
    """The encoder's blocks share the decoder-only Block: kernels that skip later keys (blockwise query blocks,
    is_causal) must not apply to them. 64 source positions: two query blocks."""
    model = EncoderDecoder(ModelConfig(**TINY), nnx.Rngs(0), n_encoder_layers=1)
    graphdef, state = nnx.split(model)
    encode = jax.jit(lambda src: nnx.merge(graphdef, state).encode(src, None, Execution(attention_impl=impl))[0])
    src = jnp.asarray(np.random.default_rng(0).integers(3, TINY["vocab_size"], (1, 64)), jnp.int32)
    base = encode(src)
    changed = encode(src.at[0, 63].set((src[0, 63] + 1) % TINY["vocab_size"]))
    assert np.abs(np.asarray(changed[0, 0] - base[0, 0])).max() > 1e-5  # the first position sees the last
    want = jax.jit(lambda src: nnx.merge(graphdef, state).encode(src, None, Execution(attention_impl="einsum"))[0])
    np.testing.assert_allclose(base, want(src), rtol=1e-5, atol=1e-6)


def test_decoder_self_attention_runs_blockwise_and_equals_einsum():
    """64 target positions: the decoder's causal self-attention takes the blockwise path (more matmuls traced)
    and gives einsum's logits."""
    cfg = ModelConfig(**{**TINY, "n_layers": 1, "first_k_dense": 1})
    graphdef, state = nnx.split(EncoderDecoder(cfg, nnx.Rngs(0), n_encoder_layers=1))
    src = jnp.asarray(np.random.default_rng(1).integers(3, cfg.vocab_size, (1, 8)), jnp.int32)
    tgt = jnp.asarray(np.random.default_rng(2).integers(3, cfg.vocab_size, (1, 64)), jnp.int32)

    def logits(impl):
        return lambda: nnx.merge(graphdef, state)(src, tgt, execution=Execution(attention_impl=impl))[0]

    assert str(jax.make_jaxpr(logits("blockwise"))()).count("dot_general") > \
        str(jax.make_jaxpr(logits("einsum"))()).count("dot_general")
    np.testing.assert_allclose(jax.jit(logits("blockwise"))(), jax.jit(logits("einsum"))(), rtol=1e-5, atol=1e-6)


def test_slab_gradients_through_the_encoder_decoder_equal_ragged_dots():
    """The experts' default CPU kernel (slab, its VJP written by hand) in the encoder-decoder's backward pass, which
    the study's end-to-end test does not train through (configs/tiny.py runs ragged_dot): logits and every
    gradient equal ragged_dot's, padded source rows included."""
    cfg = ModelConfig(**{**TINY, "n_layers": 2})
    graphdef, state = nnx.split(EncoderDecoder(cfg, nnx.Rngs(0), n_encoder_layers=2))  # an MoE block in each
    src, tgt, sseg, tseg = inputs()

    def loss_and_grads(kernel):
        def loss(state):
            logits = nnx.merge(graphdef, state)(src, tgt, src_segment_ids_BxS=sseg, tgt_segment_ids_BxT=tseg,
                                                execution=Execution(grouped_matmul=kernel))[0]
            return jnp.mean(jax.nn.log_softmax(logits)[..., 3]), logits

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(state)

    (_, want_logits), want = loss_and_grads("ragged_dot")
    (_, got_logits), got = loss_and_grads("slab")
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-6)
    leaves = jax.tree.leaves_with_path(want)
    routed = [(jax.tree_util.keystr(p), v) for p, v in leaves if v.ndim == 3 and "w_gate" in jax.tree_util.keystr(p)]
    assert [k.split("]")[0] for k, _ in routed] == ["['decoder'", "['encoder'"]
    assert all(np.abs(v).max() > 0 for _, v in routed)  # the experts' gradients are compared, not two zeros
    for (path, a), b in zip(leaves, jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
