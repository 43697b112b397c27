"""gpt-oss (`gpt_oss`, GptOssForCausalLM: gpt-oss-20b / 120b), as transformers 5.25 computes it.

  attention  GQA with biases on q/k/v/o (attention_bias, default true), a learned sink logit per head in every
             softmax's denominator (model.attn_sinks), rotate-half RoPE with YaRN whose correction range is not
             rounded (truncate false: model.yarn_truncate), cos / sin x 0.1 ln(factor) + 1; the layers layer_types
             marks sliding_attention (default the even ones) see the last sliding_window positions only
             (model.sliding_window, sliding_layers)
  router     a Linear with a bias (router_logit_bias): top-k of the logits, gates softmax over the k chosen
             (router "topk_softmax")
  experts    every layer MoE, no shared expert; fused [E, D, 2F] with gate and up in alternate columns and biases
             (expert_bias), the clamped SwiGLU (clamp(up, +-limit) + 1) * g sigmoid(alpha g), g = min(gate, limit)
             (expert_act "clamped_swiglu", swiglu_limit, swiglu_alpha); they run the plain loop over experts
Missing fields take GptOssConfig's defaults (head_dim 64, theta 150000, YaRN factor 32 over 4,096 positions).
The Hub's MXFP4 experts (quantization_config {"quant_method": "mxfp4", "modules_to_not_convert": [...]}: each
`experts.gate_up_proj_blocks` / `_scales` and `experts.down_proj_blocks` / `_scales` pair) are dequantized to fp32
as they are read, in the in-memory, sharded and layer-streamed imports alike (moe/hf/tensors.py, moe/hf/quant.py):
the weights equal transformers' Mxfp4Config(dequantize=True) bit for bit; a module listed in
modules_to_not_convert must be stored plain.
Refused: RoPE other than default or YaRN, layer_types other than full / sliding attention.
"""

from moe.config import ModelConfig
from moe.hf.common import field, refuse, rope_parameters, stack_fields
from moe.hf.weights import Layout

MODEL_TYPES = ("gpt_oss",)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def rope_fields(c: dict, where: str) -> dict:
    """RoPE's ModelConfig fields: default, or YaRN as transformers' _compute_yarn_parameters reads it."""
    given = c.get("rope_parameters") or c.get("rope_scaling")
    rp = rope_parameters(dict(c, rope_parameters=given or DEFAULT_ROPE, rope_theta=c.get("rope_theta") or 150000.0))
    if rp["rope_type"] == "default":
        return dict(rope_theta=float(rp["rope_theta"]))
    if rp["rope_type"] != "yarn":
        refuse(where, "rope_type", rp["rope_type"], "only default RoPE and YaRN")
    if rp.get("attention_factor") is not None:
        refuse(where, "rope_parameters.attention_factor", rp["attention_factor"], "derived from factor and mscale")
    original = int(rp.get("original_max_position_embeddings") or c.get("max_position_embeddings", 131072))
    factor = float(rp.get("factor") or c.get("max_position_embeddings", 131072) / original)
    if factor <= 1:
        refuse(where, "rope_parameters.factor", factor, "YaRN's factor must be > 1 (a plain RoPE config says default)")
    return dict(rope_theta=float(rp["rope_theta"]), rope_scaling_factor=factor, rope_original_max_position=original,
                yarn_beta_fast=float(rp.get("beta_fast") or 32.0), yarn_beta_slow=float(rp.get("beta_slow") or 1.0),
                yarn_mscale=float(rp.get("mscale") or 0.0), yarn_mscale_all_dim=float(rp.get("mscale_all_dim") or 0.0),
                yarn_truncate=bool(rp.get("truncate", True)))


def model_config(c: dict, where: str) -> ModelConfig:
    n = c["num_hidden_layers"]
    types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        refuse(where, "layer_types", types, f"one per layer ({n}), each sliding_attention or full_attention")
    sliding = [i for i in range(n) if types[i] == "sliding_attention"]
    window = int(c.get("sliding_window", 128) or 0) if sliding else 0
    fields = dict(stack_fields(c, where), head_dim=c.get("head_dim") or 64, n_kv_heads=c.get("num_key_value_heads")
                  or 8)
    bias = bool(c.get("attention_bias", True))
    F = c["intermediate_size"]
    return ModelConfig(
        **fields, **rope_fields(c, where), qkv_bias=bias, attn_out_bias=bias, attn_sinks=True,
        sliding_window=window if window else 0, sliding_layers=",".join(map(str, sliding)) if window else "",
        d_ff=F, first_k_dense=0, n_routed_experts=field(c, "num_local_experts", "num_experts", default=128),
        n_shared_experts=0, top_k=c.get("num_experts_per_tok", 4), moe_d_ff=F, router="topk_softmax",
        router_logit_bias=True, expert_bias=True, expert_act="clamped_swiglu",
        swiglu_limit=float(c.get("swiglu_limit", 7.0)), swiglu_alpha=float(c.get("swiglu_alpha", 1.702)))


def layout(c: dict) -> Layout:
    return Layout(router="router.weight", experts_in_out=True, interleaved=True)
