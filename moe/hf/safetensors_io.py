"""Our own lossless checkpoint format: every model variable (params AND routing biases) as safetensors.

  path_dir/model.safetensors   flat keys named by the module path, e.g. `blocks.3.ffn.w_gate`, `embed`,
                               `blocks.3.ffn.bias` (the RoutingBias), all fp32, in our layouts ([D,H,Dh] ...)
  path_dir/moe_config.json     dataclasses.asdict(ModelConfig)

`load_safetensors` rebuilds the exact model for any config (prefix mask, NoPE, tied embeddings ...): no
HuggingFace mapping is involved (that is moe/hf/write.py). Optional `extra_meta` (JSON-serializable) rides in
the safetensors header and comes back from `read_extra_meta`.
"""

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from moe.config import LEGACY_EXECUTION_FIELDS, RENAMED_FIELDS, ModelConfig
from moe.hf.paths import file_inside
from moe.model import Transformer

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "moe_config.json"
FORMAT = "moe-lm/1"


def _key(path) -> str:
    return ".".join(str(p) for p in path)


def flat_variables(model: Transformer) -> dict[str, np.ndarray]:
    """Every nnx.Variable of the model (Param, RoutingBias, ...) as host arrays keyed `a.b.3.c`."""
    _, state = nnx.split(model)
    return {_key(path): np.asarray(var.get_value()) for path, var in nnx.to_flat_state(state)}


def save_file_readable(tensors: dict[str, np.ndarray], path: str, metadata: dict | None = None) -> None:
    """safetensors' save_file, leaving the file with the permissions of any other file this process writes
    (0666 less the umask: safetensors creates it 0600)."""
    save_file(tensors, path, metadata=metadata)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def save_safetensors(model: Transformer, path_dir: str, extra_meta: dict | None = None) -> None:
    os.makedirs(path_dir, exist_ok=True)
    meta = {"format": FORMAT}
    if extra_meta is not None:
        meta["extra_meta"] = json.dumps(extra_meta)
    tensors = {k: np.ascontiguousarray(v) for k, v in flat_variables(model).items()}
    save_file_readable(tensors, os.path.join(path_dir, WEIGHTS_FILE), metadata=meta)
    with open(os.path.join(path_dir, CONFIG_FILE), "w") as f:
        json.dump(dataclasses.asdict(model.cfg), f, indent=2, sort_keys=True)


def load_config(path_dir: str) -> ModelConfig:
    path = os.path.join(path_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: missing; expected a directory written by moe.hf.safetensors_io.save_safetensors")
    with open(file_inside(path_dir, CONFIG_FILE, "file")) as f:
        fields = json.load(f)
    known = {f.name for f in dataclasses.fields(ModelConfig)} | set(LEGACY_EXECUTION_FIELDS) | set(RENAMED_FIELDS)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{path}: unknown ModelConfig field(s) {', '.join(unknown)}; written by a newer version?")
    return ModelConfig.from_dict(fields)


def read_extra_meta(path_dir: str) -> dict | None:
    """The `extra_meta` given to save_safetensors (None if there was none)."""
    with safe_open(_weights_path(path_dir), framework="np") as f:
        meta = f.metadata() or {}
    return json.loads(meta["extra_meta"]) if "extra_meta" in meta else None


def _weights_path(path_dir: str) -> str:
    path = os.path.join(path_dir, WEIGHTS_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: missing; expected a directory written by moe.hf.safetensors_io.save_safetensors")
    return str(file_inside(path_dir, WEIGHTS_FILE, "file"))


def load_safetensors(path_dir: str) -> Transformer:
    """Rebuild the model saved by save_safetensors; every variable must be present with its exact shape."""
    cfg = load_config(path_dir)
    path = _weights_path(path_dir)
    with safe_open(path, framework="np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return model_from_flat(cfg, tensors, path, f"the config in {CONFIG_FILE}")


def model_from_flat(cfg: ModelConfig, tensors: dict, where: str, config_name: str = "the config") -> Transformer:
    """The model for `cfg` from flat arrays keyed like `flat_variables`; names, shapes and dtypes must match
    exactly (ValueError naming the tensor and `where` otherwise)."""
    return model_from_items(cfg, tensors.items(), where, config_name)


def model_from_items(cfg: ModelConfig, items, where: str, config_name: str = "the config") -> Transformer:
    """As model_from_flat, from (name, array) pairs taken one at a time: each array is checked against the abstract
    model (nnx.eval_shape, no memory) and becomes the model's own before the next is taken, so a streaming source
    keeps no more than the model and one array alive here."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    expected = {_key(p): (p, var) for p, var in nnx.to_flat_state(state)}
    filled, unexpected = {}, []
    for k, arr in items:
        if k not in expected:
            unexpected.append(k)
            continue
        p, var = expected[k]
        want = var.get_value()
        if tuple(arr.shape) != tuple(want.shape) or arr.dtype != np.dtype(want.dtype):
            raise ValueError(f"{where}: tensor {k!r} is {arr.dtype}{list(arr.shape)}, {config_name} "
                             f"needs {np.dtype(want.dtype)}{list(want.shape)}")
        filled[k] = (p, var.replace(jnp.asarray(arr)))
        del arr
    missing = [k for k in expected if k not in filled]
    if missing:
        raise ValueError(f"{where}: tensor {missing[0]!r} missing for {config_name}")
    if unexpected:
        raise ValueError(f"{where}: unexpected tensor(s) {', '.join(sorted(unexpected)[:5])} for {config_name}")
    return nnx.merge(graphdef, nnx.from_flat_state([filled[k] for k in expected]))
