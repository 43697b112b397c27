"""DeepSeek-V2 (`deepseek_v2`), DeepSeek-V3 / Moonlight (`deepseek_v3`), Kimi-K2 (`kimi_k2`, and the text model
of Kimi-K2.5 / K2.6, `kimi_k25`) and GLM-4.7-Flash (`glm4_moe_lite`): multi-head latent attention (moe/mla.py) with
DeepSeek MoE, as transformers 5.x computes them.

  deepseek_v2    softmax over all routed experts (fp32), top-k by `topk_method`: greedy, or group_limited_greedy (a
                 group scores as its BEST expert: ModelConfig.router_group_score="max"); gates are the chosen
                 probabilities x routed_scaling_factor, never renormalized (transformers ignores norm_topk_prob, so
                 true is refused: DeepSeek's own code would renormalize); RoPE always on interleaved pairs (its
                 complex rotation).
  deepseek_v3    glm4_moe's routing: sigmoid (fp32), e_score_correction_bias for selection only, groups scored by
  glm4_moe_lite  their top-2 sum, norm_topk_prob, routed_scaling_factor; rope_interleave (default true).
                 glm4_moe_lite places dense layers by mlp_layer_types (default: layer 0 only), not by
                 first_k_dense_replace.
  kimi_k2        DeepSeek-V3's architecture under its own name (transformers has no kimi_k2 and loads it as
                 DeepseekV3Config): deepseek_v3 throughout, with its defaults. Kimi-K2.5 (`kimi_k25`) nests that
                 config in `text_config` and its weights under `language_model.` (kimi_k25_text, k25_tensor_name);
                 the vision tower and projector are not imported, and the lm_head is tied by the TOP-LEVEL
                 tie_word_embeddings (transformers' Kimi_K25Config default: true) unless the stored head differs.
All three: shared experts of width moe_intermediate_size x n_shared_experts, dense SwiGLU (intermediate_size) in the
dense layers, default RoPE or YaRN (common.yarn_rope_fields). MTP layers (num_nextn_predict_layers, stored after
the last layer: enorm, hnorm, eh_proj, a decoder layer, shared_head.norm, and copies of the embedding and head)
become our MTP modules (moe/mtp.py; transformers' forward never runs them); copies that differ from the main
embedding or head are refused.

Refused, one line naming the field: DeepSeek-V3.2's sparse indexer (index_*), attention_bias, mlp_bias,
hidden_act other than silu, num_key_value_heads != num_attention_heads, moe_layer_freq != 1, and a scoring_func /
topk_method that transformers would silently replace by its own. Fields missing from config.json take
transformers' class defaults (DEFAULTS), which differ per family. Quantized weights: moe/hf/quant.py (block FP8).
"""

from moe.config import ModelConfig
from moe.hf.common import dense_placement, field, n_experts, refuse, stack_fields, yarn_rope_fields
from moe.hf.weights import Layout

MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe_lite")
# transformers' class defaults (DeepseekV2Config, DeepseekV3Config, Glm4MoeLiteConfig) for the fields that change
# the math and that checkpoints sometimes omit.
DEFAULTS = {
    "deepseek_v2": dict(first_k_dense_replace=0, n_shared_experts=2, routed_scaling_factor=1.0, topk_method="greedy"),
    "deepseek_v3": dict(first_k_dense_replace=3, n_shared_experts=1, routed_scaling_factor=2.5, n_group=8,
                        topk_group=4, norm_topk_prob=True, rope_interleave=True),
    "kimi_k2": dict(first_k_dense_replace=3, n_shared_experts=1, routed_scaling_factor=2.5, n_group=8,
                    topk_group=4, norm_topk_prob=True, rope_interleave=True),  # DeepseekV3Config's: what loads it
    "glm4_moe_lite": dict(n_shared_experts=1, routed_scaling_factor=1.8, n_group=1, topk_group=1, norm_topk_prob=True,
                          rope_interleave=True),
}
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
INDEXER_FIELDS = ("index_topk", "index_n_heads", "index_head_dim")  # DeepSeek-V3.2's sparse attention (DSA)


def model_config(c: dict, where: str) -> ModelConfig:
    kind = c["model_type"]
    _refuse_unsupported(c, where, kind)
    d = DEFAULTS[kind]

    def get(name):
        return field(c, name, default=d[name])

    H = c["num_attention_heads"]
    attention = dict(
        attention="mla", q_lora_rank=c["q_lora_rank"] or 0, kv_lora_rank=c["kv_lora_rank"],
        qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"],
        # deepseek_v2 rotates (2i, 2i+1) pairs as complex numbers whatever the field says.
        rope_interleave=True if kind == "deepseek_v2" else bool(get("rope_interleave")), n_kv_heads=H,
        # transformers (and DeepSeek's code) build q_a_layernorm / kv_a_layernorm with eps 1e-6, not rms_norm_eps.
        latent_norm_eps=1e-6)
    if kind == "deepseek_v2":
        grouped = get("topk_method") == "group_limited_greedy"
        groups = dict(n_group=c["n_group"], topk_group=c["topk_group"], router_group_score="max") if grouped else {}
        routing = dict(router="softmax", norm_topk_prob=False, **groups)
    else:
        routing = dict(router="sigmoid", norm_topk_prob=bool(get("norm_topk_prob")), n_group=get("n_group"),
                       topk_group=get("topk_group"))
    return ModelConfig(
        **{**stack_fields(c, where), **attention}, **yarn_rope_fields(c, where), **_dense_layers(c, where, kind),
        d_ff=c["intermediate_size"], n_routed_experts=n_experts(c), n_shared_experts=get("n_shared_experts"),
        top_k=c["num_experts_per_tok"], moe_d_ff=c["moe_intermediate_size"],
        routed_scaling_factor=float(get("routed_scaling_factor")), **routing)


def layout(c: dict) -> Layout:
    mtp = field(c, "num_nextn_predict_layers", "num_mtp_layers", default=0)
    bias = None if c["model_type"] == "deepseek_v2" else "gate.e_score_correction_bias"
    return Layout(shared="shared_experts", routing_bias=bias,
                  mtp_from=c["num_hidden_layers"] if mtp else None)


def _dense_layers(c: dict, where: str, kind: str) -> dict:
    """first_k_dense (deepseek_v2 / v3: first_k_dense_replace), or glm4_moe_lite's mlp_layer_types as the leading
    dense layers plus any later ones (dense_layers)."""
    if kind != "glm4_moe_lite":
        return dict(first_k_dense=field(c, "first_k_dense_replace", default=DEFAULTS[kind]["first_k_dense_replace"]))
    return dense_placement(c, where)


def kimi_k25_text(c: dict, where: str) -> dict:
    """Kimi-K2.5 / K2.6's config.json -> its text model's (deepseek_v3 / kimi_k2) config, as transformers'
    Kimi_K25ForConditionalGeneration builds it: `text_config` (model_type kimi_k2 read as deepseek_v3), the lm_head
    tied by the top-level tie_word_embeddings (default true; moe.hf.weights.untie_as_transformers unties a stored
    head that differs), and the top-level quantization_config when the text config has none."""
    text = c.get("text_config")
    if not isinstance(text, dict):
        refuse(where, "text_config", text, "kimi_k25 keeps its text model's config.json there")
    kind = text.get("model_type", "deepseek_v3")
    if kind not in ("deepseek_v3", "kimi_k2"):
        refuse(where, "text_config.model_type", kind, "Kimi-K2.5's text model is deepseek_v3 (kimi_k2)")
    text = dict(text, model_type=kind, tie_word_embeddings=c.get("tie_word_embeddings", True))
    if text.get("quantization_config") is None and c.get("quantization_config") is not None:
        text["quantization_config"] = c["quantization_config"]
    return text


K25_TEXT = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),  # the Hub's names
            ("model.language_model.", "model."))  # transformers' in-memory ones
K25_OTHER = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")


def k25_tensor_name(name: str) -> str | None:
    """A Kimi-K2.5 tensor's name in DeepseekV3ForCausalLM's terms; None for the vision tower and projector (not
    imported). Anything else keeps its name (and is refused as unexpected if the text model has no such tensor)."""
    for old, new in K25_TEXT:
        if name.startswith(old):
            return new + name[len(old):]
    return None if name.startswith(K25_OTHER) else name


def _refuse_unsupported(c: dict, where: str, kind: str) -> None:
    """What transformers' forward would not compute as the checkpoint's authors meant, or what our model lacks."""
    for name in INDEXER_FIELDS:
        if c.get(name) is not None:
            refuse(where, name, c[name], "DeepSeek-V3.2's sparse attention indexer is not implemented")
    for name in ("attention_bias", "mlp_bias"):
        if c.get(name):
            refuse(where, name, c[name], "our multi-head latent attention and SwiGLU have no biases")
    H, N = c["num_attention_heads"], c.get("num_key_value_heads")
    if N is not None and N != H:
        refuse(where, "num_key_value_heads", N, f"multi-head latent attention has one key per head ({H})")
    if c.get("moe_layer_freq", 1) != 1:
        refuse(where, "moe_layer_freq", c["moe_layer_freq"], "transformers ignores it (every layer after "
                                                             "first_k_dense_replace is MoE)")
    scoring = "softmax" if kind == "deepseek_v2" else "sigmoid"
    if c.get("scoring_func", scoring) != scoring:
        refuse(where, "scoring_func", c["scoring_func"], f"transformers' {kind} always scores with {scoring}")
    method = c.get("topk_method")
    if kind == "deepseek_v2":
        if field(c, "topk_method", default="greedy") not in V2_TOPK_METHODS:
            refuse(where, "topk_method", method, f"deepseek_v2 selects by {' or '.join(V2_TOPK_METHODS)} "
                                                 "(noaux_tc is deepseek_v3's)")
        if c.get("norm_topk_prob"):
            refuse(where, "norm_topk_prob", True, "transformers' deepseek_v2 never renormalizes the top-k weights "
                                                  "while DeepSeek's code does; ambiguous")
    elif method not in (None, "noaux_tc"):
        refuse(where, "topk_method", method, f"transformers' {kind} always routes by noaux_tc (sigmoid + bias)")
    if kind == "glm4_moe_lite" and c.get("head_dim") not in (None, c["qk_rope_head_dim"]):
        refuse(where, "head_dim", c["head_dim"], "glm4_moe_lite reads head_dim as qk_rope_head_dim "
                                                 f"({c['qk_rope_head_dim']}); ambiguous")
