"""The inverse of train/hf_export.py: a `Glm4MoeForCausalLM` directory (config.json + safetensors) -> our model.

  model = load_hf_checkpoint("out/hf")        # moe.Transformer, params in fp32, routing biases restored

Only the configs our export writes are accepted (full rotary, no q/k norm, no attention bias, no MTP layers):
anything else would load into a model that computes something different, so it is refused with HFImportError
naming the field. Routed experts are read per expert (`mlp.experts.E.*_proj.weight`), as we write them.
"""

import json
import os

import numpy as np

from moe.config import ModelConfig
from moe.model import Transformer
from moe.safetensors_io import model_from_flat


class HFImportError(ValueError):
    """The directory is not a Glm4MoeForCausalLM checkpoint our model can reproduce; the message says why."""


def _rope(c: dict) -> tuple[float, float]:
    rp = c.get("rope_parameters") or {}
    theta = rp.get("rope_theta", c.get("rope_theta", 10000.0))
    partial = rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.5))  # HF's default is 0.5
    if rp.get("rope_type", "default") != "default":
        raise HFImportError(f"rope_type {rp['rope_type']!r} is not supported (only 'default')")
    return float(theta), float(partial)


def model_config(c: dict, where: str = "config.json") -> ModelConfig:
    """Our ModelConfig for a glm4_moe config.json dict; refuses fields that change the math we cannot match."""
    if c.get("model_type") != "glm4_moe":
        raise HFImportError(f"{where}: model_type {c.get('model_type')!r}; only glm4_moe (our export) is supported")
    theta, partial = _rope(c)
    refuse = {"partial_rotary_factor": (partial, 1.0), "use_qk_norm": (c.get("use_qk_norm", False), False),
              "attention_bias": (c.get("attention_bias", False), False),
              "num_nextn_predict_layers": (c.get("num_nextn_predict_layers", 0), 0)}
    for field, (got, want) in refuse.items():
        if got != want:
            raise HFImportError(f"{where}: {field}={got!r} is not supported (our model needs {want!r})")
    if c.get("hidden_act", "silu") != "silu":
        raise HFImportError(f"{where}: hidden_act={c['hidden_act']!r} is not supported (our model needs 'silu')")
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=c["hidden_size"], n_layers=c["num_hidden_layers"],
        n_heads=c["num_attention_heads"], n_kv_heads=c["num_key_value_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        d_ff=c["intermediate_size"], first_k_dense=c.get("first_k_dense_replace", 1),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)), norm_eps=c["rms_norm_eps"], rope_theta=theta,
        n_routed_experts=c["n_routed_experts"], n_shared_experts=c["n_shared_experts"],
        top_k=c["num_experts_per_tok"], moe_d_ff=c["moe_intermediate_size"], n_group=c.get("n_group", 1),
        topk_group=c.get("topk_group", 1), routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(c.get("norm_topk_prob", True)), init_std=c.get("initializer_range", 0.02))


def read_hf_tensors(path_dir: str) -> dict[str, np.ndarray]:
    """All tensors of model.safetensors or of the shards in model.safetensors.index.json, as fp32 NumPy."""
    from safetensors import safe_open

    index = os.path.join(path_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise HFImportError(f"{path_dir}: no model.safetensors or model.safetensors.index.json")
    out = {}
    for name in files:
        # framework="flax": NumPy has no bfloat16, jax arrays do; everything becomes fp32 host arrays here.
        with safe_open(os.path.join(path_dir, name), framework="flax") as f:
            for k in f.keys():
                out[k] = np.asarray(f.get_tensor(k).astype("float32"))
    return out


def our_tensors(cfg: ModelConfig, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF names ([out, in] layouts) -> our flat variable names (moe.safetensors_io.flat_variables layouts)."""
    sd = dict(sd)
    take = lambda name: sd.pop(name) if name in sd else _missing(name)
    H, N, Dh, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
    out = {"embed": take("model.embed_tokens.weight"), "final_norm.scale": take("model.norm.weight")}
    if not cfg.tie_embeddings:
        out["lm_head"] = take("lm_head.weight").T
    for i in range(cfg.n_layers):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        out[q + "attn_norm.scale"] = take(p + "input_layernorm.weight")
        out[q + "ffn_norm.scale"] = take(p + "post_attention_layernorm.weight")
        out[q + "attn.wq"] = take(p + "self_attn.q_proj.weight").T.reshape(D, H, Dh)
        out[q + "attn.wk"] = take(p + "self_attn.k_proj.weight").T.reshape(D, N, Dh)
        out[q + "attn.wv"] = take(p + "self_attn.v_proj.weight").T.reshape(D, N, Dh)
        out[q + "attn.wo"] = take(p + "self_attn.o_proj.weight").T.reshape(H, Dh, D)
        if not cfg.is_moe_layer(i):
            for w in ("gate", "up", "down"):
                out[f"{q}ffn.w_{w}"] = take(f"{p}mlp.{w}_proj.weight").T
            continue
        out[q + "ffn.router"] = take(p + "mlp.gate.weight").T
        out[q + "ffn.bias"] = take(p + "mlp.gate.e_score_correction_bias")
        for w in ("gate", "up", "down"):
            out[f"{q}ffn.w_{w}"] = np.stack([take(f"{p}mlp.experts.{e}.{w}_proj.weight").T
                                             for e in range(cfg.n_routed_experts)])
            shared = take(f"{p}mlp.shared_experts.{w}_proj.weight").T
            if cfg.n_shared_experts:
                out[f"{q}ffn.shared.w_{w}"] = shared
    if sd:
        raise HFImportError(f"unexpected tensor(s) {', '.join(sorted(sd)[:5])} for the config in config.json")
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def _missing(name):
    raise HFImportError(f"tensor {name!r} missing (fused or renamed experts are not supported; "
                        "expected a directory written by train.export --format hf)")


def load_hf_checkpoint(path_dir: str) -> Transformer:
    """Our Transformer (fp32 params, fp32 compute) from a directory written by train/hf_export.py."""
    path = os.path.join(path_dir, "config.json")
    if not os.path.isfile(path):
        raise HFImportError(f"{path}: missing; expected a HuggingFace model directory")
    with open(path) as f:
        cfg = model_config(json.load(f), path)
    tensors = our_tensors(cfg, read_hf_tensors(path_dir))
    return model_from_flat(cfg, tensors, path_dir, "config.json")
