"""Llama 4 text models (`llama4_text`, Llama4ForCausalLM: Scout's and Maverick's text stack), as transformers 5.25
computes them.

  router     top-k of the raw logits, gate sigmoid(logit) unnormalized, applied to the expert's INPUT
             (router "sigmoid_input"); one ungated shared expert; experts and shared expert intermediate_size
             wide, stored fused [E, D, 2F] ([gate | up] columns) and [E, F, D]
  layers     MoE where moe_layers says (default every interleave_moe_layer_step-th), else a dense SwiGLU of
             intermediate_size_mlp (dense_layers)
  attention  GQA, RoPE on interleaved pairs (its complex rotation) on the layers no_rope_layers marks 1 (default
             all but every no_rope_layer_interval-th), which also attend within chunks of attention_chunk_size
             (attention_chunk) and norm q and k after RoPE by a weightless RMSNorm (use_qk_norm); the NoPE layers
             (nope_layers) attend causally over everything and scale the query by 1 + attn_scale
             ln(1 + floor((pos + 1) / floor_scale)) (attn_temperature_tuning: query_scale_*)
RoPE default, or Scout's llama3 frequencies (rope_scaling "llama3"). Missing fields take Llama4TextConfig's
defaults. Refused: other RoPE scalings, layer_types that disagree with the chunked / NoPE layers, hidden_act other than silu. The multimodal
wrapper (`llama4`, text_config, names under language_model.) is not read: import the text model's checkpoint.
"""

from moe.config import ModelConfig
from moe.hf.common import field, refuse, rope_parameters, stack_fields
from moe.hf.weights import Layout

MODEL_TYPES = ("llama4_text",)


def model_config(c: dict, where: str) -> ModelConfig:
    rp = rope_parameters(dict(c, rope_theta=c.get("rope_theta") or 500000.0))  # Llama4TextConfig's default theta
    if rp["rope_type"] not in ("default", "llama3"):
        refuse(where, "rope_type", rp["rope_type"], "only default RoPE and llama3 scaling (Scout's)")
    scaling = {}
    if rp["rope_type"] == "llama3":  # transformers' _compute_llama3_parameters reads these four
        scaling = dict(rope_scaling="llama3", rope_scaling_factor=float(rp["factor"]),
                       rope_original_max_position=int(rp["original_max_position_embeddings"]),
                       llama3_low_freq_factor=float(rp["low_freq_factor"]),
                       llama3_high_freq_factor=float(rp["high_freq_factor"]))
    n = c["num_hidden_layers"]
    interval = c.get("no_rope_layer_interval", 4)
    uses_rope = c.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    if len(uses_rope) != n:
        refuse(where, "no_rope_layers", uses_rope, f"one entry per layer ({n})")
    nope = [i for i in range(n) if not uses_rope[i]]
    chunk = c.get("attention_chunk_size", 8192) or 0
    kinds = ["chunked_attention" if uses_rope[i] and chunk else "full_attention" for i in range(n)]
    if c.get("layer_types") and list(c["layer_types"]) != kinds:
        refuse(where, "layer_types", c["layer_types"], f"transformers' defaults for these no_rope_layers and "
                                                        f"attention_chunk_size are {kinds}; other layouts are not "
                                                        "implemented")
    step = c.get("interleave_moe_layer_step", 1)
    moe = c.get("moe_layers") or list(range(step - 1, n, step))
    tuning = bool(c.get("attn_temperature_tuning", True)) and nope
    bias = bool(c.get("attention_bias", False))
    fields = stack_fields(c, where)
    fields["head_dim"] = c.get("head_dim", 128) or c["hidden_size"] // c["num_attention_heads"]
    return ModelConfig(
        **fields, **scaling, rope_theta=float(rp["rope_theta"]), rope_interleave=True, nope_layers=",".join(map(str, nope)),
        attention_chunk=chunk, qk_norm="weightless" if c.get("use_qk_norm", True) else "none",
        qk_norm_after_rope=bool(c.get("use_qk_norm", True)), query_scale_beta=float(c.get("attn_scale", 0.1)) if tuning
        else 0.0, query_scale_period=int(c.get("floor_scale", 8192)) if tuning else 0,
        query_scale_offset=1 if tuning else 0, qkv_bias=bias, attn_out_bias=bias,
        d_ff=c.get("intermediate_size_mlp", 16384), first_k_dense=0,
        dense_layers=",".join(str(i) for i in range(n) if i not in moe),
        n_routed_experts=field(c, "num_local_experts", default=16), n_shared_experts=1,
        top_k=c.get("num_experts_per_tok", 1), moe_d_ff=c["intermediate_size"], router="sigmoid_input")


def layout(c: dict) -> Layout:
    return Layout(moe=("feed_forward",), router="router.weight", shared="shared_expert", dense="feed_forward",
                  experts_in_out=True)
