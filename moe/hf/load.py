"""`load_hf_moe(DIR)`: a HuggingFace MoE directory -> (our moe.Transformer, tokenizers.Tokenizer or None).

Dispatches on config.json `model_type` (FAMILIES: one module per family, each listing its MODEL_TYPES; NESTED:
multimodal wrappers read through their `text_config`; docs/hf_import.md tabulates them all); each family module
maps config.json to a ModelConfig that reproduces HF's forward exactly and says where its tensors live. Every field a family reads is type-checked first (common.check_field_types), and a
`quantization_config` must be FP8 (block or per-tensor scales) or gpt-oss's MXFP4 (quant.quantization; its weights
are dequantized on load).
Params are fp32 (the checkpoint's dtype is upcast). With a mesh, every variable is placed straight into its sharded
array, each process reading only the slices its devices hold (moe/hf/sharded.py); `open_checkpoint` is what the
layer-streamed forward (moe/hf/stream.py) reads from.
"""

import dataclasses
import os

import tokenizers

from moe.config import ConfigError
from moe.hf import (
    deepseek,
    deepseek_dsa,
    dots1,
    ernie4_5_moe,
    glm4_moe,
    gpt_oss,
    hunyuan_v1_moe,
    hy_v3,
    llama4,
    longcat_flash,
    minimax_m2,
    mistral4,
    mixtral,
    olmoe,
    qwen3_next,
    qwen_moe,
)
from moe.hf.common import HFImportError, check_field_types, inside, read_config
from moe.hf.quant import quantization
from moe.hf.safetensors_io import model_from_items
from moe.hf.sharded import load_sharded
from moe.hf.tensors import SafetensorsFiles
from moe.hf.weights import Layout, check_layers, mtp_depth, untie_as_transformers, variables
from moe.model import Transformer
from moe.sharding import RULES

FAMILIES = {t: m for m in (glm4_moe, qwen_moe, olmoe, mixtral, deepseek, ernie4_5_moe, dots1, hunyuan_v1_moe,
                            minimax_m2, hy_v3, deepseek_dsa, mistral4,
                            llama4, gpt_oss, longcat_flash, qwen3_next) for t in m.MODEL_TYPES}
# Multimodal wrappers whose text model is one of FAMILIES: model_type -> (its config, its tensors' names).
NESTED = {"kimi_k25": (deepseek.kimi_k25_text, deepseek.k25_tensor_name)}
# Known MoE families we cannot reproduce exactly: model_type -> (field, why).
REFUSED = {
    "deepseek_v4": ("compress_rates", "DeepSeek-V4's compressed sparse attention, hyper-connections and hash routing "
                                      "are not implemented"),
}


def text_model(c: dict, where: str = "config.json") -> tuple[dict, str, object]:
    """(the config.json dict of the MoE text model, where to name its fields, rename of stored tensor names or
    None): c itself, or a NESTED wrapper's text config; every field's JSON type checked (HFImportError)."""
    check_field_types(c, where)
    if c.get("model_type") not in NESTED:
        return c, where, None
    text, rename = NESTED[c["model_type"]]
    c, where = text(c, where), f"{where} text_config"
    check_field_types(c, where)
    return c, where, rename


def model_config(c: dict, where: str = "config.json"):
    """Our ModelConfig for a config.json dict (HFImportError naming the field if it cannot be exact)."""
    c, where, _ = text_model(c, where)
    return _family_config(c, where)


def _family(c: dict, where: str):
    """The family module of c's model_type (HFImportError naming it when refused or unknown)."""
    kind = c.get("model_type")
    if kind in REFUSED:
        field, why = REFUSED[kind]
        raise HFImportError(f"{where}: model_type {kind!r} ({field}={c.get(field)!r}) is not supported: {why}")
    if kind not in FAMILIES:
        raise HFImportError(f"{where}: model_type {kind!r} is not supported; supported: "
                            f"{', '.join([*FAMILIES, *NESTED])}")
    return FAMILIES[kind]


def _family_config(c: dict, where: str):
    family = _family(c, where)
    quantization(c, where)  # refused unless FP8 or gpt-oss's MXFP4
    try:
        return family.model_config(c, where)
    except KeyError as e:
        raise HFImportError(f"{where}: field {e.args[0]!r} missing for model_type {c['model_type']!r}") from None
    except ConfigError as e:  # a value our ModelConfig refuses, e.g. heads not divisible by kv heads
        raise HFImportError(f"{where}: {e}") from None


@dataclasses.dataclass
class Checkpoint:
    """A HF directory opened for reading: the ModelConfig that reproduces it, where its family keeps its tensors,
    and its safetensors (headers read and checked; no tensor read yet)."""

    cfg: object  # moe.ModelConfig
    layout: Layout
    files: SafetensorsFiles
    where: str  # config.json's path, for messages


def open_checkpoint(path_dir: str, keep_dtype: bool = False) -> Checkpoint:
    """The checkpoint of `path_dir`, with the MTP layers its weights hold and the head transformers would use. The
    layer count is compared with the stored tensor names before anything is built from it. keep_dtype: read F16 /
    BF16 tensors as stored (SafetensorsFiles)."""
    c, where = read_config(path_dir)
    c, where, rename = text_model(c, where)
    family = _family(c, where)
    files = SafetensorsFiles(path_dir, quantization(c, where), rename, keep_dtype=keep_dtype)
    if "num_hidden_layers" in c:  # before ModelConfig, whose size checks grow with the layer count
        check_layers(c["num_hidden_layers"], family.layout(c), files.shapes, where)
    cfg = _family_config(c, where)
    layout = family.layout(c)
    # the MTP layers the weights hold (num_nextn_predict_layers says how many the model had; tiny checkpoints
    # saved by transformers keep none), and the head transformers would use
    cfg = dataclasses.replace(cfg, mtp_depth=mtp_depth(layout, files.shapes))
    return Checkpoint(untie_as_transformers(cfg, files), layout, files, where)


def load_model(path_dir: str, mesh=None, rules=RULES) -> Transformer:
    """The model, streamed: each variable is filled from the safetensors it needs, read when its layer is reached,
    so host memory peaks near the fp32 model's bytes plus one layer's (benchmarks/hf_import_memory.py). With a
    `mesh` (moe.sharding.make_mesh) each variable is placed into its sharded array by `rules` (moe.sharding.RULES:
    experts on the expert axis, heads on the tensor axis ...), each process reading only its devices' slices."""
    ck = open_checkpoint(path_dir)
    if mesh is not None:
        return load_sharded(ck.cfg, ck.layout, ck.files, ck.where, mesh, rules)
    return model_from_items(ck.cfg, variables(ck.cfg, ck.layout, ck.files, ck.where), path_dir, "config.json")


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


def check_vocabulary(tokenizer, vocab_size: int, path: str) -> None:
    """Every id the tokenizer can produce, added tokens included, indexes the model's embedding (HFImportError)."""
    ids = tokenizer.get_vocab(with_added_tokens=True)
    if ids and max(ids.values()) >= vocab_size:
        token, top = max(ids.items(), key=lambda kv: kv[1])
        raise HFImportError(f"{path}: token {token!r} has id {top}, past the model's vocab_size {vocab_size} "
                            "(config.json); use the tokenizer.json that belongs to these weights")


def load_hf_moe(path_dir: str, mesh=None, rules=RULES):
    """(model, tokenizer or None) for a directory of any model_type in FAMILIES (or NESTED); with a `mesh`, the model
    sharded by `rules` as it is read (load_model)."""
    model, tokenizer = load_model(path_dir, mesh, rules), load_tokenizer(path_dir)
    if tokenizer is not None:
        check_vocabulary(tokenizer, model.cfg.vocab_size, os.path.join(path_dir, "tokenizer.json"))
    return model, tokenizer
