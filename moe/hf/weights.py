"""HF tensor names ([out, in] Linear layouts) -> our flat variable names (moe.hf.safetensors_io layouts).

Shared by every family; a `Layout` says where a family keeps its MoE pieces. Attention is grouped-query
(q/k/v/o_proj) or multi-head latent (`_mla`, DeepSeek-V2/V3 and GLM-4.7-Flash). Routed experts are read in either
layout found in the wild: per expert (`experts.E.gate_proj.weight`, what the Hub stores and save_pretrained
writes) or fused (`experts.gate_up_proj` [E, 2F, D] + `experts.down_proj` [E, D, F], transformers 5.x in memory).
"""

import dataclasses
import hashlib
import math
import re

import numpy as np

from moe.config import ModelConfig
from moe.hf.common import HFImportError


@dataclasses.dataclass(frozen=True)
class Layout:
    moe: tuple[str, ...] = ("mlp",)  # module name(s) of the MoE block, first match wins (Mixtral: block_sparse_moe)
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per-expert gate / up / down names
    shared: str | None = None  # shared SwiGLU under the MoE block: "shared_experts" (GLM), "shared_expert" (Qwen2)
    shared_gate: str | None = None  # "shared_expert_gate" (Qwen2-MoE)
    routing_bias: str | None = None  # "gate.e_score_correction_bias" (GLM / DeepSeek-V3)
    # Where MTP layers would start (num_hidden_layers, when config.json has num_nextn_predict_layers): as many as
    # the weights hold become our MTP modules (mtp_depth); the rest of them are skipped, as HF's forward skips all.
    mtp_from: int | None = None


def mtp_depth(layout: Layout, names) -> int:
    """How many MTP layers the checkpoint holds (layer mtp_from + k with an eh_proj, k = 0, 1, ...)."""
    n = 0
    while layout.mtp_from is not None and f"model.layers.{layout.mtp_from + n}.eh_proj.weight" in names:
        n += 1
    return n


def our_tensors(cfg: ModelConfig, layout: Layout, sd: dict[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    """All our variables at once from HF tensors already in memory (`sd` is not changed)."""
    return dict(variables(cfg, layout, InMemory(sd), where))


class InMemory:
    """HF tensors already in memory, read as moe.hf.common.SafetensorsFiles reads them from disk."""

    def __init__(self, sd: dict[str, np.ndarray]):
        self._sd = dict(sd)
        self.shapes = {k: tuple(np.shape(v)) for k, v in sd.items()}

    def read(self, name: str) -> np.ndarray:
        return self._sd.pop(name)

    def release(self) -> None:
        pass


def variables(cfg: ModelConfig, layout: Layout, src, where: str):
    """(our variable name, contiguous fp32 array) for every variable of `cfg`, from the HF tensors of `src` (`shapes`:
    name -> shape, `read(name)`, `release()`: moe.hf.common.SafetensorsFiles or InMemory), a group at a time (a
    layer's norms and attention, each [E, ...] expert array, the rest of the layer): a group's tensors are read when
    it is reached, `src` is released, and its variables are handed out one by one and dropped here. A projection's or
    expert's shape is checked against the config from `shapes` before it is read; missing and left-over tensors are
    refused (HFImportError naming them)."""
    names = {k: v for k, v in src.shapes.items()
             if not k.endswith("rotary_emb.inv_freq") and not _dropped(layout, cfg.mtp_depth, k)}

    def shape(name):
        if name not in names:
            raise HFImportError(f"{where}: tensor {name!r} missing for the config in config.json")
        return names[name]

    def take(name):
        shape(name)
        del names[name]
        return src.read(name)

    def disagree(name, got, shape):
        raise HFImportError(f"{where}: tensor {name!r} is {list(got)}, the config in config.json needs "
                            f"{math.prod(shape)} numbers {list(shape)}; the config and the weights disagree")

    def shaped(name, *shape_, transpose=True):
        """HF's [out, in] tensor as our [in, ...] layout; a size the config does not predict names the tensor."""
        got = shape(name)[::-1] if transpose else shape(name)
        if math.prod(got) != math.prod(shape_):
            disagree(name, got, shape_)
        arr = take(name)
        return (arr.T if transpose else arr).reshape(shape_)

    def stacked(hf_names, *shape_):
        """[E, in, out] from E HF [out, in] tensors, filled one expert at a time."""
        out = np.empty((len(hf_names), *shape_), np.float32)
        for e, name in enumerate(hf_names):
            got = shape(name)[::-1]
            if got != shape_:
                disagree(name, got, shape_)
            out[e] = take(name).T
        return out

    def emit(out):
        src.release()
        while out:
            k = next(iter(out))
            yield k, np.ascontiguousarray(out.pop(k), np.float32)

    H, N, Dh, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
    out = {"embed": take("model.embed_tokens.weight"), "final_norm.scale": take("model.norm.weight")}
    if not cfg.tie_embeddings:
        out["lm_head"] = take("lm_head.weight").T
    else:
        names.pop("lm_head.weight", None)  # some tied checkpoints store the (identical) head too; HF ignores it

    def layer(p, q, i):
        """Block i from HF layer prefix p into our prefix q (a main block, or an MTP module's)."""
        out[q + "attn_norm.scale"] = take(p + "input_layernorm.weight")
        out[q + "ffn_norm.scale"] = take(p + "post_attention_layernorm.weight")
        a = p + "self_attn."
        if cfg.attention == "mla":
            out.update(_mla(cfg, a, q + "attn.", take, shaped))
        else:
            out[q + "attn.wq"] = shaped(a + "q_proj.weight", D, H, Dh)
            out[q + "attn.wk"] = shaped(a + "k_proj.weight", D, N, Dh)
            out[q + "attn.wv"] = shaped(a + "v_proj.weight", D, N, Dh)
            out[q + "attn.wo"] = shaped(a + "o_proj.weight", H, Dh, D)
        if cfg.qkv_bias:
            out[q + "attn.bq"] = shaped(a + "q_proj.bias", H, Dh, transpose=False)
            out[q + "attn.bk"] = shaped(a + "k_proj.bias", N, Dh, transpose=False)
            out[q + "attn.bv"] = shaped(a + "v_proj.bias", N, Dh, transpose=False)
        if cfg.attn_out_bias:
            out[q + "attn.bo"] = take(a + "o_proj.bias")
        if cfg.qk_norm != "none":
            out[q + "attn.q_norm.scale"] = take(a + "q_norm.weight")
            out[q + "attn.k_norm.scale"] = take(a + "k_norm.weight")
        if not cfg.is_moe_layer(i):
            for w in ("gate", "up", "down"):
                out[f"{q}ffn.w_{w}"] = take(f"{p}mlp.{w}_proj.weight").T
            yield from emit(out)
            return
        m = p + next((name for name in layout.moe if p + name + ".gate.weight" in names), layout.moe[0]) + "."
        out[q + "ffn.router"] = take(m + "gate.weight").T
        bias = take(m + layout.routing_bias) if layout.routing_bias else np.zeros(cfg.n_routed_experts)
        out[q + "ffn.bias"] = bias
        yield from emit(out)
        for k, make in _experts(cfg, layout, m, q, names, shape, take, stacked, where).items():
            out[k] = make()  # one [E, ...] array at a time: handed out before the next is read
            yield from emit(out)
        if layout.shared:
            shared = {w: take(f"{m}{layout.shared}.{w}_proj.weight").T for w in ("gate", "up", "down")}
            if cfg.n_shared_experts:  # else HF's zero-width shared MLP (GLM with n_shared_experts 0): dropped
                out.update({f"{q}ffn.shared.w_{w}": v for w, v in shared.items()})
            del shared
        if cfg.shared_expert_gate:
            out[q + "ffn.shared_gate"] = shaped(f"{m}{layout.shared_gate}.weight", D, transpose=False)
        yield from emit(out)
    digests = {"model.embed_tokens.weight": _digest(out["embed"]),  # what MTP layers' copies must equal
               "lm_head.weight": _digest(out["embed"] if cfg.tie_embeddings else out["lm_head"].T)} \
        if cfg.mtp_depth else {}
    yield from emit(out)
    for i in range(cfg.n_layers):
        yield from layer(f"model.layers.{i}.", f"blocks.{i}.", i)
    for k in range(cfg.mtp_depth):  # DeepSeek-V3's MTP layer k: our mtp[k] (moe/mtp.py)
        p, q = f"model.layers.{cfg.n_layers + k}.", f"mtp.{k}."
        out[q + "enorm.scale"] = take(p + "enorm.weight")
        out[q + "hnorm.scale"] = take(p + "hnorm.weight")
        out[q + "eh_proj"] = shaped(p + "eh_proj.weight", 2 * D, D)
        out[q + "head_norm.scale"] = take(p + "shared_head.norm.weight")
        # the module's copies of the embedding and head: ours shares the main model's, so they must be equal
        for name, main in ((p + "embed_tokens.weight", "model.embed_tokens.weight"),
                           (p + "shared_head.head.weight", "lm_head.weight")):
            if name in names and _digest(take(name)) != digests[main]:
                raise HFImportError(f"{where}: tensor {name!r} differs from {main!r}; our MTP modules share the "
                                    "main model's embedding and head (as DeepSeek-V3 trains them)")
        yield from emit(out)
        yield from layer(p, q + "block.", cfg.n_layers + k)
    if names:
        raise HFImportError(f"{where}: unexpected tensor(s) {', '.join(sorted(names)[:4])} for the config in "
                            "config.json (a feature this importer does not know)")


def _mla(cfg, a, q, take, shaped):
    """Multi-head latent attention (DeepseekV2/V3Attention): the mapping moe/mla.py's docstring lists. Per head
    the query is [nope | rope] and kv_b's output [k_nope | v], as transformers splits them."""
    D, H, Q, R = cfg.d_model, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    Dn, Dr, Dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    out = {q + "wkv_a": shaped(a + "kv_a_proj_with_mqa.weight", D, R + Dr),
           q + "kv_norm.scale": take(a + "kv_a_layernorm.weight"),
           q + "wkv_b": shaped(a + "kv_b_proj.weight", R, H, Dn + Dv),
           q + "wo": shaped(a + "o_proj.weight", H, Dv, D)}
    if Q:
        out[q + "wq_a"] = shaped(a + "q_a_proj.weight", D, Q)
        out[q + "q_norm.scale"] = take(a + "q_a_layernorm.weight")
        out[q + "wq_b"] = shaped(a + "q_b_proj.weight", Q, H, Dn + Dr)
    else:
        out[q + "wq"] = shaped(a + "q_proj.weight", D, H, Dn + Dr)
    return out


def _dropped(layout: Layout, imported: int, name: str) -> bool:
    """An MTP layer past the `imported` ones (HF's forward runs none of them)."""
    if layout.mtp_from is None:
        return False
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return m is not None and int(m.group(1)) >= layout.mtp_from + imported


def _digest(arr) -> bytes:
    """A fingerprint of a tensor's values: MTP layers store copies of the embedding and head, compared by it (the
    streaming import does not keep the originals)."""
    return hashlib.blake2b(np.ascontiguousarray(arr, np.float32).tobytes(), digest_size=16).digest()


def _experts(cfg, layout, m, q, names, shape, take, stacked, where):
    """Routed experts [E, D, F] / [E, F, D] from the per-expert or the fused layout: name -> a function reading it."""
    E, F, D = cfg.n_routed_experts, cfg.moe_d_ff, cfg.d_model
    gate, up, down = layout.experts
    if m + f"experts.0.{gate}.weight" in names:
        return {f"{q}ffn.w_gate": lambda: stacked([f"{m}experts.{e}.{gate}.weight" for e in range(E)], D, F),
                f"{q}ffn.w_up": lambda: stacked([f"{m}experts.{e}.{up}.weight" for e in range(E)], D, F),
                f"{q}ffn.w_down": lambda: stacked([f"{m}experts.{e}.{down}.weight" for e in range(E)], F, D)}
    gate_up, w_down = shape(m + "experts.gate_up_proj"), shape(m + "experts.down_proj")
    if gate_up != (E, 2 * F, D) or w_down != (E, D, F):
        raise HFImportError(f"{where}: fused experts {m}experts.* are {list(gate_up)} / {list(w_down)}, "
                            f"expected [{E}, {2 * F}, {D}] / [{E}, {D}, {F}]")
    gate_up = take(m + "experts.gate_up_proj")
    return {f"{q}ffn.w_gate": lambda: gate_up[:, :F].transpose(0, 2, 1),
            f"{q}ffn.w_up": lambda: gate_up[:, F:].transpose(0, 2, 1),
            f"{q}ffn.w_down": lambda: take(m + "experts.down_proj").transpose(0, 2, 1)}
