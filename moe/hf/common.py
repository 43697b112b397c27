"""What every family shares: the one-line error, config.json fields, RoPE settings, reading safetensors.

Each family module (glm4_moe.py, qwen_moe.py, olmoe.py, mixtral.py, deepseek.py) turns its config.json into a
ModelConfig that reproduces HF's forward exactly, refusing (HFImportError naming the field) whatever our model
cannot reproduce. RoPE: default only (rope_settings), or default and YaRN for multi-head latent attention
(yarn_rope_fields: the DeepSeek families ship YaRN configs).
"""

import json
import os

import numpy as np
from safetensors import safe_open

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
    original = int(c.get("original_max_position_embeddings") or rp.get("original_max_position_embeddings")
                   or c["max_position_embeddings"])
    factor = float(rp["factor"] if rp.get("factor") is not None else c["max_position_embeddings"] / original)
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


FLOAT_DTYPES = ("F32", "F16", "BF16")  # safetensors' names of the dtypes fp32 holds exactly


class SafetensorsFiles:
    """The tensors of DIR's model.safetensors or of the shards in model.safetensors.index.json, read one at a time.

    Opening reads only the headers: every file resolves inside DIR (moe.hf.paths) and every tensor is F32, F16 or
    BF16 (else HFImportError naming it); `shapes` is name -> shape. `read(name)` returns one tensor as fp32 NumPy
    (nothing is unpickled); it keeps one file mapped until the next file is needed or `release()`, so a caller that
    releases between layers keeps at most a layer's pages of the checkpoint resident."""

    def __init__(self, path_dir: str):
        index = "model.safetensors.index.json"
        if os.path.isfile(os.path.join(path_dir, index)):
            weight_map = read_json(path_dir, index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise HFImportError(f"{os.path.join(path_dir, index)}: no weight_map; re-download the checkpoint")
            files = sorted({str(v) for v in weight_map.values()})
        elif os.path.isfile(os.path.join(path_dir, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            raise HFImportError(f"{path_dir}: no model.safetensors or model.safetensors.index.json "
                                "(.bin checkpoints are not read; convert them to safetensors)")
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._file: dict[str, str] = {}
        self._open = None  # (path, safe_open handle) of the one file mapped now
        for name in files:
            path = inside(path_dir, name, f"{index} weight_map entry")
            with safe_open(path, framework="flax") as f:
                for k in f.keys():
                    tensor = f.get_slice(k)
                    if tensor.get_dtype() not in FLOAT_DTYPES:
                        raise HFImportError(f"{os.path.join(path_dir, name)}: tensor {k!r} is {tensor.get_dtype()}; "
                                            f"only {', '.join(FLOAT_DTYPES)} weights are read exactly (convert "
                                            "quantized, integer or float64 weights to bf16/fp32 first)")
                    self.shapes[k], self._file[k] = tuple(tensor.get_shape()), path

    def read(self, name: str) -> np.ndarray:
        path = self._file[name]
        if self._open is None or self._open[0] != path:
            self.release()
            self._open = (path, safe_open(path, framework="flax"))
        # framework="flax": NumPy has no bfloat16, jax arrays do; everything becomes fp32 host arrays here.
        return np.asarray(self._open[1].get_tensor(name).astype("float32"))

    def release(self) -> None:
        """Unmap the file read last (its pages leave this process's resident memory)."""
        if self._open is not None:
            self._open[1].__exit__(None, None, None)
            self._open = None


def read_tensors(path_dir: str) -> dict[str, np.ndarray]:
    """All tensors of DIR at once, as fp32 NumPy (SafetensorsFiles' checks); the loader streams them instead."""
    files = SafetensorsFiles(path_dir)
    try:
        return {k: files.read(k) for k in files.shapes}
    finally:
        files.release()
