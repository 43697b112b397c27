"""Multi-head latent attention (moe/mla.py): config validation, accounting by hand, YaRN and the attention layer
against transformers' DeepseekV3Attention, and every attention_impl / mask / dtype / scan / remat / mesh against
the einsum reference."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe import ConfigError, Execution, ModelConfig, param_counts, sharding, train_flops_per_token
from moe.accounting import kv_cache_bytes_per_token
from moe.attention import (
    BlockInputs,
    attention_mask,
    rope,
    rotate,
    softmax_scale,
    yarn_attention_factor,
    yarn_inv_frequencies,
)
from moe.hf.write import architecture, glm4_moe_unsupported_features, unsupported_features
from moe.mla import MLA
from moe.model import abstract_model
from tests.model_fixtures import TINY, ragged_execution, tiny_model

# Dq = 12 query/key dims per head against Dv = 6 value dims: xla / cudnn pad them to one width.
MLA_FIELDS = dict(attention="mla", q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                  v_head_dim=6)
# The model-level tests: two dense layers (the MoE blocks are tested elsewhere and dominate compile time).
MLA_MODEL = dict(MLA_FIELDS, n_layers=2, first_k_dense=2, vocab_size=64)
YARN = dict(rope_scaling_factor=40.0, rope_original_max_position=8, yarn_mscale=1.0, yarn_mscale_all_dim=0.7)


@pytest.mark.parametrize("changes,field", [
    (dict(attention="mqa"), "model.attention"),
    (dict(attention="mla"), "model.kv_lora_rank"),  # no MLA dims given
    (dict(MLA_FIELDS, kv_lora_rank=0), "model.kv_lora_rank"),
    (dict(MLA_FIELDS, v_head_dim=0), "model.v_head_dim"),
    (dict(MLA_FIELDS, qk_rope_head_dim=5), "model.qk_rope_head_dim"),
    (dict(MLA_FIELDS, q_lora_rank=-1), "model.q_lora_rank"),
    (dict(MLA_FIELDS, q_lora_rank=2.5), "model.q_lora_rank"),
    (dict(MLA_FIELDS, rope=False), "model.rope"),
    (dict(MLA_FIELDS, qk_norm="head"), "model.qk_norm"),
    (dict(MLA_FIELDS, qkv_bias=True), "model.qkv_bias"),
    (dict(MLA_FIELDS, attn_out_bias=True), "model.attn_out_bias"),
    (dict(MLA_FIELDS, rope_fraction=0.5), "model.rope_fraction"),
    (dict(kv_lora_rank=16), "model.kv_lora_rank"),  # an MLA field while attention is gqa
    (dict(rope_interleave=1), "model.rope_interleave"),  # interleaved RoPE itself is gqa's too (ERNIE 4.5)
    (dict(qk_norm="head", qk_norm_after_rope=True, rope_interleave=True), "model.qk_norm_after_rope"),
    (dict(qk_norm_after_rope=True), "model.qk_norm_after_rope"),  # without a q/k norm
    (dict(query_scale_beta=0.1, query_scale_period=4), "model.query_scale_beta"),  # gqa
    (dict(MLA_FIELDS, query_scale_beta=0.1), "model.query_scale_beta"),  # no period
    (dict(latent_norm_eps=1e-6), "model.latent_norm_eps"),  # an MLA field while attention is gqa
    (dict(MLA_FIELDS, latent_norm_eps=-1.0), "model.latent_norm_eps"),
    (dict(rope_scaling_factor=0.5), "model.rope_scaling_factor"),
    (dict(rope_scaling_factor=float("nan")), "model.rope_scaling_factor"),
    (dict(rope_scaling_factor=4.0), "model.rope_original_max_position"),
    (dict(YARN, rope=False), "model.rope_scaling_factor"),
    (dict(YARN, yarn_beta_fast=0.5), "model.yarn_beta_fast"),
    (dict(YARN, yarn_mscale=-1.0), "model.yarn_mscale"),
    (dict(yarn_mscale_all_dim=1.0), "model.yarn_mscale_all_dim"),  # a YaRN field without YaRN
    (dict(rope_original_max_position=4096), "model.rope_original_max_position"),
])
def test_validation_names_the_field(changes, field):
    with pytest.raises(ConfigError, match=field) as e:
        ModelConfig(**changes)
    assert "\n" not in str(e.value)


def test_old_configs_load_and_mla_ignores_the_gqa_fields():
    old = {k: v for k, v in dataclasses.asdict(ModelConfig()).items()
           if k not in ("attention", "rope_interleave", "rope_scaling_factor", "rope_original_max_position")
           and not k.startswith(("yarn_", "q_lora", "kv_lora", "qk_nope", "qk_rope", "v_head"))}
    assert ModelConfig.from_dict(old) == ModelConfig()
    ModelConfig(**MLA_FIELDS, n_heads=6, n_kv_heads=4, head_dim=7)  # n_kv_heads / head_dim: unused by mla
    ModelConfig(**YARN)  # YaRN on grouped-query attention
    ModelConfig(**MLA_FIELDS, **YARN, rope_interleave=True)


def _tree_params(cfg):
    """Parameters the built model has (shapes only, nothing allocated)."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(abstract_model(cfg), nnx.Param)))


@pytest.mark.parametrize("q_lora_rank", [0, 12])
def test_accounting_by_hand(q_lora_rank):
    cfg = ModelConfig(**{**TINY, **MLA_FIELDS, "q_lora_rank": q_lora_rank})
    # D 32, H 4, Q 12 | 0, R 16, Dn 8, Dr 4, Dv 6
    query = 32 * 12 + 12 + 12 * 4 * 12 if q_lora_rank else 32 * 4 * 12  # (wq_a, q_norm, wq_b) | wq
    attn = query + 32 * 20 + 16 + 16 * 4 * 14 + 4 * 6 * 32  # wkv_a, kv_norm, wkv_b, wo
    attn_matmul = attn - 16 - (12 if q_lora_rank else 0)
    ffn_dense, expert, router, shared = 3 * 32 * 48, 3 * 32 * 16, 32 * 8, 3 * 32 * 16
    embed = 2 * 61 * 32 + 32
    total = embed + 3 * (attn + 64) + ffn_dense + 2 * (router + shared + 8 * expert)
    active = embed + 3 * (attn + 64) + ffn_dense + 2 * (router + shared + 2 * expert)
    assert param_counts(cfg) == {"total": total, "active": active}
    assert param_counts(cfg)["total"] == _tree_params(cfg)
    matmul = 3 * attn_matmul + ffn_dense + 2 * (router + 2 * expert + shared) + 32 * 61
    assert train_flops_per_token(cfg, 64) == 6 * matmul + 6 * 3 * 64 * 4 * (12 + 6)
    assert kv_cache_bytes_per_token(cfg) == 3 * (16 + 4) * 4
    assert kv_cache_bytes_per_token(cfg, "bfloat16") == 3 * (16 + 4) * 2
    gqa = ModelConfig(**TINY)
    assert kv_cache_bytes_per_token(gqa, "bfloat16") == 2 * 3 * 2 * 8 * 2
    gqa_matmul = 3 * 32 * 8 * (2 * 4 + 2 * 2) + ffn_dense + 2 * (router + 2 * expert + shared) + 32 * 61
    assert train_flops_per_token(gqa, 64) == 6 * gqa_matmul + 12 * 3 * 64 * 4 * 8  # GQA's count unchanged


def test_yarn_matches_transformers():
    """Frequencies, cos/sin factor and DeepSeek's softmax correction against transformers' own functions, for
    DeepSeek-V3's rope_scaling and for a plain YaRN (mscale only)."""
    ds = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    for mscale, mscale_all_dim in ((1.0, 1.0), (0.0, 0.0), (1.0, 0.7)):
        rp = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": mscale, "mscale_all_dim": mscale_all_dim}
        hc = ds.DeepseekV3Config(qk_rope_head_dim=64, rope_parameters=rp, max_position_embeddings=163840)
        want_freq, want_factor = rope_utils._compute_yarn_parameters(hc)
        cfg = ModelConfig(attention="mla", kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                          v_head_dim=128, rope_scaling_factor=40.0, rope_original_max_position=4096,
                          yarn_mscale=mscale, yarn_mscale_all_dim=mscale_all_dim)
        np.testing.assert_allclose(yarn_inv_frequencies(cfg, 64), want_freq.numpy(), rtol=1e-6)
        assert yarn_attention_factor(cfg) == pytest.approx(want_factor, rel=1e-12)
        assert softmax_scale(cfg, 192) == pytest.approx(ds.yarn_apply_mscale(rp, 192 ** -0.5), rel=1e-12)
    # Grouped-query attention takes the frequencies and the cos/sin factor, not DeepSeek's softmax correction.
    gqa = ModelConfig(**YARN)
    assert softmax_scale(gqa, 64) == 64 ** -0.5
    x = jax.random.normal(jax.random.key(0), (1, 3, 2, 64))
    pos = jnp.asarray([[0, 9, 300]])
    want = rope(x, pos, 1e4, 64, inv_freq_F=yarn_inv_frequencies(gqa, 64), scale=yarn_attention_factor(gqa))
    np.testing.assert_array_equal(rotate(gqa, x, pos, 64), want)
    assert yarn_attention_factor(gqa) == pytest.approx((0.1 * math.log(40) + 1) / (0.07 * math.log(40) + 1))


def _hf_mla_pair(q_lora_rank, interleave, yarn):
    """A DeepseekV3Attention with random weights, its rotary embedding, and our MLA holding the same weights."""
    torch = pytest.importorskip("torch")
    ds = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    D, H, Q, R, Dn, Dr, Dv = 32, 4, q_lora_rank, 16, 8, 8, 6
    ours = dict(d_model=D, n_heads=H, attention="mla", q_lora_rank=Q, kv_lora_rank=R, qk_nope_head_dim=Dn,
                qk_rope_head_dim=Dr, v_head_dim=Dv, rope_interleave=interleave, **(YARN if yarn else {}))
    rp = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rp = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 8,
              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7}
    hc = ds.DeepseekV3Config(hidden_size=D, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=Q or None,
                             kv_lora_rank=R, qk_nope_head_dim=Dn, qk_rope_head_dim=Dr, v_head_dim=Dv,
                             rope_interleave=interleave, rope_parameters=rp, max_position_embeddings=320,
                             rms_norm_eps=1e-6)
    hc._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = ds.DeepseekV3Attention(hc, layer_idx=0).eval()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    with nnx.use_eager_sharding(False):
        mla = MLA(ModelConfig(**ours), nnx.Rngs(0))
    # The importer's mapping (torch Linear weights are [out, in]); moe/mla.py's docstring lists it.
    w = {k: jnp.asarray(v.detach().numpy().T) for k, v in attn.state_dict().items()}
    if Q:
        mla.wq_a.set_value(w["q_a_proj.weight"])
        mla.q_norm.scale.set_value(w["q_a_layernorm.weight"])
        mla.wq_b.set_value(w["q_b_proj.weight"].reshape(Q, H, Dn + Dr))
    else:
        mla.wq.set_value(w["q_proj.weight"].reshape(D, H, Dn + Dr))
    mla.wkv_a.set_value(w["kv_a_proj_with_mqa.weight"])
    mla.kv_norm.scale.set_value(w["kv_a_layernorm.weight"])
    mla.wkv_b.set_value(w["kv_b_proj.weight"].reshape(R, H, Dn + Dv))
    mla.wo.set_value(w["o_proj.weight"].reshape(H, Dv, D))
    return attn, ds.DeepseekV3RotaryEmbedding(hc), mla


@pytest.mark.parametrize("q_lora_rank,interleave,yarn", [(0, False, False), (12, True, True), (0, True, True),
                                                         (12, False, True)])
def test_attention_matches_transformers_deepseek_v3(q_lora_rank, interleave, yarn):
    """Output and probabilities of one attention layer, fp32, causal, positions 100.. (past YaRN's original 8)."""
    torch = pytest.importorskip("torch")

    attn, rotary, mla = _hf_mla_pair(q_lora_rank, interleave, yarn)
    B, L = 2, 12
    x = np.random.default_rng(0).normal(size=(B, L, 32)).astype(np.float32)
    pos = np.broadcast_to(np.arange(100, 100 + L), (B, L)).copy()
    causal = torch.full((L, L), float("-inf")).triu(1)[None, None].expand(B, 1, L, L)
    with torch.no_grad():
        want, want_probs = attn(torch.tensor(x), rotary(torch.tensor(x), torch.tensor(pos)), causal)
    idx = jnp.broadcast_to(jnp.arange(L), (B, L))
    inputs = BlockInputs(jnp.asarray(pos), attention_mask("causal", idx, idx, n_heads=4), jnp.ones((B, L), bool))
    got, _, probs = mla(jnp.asarray(x), inputs, ragged_execution(attention_impl="einsum"), return_probs=True)
    scale = np.abs(want.numpy()).max()
    np.testing.assert_allclose(np.asarray(got) / scale, want.numpy() / scale, rtol=0, atol=1e-5)
    np.testing.assert_allclose(probs, want_probs.numpy(), rtol=0, atol=1e-5)
    if interleave:  # the layout matters: rotate-half on interleaved weights gives other numbers
        other = mla.cfg.replace(rope_interleave=False)
        mla.cfg = other
        assert np.abs(np.asarray(mla(jnp.asarray(x), inputs, ragged_execution(attention_impl="einsum"))[0])
                      - want.numpy()).max() > 1e-3


@functools.cache
def _loss_and_grads(ex: Execution, mask: str = "causal", L: int = 64, sharded: bool = False):
    """(logits [4,L,V], attention probabilities or None, gradients of a loss of the logits) of the tiny MLA model;
    sharded: parameters and batch on a (data 2, fsdp 2, expert 1, tensor 2) mesh, `ex` on it."""
    graphdef, state = nnx.split(tiny_model(**MLA_MODEL, mask=mask))
    tokens = jax.random.randint(jax.random.key(0), (4, L), 0, 64)
    prefix = jnp.asarray([L // 2, 3, L, 1], jnp.int32) if mask in ("prefix", "mixed") else None
    probs = ex.attention_impl == "einsum" and not sharded and ex.dtype == "float32"
    if sharded:
        mesh = sharding.make_mesh(2, 2, 1, 2)
        state = jax.device_put(state, sharding.state_shardings(state, mesh))
        tokens = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(("batch",))))
        ex = ex.replace(mesh=mesh)

    def loss(state):
        logits, aux = nnx.merge(graphdef, state)(tokens, execution=ex, prefix_len_B=prefix, return_attention=probs)
        return jnp.mean(jnp.sin(logits.astype(jnp.float32))), (logits, aux.attention)

    (_, (logits, attn)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    return logits, attn, jax.tree.leaves(grads)


def _assert_same(got, want, rtol=1e-5, grad_rtol=1e-4):
    np.testing.assert_allclose(got[0], want[0], rtol=rtol, atol=1e-6)
    for a, b in zip(got[2], want[2], strict=True):
        np.testing.assert_allclose(a, b, rtol=grad_rtol, atol=1e-7)


@pytest.mark.parametrize("impl", ["blockwise", "xla"])
def test_attention_impls_equal_the_einsum_reference(impl):
    """Values and gradients; blockwise runs 2 query blocks at 64 positions, xla pads keys (12) and values (6) to
    one width for jax.nn.dot_product_attention."""
    _assert_same(_loss_and_grads(ragged_execution(attention_impl=impl)),
                 _loss_and_grads(ragged_execution(attention_impl="einsum")))


@pytest.mark.parametrize("mask", ["prefix", "mixed", "bidirectional"])
def test_every_mask(mask):
    """The probabilities (return_attention) are zero exactly where the mask hides a key and sum to 1; xla (which
    gets the boolean mask, per head for mixed) equals the einsum path."""
    logits, attn, _ = ref = _loss_and_grads(ragged_execution(attention_impl="einsum"), mask, L=12)
    assert len(attn) == MLA_MODEL["n_layers"]
    idx = jnp.broadcast_to(jnp.arange(12), (4, 12))
    prefix = jnp.asarray([6, 3, 12, 1], jnp.int32) if mask != "bidirectional" else None
    visible = np.broadcast_to(attention_mask(mask, idx, idx, n_heads=4, prefix_len_B=prefix), attn[0].shape)
    for p in attn:
        assert np.all(np.asarray(p)[~visible] == 0)
        np.testing.assert_allclose(np.asarray(p).sum(-1), 1.0, rtol=1e-5)
    _assert_same(_loss_and_grads(ragged_execution(attention_impl="xla"), mask, L=12), ref)


def test_scanned_rematerialized_bf16_and_sharded():
    """Scanned layers with remat, and a (data, fsdp, tensor) mesh with the MoE layers scanned, equal the plain
    forward and its gradients; bf16 execution stays close to fp32."""
    plain = _loss_and_grads(ragged_execution())
    _assert_same(_loss_and_grads(ragged_execution(scan_layers=True, remat=True)), plain)
    _assert_same(_loss_and_grads(ragged_execution(scan_layers=True), sharded=True), plain)
    bf16 = _loss_and_grads(ragged_execution(dtype="bfloat16"))
    assert bf16[0].dtype == jnp.float32 and np.all(np.isfinite(bf16[0]))
    np.testing.assert_allclose(bf16[0], plain[0], atol=0.05 * float(np.abs(plain[0]).max()))


def test_sharded_parameters_follow_the_rules():
    """Heads over tensor, the up projections' latent axis over fsdp, the down projections replicated on tensor."""
    mesh = sharding.make_mesh(2, 2, 1, 2)
    state = nnx.state(tiny_model(**MLA_MODEL))
    specs = {name: tuple(s.spec) for name, s in sharding.state_shardings(state, mesh)["blocks"][0]["attn"].items()
             if hasattr(s, "spec")}
    assert specs["wq_b"] == ("fsdp", "tensor", None) and specs["wkv_b"] == ("fsdp", "tensor", None)
    assert specs["wq_a"] == ("fsdp", None) and specs["wkv_a"] == ("fsdp", None)
    assert specs["wo"] == ("tensor", None, "fsdp")



def test_the_glm4_moe_export_refuses_mla_and_yarn():
    """Glm4MoeForCausalLM has neither: an export would load into a model computing something else. MLA models
    export as DeepseekV3ForCausalLM instead (tests/test_hf_export_mla.py)."""
    assert "model.attention='mla'" in glm4_moe_unsupported_features(ModelConfig(**MLA_MODEL))
    assert "model.rope_scaling_factor=40.0" in unsupported_features(ModelConfig(**YARN))
    assert architecture(ModelConfig(**MLA_MODEL)) == "DeepseekV3ForCausalLM"
