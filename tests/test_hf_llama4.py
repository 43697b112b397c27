"""Llama 4's text model (`llama4_text`): a tiny random Llama4ForCausalLM with every distinguishing option on (RoPE
layers chunked by 4 with a weightless q/k norm after interleaved RoPE, NoPE layers with the query temperature
stepping every 2 positions, MoE every 2nd layer with a top-1 sigmoid router on the expert input, a shared expert,
fused [E, D, 2F] experts) loads with transformers' logits, expert ids and KV-cached greedy tokens, and
analysis.routing --hf runs on it."""


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
from moe.attention import llama3_inv_frequencies  # noqa: E402
from moe.decoding.generate import generate  # noqa: E402
from moe.hf import HFImportError, load_hf_moe, model_config  # noqa: E402

V, N_NEW = 320, 12
# Scout's llama3 frequency scaling over a short original context, so that all three bands occur in 8 frequencies
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
TOKENS = np.random.RandomState(0).randint(2, V, (2, 12))


def _config(**changes):
    return transformers.Llama4TextConfig(**dict(dict(
        vocab_size=V, hidden_size=64, intermediate_size=32, intermediate_size_mlp=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=4, floor_scale=2, attn_scale=0.1,
        max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=None,
        rope_parameters=dict(LLAMA3)), **changes))


def _top_k_of_logits(hf):
    """Llama 4's router returns (scores, logits): the chosen ids are the top-k of the logits."""
    return lambda out: torch.topk(out[1], hf.config.num_experts_per_tok).indices


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    hf = random_hf(_config(), cls=transformers.Llama4ForCausalLM)
    path = tmp_path_factory.mktemp("llama4")
    hf.save_pretrained(str(path))
    return dict(path=str(path), forward=hf_forward(hf, TOKENS, routers=("feed_forward.router",), chosen=_top_k_of_logits(hf)), tokens=hf_generate(hf, TOKENS[:, :5], N_NEW),
                n_params=sum(p.numel() for p in hf.parameters()))


def test_logits_experts_and_greedy_tokens_match_transformers(llama4):
    model, _ = load_hf_moe(llama4["path"])
    cfg = model.cfg
    assert (cfg.nope_layers, cfg.attention_chunk, cfg.qk_norm, cfg.moe_layer_ids, cfg.router, cfg.rope_scaling) == \
        ("1,3", 4, "weightless", (1, 3), "sigmoid_input", "llama3")
    logits, ids = ours_forward(model, jnp.asarray(TOKENS))
    hf_logits, hf_ids = llama4["forward"]
    err = np.abs(np.asarray(logits) - hf_logits).max() / np.abs(hf_logits).max()
    print(f"llama4_text: max |logit diff| / max |logit| = {err:.1e}; experts {same_experts(ids, hf_ids)}")
    assert err <= 1e-4
    assert same_experts(ids, hf_ids) == [1.0, 1.0]
    ours = generate(model, jnp.asarray(TOKENS[:, :5]), jax.random.key(0), execution=EX, max_new_tokens=N_NEW, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(ours), llama4["tokens"])
    assert param_counts(cfg)["total"] == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == \
        llama4["n_params"]


def test_routing_analysis_runs(llama4, tmp_path):
    a, doc = routing_on_hf(llama4["path"], tmp_path)
    assert doc["model_type"] == "llama4_text" and doc["layer_ids"] == [1, 3] and a.n_tokens > 0


@pytest.mark.parametrize("changes,field", [
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 5e5, "factor": 8.0}), "rope_type"),
    (dict(layer_types=["full_attention"] * 4), "layer_types"),
    (dict(no_rope_layers=[1, 0, 1]), "no_rope_layers"),
    (dict(moe_layers=["1"]), "field 'moe_layers' is a list"),
])
def test_refused_configs_name_the_field(changes, field):
    c = dict(_config().to_dict(), **changes)
    with pytest.raises(HFImportError, match=field):
        model_config(c)


@pytest.mark.parametrize("dim,original", [(16, 64), (128, 8192)])  # the tiny model's; Scout's
def test_llama3_frequencies_equal_transformers(dim, original):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(LLAMA3, original_max_position_embeddings=original)
    hf_cfg = _config(head_dim=dim, rope_parameters=rope)
    theirs, scale = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    cfg = model_config(dict(hf_cfg.to_dict()))
    ours = np.asarray(llama3_inv_frequencies(cfg, dim))
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6, atol=0)
    assert scale == 1.0 and np.sum(ours != 1.0 / 500000.0 ** (np.arange(0, dim, 2) / dim)) > 0
