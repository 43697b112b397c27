"""Qwen1.5/Qwen2-MoE (`qwen2_moe`) and Qwen3-MoE (`qwen3_moe`).

Softmax over all experts in fp32, top-k of the probabilities, renormalized only with norm_topk_prob; no routing
bias, no groups. MoE in layer i iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (else a
dense SwiGLU of intermediate_size). Qwen2-MoE: q/k/v bias (qkv_bias, always on before transformers 5), one shared
expert of width shared_expert_intermediate_size scaled by sigmoid(shared_expert_gate . x). Qwen3-MoE: per-head
q/k RMSNorm, no shared expert, attention_bias puts a bias on q/k/v AND o. Active sliding-window attention is refused.
"""

from moe.config import ModelConfig
from moe.hf.common import dense_layer_text, n_experts, refuse, rope_settings, stack_fields
from moe.hf.weights import Layout

MODEL_TYPES = ("qwen2_moe", "qwen3_moe")


def model_config(c: dict, where: str) -> ModelConfig:
    theta, partial = rope_settings(c, where)
    if partial != 1.0:
        refuse(where, "partial_rotary_factor", partial, "Qwen-MoE rotates the whole head")
    if c.get("use_sliding_window", False):
        refuse(where, "use_sliding_window", True, "sliding-window attention is not implemented")
    if any(t != "full_attention" for t in c.get("layer_types") or []):
        refuse(where, "layer_types", sorted(set(c["layer_types"])), "sliding-window attention is not implemented")
    if not n_experts(c):
        refuse(where, "num_experts", n_experts(c), "a dense model has no routing to analyse")
    qwen2 = c["model_type"] == "qwen2_moe"
    fields = dict(
        **stack_fields(c, where), rope_theta=theta, d_ff=c["intermediate_size"], first_k_dense=0,
        moe_layer_step=c.get("decoder_sparse_step", 1) or 1, dense_layers=dense_layer_text(c.get("mlp_only_layers")),
        n_routed_experts=n_experts(c), top_k=c["num_experts_per_tok"], moe_d_ff=c["moe_intermediate_size"],
        norm_topk_prob=bool(c.get("norm_topk_prob", False)), router="softmax")
    if qwen2:
        shared = c.get("shared_expert_intermediate_size", 0)
        if not shared:
            refuse(where, "shared_expert_intermediate_size", shared, "Qwen2-MoE's shared expert needs a width")
        return ModelConfig(**fields, qkv_bias=bool(c.get("qkv_bias", True)), n_shared_experts=1,
                           shared_d_ff=shared, shared_expert_gate=True)
    bias = bool(c.get("attention_bias", False))
    return ModelConfig(**fields, qkv_bias=bias, attn_out_bias=bias, qk_norm="head", n_shared_experts=0)


def layout(c: dict) -> Layout:
    if c["model_type"] == "qwen2_moe":
        return Layout(shared="shared_expert", shared_gate="shared_expert_gate")
    return Layout()
