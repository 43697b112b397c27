"""LongCat-Flash (`longcat_flash`): a tiny random LongcatFlashForCausalLM (two MLA + dense SwiGLU sublayers and a
shortcut MoE per layer, LoRA-scaled MLA, a softmax router over 8 experts and 4 zero experts with a selection bias,
top-3 unnormalized x 6) loads with transformers' logits, expert ids (zero experts included) and KV-cached greedy
tokens, and analysis.routing --hf runs on it."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="torch builds the reference models")
transformers = pytest.importorskip("transformers", reason="transformers builds the reference models")
from tests.hf_random import (  # noqa: E402
    EX,
    hf_forward,
    hf_generate,
    ours_forward,
    random_hf,
    routing_on_hf,
    same_experts,
)

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

from moe import param_counts  # noqa: E402
from moe.decoding.generate import generate  # noqa: E402
from moe.hf import HFImportError, load_hf_moe, model_config  # noqa: E402

V, N_NEW = 320, 12
TOKENS = np.random.RandomState(0).randint(2, V, (2, 12))


def _config(**changes):
    return transformers.LongcatFlashConfig(**dict(dict(
        vocab_size=V, hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=96, q_lora_rank=48,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8, n_routed_experts=8,
        zero_expert_num=4, moe_topk=3, expert_ffn_hidden_size=32, routed_scaling_factor=6.0, rms_norm_eps=1e-5,
        max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        eos_token_id=None, bos_token_id=None, pad_token_id=None), **changes))


@pytest.fixture(scope="module")
def longcat(tmp_path_factory):
    hf = random_hf(_config())
    path = tmp_path_factory.mktemp("longcat")
    hf.save_pretrained(str(path))
    return dict(path=str(path), forward=hf_forward(hf, TOKENS, routers=("mlp.router",)), tokens=hf_generate(hf, TOKENS[:, :5], N_NEW),
                n_params=sum(p.numel() for p in hf.parameters()))


def test_logits_experts_and_greedy_tokens_match_transformers(longcat):
    model, _ = load_hf_moe(longcat["path"])
    cfg = model.cfg
    assert (cfg.dual_sublayers, cfg.mla_lora_scale, cfg.n_zero_experts, cfg.n_layers) == (True, True, 4, 2)
    logits, ids = ours_forward(model, jnp.asarray(TOKENS))
    hf_logits, hf_ids = longcat["forward"]
    err = np.abs(np.asarray(logits) - hf_logits).max() / np.abs(hf_logits).max()
    print(f"longcat_flash: max |logit diff| / max |logit| = {err:.1e}; experts {same_experts(ids, hf_ids)}; "
          f"zero-expert picks {int(sum((np.asarray(i) >= 8).sum() for i in ids))}")
    assert err <= 1e-4
    assert same_experts(ids, hf_ids) == [1.0, 1.0]
    assert sum((np.asarray(i) >= 8).sum() for i in ids) > 0  # zero experts were chosen
    ours = generate(model, jnp.asarray(TOKENS[:, :5]), jax.random.key(0), execution=EX, max_new_tokens=N_NEW, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(ours), longcat["tokens"])
    # transformers counts the router's bias buffer out; ours is a RoutingBias, not a Param, either
    assert param_counts(cfg)["total"] == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == \
        longcat["n_params"]


def test_routing_analysis_runs(longcat, tmp_path):
    a, doc = routing_on_hf(longcat["path"], tmp_path)
    assert doc["model_type"] == "longcat_flash" and doc["layer_ids"] == [0, 1] and a.n_tokens > 0


@pytest.mark.parametrize("changes,field", [
    (dict(router_bias=True), "router_bias"),
    (dict(mla_scale_q_lora=False), "mla_scale_q_lora"),
    (dict(zero_expert_type="zero"), "zero_expert_type"),
    (dict(head_dim=16), "head_dim"),
    (dict(mla_scale_kv_lora="false"), "field 'mla_scale_kv_lora' is a string"),
])
def test_refused_configs_name_the_field(changes, field):
    c = dict(_config().to_dict(), **changes)
    with pytest.raises(HFImportError, match=field):
        model_config(c)


@pytest.mark.parametrize("changes,field", [
    (dict(dual_sublayers=True), "dual_sublayers"), (dict(mla_lora_scale=True), "mla_lora_scale"),
    (dict(query_scale_beta=0.1, query_scale_period=4), "query_scale_beta"),
    (dict(expert_act="clamped_swiglu"), "expert_act"),
])
def test_exports_refuse_the_imported_families_features(changes, field):
    """An export writes deepseek_v3 / glm4_moe, which have none of these: refused naming the field."""
    from moe.config import ModelConfig
    from moe.hf.write import unsupported_features

    mla = dict(attention="mla", q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
               v_head_dim=8, n_heads=2, n_kv_heads=2, d_model=32, n_routed_experts=4, top_k=2, first_k_dense=0)
    assert any(field in f for f in unsupported_features(ModelConfig(**mla, **changes)))
    gqa = dict(sliding_window=4, sliding_layers="0", attn_sinks=True)
    assert {"model.sliding_window=4", "model.attn_sinks=True"} <= set(unsupported_features(ModelConfig(**gqa)))
