"""Qwen3-Next (`qwen3_next`): a tiny random Qwen3NextForCausalLM with every distinguishing option on (Gated DeltaNet
layers with 2 key heads over 4 value heads beside a gated-attention layer, zero-centred norms, partial RoPE on a
quarter of the head, a dense layer by mlp_only_layers, the sigmoid-gated shared expert) loads with transformers'
logits over 70 tokens (two of HF's 64-token chunks), expert ids and KV-cached greedy tokens; its `mtp.*` tensors
are skipped as transformers skips them, analysis.routing --hf runs on it, and what we do not reproduce is refused
naming the field."""

import copy
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

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
transformers.utils.logging.set_verbosity_error()  # the CPU fallbacks of causal_conv1d / flash-linear-attention

from moe import param_counts  # noqa: E402
from moe.decoding.generate import generate  # noqa: E402
from moe.hf import ExportError, HFImportError, check_exportable, load_hf_moe, model_config  # noqa: E402

V, N_NEW = 320, 12
TOKENS = np.random.RandomState(0).randint(2, V, (2, 70))


def _config(**changes):
    return transformers.Qwen3NextConfig(**dict(dict(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=40, mlp_only_layers=[2],
        max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}), **changes))


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    hf = random_hf(_config())
    with torch.no_grad():  # the zero-centred norms store w of x (1 + w): w ~ N(0, 0.2), the others' scales' spread
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                p.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("qwen3_next")
    hf.save_pretrained(str(path))
    exact = copy.deepcopy(hf).double()
    exact.config._experts_implementation = "eager"  # grouped_mm has no float64
    with torch.no_grad():
        float64 = exact(torch.tensor(TOKENS)).logits.numpy()
    return dict(path=str(path), forward=hf_forward(hf, TOKENS), tokens=hf_generate(hf, TOKENS[:, :5], N_NEW),
                n_params=sum(p.numel() for p in hf.parameters()), float64=float64)


def test_logits_experts_and_greedy_tokens_match_transformers(qwen3_next):
    model, _ = load_hf_moe(qwen3_next["path"])
    cfg = model.cfg
    assert (cfg.linear_layers, cfg.rope_dim, cfg.moe_layer_ids, cfg.attn_output_gate, cfg.norm_offset, cfg.router) \
        == ("0,1,2", 8, (0, 1, 3), True, True, "softmax")
    logits, ids = ours_forward(model, jnp.asarray(TOKENS))
    hf_logits, hf_ids = qwen3_next["forward"]
    err = np.abs(np.asarray(logits) - hf_logits).max() / np.abs(hf_logits).max()
    # the tiny random model is ill-conditioned in fp32: transformers' own fp32 logits lie ~6e-5 from float64
    scale = np.abs(qwen3_next["float64"]).max()
    ours_64, theirs_64 = (np.abs(x - qwen3_next["float64"]).max() / scale for x in (np.asarray(logits), hf_logits))
    print(f"qwen3_next: max |logit diff| / max |logit| = {err:.1e}; experts {same_experts(ids, hf_ids)}; from "
          f"transformers in float64: ours {ours_64:.1e}, transformers' fp32 {theirs_64:.1e}")
    assert err <= 1e-4
    assert ours_64 <= 3 * theirs_64
    assert same_experts(ids, hf_ids) == [1.0] * 3
    ours = generate(model, jnp.asarray(TOKENS[:, :5]), jax.random.key(0), execution=EX, max_new_tokens=N_NEW, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(ours), qwen3_next["tokens"])
    assert param_counts(cfg)["total"] == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == \
        qwen3_next["n_params"]


def test_mtp_tensors_are_skipped(qwen3_next, tmp_path):
    """The released checkpoints ship mtp.* tensors that transformers' forward never reads: so do we."""
    shutil.copytree(qwen3_next["path"], tmp_path / "hf")
    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    save_file({**sd, "mtp.fc.weight": np.ones((64, 128), np.float32)}, str(tmp_path / "hf" / "model.safetensors"),
              metadata={"format": "pt"})
    model, _ = load_hf_moe(str(tmp_path / "hf"))
    assert model.cfg.mtp_depth == 0
    np.testing.assert_array_equal(np.asarray(model.blocks[0].attn.A_log[...]), sd["model.layers.0.linear_attn.A_log"])


def test_routing_analysis_runs(qwen3_next, tmp_path):
    a, doc = routing_on_hf(qwen3_next["path"], tmp_path)
    assert doc["model_type"] == "qwen3_next" and doc["layer_ids"] == [0, 1, 3] and a.n_tokens > 0


@pytest.mark.parametrize("changes,field", [
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope_type"),
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]), "layer_types"),
    (dict(layer_types=["full_attention"] * 3), "layer_types"),
    (dict(num_experts=0), "num_experts"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads"),
    (dict(linear_num_key_heads="2"), "linear_num_key_heads"),
])
def test_refused_configs_name_the_field(changes, field):
    c = dict(_config().to_dict(), **changes)
    with pytest.raises(HFImportError, match=field):
        model_config(c)


def test_default_layer_types_and_export_refusal():
    """Without layer_types every full_attention_interval-th layer is attention (transformers' default); the export
    (a Glm4Moe checkpoint) names what it cannot write."""
    c = _config().to_dict()
    c.pop("layer_types")
    cfg = model_config(dict(c, num_hidden_layers=8, full_attention_interval=4, mlp_only_layers=[]))
    assert cfg.linear_layer_ids == (0, 1, 2, 4, 5, 6)
    with pytest.raises(ExportError, match="attn_output_gate.*norm_offset.*linear_layers"):
        check_exportable(cfg)
