"""GLM-4.5 / GLM-4.6 (`glm4_moe`, Glm4MoeForCausalLM): DeepSeek-V3 routing with GQA. Also our own HF export.

Sigmoid router in fp32, e_score_correction_bias for selection only, group-limited top-k, gates normalized
(norm_topk_prob) x routed_scaling_factor, shared experts of width moe_intermediate_size x n_shared_experts, dense
SwiGLU in the first first_k_dense_replace layers, partial rotary (partial_rotary_factor, HF's default 0.5,
rotate-half within the rotated part), optional q/k bias (attention_bias) and per-head q/k RMSNorm (use_qk_norm).
MTP layers (num_nextn_predict_layers; not part of HF's forward) are read into our MTP modules as DeepSeek-V3's are
(moe/hf/weights.py).
"""

from moe.config import ModelConfig
from moe.hf.common import field, n_experts, refuse, rope_settings, stack_fields
from moe.hf.weights import Layout

MODEL_TYPES = ("glm4_moe",)


def model_config(c: dict, where: str) -> ModelConfig:
    theta, partial = rope_settings(c, where, default_partial=0.5)  # HF's Glm4MoeConfig default
    if c.get("scoring_func", "sigmoid") != "sigmoid":
        refuse(where, "scoring_func", c["scoring_func"], "glm4_moe routes with sigmoid scores")
    return ModelConfig(
        **stack_fields(c, where), rope_theta=theta, rope_fraction=partial, d_ff=c["intermediate_size"],
        first_k_dense=c.get("first_k_dense_replace", 1), n_routed_experts=n_experts(c),
        n_shared_experts=c.get("n_shared_experts", 1), top_k=c["num_experts_per_tok"],
        moe_d_ff=c["moe_intermediate_size"], n_group=c.get("n_group", 1), topk_group=c.get("topk_group", 1),
        routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(c.get("norm_topk_prob", True)), qkv_bias=bool(c.get("attention_bias", False)),
        qk_norm="head" if c.get("use_qk_norm", False) else "none", router="sigmoid")


def layout(c: dict) -> Layout:
    mtp = field(c, "num_nextn_predict_layers", "num_mtp_layers", default=0)
    return Layout(shared="shared_experts", routing_bias="gate.e_score_correction_bias",
                  mtp_from=c["num_hidden_layers"] if mtp else None)
