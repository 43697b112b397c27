"""Mistral Small 4 (`mistral4`, Mistral4ForCausalLM, the text model): DeepSeek-V3's multi-head latent attention with
a softmax router and Llama 4's query scale, as transformers 5.25 computes it.

  router     softmax over all experts, top-k (group-limited by the top-2 sum when n_group > 1), renormalized iff
             norm_topk_prob, x routed_scaling_factor; no selection bias; one ungated shared expert
  attention  MLA; RoPE on interleaved pairs (rope_interleave, default true) with YaRN over the rotary part of the
             head (partial_rotary_factor x (qk_nope_head_dim + qk_rope_head_dim) = qk_rope_head_dim), cos / sin
             scaled by mscale / mscale_all_dim, the softmax scale by mscale(factor, mscale_all_dim)^2 (transformers
             5.25's choice; Mistral's own `apply_scale: false` keeps 1/sqrt(d), so which is the authors' model is
             disputed); the whole query times 1 + llama_4_scaling_beta ln(1 + floor(pos / original context)) after
             RoPE (query_scale_beta, query_scale_period)
  layers     dense SwiGLU in the first first_k_dense_replace (default 0) layers, experts fused on the Hub
             (experts.gate_up_proj / down_proj), read as any fused layout
Missing fields take Mistral4Config's defaults. Refused: RoPE other than YaRN (transformers' forward needs YaRN's
llama_4_scaling_beta and original context), a partial_rotary_factor that is not qk_rope_head_dim / (qk_nope_head_dim +
qk_rope_head_dim), and what deepseek_v3 refuses. The Hub's multimodal wrapper (`mistral3`, text_config
`mistral4`, names under language_model.) and its per-tensor FP8 are not read: import a text-only bf16 copy.
"""

import dataclasses

from moe.config import ModelConfig
from moe.hf import deepseek
from moe.hf.common import field, refuse, rope_parameters
from moe.hf.weights import Layout

MODEL_TYPES = ("mistral4",)
DEFAULTS = dict(first_k_dense_replace=0, n_shared_experts=1, routed_scaling_factor=1.0, n_group=1, topk_group=1,
                norm_topk_prob=True, rope_interleave=True)


def model_config(c: dict, where: str) -> ModelConfig:
    rp = rope_parameters(c)
    if rp["rope_type"] != "yarn":
        refuse(where, "rope_type", rp["rope_type"], "transformers' mistral4 needs YaRN (its forward reads "
                                                    "llama_4_scaling_beta and original_max_position_embeddings)")
    Dn, Dr = c["qk_nope_head_dim"], c["qk_rope_head_dim"]
    partial = rp.get("partial_rotary_factor", Dr / (Dn + Dr))
    if abs(partial * (Dn + Dr) - Dr) > 1e-9:
        refuse(where, "partial_rotary_factor", partial, f"the rotary part must be qk_rope_head_dim ({Dr}) of the "
                                                        f"{Dn + Dr} query dims")
    beta = rp.get("llama_4_scaling_beta")
    if beta is None:
        refuse(where, "llama_4_scaling_beta", None, "transformers' mistral4 scales the query by it")
    period = int(c.get("original_max_position_embeddings") or rp.get("original_max_position_embeddings") or 0)
    mla = {k: v for k, v in c.items() if k not in ("rope_scaling", "rope_parameters", "partial_rotary_factor")}
    mla["rope_parameters"] = {k: v for k, v in rp.items() if k not in ("partial_rotary_factor", "llama_4_scaling_beta",
                                                                       "max_position_embeddings", "type")}
    mla.update({k: field(c, k, default=v) for k, v in DEFAULTS.items()}, model_type="deepseek_v3")
    cfg = deepseek.model_config(mla, where)
    return dataclasses.replace(cfg, router="softmax", query_scale_beta=float(beta), query_scale_period=period)


def layout(c: dict) -> Layout:
    return Layout(shared="shared_experts")
