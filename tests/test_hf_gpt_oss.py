"""gpt-oss (`gpt_oss`): a tiny random GptOssForCausalLM with every distinguishing option on (attention sinks,
sliding windows of 4 on the even layers, biases on q/k/v/o, the router and the experts, the clamped SwiGLU on
interleaved gate / up columns, YaRN without rounding) loads with transformers' logits, expert ids and KV-cached
greedy tokens, and analysis.routing --hf runs on it; the pieces are checked against plain formulas."""


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
from moe.attention import softmax_attention  # noqa: E402
from moe.decoding.generate import generate  # noqa: E402
from moe.dispatch.experts import clamped_swiglu  # noqa: E402
from moe.hf import HFImportError, load_hf_moe, model_config  # noqa: E402

V, N_NEW = 320, 12
TOKENS = np.random.RandomState(0).randint(2, V, (2, 12))
ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}


def _config(**changes):
    return transformers.GptOssConfig(**dict(dict(
        vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=256, rope_parameters=dict(ROPE), eos_token_id=None, bos_token_id=None,
        pad_token_id=None), **changes))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    hf = random_hf(_config())
    path = tmp_path_factory.mktemp("gpt_oss")
    hf.save_pretrained(str(path))
    return dict(path=str(path), forward=hf_forward(hf, TOKENS, routers=("mlp.router",)), tokens=hf_generate(hf, TOKENS[:, :5], N_NEW),
                n_params=sum(p.numel() for p in hf.parameters()))


def test_logits_experts_and_greedy_tokens_match_transformers(gpt_oss):
    model, _ = load_hf_moe(gpt_oss["path"])
    cfg = model.cfg
    assert (cfg.sliding_layers, cfg.sliding_window, cfg.attn_sinks, cfg.router, cfg.expert_act, cfg.yarn_truncate) == \
        ("0,2", 4, True, "topk_softmax", "clamped_swiglu", False)
    logits, ids = ours_forward(model, jnp.asarray(TOKENS))
    hf_logits, hf_ids = gpt_oss["forward"]
    err = np.abs(np.asarray(logits) - hf_logits).max() / np.abs(hf_logits).max()
    print(f"gpt_oss: max |logit diff| / max |logit| = {err:.1e}; experts {same_experts(ids, hf_ids)}")
    assert err <= 1e-4
    assert same_experts(ids, hf_ids) == [1.0] * 4
    ours = generate(model, jnp.asarray(TOKENS[:, :5]), jax.random.key(0), execution=EX, max_new_tokens=N_NEW, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(ours), gpt_oss["tokens"])
    assert param_counts(cfg)["total"] == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == \
        gpt_oss["n_params"]


def test_sinks_and_clamped_swiglu_are_their_formulas():
    """A sink is one more logit in each denominator with no value; the clamped SwiGLU is gpt-oss's expression."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in ((1, 3, 1, 2, 4), (1, 3, 1, 4), (1, 3, 1, 4)))
    sinks = rng.normal(size=(1, 2)).astype(np.float32)
    mask = np.tril(np.ones((3, 3), bool))[None, None]
    out, probs = softmax_attention(*map(jnp.asarray, (q, k, v, mask)), True, sinks_NxG=jnp.asarray(sinks))
    s = np.einsum("blngk,bsnk->bngls", q, k) / 2.0
    s = np.where(mask[:, :, None], s, -np.inf)
    e = np.exp(s)
    want = e / (e.sum(-1, keepdims=True) + np.exp(sinks)[None, :, :, None, None])
    np.testing.assert_allclose(np.asarray(probs), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(out), np.einsum("bngls,bsnk->blngk", want, v), rtol=1e-5, atol=1e-6)
    a, b = rng.normal(scale=5, size=(2, 64)).astype(np.float32)
    g = np.minimum(a, 7.0)
    np.testing.assert_allclose(np.asarray(clamped_swiglu(a, b, 7.0, 1.702)),
                               (np.clip(b, -7, 7) + 1) * g / (1 + np.exp(-1.702 * g)), rtol=1e-5, atol=1e-6)


def test_routing_analysis_runs(gpt_oss, tmp_path):
    a, doc = routing_on_hf(gpt_oss["path"], tmp_path)
    assert doc["model_type"] == "gpt_oss" and doc["layer_ids"] == [0, 1, 2, 3] and a.n_tokens > 0


@pytest.mark.parametrize("changes,field", [
    (dict(quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}),
     "quantization_config.modules_to_not_convert"),
    (dict(quantization_config={"quant_method": "mxfp4", "group_size": 32}), "quantization_config.group_size"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}), "rope_type"),
    (dict(layer_types=["chunked_attention"] * 4), "layer_types"),
])
def test_refused_configs_name_the_field(changes, field):
    c = dict(_config().to_dict(), **changes)
    with pytest.raises(HFImportError, match=field):
        model_config(c)
