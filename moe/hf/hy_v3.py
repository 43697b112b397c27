"""Tencent Hy3 (`hy_v3`, HYV3ForCausalLM): Qwen3's attention (GQA, explicit head_dim, per-head q/k RMSNorm before a
full rotate-half RoPE, attention_bias on q/k/v and o) with DeepSeek-V3's sigmoid routing without groups: fp32
logits, the MoE block's selection-only bias (Hub: `mlp.expert_bias`), gates always normalized x
router_scaling_factor; routed experts of moe_intermediate_size and one ungated shared expert
(`mlp.shared_mlp`, moe_intermediate_size x num_shared_experts); the router at `mlp.router.gate.weight`. Dense
SwiGLU layers where mlp_layer_types says "dense" (default: layer 0 only). Missing fields take HYV3Config's
defaults (head_dim 128, theta 11,158,840, router_scaling_factor 2.826). MTP layers (num_nextn_predict_layers, after
the last layer) are skipped: transformers' forward never runs them and defines no structure for them.

Refused where the original model would differ from transformers, which ignores these fields: qk_norm, route_norm,
moe_router_use_sigmoid, moe_router_enable_expert_bias false; also num_shared_experts 0 (transformers then builds a
shared expert of the dense width), mlp_bias, a first_k_dense_replace that disagrees with mlp_layer_types, scaled or
partial RoPE.
"""

from moe.config import ModelConfig
from moe.hf.common import dense_placement, field, n_experts, refuse, rope_parameters, stack_fields
from moe.hf.weights import Layout

MODEL_TYPES = ("hy_v3",)


def model_config(c: dict, where: str) -> ModelConfig:
    rp = rope_parameters(dict(c, rope_theta=c.get("rope_theta") or 11_158_840.0))  # HYV3Config's default theta
    if rp["rope_type"] != "default":
        refuse(where, "rope_type", rp["rope_type"], "only default RoPE; scaled RoPE changes the frequencies")
    if rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) not in (None, 1, 1.0):
        refuse(where, "partial_rotary_factor", rp.get("partial_rotary_factor", c.get("partial_rotary_factor")),
               "Hy3 rotates the whole head")
    for name in ("qk_norm", "route_norm", "moe_router_use_sigmoid", "moe_router_enable_expert_bias"):
        if c.get(name, True) is not True:
            refuse(where, name, c[name], "transformers' hy_v3 ignores it (always on) and would compute another model")
    if c.get("mlp_bias"):
        refuse(where, "mlp_bias", True, "biases on the dense and shared MLPs are not implemented")
    shared = c.get("num_shared_experts", 1)
    if not shared:
        refuse(where, "num_shared_experts", shared, "transformers then builds a shared expert of intermediate_size")
    bias = bool(c.get("attention_bias", False))
    return ModelConfig(
        **dict(stack_fields(c, where), head_dim=c.get("head_dim") or 128), rope_theta=float(rp["rope_theta"]),
        d_ff=c["intermediate_size"], **dense_placement(c, where),
        n_routed_experts=n_experts(c), n_shared_experts=shared, top_k=c["num_experts_per_tok"],
        moe_d_ff=c["moe_intermediate_size"], norm_topk_prob=True, router="sigmoid",
        routed_scaling_factor=float(field(c, "router_scaling_factor", default=2.826)), qkv_bias=bias,
        attn_out_bias=bias, qk_norm="head")


def layout(c: dict) -> Layout:
    n, mtp = c["num_hidden_layers"], field(c, "num_nextn_predict_layers", default=0)
    return Layout(shared="shared_mlp", router="router.gate.weight", routing_bias="expert_bias",
                  ignored=tuple(f"model.layers.{n + k}." for k in range(mtp)))
