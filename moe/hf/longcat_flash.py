"""LongCat-Flash (`longcat_flash`, LongcatFlashForCausalLM), as transformers 5.25 computes it.

  layer      two sublayers of (pre-norm MLA, pre-norm dense SwiGLU of ffn_hidden_size) and one MoE whose input is the
             first SwiGLU's normed input and whose output joins the residual after the second (dual_sublayers);
             num_layers such layers
  attention  DeepSeek-V3's MLA with a query latent, RoPE on interleaved pairs (theta 1e7 by default), the query x
             sqrt(hidden / q_lora_rank) and the normed kv latent x sqrt(hidden / kv_lora_rank) (mla_lora_scale)
  router     softmax over n_routed_experts + zero_expert_num candidates (fp32), e_score_correction_bias for selection
             only, top moe_topk, never renormalized, x routed_scaling_factor; a chosen zero expert returns its input
             x its gate (n_zero_experts); no shared expert
MTP tensors (model.mtp.*) are skipped, as transformers skips them. Refused: router_bias true (transformers ignores the
classifier's bias), mla_scale_q_lora / mla_scale_kv_lora false and zero_expert_type other than identity
(transformers ignores them), a head_dim other than qk_rope_head_dim (transformers' RoPE reads it), a qk_head_dim
other than qk_nope_head_dim + qk_rope_head_dim, num_key_value_heads != num_attention_heads. Only
analysis.routing's inspection path knows the two-sublayer layer (analyses that call a block's attend /
feed_forward do not).
"""

from moe.config import ModelConfig
from moe.hf.common import field, refuse, stack_fields, yarn_rope_fields
from moe.hf.weights import Layout

MODEL_TYPES = ("longcat_flash",)


def model_config(c: dict, where: str) -> ModelConfig:
    for name, ok, why in (
            ("router_bias", not c.get("router_bias", False), "transformers' router ignores the classifier's bias"),
            ("mla_scale_q_lora", c.get("mla_scale_q_lora", True), "transformers always scales the query latent"),
            ("mla_scale_kv_lora", c.get("mla_scale_kv_lora", True), "transformers always scales the kv latent"),
            ("zero_expert_type", c.get("zero_expert_type", "identity") == "identity",
             "transformers' zero experts are identities")):
        if not ok:
            refuse(where, name, c[name], why)
    Dn, Dr, H = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["num_attention_heads"]
    if c.get("head_dim", 64) != Dr:
        refuse(where, "head_dim", c.get("head_dim", 64), f"transformers' RoPE reads it as qk_rope_head_dim ({Dr})")
    if c.get("qk_head_dim") not in (None, Dn + Dr):
        refuse(where, "qk_head_dim", c["qk_head_dim"], f"must be qk_nope_head_dim + qk_rope_head_dim ({Dn + Dr})")
    if c.get("num_key_value_heads") not in (None, H):
        refuse(where, "num_key_value_heads", c["num_key_value_heads"], f"MLA has one key per head ({H})")
    if not c.get("q_lora_rank"):
        refuse(where, "q_lora_rank", c.get("q_lora_rank"), "transformers' longcat_flash always has a query latent")
    c = dict(c, num_hidden_layers=c["num_layers"], rope_theta=c.get("rope_theta") or 1e7)
    fields = dict(stack_fields(c, where), n_kv_heads=H)
    return ModelConfig(
        **fields, **yarn_rope_fields(c, where), attention="mla", q_lora_rank=c["q_lora_rank"],
        kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=Dn, qk_rope_head_dim=Dr, v_head_dim=c["v_head_dim"],
        rope_interleave=True, latent_norm_eps=1e-6, mla_lora_scale=True, dual_sublayers=True,
        d_ff=field(c, "ffn_hidden_size", "intermediate_size"), first_k_dense=0,
        n_routed_experts=field(c, "n_routed_experts", "num_local_experts"),
        n_zero_experts=c.get("zero_expert_num") or 0, n_shared_experts=0,
        top_k=field(c, "moe_topk", "num_experts_per_tok"),
        moe_d_ff=field(c, "expert_ffn_hidden_size", "moe_intermediate_size"), router="softmax", norm_topk_prob=False,
        routed_scaling_factor=float(c.get("routed_scaling_factor", 6.0)))


def layout(c: dict) -> Layout:
    return Layout(router="router.classifier.weight", routing_bias="router.e_score_correction_bias",
                  ignored=("model.mtp.",))
