"""HF tensor names ([out, in] Linear layouts) -> our flat variable names (moe.hf.safetensors_io layouts).

Shared by every family; a `Layout` says where a family keeps its MoE pieces. Attention is grouped-query
(q/k/v/o_proj) or multi-head latent (`_mla`, DeepSeek-V2/V3 and GLM-4.7-Flash). Routed experts are read in either
layout found in the wild: per expert (`experts.E.gate_proj.weight`, what the Hub stores and save_pretrained
writes) or fused (`experts.gate_up_proj` [E, 2F, D] + `experts.down_proj` [E, D, F], transformers 5.x in memory).

`plan` is the one mapping: each variable as a `moe.hf.pieces.Piece` of HF tensors, checked against the config from
the tensors' names and shapes alone. `variables` reads it whole, a step at a time (the import); the layer-streamed
forward (moe/hf/stream.py) reads one block's steps at a time, and the sharded import (moe/hf/sharded.py) each
device's slice of every piece.
"""

import dataclasses
import hashlib
import re

import ml_dtypes
import numpy as np

from moe.config import ModelConfig
from moe.hf.common import HFImportError
from moe.hf.pieces import Piece


@dataclasses.dataclass(frozen=True)
class Layout:
    moe: tuple[str, ...] = ("mlp",)  # module name(s) of the MoE block, first match wins (Mixtral: block_sparse_moe)
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per-expert gate / up / down names
    shared: str | None = None  # shared SwiGLU under the MoE block: "shared_experts" (GLM), "shared_expert" (Qwen2)
    shared_gate: str | None = None  # "shared_expert_gate" (Qwen2-MoE)
    routing_bias: str | None = None  # "gate.e_score_correction_bias" (GLM / DeepSeek-V3); [E] or [1, E] (ERNIE)
    router: str = "gate.weight"  # the router weight under the MoE block (Hunyuan: gate.wg.weight)
    qk_norms: tuple[str, str] = ("q_norm", "k_norm")  # under self_attn (Hunyuan: query_layernorm, key_layernorm)
    ignored: tuple[str, ...] = ()  # name prefixes transformers' forward never reads (ERNIE's model.mtp_*)
    dense: str = "mlp"  # the dense SwiGLU's module (Llama 4: feed_forward)
    experts_in_out: bool = False  # fused experts stored [E, D, 2F] ([gate | up] columns) and [E, F, D] (Llama 4)
    interleaved: bool = False  # ... with gate and up in alternate columns, gate first (gpt-oss)
    router_bias: str = "router.bias"  # the router's logit bias under the MoE block (model.router_logit_bias)
    # Where MTP layers would start (num_hidden_layers, when config.json has num_nextn_predict_layers): as many as
    # the weights hold become our MTP modules (mtp_depth); the rest of them are skipped, as HF's forward skips all.
    mtp_from: int | None = None


def mtp_depth(layout: Layout, names) -> int:
    """How many MTP layers the checkpoint holds (layer mtp_from + k with an eh_proj, k = 0, 1, ...)."""
    n = 0
    while layout.mtp_from is not None and f"model.layers.{layout.mtp_from + n}.eh_proj.weight" in names:
        n += 1
    return n


LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_layers(n_layers: int, layout: Layout, names, where: str) -> None:
    """The weights hold decoder layers 0 .. n_layers - 1 (config.json's num_hidden_layers), and after them only MTP
    layers (an eh_proj each, when the family reads num_nextn_predict_layers): else HFImportError naming a tensor.
    From the names alone, before any shape is built: a config claiming 2,000 layers over 3 is refused at once, and
    one claiming fewer layers than stored never loads a truncated model."""
    stored = {}
    for k in names:
        m = None if k.startswith(layout.ignored) else LAYER.match(k)
        if m:
            stored.setdefault(int(m.group(1)), k)
    mtp = mtp_depth(layout, names)
    holds = f"the weights hold model.layers.0-{max(stored)}" if stored else "the weights hold no model.layers"
    n_mtp = sum(f"model.layers.{i}.eh_proj.weight" in names for i in stored)
    holds += f", {n_mtp} of them MTP layers (eh_proj)" if n_mtp else ""
    extra = sorted(i for i in stored if i >= n_layers + mtp)
    if extra:
        hint = "" if layout.mtp_from is not None or not n_mtp else " (MTP layers need num_nextn_predict_layers)"
        raise HFImportError(f"{where}: unexpected tensor(s) {stored[extra[0]]!r} ...: num_hidden_layers is "
                            f"{n_layers} but {holds}{hint}; the config and the weights disagree")
    if sum(i < n_layers for i in stored) != n_layers:
        first = next(i for i in range(n_layers) if i not in stored)
        raise HFImportError(f"{where}: tensor(s) of model.layers.{first} missing: num_hidden_layers is {n_layers} "
                            f"but {holds}; the config and the weights disagree")


def untie_as_transformers(cfg: ModelConfig, src) -> ModelConfig:
    """tie_word_embeddings true, and the checkpoint stores an lm_head.weight that differs from the embedding:
    transformers 5.x then does not tie them (modeling_utils `tie_weights`: "both are present in the checkpoints
    with different values, so we will NOT tie them") and uses the stored head; so do we (tie_embeddings False).
    Identical copies stay tied."""
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    if not cfg.tie_embeddings or head not in src.shapes or embed not in src.shapes:
        return cfg
    if src.shapes[head] == src.shapes[embed] and np.array_equal(src.read(head), src.read(embed)):
        return cfg  # transformers' test: torch.equal
    return dataclasses.replace(cfg, tie_embeddings=False)


def our_tensors(cfg: ModelConfig, layout: Layout, sd: dict[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    """All our variables at once from HF tensors already in memory (`sd` is not changed)."""
    return dict(variables(cfg, layout, InMemory(sd), where))


class InMemory:
    """HF tensors already in memory, read as moe.hf.tensors.SafetensorsFiles reads them from disk."""

    def __init__(self, sd: dict[str, np.ndarray]):
        self._sd = dict(sd)
        self.shapes = {k: tuple(np.shape(v)) for k, v in sd.items()}

    def read(self, name: str) -> np.ndarray:
        return self._sd[name]

    def read_block(self, name: str, index) -> np.ndarray:
        return self._sd[name][tuple(index)]

    def release(self) -> None:
        pass


@dataclasses.dataclass
class Step:
    """Variables read together (a layer's norms and attention; one [E, ...] expert array; the rest of the layer):
    our variable name -> the Piece it is read from, and what the step's HF tensors must equal."""

    group: str  # "ends" (embedding, final norm, head), "blocks.i", "mtp.k" (the MTP module, its block included)
    pieces: dict[str, Piece]
    # MTP layers' copies of the embedding and head: (HF tensor, the main HF tensor it must equal)
    copies: tuple[tuple[str, str], ...] = ()
    tied_head: str | None = None  # tie_word_embeddings with a stored head: the HF head that must equal the embedding


def plan(cfg: ModelConfig, layout: Layout, shapes: dict, where: str) -> list[Step]:
    """Where every variable of `cfg` comes from, in the order the import reads them, from the HF tensors' names and
    shapes alone (nothing is read): every tensor's full HF shape ([out, in] for a Linear weight) is checked against
    the config, the layer count first (check_layers); missing and left-over tensors are refused (HFImportError
    naming them). The one mapping: the import (`variables`), the layer-streamed forward (moe/hf/stream.py) and the
    sharded import (moe/hf/sharded.py) all read through it."""
    check_layers(cfg.n_layers, layout, shapes, where)
    names = {k: tuple(v) for k, v in shapes.items()
             if not k.endswith("rotary_emb.inv_freq") and not _dropped(layout, cfg.mtp_depth, k)
             and not k.startswith(layout.ignored)}

    def check(name, hf_shape):
        """Consume the HF tensor `name`, refused unless it is exactly `hf_shape`."""
        if name not in names:
            raise HFImportError(f"{where}: tensor {name!r} missing for the config in config.json")
        if names[name] != hf_shape:
            raise HFImportError(f"{where}: tensor {name!r} is {list(names[name])}, the config in config.json needs "
                                f"{list(hf_shape)}; the config and the weights disagree")
        del names[name]

    def take(name, *hf_shape, shape=None):
        """The HF tensor `name` as it is (reshaped to `shape`)."""
        check(name, hf_shape)
        return Piece((name,), hf_shape, shape or hf_shape)

    def linear(name, n_out, n_in, *ours):
        """HF's Linear weight [n_out, n_in] as our [in ..., out ...] layout `ours` (same numbers, transposed)."""
        check(name, (n_out, n_in))
        return Piece((name,), (n_out, n_in), ours, perm=(1, 0))

    def stacked(hf_names, n_in, n_out):
        """[E, in, out] from E HF [out, in] tensors (read one expert at a time)."""
        for name in hf_names:
            check(name, (n_out, n_in))
        return Piece(tuple(hf_names), (len(hf_names), n_out, n_in), (len(hf_names), n_in, n_out), perm=(0, 2, 1),
                     stacked=True)

    H, N, Dh, D, V = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model, cfg.vocab_size
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    if cfg.tie_embeddings and embed not in names and head in names:
        embed = head  # transformers ties symmetrically: a tied checkpoint storing only the head loads it as both
    ends = Step("ends", {"embed": take(embed, V, D), "final_norm.scale": take("model.norm.weight", D)})
    if not cfg.tie_embeddings:
        ends.pieces["lm_head"] = linear(head, V, D, D, V)
    elif head in names:
        check(head, (V, D))
        ends.tied_head = head
    steps = [ends]

    def layer(p, q, i, group):
        """Block i from HF layer prefix p into our prefix q (a main block, or an MTP module's)."""
        a = p + "self_attn."
        out = {} if cfg.dual_sublayers else {q + "attn_norm.scale": take(p + "input_layernorm.weight", D),
                                             q + "ffn_norm.scale": take(p + "post_attention_layernorm.weight", D)}
        if cfg.dual_sublayers:  # LongCat-Flash: norms, MLA and dense SwiGLU in pairs, then the MoE below
            for j in range(2):
                out[f"{q}attn_norm.{j}.scale"] = take(f"{p}input_layernorm.{j}.weight", D)
                out[f"{q}ffn_norm.{j}.scale"] = take(f"{p}post_attention_layernorm.{j}.weight", D)
                out.update(_mla(cfg, f"{a}{j}.", f"{q}attn.{j}.", take, linear))
                for w, n_out, n_in in (("gate", cfg.d_ff, D), ("up", cfg.d_ff, D), ("down", D, cfg.d_ff)):
                    out[f"{q}mlp.{j}.w_{w}"] = linear(f"{p}mlps.{j}.{w}_proj.weight", n_out, n_in, n_in, n_out)
        elif cfg.attention == "mla":
            out.update(_mla(cfg, a, q + "attn.", take, linear))
        elif i in cfg.linear_layer_ids:
            out.update(_gdn(cfg, p + "linear_attn.", q + "attn.", take, linear))
        else:
            Dq = 2 * Dh if cfg.attn_output_gate else Dh  # Qwen3-Next: each head's rows [q | gate]
            out[q + "attn.wq"] = linear(a + "q_proj.weight", H * Dq, D, D, H, Dq)
            out[q + "attn.wk"] = linear(a + "k_proj.weight", N * Dh, D, D, N, Dh)
            out[q + "attn.wv"] = linear(a + "v_proj.weight", N * Dh, D, D, N, Dh)
            out[q + "attn.wo"] = linear(a + "o_proj.weight", D, H * Dh, H, Dh, D)
        if cfg.qkv_bias and i not in cfg.linear_layer_ids:
            Dq = 2 * Dh if cfg.attn_output_gate else Dh
            out[q + "attn.bq"] = take(a + "q_proj.bias", H * Dq, shape=(H, Dq))
            out[q + "attn.bk"] = take(a + "k_proj.bias", N * Dh, shape=(N, Dh))
            out[q + "attn.bv"] = take(a + "v_proj.bias", N * Dh, shape=(N, Dh))
        if cfg.attn_out_bias and i not in cfg.linear_layer_ids:
            out[q + "attn.bo"] = take(a + "o_proj.bias", D)
        if cfg.attn_sinks:
            out[q + "attn.sinks"] = take(a + "sinks", H)
        if cfg.qk_norm in ("head", "full") and i not in cfg.linear_layer_ids:  # ("weightless": Llama 4's)
            whole = cfg.qk_norm == "full"  # OLMoE: one norm over all heads' q (k)
            qn, kn = layout.qk_norms
            out[q + "attn.q_norm.scale"] = take(f"{a}{qn}.weight", H * Dh if whole else Dh)
            out[q + "attn.k_norm.scale"] = take(f"{a}{kn}.weight", N * Dh if whole else Dh)
        if not cfg.is_moe_layer(i):
            F = cfg.d_ff
            for w, n_out, n_in in (("gate", F, D), ("up", F, D), ("down", D, F)):
                out[f"{q}ffn.w_{w}"] = linear(f"{p}{layout.dense}.{w}_proj.weight", n_out, n_in, n_in, n_out)
            steps.append(Step(group, out))
            return
        Ec = cfg.n_candidates  # the router's outputs: routed experts, then zero experts (LongCat-Flash)
        m = p + next((name for name in layout.moe if f"{p}{name}.{layout.router}" in names), layout.moe[0]) + "."
        out[q + "ffn.router"] = linear(m + layout.router, Ec, D, D, Ec)
        bias = m + (layout.routing_bias or "")
        stored = (1, Ec) if names.get(bias) == (1, Ec) else (Ec,)  # ERNIE stores [1, E]
        out[q + "ffn.bias"] = take(bias, *stored, shape=(Ec,)) if layout.routing_bias else Piece((), (Ec,), (Ec,))
        if cfg.router_logit_bias:
            out[q + "ffn.logit_bias"] = take(m + layout.router_bias, Ec)
        steps.append(Step(group, out))
        for k, piece in _experts(cfg, layout, m, q, names, check, stacked).items():
            steps.append(Step(group, {k: piece}))  # one [E, ...] array at a time
        out = {}
        if layout.shared:
            S = cfg.shared_width
            shared = {w: linear(f"{m}{layout.shared}.{w}_proj.weight", n_out, n_in, n_in, n_out)
                      for w, n_out, n_in in (("gate", S, D), ("up", S, D), ("down", D, S))}
            if cfg.n_shared_experts:  # else HF's zero-width shared MLP (GLM with n_shared_experts 0): dropped
                out.update({f"{q}ffn.shared.w_{w}": v for w, v in shared.items()})
        if cfg.shared_expert_gate:
            out[q + "ffn.shared_gate"] = take(f"{m}{layout.shared_gate}.weight", 1, D, shape=(D,))
        if out:
            steps.append(Step(group, out))

    for i in range(cfg.n_layers):
        layer(f"model.layers.{i}.", f"blocks.{i}.", i, f"blocks.{i}")
    for k in range(cfg.mtp_depth):  # DeepSeek-V3's MTP layer k: our mtp[k] (moe/mtp.py)
        p, q = f"model.layers.{cfg.n_layers + k}.", f"mtp.{k}."
        step = Step(f"mtp.{k}", {q + "enorm.scale": take(p + "enorm.weight", D),
                                 q + "hnorm.scale": take(p + "hnorm.weight", D),
                                 q + "eh_proj": linear(p + "eh_proj.weight", D, 2 * D, 2 * D, D),
                                 q + "head_norm.scale": take(p + "shared_head.norm.weight", D)})
        # the module's copies of the embedding and head: ours shares the main model's, so they must be equal
        copies = [(name, main) for name, main in ((p + "embed_tokens.weight", "model.embed_tokens.weight"),
                                                  (p + "shared_head.head.weight", "lm_head.weight")) if name in names]
        for name, _ in copies:
            check(name, (V, D))
        step.copies = tuple(copies)
        steps.append(step)
        layer(p, q + "block.", cfg.n_layers + k, f"mtp.{k}")
    if names:
        raise HFImportError(f"{where}: unexpected tensor(s) {', '.join(sorted(names)[:4])} for the config in "
                            "config.json (a feature this importer does not know)")
    return steps


def variables(cfg: ModelConfig, layout: Layout, src, where: str):
    """(our variable name, contiguous array) for every variable of `cfg`, from the HF tensors of `src` (`shapes`:
    name -> shape, `read(name)`, `read_block(name, index)`, `release()`: moe.hf.tensors.SafetensorsFiles or
    InMemory), a Step of `plan` at a time (a layer's norms and attention, each [E, ...] expert array, the rest of
    the layer): a step's tensors are read when it is reached, `src` is released, and its variables are handed out
    one by one and dropped here. Arrays are fp32, or with `src.keep_dtype` BF16 / F16 as stored (FP8 is
    dequantized to fp32). Every check of `plan` comes first, before anything is read."""
    keep = getattr(src, "keep_dtype", False)
    digests = {}  # what the MTP layers' copies of the embedding and head must equal
    for step in plan(cfg, layout, src.shapes, where):
        out = read_step(step, src, where)
        if step.group == "ends" and cfg.mtp_depth:
            digests = {"model.embed_tokens.weight": _digest(out["embed"]),
                       "lm_head.weight": _digest(out["embed"] if cfg.tie_embeddings else out["lm_head"].T)}
        for name, main in step.copies:
            if _digest(src.read(name)) != digests[main]:
                raise HFImportError(f"{where}: tensor {name!r} differs from {main!r}; our MTP modules share the "
                                    "main model's embedding and head (as DeepSeek-V3 trains them)")
        src.release()
        while out:
            k = next(iter(out))
            yield k, held(out.pop(k), keep)


def read_step(step: Step, src, where: str) -> dict:
    """The step's variables read whole from `src` (its tied head checked against the embedding)."""
    out = {k: piece.read(src) for k, piece in step.pieces.items()}
    if step.tied_head and not np.array_equal(src.read(step.tied_head), out["embed"]):
        raise HFImportError(f"{where}: tie_word_embeddings is true but tensor {step.tied_head!r} differs from "
                            f"{step.pieces['embed'].names[0]!r}; transformers then uses the stored head "
                            "(moe.hf.load_model does too): set tie_word_embeddings to false")
    return out


KEPT_DTYPES = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


def held(arr, keep: bool = False) -> np.ndarray:
    """A variable as the model holds it: contiguous fp32, or with `keep` BF16 / F16 as stored (each exact in fp32,
    what the computation casts them to)."""
    return np.ascontiguousarray(arr, arr.dtype if keep and arr.dtype in KEPT_DTYPES else np.float32)


def _mla(cfg, a, q, take, linear):
    """Multi-head latent attention (DeepseekV2/V3Attention): the mapping moe/mla.py's docstring lists. Per head
    the query is [nope | rope] and kv_b's output [k_nope | v], as transformers splits them."""
    D, H, Q, R = cfg.d_model, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    Dn, Dr, Dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    out = {q + "wkv_a": linear(a + "kv_a_proj_with_mqa.weight", R + Dr, D, D, R + Dr),
           q + "kv_norm.scale": take(a + "kv_a_layernorm.weight", R),
           q + "wkv_b": linear(a + "kv_b_proj.weight", H * (Dn + Dv), R, R, H, Dn + Dv),
           q + "wo": linear(a + "o_proj.weight", D, H * Dv, H, Dv, D)}
    if Q:
        out[q + "wq_a"] = linear(a + "q_a_proj.weight", Q, D, D, Q)
        out[q + "q_norm.scale"] = take(a + "q_a_layernorm.weight", Q)
        out[q + "wq_b"] = linear(a + "q_b_proj.weight", H * (Dn + Dr), Q, Q, H, Dn + Dr)
    else:
        out[q + "wq"] = linear(a + "q_proj.weight", H * (Dn + Dr), D, D, H, Dn + Dr)
    return out


def _gdn(cfg, a, q, take, linear):
    """Gated DeltaNet (Qwen3NextGatedDeltaNet, moe/gdn.py): the projections keep HF's grouping by key head, the
    conv weight [C, 1, K] its channel order [q | k | v]."""
    D, Hk, Hv, Dk, Dv = cfg.d_model, cfg.gdn_key_heads, cfg.gdn_value_heads, cfg.gdn_key_dim, cfg.gdn_value_dim
    r, C, K = Hv // Hk, 2 * Hk * Dk + Hv * Dv, cfg.gdn_conv_kernel
    return {q + "w_qkvz": linear(a + "in_proj_qkvz.weight", Hk * (2 * Dk + 2 * r * Dv), D, D, Hk, 2 * Dk + 2 * r * Dv),
            q + "w_ba": linear(a + "in_proj_ba.weight", 2 * Hv, D, D, Hk, 2 * r),
            q + "conv": take(a + "conv1d.weight", C, 1, K, shape=(C, K)),
            q + "dt_bias": take(a + "dt_bias", Hv), q + "A_log": take(a + "A_log", Hv),
            q + "out_norm": take(a + "norm.weight", Dv),
            q + "wo": linear(a + "out_proj.weight", D, Hv * Dv, Hv, Dv, D)}


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


def _experts(cfg, layout, m, q, names, check, stacked):
    """Routed experts [E, D, F] / [E, F, D] from the per-expert or the fused layout: our name -> its Piece."""
    E, F, D = cfg.n_routed_experts, cfg.moe_d_ff, cfg.d_model
    gate, up, down = layout.experts
    if m + f"experts.0.{gate}.weight" in names:
        return {f"{q}ffn.w_gate": stacked([f"{m}experts.{e}.{gate}.weight" for e in range(E)], D, F),
                f"{q}ffn.w_up": stacked([f"{m}experts.{e}.{up}.weight" for e in range(E)], D, F),
                f"{q}ffn.w_down": stacked([f"{m}experts.{e}.{down}.weight" for e in range(E)], F, D)}
    gate_up, down_proj = m + "experts.gate_up_proj", m + "experts.down_proj"
    if layout.experts_in_out:  # already our [E, in, out] layout, gate and up side by side (or alternating)
        check(gate_up, (E, D, 2 * F))
        check(down_proj, (E, F, D))
        up, step = (1, 2) if layout.interleaved else (F, 1)
        out = {f"{q}ffn.w_gate": Piece((gate_up,), (E, D, F), (E, D, F), step=step),
               f"{q}ffn.w_up": Piece((gate_up,), (E, D, F), (E, D, F), cols=up, step=step),
               f"{q}ffn.w_down": Piece((down_proj,), (E, F, D), (E, F, D))}
        if cfg.expert_bias:  # gpt-oss: [E, 2F] laid out as the columns above, and [E, D]
            check(gate_up + "_bias", (E, 2 * F))
            check(down_proj + "_bias", (E, D))
            out.update({f"{q}ffn.b_gate": Piece((gate_up + "_bias",), (E, F), (E, F), step=step),
                        f"{q}ffn.b_up": Piece((gate_up + "_bias",), (E, F), (E, F), cols=up, step=step),
                        f"{q}ffn.b_down": Piece((down_proj + "_bias",), (E, D), (E, D))})
        return out
    check(gate_up, (E, 2 * F, D))
    check(down_proj, (E, D, F))
    return {f"{q}ffn.w_gate": Piece((gate_up,), (E, F, D), (E, D, F), perm=(0, 2, 1)),
            f"{q}ffn.w_up": Piece((gate_up,), (E, F, D), (E, D, F), perm=(0, 2, 1), rows=F),
            f"{q}ffn.w_down": Piece((down_proj,), (E, D, F), (E, F, D), perm=(0, 2, 1))}
