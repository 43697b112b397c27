"""dots.llm1 (`dots1`, Dots1ForCausalLM): DeepSeek-V3's MoE on Qwen3's attention. Sigmoid router in fp32,
e_score_correction_bias for selection only, group-limited top-k (groups scored by their top-2 sum), gates
renormalized iff norm_topk_prob x routed_scaling_factor, ungated shared experts of width moe_intermediate_size x
n_shared_experts, dense SwiGLU (intermediate_size) in the first first_k_dense_replace layers; GQA with per-head
q/k RMSNorm before a full rotate-half RoPE, attention_bias on q/k/v AND o. Missing fields take Dots1Config's
defaults (first_k_dense_replace 0, norm_topk_prob false, routed_scaling_factor 1, one group), which differ from
DeepSeek-V3's. Refused: any sliding-window layer (layer_types, or as transformers derives them from
sliding_window and max_window_layers), a scoring_func / topk_method other than transformers' sigmoid / noaux_tc,
scaled or partial RoPE, null n_shared_experts / n_group.
"""

from moe.config import ModelConfig
from moe.hf.common import field, n_experts, refuse, rope_settings, stack_fields
from moe.hf.weights import Layout

MODEL_TYPES = ("dots1",)


def layer_types(c: dict) -> list[str]:
    """Each layer's attention as Dots1Config derives it when config.json lists none."""
    if c.get("layer_types"):
        return list(c["layer_types"])
    window, first = c.get("sliding_window", 4096), c.get("max_window_layers", 62)
    return ["sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(c["num_hidden_layers"])]


def model_config(c: dict, where: str) -> ModelConfig:
    theta, partial = rope_settings(c, where)
    if partial != 1.0:
        refuse(where, "partial_rotary_factor", partial, "dots1 rotates the whole head")
    sliding = [i for i, t in enumerate(layer_types(c)) if t != "full_attention"]
    if sliding:
        refuse(where, "layer_types", f"sliding_attention at layers {sliding}", "sliding-window attention is not "
               "implemented (without layer_types, transformers makes layers >= max_window_layers sliding)")
    if c.get("scoring_func", "sigmoid") not in ("sigmoid", "noaux_tc"):
        refuse(where, "scoring_func", c["scoring_func"], "transformers' dots1 always scores with sigmoid")
    if c.get("topk_method", "noaux_tc") != "noaux_tc":
        refuse(where, "topk_method", c["topk_method"], "transformers' dots1 always routes by noaux_tc")
    for name in ("n_shared_experts", "n_group", "topk_group"):
        if name in c and c[name] is None:
            refuse(where, name, None, "transformers cannot build dots1 with it null")
    bias = bool(c.get("attention_bias", False))
    return ModelConfig(
        **stack_fields(c, where), rope_theta=theta, d_ff=c["intermediate_size"],
        first_k_dense=c.get("first_k_dense_replace", 0), n_routed_experts=n_experts(c),
        n_shared_experts=field(c, "n_shared_experts"), top_k=c["num_experts_per_tok"],
        moe_d_ff=c["moe_intermediate_size"], n_group=c.get("n_group", 1), topk_group=c.get("topk_group", 1),
        routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(c.get("norm_topk_prob", False)), qkv_bias=bias, attn_out_bias=bias, qk_norm="head",
        router="sigmoid")


def layout(c: dict) -> Layout:
    return Layout(shared="shared_experts", routing_bias="gate.e_score_correction_bias")
