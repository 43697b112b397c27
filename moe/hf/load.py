"""`load_hf_moe(DIR)`: a HuggingFace MoE directory -> (our moe.Transformer, tokenizers.Tokenizer or None).

Dispatches on config.json `model_type` (FAMILIES: glm4_moe, qwen2_moe, qwen3_moe, olmoe, mixtral, and with
multi-head latent attention deepseek_v2, deepseek_v3, glm4_moe_lite); each family module maps config.json to a
ModelConfig that reproduces HF's forward exactly and says where its tensors live. Params are fp32 (the checkpoint's
dtype is upcast).
"""

import dataclasses
import os

import tokenizers

from moe.config import ConfigError
from moe.hf import deepseek, glm4_moe, mixtral, olmoe, qwen_moe
from moe.hf.common import HFImportError, SafetensorsFiles, inside, read_config
from moe.hf.safetensors_io import model_from_items
from moe.hf.weights import mtp_depth, variables
from moe.model import Transformer

FAMILIES = {t: m for m in (glm4_moe, qwen_moe, olmoe, mixtral, deepseek) for t in m.MODEL_TYPES}
# Known MoE families we cannot reproduce exactly: model_type -> (field, why).
REFUSED = {
    "deepseek_v32": ("index_topk", "DeepSeek-V3.2's sparse attention (a lightning indexer picks the keys) is not "
                                   "implemented; deepseek_v3, its dense predecessor, is supported"),
    "glm_moe_dsa": ("index_topk", "GLM's DeepSeek sparse attention (a lightning indexer picks the keys) is not "
                                  "implemented"),
    "deepseek_v4": ("compress_rates", "DeepSeek-V4's compressed sparse attention, hyper-connections and hash routing "
                                      "are not implemented"),
}


def model_config(c: dict, where: str = "config.json"):
    """Our ModelConfig for a config.json dict (HFImportError naming the field if it cannot be exact)."""
    kind = c.get("model_type")
    if kind in REFUSED:
        field, why = REFUSED[kind]
        raise HFImportError(f"{where}: model_type {kind!r} ({field}={c.get(field)!r}) is not supported: {why}")
    if kind not in FAMILIES:
        raise HFImportError(f"{where}: model_type {kind!r} is not supported; supported: {', '.join(FAMILIES)}")
    try:
        return FAMILIES[kind].model_config(c, where)
    except KeyError as e:
        raise HFImportError(f"{where}: field {e.args[0]!r} missing for model_type {kind!r}") from None
    except ConfigError as e:  # a value our ModelConfig refuses, e.g. heads not divisible by kv heads
        raise HFImportError(f"{where}: {e}") from None


def load_model(path_dir: str) -> Transformer:
    """The model, streamed: each variable is filled from the safetensors it needs, read when its layer is reached,
    so host memory peaks near the fp32 model's bytes plus one layer's (benchmarks/hf_import_memory.py)."""
    c, where = read_config(path_dir)
    cfg = model_config(c, where)
    files = SafetensorsFiles(path_dir)
    layout = FAMILIES[c["model_type"]].layout(c)
    try:
        # the MTP layers the weights hold (num_nextn_predict_layers says how many the model had; tiny checkpoints
        # saved by transformers keep none)
        cfg = dataclasses.replace(cfg, mtp_depth=mtp_depth(layout, files.shapes))
        return model_from_items(cfg, variables(cfg, layout, files, path_dir), path_dir, "config.json")
    finally:
        files.release()


def load_tokenizer(path_dir: str):
    """DIR/tokenizer.json through the `tokenizers` library, or None when the directory has none."""
    path = os.path.join(path_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None

    path = inside(path_dir, "tokenizer.json", "file")
    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise HFImportError(f"{path}: unreadable tokenizer ({str(e)[:100]})") from e


def load_hf_moe(path_dir: str):
    """(model, tokenizer or None) for a directory of any model_type in FAMILIES."""
    return load_model(path_dir), load_tokenizer(path_dir)
