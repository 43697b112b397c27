"""Hunyuan-A13B (`hunyuan_v1_moe`, HunYuanMoEV1ForCausalLM), as transformers 5.x computes it: GQA whose per-head
q/k RMSNorm comes AFTER RoPE (qk_norm_after_rope; the cache holds the normed keys), rotate-half RoPE over the whole
head whose base is stretched by the fixed NTK alpha (rope_type "dynamic" with an `alpha`: theta x alpha^(d /
(d - 2)), static), attention_bias on q/k/v and o. Every layer is MoE: softmax router in fp32 (`mlp.gate.wg`), top-k
per layer (moe_topk: one K, or one per layer: layer_top_k), always renormalized; routed experts and one ungated
shared MLP (`mlp.shared_mlp`), all of width intermediate_size.

transformers hard-codes what the original configs make optional, so where a config.json says otherwise the
original model differs from transformers' and is refused naming the field: use_qk_norm false, use_cla true,
use_mixed_mlp_moe false, num_shared_expert != 1, moe_intermediate_size != intermediate_size (Hunyuan-Large's
layout). Also refused: a missing head_dim (transformers cannot build the model), dynamic NTK without alpha and
other scaled RoPE.
"""

from moe.config import ModelConfig
from moe.hf.common import field, refuse, rope_parameters, stack_fields
from moe.hf.weights import Layout

MODEL_TYPES = ("hunyuan_v1_moe",)


def rope_theta(c: dict, where: str, head_dim: int) -> float:
    """RoPE's base: rope_theta, or with the NTK alpha theta * alpha ** (d / (d - 2)) (transformers'
    compute_ntk_alpha_rope_parameters, in Python floats)."""
    rp = rope_parameters(c)
    theta, kind, alpha = float(rp["rope_theta"]), rp["rope_type"], rp.get("alpha")
    if kind == "dynamic" and alpha:
        return theta * float(alpha) ** (head_dim / (head_dim - 2))
    if kind != "default":
        refuse(where, "rope_type", kind, "only default RoPE and Hunyuan's fixed NTK alpha (dynamic with alpha)")
    if rp.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(where, "partial_rotary_factor", rp["partial_rotary_factor"], "Hunyuan rotates the whole head")
    return theta


def _each(value) -> list:
    return value if isinstance(value, list) else [value]


def model_config(c: dict, where: str) -> ModelConfig:
    if not c.get("head_dim"):
        refuse(where, "head_dim", c.get("head_dim"), "transformers' hunyuan_v1_moe needs it (it does not derive it)")
    F, n = c["intermediate_size"], c["num_hidden_layers"]
    for name, ok, why in (
            ("use_qk_norm", c.get("use_qk_norm", True), "transformers always norms q and k"),
            ("use_cla", not c.get("use_cla", False), "cross-layer attention is not in transformers' model"),
            ("use_mixed_mlp_moe", c.get("use_mixed_mlp_moe", True), "transformers always adds the shared MLP"),
            ("num_shared_expert", all(k == 1 for k in _each(c.get("num_shared_expert", 1))),
             "transformers builds one shared MLP"),
            ("moe_intermediate_size", all(k == F for k in _each(c.get("moe_intermediate_size", F))),
             f"transformers' experts are intermediate_size ({F}) wide")):
        if not ok:
            refuse(where, name, c[name], why)
    ks = _each(field(c, "moe_topk", "num_experts_per_tok"))
    if len(ks) > 1 and len(ks) < n:
        refuse(where, "moe_topk", ks, f"one K per layer needs {n} entries")
    per_layer = ",".join(str(k) for k in ks[:n]) if len(set(ks[:n])) > 1 else ""
    fields = stack_fields(c, where)
    bias = bool(c.get("attention_bias", False))
    return ModelConfig(
        **fields, rope_theta=rope_theta(c, where, fields["head_dim"]), d_ff=F, first_k_dense=0,
        n_routed_experts=field(c, "num_experts", "num_local_experts"), n_shared_experts=1, top_k=max(ks),
        layer_top_k=per_layer, moe_d_ff=F, norm_topk_prob=True, router="softmax", qkv_bias=bias, attn_out_bias=bias,
        qk_norm="head", qk_norm_after_rope=True)


def layout(c: dict) -> Layout:
    return Layout(shared="shared_mlp", router="gate.wg.weight", qk_norms=("query_layernorm", "key_layernorm"))
