"""Qwen3-Next (`qwen3_next`, Qwen3NextForCausalLM: Qwen3-Next-80B-A3B, Qwen3-Coder-Next), as transformers 5.25
computes it.

  layers     layer_types (default: every full_attention_interval-th full_attention, the rest linear_attention):
             Gated DeltaNet on the linear ones (model.linear_layers, moe/gdn.py: linear_num_key_heads /
             linear_num_value_heads heads of linear_key_head_dim / linear_value_head_dim, a causal conv of
             linear_conv_kernel_dim taps), gated attention on the others
  attention  GQA; q_proj emits [q | gate] per head and the output is x sigmoid(gate) before o_proj
             (model.attn_output_gate); per-head q/k RMSNorm before partial rotate-half RoPE (partial_rotary_factor,
             default 0.25)
  norms      zero-centred x / rms(x) * (1 + w) (model.norm_offset), the Gated DeltaNet output norm excepted
  router     softmax over all experts (fp32), top-k, renormalized with norm_topk_prob; a shared expert of
             shared_expert_intermediate_size scaled by sigmoid(shared_expert_gate . x)
  layers     MoE where i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0, else a dense SwiGLU of
             intermediate_size
The checkpoint's multi-token prediction tensors (`mtp.*`) are skipped, as transformers skips them. Refused: scaled
RoPE, num_experts 0 (a dense model), hidden_act other than silu, layer_types other than linear / full attention.
"""

from moe.config import ModelConfig
from moe.hf.common import dense_layer_text, n_experts, refuse, rope_settings, stack_fields
from moe.hf.weights import Layout

MODEL_TYPES = ("qwen3_next",)


def layer_types(c: dict, where: str) -> list[str]:
    """config.layer_types, or transformers' default from full_attention_interval (4)."""
    n = c["num_hidden_layers"]
    interval = c.get("full_attention_interval", 4)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        refuse(where, "full_attention_interval", interval, "a positive integer")
    types = c.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention"
                                     for i in range(n)]
    if len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        refuse(where, "layer_types", types, f"one per layer ({n}), each linear_attention or full_attention")
    return types


def model_config(c: dict, where: str) -> ModelConfig:
    theta, partial = rope_settings(c, where, default_partial=0.25)
    if not n_experts(c):
        refuse(where, "num_experts", n_experts(c), "a dense model has no routing to analyse")
    types = layer_types(c, where)
    nk, nv = c.get("linear_num_key_heads", 16), c.get("linear_num_value_heads", 32)
    if nk and nv and nv % nk:
        refuse(where, "linear_num_value_heads", nv, f"must be a multiple of linear_num_key_heads ({nk})")
    shared = c.get("shared_expert_intermediate_size", 512)
    if not shared:
        refuse(where, "shared_expert_intermediate_size", shared, "Qwen3-Next's shared expert needs a width")
    bias = bool(c.get("attention_bias", False))
    return ModelConfig(
        **stack_fields(c, where), rope_theta=theta, rope_fraction=partial, qkv_bias=bias, attn_out_bias=bias,
        qk_norm="head", attn_output_gate=True, norm_offset=True,
        linear_layers=",".join(str(i) for i, t in enumerate(types) if t == "linear_attention"),
        gdn_key_heads=nk, gdn_value_heads=nv,
        gdn_key_dim=c.get("linear_key_head_dim", 128), gdn_value_dim=c.get("linear_value_head_dim", 128),
        gdn_conv_kernel=c.get("linear_conv_kernel_dim", 4),
        d_ff=c["intermediate_size"], first_k_dense=0, moe_layer_step=c.get("decoder_sparse_step", 1) or 1,
        dense_layers=dense_layer_text(c.get("mlp_only_layers")), n_routed_experts=n_experts(c),
        top_k=c["num_experts_per_tok"], moe_d_ff=c["moe_intermediate_size"],
        norm_topk_prob=bool(c.get("norm_topk_prob", True)), router="softmax", n_shared_experts=1,
        shared_d_ff=shared, shared_expert_gate=True)


def layout(c: dict) -> Layout:
    return Layout(shared="shared_expert", shared_gate="shared_expert_gate", ignored=("mtp.",))
