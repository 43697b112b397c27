"""Mistral Small 4 (`mistral4`): a tiny random Mistral4ForCausalLM (YaRN over the rotary part of the MLA head, Llama
4's query scale stepping every 4 positions so that 12 tokens cross it twice, a softmax router over groups, a
shared expert, a dense first layer) loads with transformers' logits, expert ids and KV-cached greedy tokens, and
analysis.routing --hf runs on it; what transformers cannot run or we do not reproduce is refused naming the field."""


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

from moe.attention import query_scale  # noqa: E402
from moe.decoding.generate import generate  # noqa: E402
from moe.hf import HFImportError, load_hf_moe, model_config  # noqa: E402

V, N_NEW = 320, 12
TOKENS = np.random.RandomState(0).randint(2, V, (2, 12))
ROPE = {"type": "yarn", "rope_theta": 10000.0, "factor": 128.0, "original_max_position_embeddings": 4,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}


def _config(**changes):
    return transformers.Mistral4Config(**dict(dict(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=512, rope_parameters=dict(ROPE), eos_token_id=None,
        bos_token_id=None, pad_token_id=None), **changes))


@pytest.fixture(scope="module")
def mistral4(tmp_path_factory):
    hf = random_hf(_config(), cls=transformers.Mistral4ForCausalLM)
    path = tmp_path_factory.mktemp("mistral4")
    hf.save_pretrained(str(path))
    return dict(path=str(path), forward=hf_forward(hf, TOKENS), tokens=hf_generate(hf, TOKENS[:, :5], N_NEW))


def test_logits_experts_and_greedy_tokens_match_transformers(mistral4):
    model, _ = load_hf_moe(mistral4["path"])
    cfg = model.cfg
    assert (cfg.attention, cfg.router, cfg.query_scale_beta, cfg.query_scale_period, cfg.rope_scaling_factor) == \
        ("mla", "softmax", 0.1, 4, 128.0)
    logits, ids = ours_forward(model, jnp.asarray(TOKENS))
    hf_logits, hf_ids = mistral4["forward"]
    err = np.abs(np.asarray(logits) - hf_logits).max() / np.abs(hf_logits).max()
    print(f"mistral4: max |logit diff| / max |logit| = {err:.1e}; experts {same_experts(ids, hf_ids)}")
    assert err <= 1e-4
    assert same_experts(ids, hf_ids) == [1.0] * cfg.n_moe_layers == [1.0, 1.0]
    ours = generate(model, jnp.asarray(TOKENS[:, :5]), jax.random.key(0), execution=EX, max_new_tokens=N_NEW, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(ours), mistral4["tokens"])
    # without the query scale the model differs from transformers' past the first 4 positions
    off = nnx.merge(*nnx.split(model))
    off.cfg = cfg.replace(query_scale_beta=0.0, query_scale_period=0)
    for block in off.blocks:
        block.attn.cfg = off.cfg
    plain = np.asarray(off(jnp.asarray(TOKENS))[0])
    assert np.abs(plain[:, :4] - hf_logits[:, :4]).max() <= 1e-4 * np.abs(hf_logits).max()
    assert np.abs(plain[:, 4:] - hf_logits[:, 4:]).max() > 1e-2 * np.abs(hf_logits).max()


def test_query_scale_is_llama4s():
    """transformers' get_llama_4_attn_scale: 1 + beta ln(1 + floor(pos / L0)) at pos 0, L0 - 1, L0, 2 L0, 100000."""
    cfg = model_config(_config(rope_parameters=dict(ROPE, original_max_position_embeddings=8192)).to_dict())
    pos = jnp.asarray([[0, 8191, 8192, 16384, 100000]])
    np.testing.assert_allclose(np.asarray(query_scale(cfg, pos))[0], [1.0, 1.0, 1.0693147, 1.1098612, 1.2564949],
                               rtol=1e-6)


def test_routing_analysis_runs(mistral4, tmp_path):
    a, doc = routing_on_hf(mistral4["path"], tmp_path)
    assert doc["model_type"] == "mistral4" and doc["layer_ids"] == [1, 2] and a.n_tokens > 0


@pytest.mark.parametrize("rope,field", [
    ({"rope_type": "default", "rope_theta": 1e4}, "rope_type"),
    (dict(ROPE, partial_rotary_factor=1.0), "partial_rotary_factor"),
    ({k: v for k, v in ROPE.items() if k != "llama_4_scaling_beta"}, "llama_4_scaling_beta"),
])
def test_refused_configs_name_the_field(rope, field):
    c = _config().to_dict()
    c["rope_parameters"] = rope
    with pytest.raises(HFImportError, match=field):
        model_config(c)
