"""Export a multi-head latent attention model (`model.attention="mla"`) as HuggingFace `DeepseekV3ForCausalLM`
(`model_type: deepseek_v3`), exactly: config.json, the attention tensors and what cannot be exported. export.py
dispatches here and writes the tensors deepseek_v3 names as glm4_moe does (embeddings, norms, dense MLPs, router,
e_score_correction_bias, experts, shared experts).

The inverse of the importer (moe/hf/deepseek.py, moe/hf/weights.py `_mla`; moe/mla.py's docstring lists the
mapping). transformers 5.24's deepseek_v3 fixes, and a model is refused (one line naming the field) unless ours
matches:
  latent norms    q_a_layernorm / kv_a_layernorm eps 1e-6, whatever rms_norm_eps is (ours: latent_norm_eps, 0:
                  norm_eps)
  layers          dense exactly the first first_k_dense_replace, MoE every layer after (no moe_layer_step,
                  dense_layers elsewhere)
  router          sigmoid + e_score_correction_bias for selection (noaux_tc), groups scored by their top-2 sum, so
                  >= 2 experts per group; shared experts one SwiGLU of moe_intermediate_size x n_shared_experts
  attention       causal, RoPE on every qk_rope_head_dim dim, no biases, no q/k norm
YaRN goes to rope_parameters as transformers' `_compute_yarn_parameters` and `yarn_apply_mscale` read it (and to
rope_scaling with the same values, for 4.x readers); an unset mscale / mscale_all_dim (0 here) is omitted, which
transformers reads as 0 and DeepSeek's own code as its defaults. q_lora_rank 0 is written as null (one q_proj).
"""

import numpy as np

from moe.config import ModelConfig
from moe.router import ROUTERS

ARCHITECTURE = "DeepseekV3ForCausalLM"
LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, used for q_a_layernorm and kv_a_layernorm


def leading_dense_layers(cfg: ModelConfig) -> int:
    """The number of dense layers before the first MoE layer: config.json's first_k_dense_replace."""
    return next((i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)), cfg.n_layers)


def unsupported_features(cfg: ModelConfig) -> list[str]:
    """Features of an MLA `cfg` with no exact DeepseekV3ForCausalLM equivalent (empty: the export is exact)."""
    out = []
    if cfg.mask != "causal":
        out.append(f"{cfg.mask} mask")
    if not cfg.rope:
        out.append("no position encoding (NoPE)")
    eps = cfg.latent_norm_eps or cfg.norm_eps
    if eps != LATENT_NORM_EPS:
        field = "latent_norm_eps" if cfg.latent_norm_eps else "norm_eps"
        out.append(f"model.{field}={eps!r} as the latent norms' eps (deepseek_v3 fixes it at {LATENT_NORM_EPS})")
    k = leading_dense_layers(cfg)
    if cfg.moe_layer_ids != tuple(range(k, cfg.n_layers)):
        step = cfg.moe_layer_step != 1 and any((i + 1) % cfg.moe_layer_step for i in range(k, cfg.n_layers))
        field = f"moe_layer_step={cfg.moe_layer_step!r}" if step else f"dense_layers={cfg.dense_layers!r}"
        out.append(f"model.{field} (MoE layers {list(cfg.moe_layer_ids)}; deepseek_v3 makes every layer after "
                   "the first first_k_dense_replace MoE)")
    if cfg.n_moe_layers:
        if "deepseek_v3" not in ROUTERS[cfg.router].exports_as:
            out.append(f"model.router={cfg.router!r} (deepseek_v3 routes as model.router='sigmoid')")
        if cfg.router_group_score != "top2_sum":
            out.append(f"model.router_group_score={cfg.router_group_score!r} (deepseek_v3 scores a group by its "
                       "two best experts)")
        if cfg.n_routed_experts // cfg.n_group < 2:
            out.append(f"fewer than 2 routed experts per group ({cfg.n_routed_experts} experts, model.n_group="
                       f"{cfg.n_group}; HF scores a group by its two best experts)")
        if cfg.shared_expert_gate:
            out.append("model.shared_expert_gate=True")
        if cfg.shared_width != cfg.moe_d_ff * cfg.n_shared_experts:
            out.append(f"model.shared_d_ff={cfg.shared_d_ff!r} (deepseek_v3's shared experts are "
                       "moe_d_ff x n_shared_experts wide)")
    for field, plain in (("qk_norm", "none"), ("qkv_bias", False), ("attn_out_bias", False), ("rope_fraction", 1.0),
                         ("query_scale_beta", 0.0), ("mla_lora_scale", False), ("dual_sublayers", False),
                         ("expert_act", "swiglu"), ("expert_bias", False), ("yarn_truncate", True)):
        if getattr(cfg, field) != plain:  # moe.config refuses these with mla today; kept for a future relaxation
            out.append(f"model.{field}={getattr(cfg, field)!r}")
    return out


def rope_parameters(cfg: ModelConfig) -> dict:
    """transformers 5.x `rope_parameters`: default RoPE, or YaRN with every field that changes the math."""
    rp = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": 1.0}
    if cfg.rope_scaling_factor == 1.0:
        return rp
    rp.update(rope_type="yarn", factor=cfg.rope_scaling_factor,
              original_max_position_embeddings=cfg.rope_original_max_position, beta_fast=cfg.yarn_beta_fast,
              beta_slow=cfg.yarn_beta_slow)
    # 0 is our "unset"; transformers reads a missing key as 0 too (an explicit 0 would change DeepSeek's own code).
    if cfg.yarn_mscale:
        rp["mscale"] = cfg.yarn_mscale
    if cfg.yarn_mscale_all_dim:
        rp["mscale_all_dim"] = cfg.yarn_mscale_all_dim
    return rp


def hf_config(cfg: ModelConfig, *, eos_token_id: int, pad_token_id: int, bos_token_id: int | None, dtype: str,
              max_position_embeddings: int, mtp_layers: int = 0) -> dict:
    """config.json for `deepseek_v3`; every field that changes the math is written explicitly (call
    unsupported_features first)."""
    rope = rope_parameters(cfg)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,  # one key per head
        "q_lora_rank": cfg.q_lora_rank or None,  # null: one full-rank q_proj
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "head_dim": cfg.qk_rope_head_dim,  # what DeepseekV3Config sets itself: the rotary dims
        "rope_interleave": cfg.rope_interleave,
        "hidden_act": "silu",
        "intermediate_size": cfg.d_ff,
        "first_k_dense_replace": leading_dense_layers(cfg),
        "moe_layer_freq": 1,
        "moe_intermediate_size": cfg.moe_d_ff,
        "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.top_k,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "num_nextn_predict_layers": mtp_layers,  # the MTP layers written (the class default is 1)
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope,
        # For transformers 4.x readers (5.x reads rope_scaling first: the same values).
        "rope_scaling": {**rope, "type": "yarn"} if rope["rope_type"] == "yarn" else None,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def attention_tensors(attn, cfg: ModelConfig, cast) -> dict[str, np.ndarray]:
    """moe.mla.MLA's weights under their DeepseekV3Attention names (relative to `self_attn.`), [out, in] layout;
    `cast` converts one array to the export dtype."""
    D, H, Q, R = cfg.d_model, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    Dn, Dr, Dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    w = lambda v: np.asarray(v.get_value())
    out = {}
    if Q:
        out["q_a_proj.weight"] = cast(w(attn.wq_a).T)  # [D,Q] -> [Q,D]
        out["q_a_layernorm.weight"] = cast(w(attn.q_norm.scale))
        out["q_b_proj.weight"] = cast(w(attn.wq_b).reshape(Q, H * (Dn + Dr)).T)
    else:
        out["q_proj.weight"] = cast(w(attn.wq).reshape(D, H * (Dn + Dr)).T)
    out["kv_a_proj_with_mqa.weight"] = cast(w(attn.wkv_a).T)  # [D,R+Dr] -> [R+Dr,D]
    out["kv_a_layernorm.weight"] = cast(w(attn.kv_norm.scale))
    out["kv_b_proj.weight"] = cast(w(attn.wkv_b).reshape(R, H * (Dn + Dv)).T)
    out["o_proj.weight"] = cast(w(attn.wo).reshape(H * Dv, D).T)
    return out
