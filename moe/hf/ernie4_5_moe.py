"""ERNIE 4.5 MoE (`ernie4_5_moe`, Ernie4_5_MoeForCausalLM; the "-PT" checkpoints): Llama GQA attention with RoPE on
interleaved pairs (2i, 2i+1) over the whole head (rope_interleave), a softmax router in fp32 whose top-k SELECTION
adds `moe_statics.e_score_correction_bias` ([1, E]) to the probabilities while the gates are the unbiased
probabilities renormalized by max(sum, moe_norm_min) (our softmax router's norm_floor, 1e-12), ungated shared
experts of width moe_intermediate_size x moe_num_shared_experts. Layer i is MoE iff (i + 1) % moe_layer_interval
== 0 and moe_layer_start_index <= i <= moe_layer_end_index (-1: the last layer), else a dense SwiGLU of
intermediate_size. tie_word_embeddings defaults to true. MTP tensors (model.mtp_*) are skipped, as transformers
skips them. Refused: use_bias (biases on every projection and the head), a moe_norm_min other than 1e-12, scaled
or partial RoPE.
"""

from moe.config import ModelConfig
from moe.hf.common import field, refuse, rope_settings, stack_fields
from moe.hf.weights import Layout

MODEL_TYPES = ("ernie4_5_moe",)
NORM_MIN = 1e-12  # moe.router ROUTERS["softmax"].norm_floor


def model_config(c: dict, where: str) -> ModelConfig:
    theta, partial = rope_settings(c, where)
    if partial != 1.0:
        refuse(where, "partial_rotary_factor", partial, "ERNIE 4.5 rotates the whole head")
    if c.get("use_bias"):
        refuse(where, "use_bias", True, "biases on every projection and the LM head are not implemented (the "
                                        "released ERNIE 4.5 MoE models have none)")
    if float(c.get("moe_norm_min", NORM_MIN)) != NORM_MIN:
        refuse(where, "moe_norm_min", c["moe_norm_min"], f"the softmax router's gate denominator is clamped at "
                                                         f"{NORM_MIN}")
    n = c["num_hidden_layers"]
    start, end = c.get("moe_layer_start_index", 1), c.get("moe_layer_end_index", -1)
    end = n - 1 if end == -1 else end
    step = c.get("moe_layer_interval", 1)
    if step < 1 or start < 0:
        refuse(where, "moe_layer_interval" if step < 1 else "moe_layer_start_index", step if step < 1 else start,
               "must be >= 1 (>= 0 for the start)")
    if not any((i + 1) % step == 0 and start <= i <= end for i in range(n)):
        refuse(where, "moe_layer_start_index", start, f"no layer of {n} is MoE (up to moe_layer_end_index {end}, "
                                                      f"every {step}); a dense model has no routing to analyse")
    shared = c.get("moe_num_shared_experts", 2)
    fields = stack_fields(c, where)
    fields["tie_embeddings"] = bool(c.get("tie_word_embeddings", True))  # Ernie4_5_MoeConfig's default
    return ModelConfig(
        **fields, rope_theta=theta, rope_interleave=True, d_ff=c["intermediate_size"], first_k_dense=start,
        moe_layer_step=step, dense_layers=",".join(str(i) for i in range(end + 1, n)),
        n_routed_experts=field(c, "moe_num_experts", "num_experts"), n_shared_experts=shared,
        top_k=field(c, "moe_k", "num_experts_per_tok"), moe_d_ff=c["moe_intermediate_size"], norm_topk_prob=True,
        router="softmax")


def layout(c: dict) -> Layout:
    shared = "shared_experts" if c.get("moe_num_shared_experts", 2) else None
    return Layout(shared=shared, routing_bias="moe_statics.e_score_correction_bias", ignored=("model.mtp",))
