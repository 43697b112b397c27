"""What every family shares: the one-line error, config.json fields and their JSON types, RoPE settings.

Each family module (glm4_moe.py, qwen_moe.py, olmoe.py, mixtral.py, deepseek.py) turns its config.json into a
ModelConfig that reproduces HF's forward exactly, refusing (HFImportError naming the field) whatever our model
cannot reproduce. Before any family reads it, every field a family reads is checked for its JSON type
(check_field_types: "false" is not a boolean, "4" not an integer). RoPE: default only (rope_settings), or default
and YaRN for multi-head latent attention (yarn_rope_fields: the DeepSeek families ship YaRN configs).
"""

import json
import math
import os

from moe.hf.paths import OutsideDirectoryError, file_inside


class HFImportError(ValueError):
    """A HuggingFace directory our model cannot reproduce exactly; the one-line message names the field or file."""


def refuse(where: str, field: str, got, why: str):
    raise HFImportError(f"{where}: {field}={got!r} is not supported ({why})")


def field(c: dict, *names, default=None):
    """The first of `names` present (and not None) in config.json: transformers 5.x writes some fields under its
    attribute_map alias (num_local_experts for Qwen3's num_experts, num_mtp_layers ...)."""
    for name in names:
        if c.get(name) is not None:
            return c[name]
    if default is None:
        raise KeyError(names[0])
    return default


INT, NUMBER, BOOL, STRING, OBJECT = "an integer", "a number", "a boolean (true or false)", "a string", "an object"
INTS, STRINGS = "a list of integers", "a list of strings"
# Every config.json field a family module reads, with its JSON type (null: as if absent, except in REQUIRED).
FIELD_TYPES = {
    **dict.fromkeys(("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts",
                     "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group",
                     "first_k_dense_replace", "decoder_sparse_step", "shared_expert_intermediate_size", "q_lora_rank",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_nextn_predict_layers",
                     "num_mtp_layers", "max_position_embeddings", "original_max_position_embeddings",
                     "sliding_window", "moe_layer_freq", "index_topk", "index_n_heads", "index_head_dim",
                     "moe_num_experts", "moe_k", "moe_num_shared_experts", "moe_layer_start_index",
                     "moe_layer_end_index", "moe_layer_interval", "max_window_layers", "rotary_dim",
                     "num_shared_experts", "intermediate_size_mlp", "interleave_moe_layer_step",
                     "no_rope_layer_interval", "attention_chunk_size", "floor_scale", "num_layers", "ffn_hidden_size",
                     "zero_expert_num", "moe_topk", "expert_ffn_hidden_size", "qk_head_dim", "linear_num_key_heads",
                     "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_conv_kernel_dim", "full_attention_interval"), INT),
    **dict.fromkeys(("rms_norm_eps", "initializer_range", "routed_scaling_factor", "router_scaling_factor", "rope_theta",
                     "partial_rotary_factor", "clip_qkv", "moe_norm_min", "attn_scale", "swiglu_limit",
                     "swiglu_alpha"), NUMBER),
    **dict.fromkeys(("tie_word_embeddings", "norm_topk_prob", "rope_interleave", "attention_bias", "mlp_bias",
                     "qkv_bias", "use_qk_norm", "use_sliding_window", "use_bias", "use_cla", "use_mixed_mlp_moe"),
                    BOOL),
    **dict.fromkeys(("model_type", "hidden_act", "scoring_func", "topk_method"), STRING),
    **dict.fromkeys(("rope_scaling", "rope_parameters", "quantization_config", "text_config"), OBJECT),
    "mlp_only_layers": INTS, "moe_layers": INTS, "no_rope_layers": INTS, "mlp_layer_types": STRINGS, "layer_types": STRINGS,
}
INT_OR_INTS = "an integer or a list of integers"
# A family's own fields and types: Hunyuan's original config.json keeps per-layer lists (transformers reads
# moe_topk per layer and ignores the other two; moe/hf/hunyuan_v1_moe.py refuses lists that disagree); Hy3's
# switches transformers ignores (moe/hf/hy_v3.py refuses them off), and LongCat-Flash's.
FAMILY_FIELD_TYPES = {"hunyuan_v1_moe": {"moe_topk": INT_OR_INTS, "moe_intermediate_size": INT_OR_INTS,
                                         "num_shared_expert": INT_OR_INTS},
                      "hy_v3": dict.fromkeys(("qk_norm", "route_norm", "moe_router_use_sigmoid",
                                              "moe_router_enable_expert_bias"), BOOL),
                      "longcat_flash": {**dict.fromkeys(("router_bias", "mla_scale_q_lora", "mla_scale_kv_lora"), BOOL),
                                        "zero_expert_type": STRING}}
ROPE_FIELD_TYPES = {  # inside rope_scaling / rope_parameters
    **dict.fromkeys(("rope_type", "type"), STRING), "original_max_position_embeddings": INT, "truncate": BOOL,
    **dict.fromkeys(("rope_theta", "factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                     "partial_rotary_factor", "llama_4_scaling_beta", "low_freq_factor", "high_freq_factor"),
                    NUMBER),
}
# Read without a default wherever they are read: null is refused rather than taken for "absent".
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "num_experts_per_tok", "rms_norm_eps", "moe_intermediate_size", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "max_position_embeddings", "model_type")


def check_field_types(c: dict, where: str) -> None:
    """Every field a family reads (FIELD_TYPES, and ROPE_FIELD_TYPES inside the RoPE dict) has its JSON type, else
    HFImportError naming the field, its value and the type expected: Python would read "false" as true and "4"
    as a string. Called once for every family (moe.hf.load.model_config) before any family module reads c."""
    family = FAMILY_FIELD_TYPES.get(c.get("model_type"), {}) if isinstance(c.get("model_type"), str) else {}
    for name, kind in {**FIELD_TYPES, **family}.items():
        if name in c and not _is(c[name], kind, nullable=name not in REQUIRED):
            raise HFImportError(f"{where}: field {name!r} is {_describe(c[name])}; expected {kind}")
    for rope in ("rope_scaling", "rope_parameters"):
        for name, kind in ROPE_FIELD_TYPES.items():
            if isinstance(c.get(rope), dict) and name in c[rope] and not _is(c[rope][name], kind, nullable=True):
                raise HFImportError(f"{where}: field '{rope}.{name}' is {_describe(c[rope][name])}; expected {kind}")


def _is(value, kind: str, nullable: bool) -> bool:
    if value is None:
        return nullable
    if kind == INT_OR_INTS:
        return _is(value, INT, False) or _is(value, INTS, False)
    if kind in (INTS, STRINGS):
        return isinstance(value, list) and all(_is(v, INT if kind == INTS else STRING, False) for v in value)
    if isinstance(value, bool):
        return kind == BOOL
    return {INT: isinstance(value, int),
            NUMBER: isinstance(value, (int, float)) and math.isfinite(value),
            STRING: isinstance(value, str), OBJECT: isinstance(value, dict), BOOL: False}[kind]


def _describe(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    kind = {str: "a string", int: "an integer", float: "a number", list: "a list", dict: "an object"}
    return f"{kind.get(type(value), type(value).__name__)} ({json.dumps(value)[:40]})"


def n_experts(c: dict) -> int:
    return field(c, "num_experts", "num_local_experts", "n_routed_experts", default=0)


def inside(path_dir: str, name: str, what: str) -> str:
    """DIR/name, refused (HFImportError naming the entry) unless it resolves inside DIR (moe.hf.paths)."""
    try:
        return str(file_inside(path_dir, name, what))
    except OutsideDirectoryError as e:
        raise HFImportError(f"{path_dir}: {e}") from None


def read_json(path_dir: str, name: str) -> dict:
    """DIR/name as a JSON object (HFImportError naming the file when it is not one)."""
    path = inside(path_dir, name, "file")
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise HFImportError(f"{os.path.join(path_dir, name)}: not valid JSON ({str(e)[:80]}); re-download or "
                            "re-save the checkpoint") from None
    if not isinstance(doc, dict):
        raise HFImportError(f"{os.path.join(path_dir, name)}: expected a JSON object, got {type(doc).__name__}")
    return doc


def read_config(path_dir: str) -> tuple[dict, str]:
    path = os.path.join(path_dir, "config.json")
    if not os.path.isfile(path):
        raise HFImportError(f"{path}: missing; expected a HuggingFace model directory (config.json + safetensors)")
    return read_json(path_dir, "config.json"), path


def rope_parameters(c: dict) -> dict:
    """RoPE settings as transformers 5.x reads them: 4.x's `rope_scaling` wins over `rope_parameters`; rope_theta
    from the dict, else the top level, else 10000; `rope_type` (4.x: `type`) defaults to "default"."""
    rp = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
    rp.setdefault("rope_theta", c.get("rope_theta") or 10000.0)
    rp["rope_type"] = rp.get("rope_type") or rp.get("type") or "default"
    return rp


def rope_settings(c: dict, where: str, default_partial: float = 1.0) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from transformers 5.x `rope_parameters` or 4.x top-level fields;
    any rope scaling (yarn, linear, dynamic, llama3 ...) is refused: it changes the frequencies."""
    rp = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    kind = rp.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        refuse(where, "rope_type", kind, "only default RoPE; scaled RoPE changes the frequencies")
    theta = rp.get("rope_theta", c.get("rope_theta", 10000.0))
    partial = rp.get("partial_rotary_factor", c.get("partial_rotary_factor", default_partial))
    return float(theta), float(partial)


def yarn_rope_fields(c: dict, where: str) -> dict:
    """ModelConfig RoPE fields for default RoPE or YaRN, as transformers' `_compute_yarn_parameters` and DeepSeek's
    `yarn_apply_mscale` read them (moe/attention.py computes the same); other scalings are refused. A factor of 1 is
    plain RoPE (the frequencies and both mscales are then unchanged)."""
    rp = rope_parameters(c)
    kind, theta = rp["rope_type"], float(rp["rope_theta"])
    partial = rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        refuse(where, "partial_rotary_factor", partial, "multi-head latent attention ropes all qk_rope_head_dim dims")
    if kind == "default":
        return dict(rope_theta=theta)
    if kind != "yarn":
        refuse(where, "rope_type", kind, "only default RoPE and YaRN; other scalings change the frequencies")
    if rp.get("attention_factor") is not None:
        refuse(where, "rope_parameters.attention_factor", rp["attention_factor"],
               "YaRN's cos/sin factor is derived from factor, mscale and mscale_all_dim here")
    if rp.get("truncate", True) is not True:
        refuse(where, "rope_parameters.truncate", rp["truncate"], "only YaRN's truncated correction range")
    # transformers: a top-level original_max_position_embeddings wins; without either, max_position_embeddings.
    rope = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    source = next(name for name, v in (("original_max_position_embeddings", c.get("original_max_position_embeddings")),
                                       (f"{rope}.original_max_position_embeddings",
                                        rp.get("original_max_position_embeddings")),
                                       ("max_position_embeddings", True)) if v)
    original = int(c.get("original_max_position_embeddings") or rp.get("original_max_position_embeddings")
                   or c["max_position_embeddings"])
    if original <= 0:
        refuse(where, source, original, "YaRN needs the context length the model was trained on (> 0)")
    if rp.get("factor") is not None:
        factor = float(rp["factor"])
        if factor < 1:
            refuse(where, f"{rope}.factor", rp["factor"], "YaRN's factor must be >= 1 (1: no scaling)")
    else:  # transformers: max_position_embeddings over the original length
        factor = c["max_position_embeddings"] / original
        if factor < 1:
            refuse(where, "max_position_embeddings", c["max_position_embeddings"],
                   f"without {rope}.factor YaRN scales by it over the original {original} positions, which must "
                   "be >= 1")
    if factor == 1.0:
        return dict(rope_theta=theta)
    return dict(rope_theta=theta, rope_scaling_factor=factor, rope_original_max_position=original,
                yarn_beta_fast=float(rp.get("beta_fast") or 32.0), yarn_beta_slow=float(rp.get("beta_slow") or 1.0),
                yarn_mscale=float(rp.get("mscale") or 0.0),
                yarn_mscale_all_dim=float(rp.get("mscale_all_dim") or 0.0))


def check_activation(c: dict, where: str) -> None:
    if c.get("hidden_act", "silu") != "silu":
        refuse(where, "hidden_act", c["hidden_act"], "our SwiGLU uses silu")


def stack_fields(c: dict, where: str) -> dict:
    """ModelConfig fields every family spells the same way (Llama-style config.json)."""
    check_activation(c, where)
    H = c["num_attention_heads"]
    return dict(vocab_size=c["vocab_size"], d_model=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=H,
                n_kv_heads=c.get("num_key_value_heads") or H, head_dim=c.get("head_dim") or c["hidden_size"] // H,
                tie_embeddings=bool(c.get("tie_word_embeddings", False)), norm_eps=float(c["rms_norm_eps"]),
                init_std=float(c.get("initializer_range", 0.02)))


def dense_layer_text(layers) -> str:
    """Qwen's mlp_only_layers list -> our `dense_layers` string."""
    return ",".join(str(int(i)) for i in sorted(set(layers or [])))


def dense_placement(c: dict, where: str) -> dict:
    """first_k_dense and dense_layers from `mlp_layer_types` (default: layer 0 dense, the rest sparse), as
    transformers places them (GLM-4.7-Flash, Hy3); a `first_k_dense_replace` that disagrees is refused."""
    n = c["num_hidden_layers"]
    types = c.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)
    if len(types) != n or set(types) - {"dense", "sparse"}:
        refuse(where, "mlp_layer_types", types, f"expected {n} entries, each 'dense' or 'sparse'")
    leading = next((i for i, t in enumerate(types) if t != "dense"), n)
    k = c.get("first_k_dense_replace")
    if k is not None and types != ["dense"] * k + ["sparse"] * (n - k):
        refuse(where, "first_k_dense_replace", k, f"transformers ignores it and places dense layers by "
                                                  f"mlp_layer_types {types}; make the two agree")
    later = [i for i in range(leading, n) if types[i] == "dense"]
    return dict(first_k_dense=leading, dense_layers=",".join(map(str, later)))
