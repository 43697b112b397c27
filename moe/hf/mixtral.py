"""Mixtral (`mixtral`): softmax over all experts in fp32, top-k, always renormalized over the chosen k; no shared
expert, no routing bias, every layer MoE (experts of width intermediate_size, stored as block_sparse_moe.experts.E.
w1 / w3 / w2 = gate / up / down). An active sliding window (sliding_window set below max_position_embeddings) is
refused; router_jitter_noise only acts in training.
"""

from moe.config import ModelConfig
from moe.hf.common import n_experts, refuse, rope_settings, stack_fields
from moe.hf.weights import Layout

MODEL_TYPES = ("mixtral",)


def model_config(c: dict, where: str) -> ModelConfig:
    theta, partial = rope_settings(c, where)
    if partial != 1.0:
        refuse(where, "partial_rotary_factor", partial, "Mixtral rotates the whole head")
    window = c.get("sliding_window")
    if window is not None and window < c.get("max_position_embeddings", 0):
        refuse(where, "sliding_window", window, "sliding-window attention is not implemented")
    F = c["intermediate_size"]
    return ModelConfig(**stack_fields(c, where), rope_theta=theta, d_ff=F, first_k_dense=0,
                       n_routed_experts=n_experts(c), n_shared_experts=0, top_k=c["num_experts_per_tok"],
                       moe_d_ff=F, norm_topk_prob=True, router="softmax")


def layout(c: dict) -> Layout:
    # Hub checkpoints: block_sparse_moe.experts.E.w1/w3/w2; transformers 5.x renames the block to mlp (fused).
    return Layout(moe=("block_sparse_moe", "mlp"), experts=("w1", "w3", "w2"))
