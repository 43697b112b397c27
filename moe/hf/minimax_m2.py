"""MiniMax-M2 (`minimax_m2`, MiniMaxM2ForCausalLM): GQA with ONE q RMSNorm over the whole projection (all heads
together) and one k RMSNorm over all kv heads (qk_norm "full"), before a partial rotate-half RoPE (the leading
partial_rotary_factor of each head; released configs say rotary_dim, which transformers reads as rotary_dim /
head_dim); no biases. Every layer MoE, experts of width intermediate_size stored as block_sparse_moe.experts.E.w1 /
w3 / w2 = gate / up / down; sigmoid router in fp32, `e_score_correction_bias` (on the MoE block, not the gate)
for selection only, no groups, gates always renormalized, no scaling, no shared expert. Missing fields take
MiniMaxM2Config's defaults (head_dim 128, rope_theta 5e6). Refused: use_qk_norm false and a scoring_func other
than sigmoid (transformers ignores both), scaled RoPE.
"""

from moe.config import ModelConfig
from moe.hf.common import n_experts, refuse, rope_parameters, stack_fields
from moe.hf.weights import Layout

MODEL_TYPES = ("minimax_m2",)


def model_config(c: dict, where: str) -> ModelConfig:
    rp = rope_parameters(dict(c, rope_theta=c.get("rope_theta") or 5e6))  # MiniMaxM2Config's default theta
    if rp["rope_type"] != "default":
        refuse(where, "rope_type", rp["rope_type"], "only default RoPE; scaled RoPE changes the frequencies")
    head_dim = c.get("head_dim") or 128  # MiniMaxM2Config's default, not hidden_size / heads
    partial = rp.get("partial_rotary_factor", c.get("partial_rotary_factor"))
    if partial is None:
        partial = c["rotary_dim"] / head_dim if c.get("rotary_dim") else 1.0
    if c.get("use_qk_norm", True) is not True:
        refuse(where, "use_qk_norm", c["use_qk_norm"], "transformers' minimax_m2 always norms q and k")
    if c.get("scoring_func", "sigmoid") != "sigmoid":
        refuse(where, "scoring_func", c["scoring_func"], "transformers' minimax_m2 always scores with sigmoid")
    F = c["intermediate_size"]
    return ModelConfig(
        **dict(stack_fields(c, where), head_dim=head_dim), rope_theta=float(rp["rope_theta"]),
        rope_fraction=float(partial), d_ff=F, first_k_dense=0, n_routed_experts=n_experts(c), n_shared_experts=0,
        top_k=c["num_experts_per_tok"], moe_d_ff=F, norm_topk_prob=True, router="sigmoid", qk_norm="full")


def layout(c: dict) -> Layout:
    # Hub checkpoints: block_sparse_moe.experts.E.w1/w3/w2; transformers 5.x renames the block to mlp (fused).
    return Layout(moe=("block_sparse_moe", "mlp"), experts=("w1", "w3", "w2"), routing_bias="e_score_correction_bias")
