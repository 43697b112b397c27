"""Kimi-K2 (`kimi_k2`) and the text model of Kimi-K2.5 (`kimi_k25`): DeepSeek-V3's architecture under Moonshot's
config.json layout. A tiny random DeepseekV3 from transformers with Kimi's settings (one group, a dense first
layer, routed scaling 2.827, YaRN factor 64 with beta_fast = beta_slow = 1 over 4,096 original positions, theta
50,000), written as Kimi ships it (config.json rewritten to Kimi-K2's published layout, block FP8 weights),
loads with transformers' logits, experts and 32 greedy tokens (transformers reading the same dequantized weights
as deepseek_v3, since it has no kimi_k2); the K2.5 layout (text_config, `language_model.` names, a vision tower
that is not imported, the top-level tie_word_embeddings) matches transformers' own Kimi_K25ForConditionalGeneration;
and YaRN's frequencies with equal betas equal transformers'."""

import json
import math
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from moe.attention import yarn_inv_frequencies
from moe.decoding.generate import generate
from moe.hf import load_hf_moe
from moe.hf.tensors import read_tensors

torch = pytest.importorskip("torch", reason="torch builds the reference models")
transformers = pytest.importorskip("transformers", reason="transformers builds the reference models")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from tests.hf_random import EX, hf_forward, hf_generate, ours_forward, random_hf, same_experts, write_fp8  # noqa: E402

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()  # the K2.5 vision tower is not in the checkpoint: a long report

V, N_NEW = 128, 32
TOKENS = np.random.RandomState(0).randint(0, V, (2, 12))
BLOCK = [24, 20]
# Kimi-K2-Instruct-0905's rope_scaling (4.x layout), and the published fields around it (docs: kimi_k2.md, sec. 1)
KIMI_ROPE = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
SIZES = dict(vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
             qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2)


def kimi_config_json(quantization_config=None) -> dict:
    """Kimi-K2's config.json as published (model_type kimi_k2, DeepseekV3ForCausalLM through remote code, 4.x
    rope_scaling + rope_theta, Moonshot's extra router fields), with the tiny model's sizes."""
    c = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
         "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                      "AutoModel": "modeling_deepseek.DeepseekV3Model",
                      "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
         **SIZES, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
         "norm_topk_prob": True, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
         "seq_aux": True, "aux_loss_alpha": 0.001, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
         "max_position_embeddings": 262144, "rope_scaling": KIMI_ROPE, "num_nextn_predict_layers": 0,
         "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "initializer_range": 0.02,
         "bos_token_id": 125, "eos_token_id": 126, "pad_token_id": 127, "torch_dtype": "bfloat16", "use_cache": True,
         "transformers_version": "4.48.3"}
    return c if quantization_config is None else dict(c, quantization_config=quantization_config)


FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": BLOCK}


def as_deepseek_v3(kimi: dict):
    """What transformers does with Kimi's config.json (it has no kimi_k2): DeepseekV3Config of the same fields."""
    skip = ("model_type", "auto_map", "quantization_config", "architectures", "transformers_version")
    return transformers.DeepseekV3Config(**{k: v for k, v in kimi.items() if k not in skip})


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """Kimi-K2 as shipped (FP8), and transformers (DeepseekV3ForCausalLM) on the dequantized weights."""
    root = tmp_path_factory.mktemp("kimi")
    hf = random_hf(as_deepseek_v3(dict(kimi_config_json(), eos_token_id=None, bos_token_id=None, pad_token_id=None)))
    hf.save_pretrained(str(root / "plain"))
    sd = read_tensors(str(root / "plain"))
    meant = write_fp8(root / "kimi_k2", kimi_config_json(FP8), sd, BLOCK)
    save_file(meant, str(root / "plain" / "model.safetensors"), metadata={"format": "pt"})
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(root / "plain"), dtype=torch.float32).eval()
    model, tokenizer = load_hf_moe(str(root / "kimi_k2"))
    return dict(root=root, hf_config=hf.config, sd=sd, meant=meant, model=model, hf=hf_forward(reference, TOKENS),
                tokens=hf_generate(reference, TOKENS[:, :5], N_NEW))


def test_kimis_config_json_is_deepseek_v3_to_transformers(kimi):
    """The rewritten config.json describes the reference model: transformers reads its fields as deepseek_v3."""
    ours, ref = as_deepseek_v3(kimi_config_json()).to_dict(), kimi["hf_config"].to_dict()
    for k in ("rope_parameters", "n_group", "topk_group", "first_k_dense_replace", "routed_scaling_factor",
              "norm_topk_prob", "rms_norm_eps", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim"):
        assert ours[k] == ref[k], k
    assert ref["rope_parameters"]["beta_fast"] == ref["rope_parameters"]["beta_slow"] == 1.0


def test_kimi_k2_logits_experts_and_greedy_tokens_match_transformers(kimi):
    model = kimi["model"]
    cfg = model.cfg
    assert (cfg.attention, cfg.router, cfg.n_group, cfg.first_k_dense, cfg.routed_scaling_factor) == \
        ("mla", "sigmoid", 1, 1, 2.827)
    assert (cfg.rope_scaling_factor, cfg.rope_original_max_position, cfg.yarn_beta_fast, cfg.yarn_beta_slow,
            cfg.yarn_mscale_all_dim, cfg.rope_theta) == (64.0, 4096, 1.0, 1.0, 1.0, 50000.0)
    logits, ids = ours_forward(model, jnp.asarray(TOKENS))
    hf_logits, hf_ids = kimi["hf"]
    err = np.abs(np.asarray(logits) - hf_logits).max() / np.abs(hf_logits).max()
    print(f"kimi_k2 (FP8): max |logit diff| / max |logit| = {err:.1e} (scale {np.abs(hf_logits).max():.1f}); "
          f"experts {same_experts(ids, hf_ids)}")
    assert err < 1e-5
    assert same_experts(ids, hf_ids) == [1.0] * cfg.n_moe_layers == [1.0, 1.0]
    ours = np.asarray(generate(model, jnp.asarray(TOKENS[:, :5]), jax.random.key(0), execution=EX, max_new_tokens=N_NEW,
                               temperature=0.0))
    np.testing.assert_array_equal(ours, kimi["tokens"])


def _k25_name(name):
    """The Hub's Kimi-K2.5 names for the text model's tensors."""
    return "language_model." + name if name.startswith(("model.", "lm_head.")) else name


def _k25_config(text: dict, **top) -> dict:
    vision = {"model_type": "kimi_k25_vision", "patch_size": 14, "num_attention_heads": 2, "num_hidden_layers": 1,
              "hidden_size": 16, "intermediate_size": 32, "pos_emb_height": 4, "pos_emb_width": 4, "pos_emb_time": 1}
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
            "vision_config": vision, "projection_hidden_size": 16, **top}


def _vision_tensors():
    rng = np.random.default_rng(3)
    return {"vision_tower.patch_embed.proj.weight": rng.normal(size=(16, 3, 14, 14)).astype(ml_dtypes.bfloat16),
            "mm_projector.proj.0.weight": rng.normal(size=(64, 64)).astype(ml_dtypes.bfloat16)}


@pytest.mark.parametrize("stored_head", [True, False])
def test_kimi_k25_text_model_matches_transformers_kimi_k25(kimi, tmp_path, stored_head):
    """K2.5: the text model's config nested in text_config (model_type kimi_k2), its FP8 weights under
    `language_model.`, a vision tower and projector beside them (not imported), and no top-level
    tie_word_embeddings: transformers' Kimi_K25Config then ties by default, yet a stored head that differs is
    used untied; without a stored head the embedding is the head. Compared with transformers' own
    Kimi_K25ForConditionalGeneration on the dequantized weights."""
    sd = dict(kimi["sd"]) if stored_head else {k: v for k, v in kimi["sd"].items() if k != "lm_head.weight"}
    text = dict(kimi_config_json(FP8), tie_word_embeddings=False)  # the text config's flag: transformers ignores it
    vision = _vision_tensors()
    meant = write_fp8(tmp_path / "k25", _k25_config(text), sd, BLOCK, rename=_k25_name, extra=vision)
    plain = tmp_path / "plain"  # the same weights dequantized (transformers needs accelerate to read FP8)
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(_k25_config({k: v for k, v in text.items()
                                                               if k != "quantization_config"})))
    save_file({**{_k25_name(k): v for k, v in meant.items()}, **{k: v.astype(np.float32) for k, v in vision.items()}},
              str(plain / "model.safetensors"), metadata={"format": "pt"})
    reference = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(str(plain), dtype=torch.float32).eval()
    assert reference.config.tie_word_embeddings  # Kimi_K25Config's default
    with torch.no_grad():
        hf_logits = reference(input_ids=torch.tensor(TOKENS)).logits.numpy()
    model, _ = load_hf_moe(str(tmp_path / "k25"))
    assert model.cfg.tie_embeddings == (not stored_head)
    logits, _ = ours_forward(model, jnp.asarray(TOKENS))
    err = np.abs(np.asarray(logits) - hf_logits).max() / np.abs(hf_logits).max()
    print(f"kimi_k25 (FP8, head {'stored' if stored_head else 'tied'}): max |logit diff| / max |logit| = {err:.1e}")
    assert err < 1e-5, err
    if stored_head:
        np.testing.assert_allclose(np.asarray(logits), np.asarray(ours_forward(kimi["model"], jnp.asarray(TOKENS))[0]),
                                   rtol=0, atol=1e-5 * np.abs(hf_logits).max())


@pytest.mark.parametrize("dim,base,factor,original,fast,slow", [
    (64, 50000.0, 64.0, 4096, 1.0, 1.0),  # Kimi-K2-0905 / K2-Thinking / K2.5: a step at rotary pair 20
    (64, 50000.0, 32.0, 4096, 1.0, 1.0),  # Kimi-K2-Instruct
    (8, 50000.0, 64.0, 4096, 1.0, 1.0),  # the tiny model above
    (64, 10000.0, 40.0, 4096, 32.0, 1.0),  # DeepSeek-V3
    (8, math.exp(8 * math.log(4096 / (2 * math.pi)) / 4), 4.0, 4096, 1.0, 1.0),  # correction dim 2: low == high
])
def test_yarn_frequencies_with_equal_betas_equal_transformers(dim, base, factor, original, fast, slow):
    cfg = types.SimpleNamespace(rope_scaling_factor=factor, rope_theta=base, rope_original_max_position=original,
                                yarn_beta_fast=fast, yarn_beta_slow=slow)
    hf_cfg = transformers.DeepseekV3Config(qk_rope_head_dim=dim, max_position_embeddings=original * int(factor),
                                           rope_parameters={"rope_type": "yarn", "rope_theta": base, "factor": factor,
                                                            "original_max_position_embeddings": original,
                                                            "beta_fast": fast, "beta_slow": slow})
    theirs, _ = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    np.testing.assert_allclose(np.asarray(yarn_inv_frequencies(cfg, dim)), theirs.numpy(), rtol=1e-6, atol=0)
