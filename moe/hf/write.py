"""Export to a HuggingFace checkpoint, exact (same logits): `Glm4MoeForCausalLM` for grouped-query attention
(tests/test_hf_export.py), `DeepseekV3ForCausalLM` for multi-head latent attention (write_mla.py,
tests/test_hf_export_mla.py). `architecture(cfg)` says which.

  write_hf_checkpoint(model, "out/hf", "train/data/tokenizer.json", "bfloat16",
                      {"data": "...", "steps": 2000, "final_val_loss": 3.21})
  AutoModelForCausalLM.from_pretrained("out/hf"); AutoTokenizer.from_pretrained("out/hf")

GLM-4.5's architecture is ours: pre-norm RMSNorm, GQA with full rotate-half RoPE, dense SwiGLU in the first
`first_k_dense` layers, then the DeepSeek-V3 MoE (sigmoid router, selection-only bias = e_score_correction_bias,
group-limited top-k, shared experts). The checked mapping facts are in HF_EXPORT_NOTES.md; the ones that bite:
partial_rotary_factor must be 1.0 (HF's default 0.5 rotates half the head), head_dim must be written, and
num_nextn_predict_layers must count the MTP layers written. MTP modules (model.mtp_depth) are written as DeepSeek-V3
and GLM-4.5 store them, layer n_layers + k (enorm, hnorm, eh_proj, the decoder layer, shared_head.norm, copies of
the embedding and head: what vLLM and SGLang read for speculative decoding); transformers' forward never runs them
and reports them as unexpected keys (it ignores only DeepSeek-V3's layer 61), so write_hf_checkpoint(mtp=False)
leaves them out for a plain HF model. deepseek_v3 names the embedding, norm and MoE tensors as glm4_moe does; its
config.json, attention tensors and refusals are write_mla.py's. Pure NumPy here: neither torch nor
transformers is needed to export.
"""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np

from moe.accounting import param_counts
from moe.config import ModelConfig
from moe.hf import write_mla
from moe.hf.safetensors_io import save_file_readable
from moe.model import Transformer
from moe.router import ROUTERS

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


class ExportError(ValueError):
    """The model uses a feature its HF architecture cannot reproduce exactly; the message names it."""


def architecture(cfg: ModelConfig) -> str:
    """The HF class an export of `cfg` is: DeepseekV3ForCausalLM (attention="mla") or Glm4MoeForCausalLM."""
    return write_mla.ARCHITECTURE if cfg.attention == "mla" else "Glm4MoeForCausalLM"


def unsupported_features(cfg: ModelConfig) -> list[str]:
    """Features of `cfg` with no exact equivalent in `architecture(cfg)` (empty: the export is exact)."""
    if cfg.attention == "mla":
        return write_mla.unsupported_features(cfg)
    return glm4_moe_unsupported_features(cfg)


def glm4_moe_unsupported_features(cfg: ModelConfig) -> list[str]:
    """Features of `cfg` with no exact Glm4MoeForCausalLM equivalent (empty: the export is exact)."""
    out = []
    if cfg.mask != "causal":
        out.append(f"{cfg.mask} mask")  # "prefix mask", "bidirectional mask", "mixed mask"
    if not cfg.rope:
        out.append("no position encoding (NoPE)")
    if cfg.n_moe_layers and cfg.n_routed_experts < 2:
        out.append("fewer than 2 routed experts (HF scores a group by its two best experts)")
    if cfg.n_moe_layers and "glm4_moe" not in ROUTERS[cfg.router].exports_as:
        out.append(f"model.router={cfg.router!r}")
    # Options for imported families (moe.hf/); the Glm4Moe config this export writes has none of them.
    defaults = ModelConfig()
    for field in ("moe_layer_step", "dense_layers", "rope_fraction", "qkv_bias", "attn_out_bias", "qk_norm",
                  "qk_norm_after_rope", "nope_layers", "attention_chunk", "query_scale_beta", "sliding_window",
                  "attn_sinks", "expert_act", "expert_bias", "dual_sublayers",
                  "router_group_score", "shared_d_ff", "shared_expert_gate", "attention", "rope_interleave",
                  "rope_scaling_factor", "attn_output_gate", "norm_offset", "linear_layers"):
        if getattr(cfg, field) != getattr(defaults, field):
            out.append(f"model.{field}={getattr(cfg, field)!r}")
    return out


def check_exportable(cfg: ModelConfig) -> None:
    bad = unsupported_features(cfg)
    if bad:
        raise ExportError(f"cannot export to HuggingFace {architecture(cfg)}: {'; '.join(bad)} has no exact "
                          "equivalent there; use moe.hf.safetensors_io.save_safetensors for our own format instead")


def hf_config(cfg: ModelConfig, *, eos_token_id: int, pad_token_id: int, bos_token_id: int | None = None,
              dtype: str = "float32", max_position_embeddings: int = 4096, mtp_layers: int = 0) -> dict:
    """config.json for `glm4_moe` (or `deepseek_v3`, attention="mla"); every field that changes the math is
    written explicitly. mtp_layers: num_nextn_predict_layers, the MTP layers the weights hold."""
    check_exportable(cfg)
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"dtype {dtype!r} is not an export dtype; use one of {', '.join(EXPORT_DTYPES)}")
    if cfg.attention == "mla":
        return write_mla.hf_config(cfg, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                                         bos_token_id=bos_token_id, dtype=dtype,
                                         max_position_embeddings=max_position_embeddings, mtp_layers=mtp_layers)
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "intermediate_size": cfg.d_ff,
        "first_k_dense_replace": cfg.first_k_dense,
        "moe_intermediate_size": cfg.moe_d_ff,
        "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.top_k,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "num_nextn_predict_layers": mtp_layers,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": 1.0},
        # Top-level copies for transformers 4.x readers; 5.x folds them into rope_parameters / dtype.
        "rope_theta": cfg.rope_theta,
        "partial_rotary_factor": 1.0,
        "max_position_embeddings": max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_qk_norm": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def _cast(x, dtype: str) -> np.ndarray:
    # Via jnp so bfloat16 works (NumPy has no bf16; safetensors takes ml_dtypes arrays).
    return np.ascontiguousarray(np.asarray(jnp.asarray(x).astype(dtype)))


def hf_state_dict(model: Transformer, dtype: str = "float32", mtp: bool = True) -> dict[str, np.ndarray]:
    """HF tensor names -> arrays in torch Linear layout [out, in]; routed experts written one by one. mtp: the MTP
    modules as DeepSeek-V3 stores them, layer n_layers + k (else none: a plain HF model)."""
    cfg = model.cfg
    check_exportable(cfg)
    c = lambda x: _cast(np.asarray(x.get_value() if hasattr(x, "get_value") else x), dtype)
    sd = {"model.embed_tokens.weight": c(model.embed), "model.norm.weight": c(model.final_norm.scale)}
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = c(np.asarray(model.lm_head.get_value()).T)  # [D,V] -> [V,D]
    for i, block in enumerate(model.blocks):
        sd.update(_block_tensors(block, f"model.layers.{i}.", cfg, c, dtype))
    for k, module in enumerate(model.mtp if mtp and cfg.mtp_depth else []):
        p = f"model.layers.{cfg.n_layers + k}."
        sd[p + "enorm.weight"] = c(module.enorm.scale)
        sd[p + "hnorm.weight"] = c(module.hnorm.scale)
        sd[p + "eh_proj.weight"] = c(np.asarray(module.eh_proj.get_value()).T)  # [2D,D] -> [D,2D]: embedding first
        sd[p + "shared_head.norm.weight"] = c(module.head_norm.scale)
        sd[p + "embed_tokens.weight"] = sd["model.embed_tokens.weight"]  # the shared embedding and head, as
        sd[p + "shared_head.head.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])  # stored
        sd.update(_block_tensors(module.block, p, cfg, c, dtype))
    return sd


def _block_tensors(block, p: str, cfg: ModelConfig, c, dtype: str) -> dict[str, np.ndarray]:
    """One decoder layer's tensors under HF prefix p."""
    H, N, Dh, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
    sd, a = {}, block.attn
    sd[p + "input_layernorm.weight"] = c(block.attn_norm.scale)
    sd[p + "post_attention_layernorm.weight"] = c(block.ffn_norm.scale)
    if cfg.attention == "mla":
        sd.update({p + "self_attn." + k: v for k, v in write_mla.attention_tensors(a, cfg, c).items()})
    else:
        sd[p + "self_attn.q_proj.weight"] = c(np.asarray(a.wq.get_value()).reshape(D, H * Dh).T)
        sd[p + "self_attn.k_proj.weight"] = c(np.asarray(a.wk.get_value()).reshape(D, N * Dh).T)
        sd[p + "self_attn.v_proj.weight"] = c(np.asarray(a.wv.get_value()).reshape(D, N * Dh).T)
        sd[p + "self_attn.o_proj.weight"] = c(np.asarray(a.wo.get_value()).reshape(H * Dh, D).T)
    f = block.ffn
    if not block.is_moe:
        sd.update(_swiglu(p + "mlp.", f, c))
        return sd
    # HF keeps the router (and its bias) in fp32 whatever the model dtype (_keep_in_fp32_modules_strict):
    # deepseek_v3 exports write it so; glm4_moe exports write the weight in the export dtype, unchanged
    # (transformers upcasts it on load).
    router = np.asarray(f.router.get_value()).T  # [D,E] -> [E,D]
    sd[p + "mlp.gate.weight"] = _cast(router, "float32") if cfg.attention == "mla" else c(router)
    sd[p + "mlp.gate.e_score_correction_bias"] = _cast(f.bias.get_value(), "float32")
    wg, wu, wd = (np.asarray(w.get_value()) for w in (f.w_gate, f.w_up, f.w_down))
    for e in range(cfg.n_routed_experts):
        q = f"{p}mlp.experts.{e}."
        sd[q + "gate_proj.weight"] = c(wg[e].T)
        sd[q + "up_proj.weight"] = c(wu[e].T)
        sd[q + "down_proj.weight"] = c(wd[e].T)
    if f.shared is not None:
        sd.update(_swiglu(p + "mlp.shared_experts.", f.shared, c))
    else:  # HF always builds shared_experts, of width moe_intermediate_size * 0: zero-size weights.
        sd[p + "mlp.shared_experts.gate_proj.weight"] = _cast(np.zeros((0, D)), dtype)
        sd[p + "mlp.shared_experts.up_proj.weight"] = _cast(np.zeros((0, D)), dtype)
        sd[p + "mlp.shared_experts.down_proj.weight"] = _cast(np.zeros((D, 0)), dtype)
    return sd


def _swiglu(prefix, mlp, c):
    return {prefix + "gate_proj.weight": c(np.asarray(mlp.w_gate.get_value()).T),
            prefix + "up_proj.weight": c(np.asarray(mlp.w_up.get_value()).T),
            prefix + "down_proj.weight": c(np.asarray(mlp.w_down.get_value()).T)}


def write_weights(sd: dict[str, np.ndarray], out_dir: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
    """model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json (HF's names)."""
    shards, size = [[]], 0
    for name, arr in sd.items():  # insertion order keeps a layer's tensors together
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += arr.nbytes
    meta = {"format": "pt"}  # transformers refuses safetensors files without a known format tag
    if len(shards) == 1:
        save_file_readable(sd, os.path.join(out_dir, "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file_readable({n: sd[n] for n in names}, os.path.join(out_dir, fname), metadata=meta)
        files.append(fname)
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": sum(a.nbytes for a in sd.values())}, "weight_map": weight_map}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return [*files, "model.safetensors.index.json"]


def special_token_ids(tokenizer_json_path: str) -> dict[str, int]:
    """Ids of <|endoftext|> and <|pad|> in a HF tokenizers `tokenizer.json`."""
    if not os.path.isfile(tokenizer_json_path):
        raise ExportError(f"tokenizer {tokenizer_json_path}: not found; pass the tokenizer.json used in training")
    with open(tokenizer_json_path) as f:
        tok = json.load(f)
    vocab = dict((tok.get("model") or {}).get("vocab") or {})
    vocab.update({t["content"]: t["id"] for t in tok.get("added_tokens", [])})
    ids = {}
    for key, token in (("eos", EOS_TOKEN), ("pad", PAD_TOKEN)):
        if token not in vocab:
            raise ExportError(f"tokenizer {tokenizer_json_path}: special token {token} is missing; "
                              "train the tokenizer with it")
        ids[key] = vocab[token]
    return ids


def _write_json(out_dir, name, obj):
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_tokenizer(tokenizer_json_path: str, out_dir: str, model_max_length: int) -> dict[str, int]:
    ids = special_token_ids(tokenizer_json_path)
    shutil.copyfile(tokenizer_json_path, os.path.join(out_dir, "tokenizer.json"))
    # No BOS is prepended in training: <|endoftext|> separates documents, GPT-2 style (bos = eos).
    specials = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    _write_json(out_dir, "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", **specials, "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False})
    _write_json(out_dir, "special_tokens_map.json", specials)
    return ids


def model_card_text(cfg: ModelConfig, model_card: dict, dtype: str) -> str:
    counts = param_counts(cfg)
    info = dict(model_card)
    name = info.pop("name", "moe-lm")
    if cfg.attention == "mla":
        kind = "decoder-only MoE, multi-head latent attention, DeepSeek-V3 routing"
        attn = ("d_model / heads / q, kv latent / nope, rope, value head dims",
                f"{cfg.d_model} / {cfg.n_heads} / {cfg.q_lora_rank or 'none'}, {cfg.kv_lora_rank} / "
                f"{cfg.qk_nope_head_dim}, {cfg.qk_rope_head_dim}, {cfg.v_head_dim}")
    else:
        kind = "decoder-only MoE, DeepSeek-V3 routing"
        attn = ("d_model / heads / kv heads / head_dim", f"{cfg.d_model} / {cfg.n_heads} / {cfg.n_kv_heads} / "
                                                         f"{cfg.head_dim}")
    rows = [("Architecture", f"{architecture(cfg)} ({kind})"),
            ("Layers", f"{cfg.n_layers} ({cfg.n_layers - cfg.n_moe_layers} dense, {cfg.n_moe_layers} MoE)"),
            attn,
            ("Routed experts / top-k / shared", f"{cfg.n_routed_experts} / {cfg.top_k} / {cfg.n_shared_experts}"),
            ("Expert groups / groups kept", f"{cfg.n_group} / {cfg.topk_group}"),
            ("Expert width / dense FFN width", f"{cfg.moe_d_ff} / {cfg.d_ff}"),
            ("Vocabulary", str(cfg.vocab_size)),
            ("Tied embeddings", str(cfg.tie_embeddings)),
            ("Total parameters", f"{counts['total']:,}"),
            ("Active parameters per token", f"{counts['active']:,}"),
            ("Weights dtype", dtype)]
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags: [moe, jax, flax]",
             "---", "", f"# {name}", ""]
    if "description" in info:
        lines += [str(info.pop("description")), ""]
    lines += ["## Model", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
    if info:
        lines += ["## Training", "", "| | |", "|---|---|",
                  *(f"| {k.replace('_', ' ')} | {v} |" for k, v in info.items()), ""]
    lines += ["## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "tok = AutoTokenizer.from_pretrained(path)", "model = AutoModelForCausalLM.from_pretrained(path)",
              "```", "", "Exported from JAX/Flax NNX; logits match the original model (fp32).", ""]
    return "\n".join(lines)


def write_hf_checkpoint(model: Transformer, out_dir: str, tokenizer_json_path: str, dtype: str = "float32",
                        model_card: dict | None = None, *, max_position_embeddings: int = 4096,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, mtp: bool = True) -> list[str]:
    """Write a complete HF model directory; returns the file names written. Raises ExportError first if the
    model cannot be exported exactly (nothing is written then)."""
    cfg = model.cfg
    check_exportable(cfg)
    os.makedirs(out_dir, exist_ok=True)
    ids = write_tokenizer(tokenizer_json_path, out_dir, max_position_embeddings)
    config = hf_config(cfg, eos_token_id=ids["eos"], pad_token_id=ids["pad"], bos_token_id=ids["eos"],
                       dtype=dtype, max_position_embeddings=max_position_embeddings,
                       mtp_layers=cfg.mtp_depth if mtp else 0)
    _write_json(out_dir, "config.json", config)
    _write_json(out_dir, "generation_config.json", {
        "bos_token_id": ids["eos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]})
    files = write_weights(hf_state_dict(model, dtype, mtp), out_dir, max_shard_bytes)
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(model_card_text(cfg, model_card or {}, dtype))
    return ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "README.md", *files]
