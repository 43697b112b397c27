"""OLMoE (`olmoe`): softmax over all experts, top-k, renormalized only with norm_topk_prob (default off); no
shared expert, no routing bias, every layer MoE with experts of width intermediate_size. q and k go through one
RMSNorm over the WHOLE projection (all heads together) before RoPE; attention_bias biases q/k/v and o.
clip_qkv (clamping q/k/v) is refused: the released OLMoE checkpoints do not use it.
"""

from moe.config import ModelConfig
from moe.hf.common import n_experts, refuse, rope_settings, stack_fields
from moe.hf.weights import Layout

MODEL_TYPES = ("olmoe",)


def model_config(c: dict, where: str) -> ModelConfig:
    theta, partial = rope_settings(c, where)
    if partial != 1.0:
        refuse(where, "partial_rotary_factor", partial, "OLMoE rotates the whole head")
    if c.get("clip_qkv") is not None:
        refuse(where, "clip_qkv", c["clip_qkv"], "q/k/v clamping is not implemented")
    fields = stack_fields(c, where)
    fields["head_dim"] = c["hidden_size"] // c["num_attention_heads"]  # what HF's OlmoeAttention uses
    bias = bool(c.get("attention_bias", False))
    F = c["intermediate_size"]
    return ModelConfig(**fields, rope_theta=theta, d_ff=F, first_k_dense=0, n_routed_experts=n_experts(c),
                       n_shared_experts=0, top_k=c["num_experts_per_tok"], moe_d_ff=F,
                       norm_topk_prob=bool(c.get("norm_topk_prob", False)), router="softmax", qkv_bias=bias,
                       attn_out_bias=bias, qk_norm="full")


def layout(c: dict) -> Layout:
    return Layout()
