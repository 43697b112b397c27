"""From an ml_collections config to what the code uses: moe.ModelConfig (architecture), moe.Execution (how it runs,
given the mesh), checked train/mesh/data values.

`check(config)` runs before anything is written: every key must be one configs/base.py defines, have that
key's type (a bool is not an int, an int is a valid float), be finite, and lie in the range below.
"""

import dataclasses
import json
import math
import os

import ml_collections

from configs.base import base_config
from moe import ConfigError, Execution, ModelConfig, param_counts
from moe.attention import causal_blocks
from moe.dispatch.execution import DISPATCH_MODES, DROPPING_DISPATCH, check_model, check_tokens
from moe.nn import chunk_count
from plumbing.errors import UserError
from rundir.config_layout import ADDED_KEYS, RESOLVED_FIELDS, RESOLVED_KEY
from train.cli import all_keys, unknown_key_error

POSITIVE, NON_NEGATIVE = (">", 0), (">=", 0)

# key -> (check, bound or choices) for every non-model key; model.* is checked by moe.ModelConfig.
RANGES = {
    "train.steps": POSITIVE, "train.seed": NON_NEGATIVE, "train.batch_size": POSITIVE,
    "train.grad_accum": POSITIVE, "train.lr": POSITIVE, "train.min_lr_ratio": ("[]", (0, 1)),
    "train.warmup_steps": NON_NEGATIVE, "train.schedule": ("in", ("cosine", "wsd")),
    "train.decay_frac": ("(]", (0, 1)), "train.weight_decay": NON_NEGATIVE, "train.b1": ("[)", (0, 1)),
    "train.b2": ("[)", (0, 1)), "train.eps": POSITIVE, "train.grad_clip": POSITIVE,
    "train.bias_update_rate": NON_NEGATIVE, "train.bias_update_stop": ("[]", (0, 1)),
    "data.name": ("nonempty", None), "data.split": ("nonempty", None), "data.eval_split": ("nonempty", None),
    "data.text_field": ("nonempty", None), "data.seq_len": (">", 1), "data.task": ("in", ("lm", "prefix", "mlm")),
    "data.prefix_frac": ("()", (0, 1)),
    "checkpoint.every": POSITIVE, "checkpoint.keep": POSITIVE, "log.every": POSITIVE,
    "log.peak_flops": NON_NEGATIVE, "eval.every": POSITIVE, "eval.rows_per_domain": POSITIVE,
    "eval.batch_size": POSITIVE, "eval.dispatch": ("in", ("",) + DISPATCH_MODES),
    "train.balance_loss_weight": NON_NEGATIVE, "train.mtp_weight": NON_NEGATIVE, "train.mtp_weight_late": NON_NEGATIVE,
    "train.mtp_weight_switch": ("[]", (0, 1)),
}


def _type_error(key, value, default):
    kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[type(default)]
    return UserError(f"config key {key} must be {kind}, got {value!r} ({type(value).__name__})")


def check_types(c: ml_collections.ConfigDict) -> None:
    defaults = all_keys(base_config())
    for key, value in all_keys(c).items():
        if key not in defaults:
            raise unknown_key_error(key, defaults, " in the config")
        default = defaults[key]
        ok = (isinstance(value, bool) if isinstance(default, bool)
              else isinstance(value, int) and not isinstance(value, bool) if isinstance(default, int)
              else isinstance(value, (int, float)) and not isinstance(value, bool) if isinstance(default, float)
              else isinstance(value, type(default)))
        if not ok:
            raise _type_error(key, value, default)
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"config key {key} must be a finite number, got {value}")


def check_ranges(c: ml_collections.ConfigDict) -> None:
    values = all_keys(c)
    for key, (op, bound) in RANGES.items():
        v = values[key]
        bad = not _within(op, bound, v)
        if bad:
            want = _describe(op, bound)
            raise UserError(f"config key {key} must be {want}, got {v!r}")
    for key in ("data", "fsdp", "expert", "tensor"):
        if values[f"mesh.{key}"] == 0 or values[f"mesh.{key}"] < -1:
            raise UserError(f"mesh.{key} must be a positive integer or -1 (the remaining devices), "
                            f"got {values[f'mesh.{key}']}")


def _within(op, bound, v) -> bool:
    if op == ">":
        return v > bound
    if op == ">=":
        return v >= bound
    if op == "in":
        return v in bound
    if op == "nonempty":
        return bool(str(v).strip())
    lo, hi = bound
    return (lo <= v if op[0] == "[" else lo < v) and (v <= hi if op[1] == "]" else v < hi)


def _describe(op, bound) -> str:
    if op in (">", ">="):
        return f"{op} {bound}"
    if op == "in":
        return "one of " + ", ".join(repr(b) if b == "" else b for b in bound)
    if op == "nonempty":
        return "a non-empty string"
    return f"in {op[0]}{bound[0]}, {bound[1]}{op[1]}"


def model_config(c: ml_collections.ConfigDict) -> ModelConfig:
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(c.model.keys()) - fields)
    if unknown:
        raise unknown_key_error(f"model.{unknown[0]}", [f"model.{f}" for f in fields])
    try:
        return ModelConfig(**c.model.to_dict())
    except (ConfigError, TypeError) as e:
        raise UserError(str(e)) from None


def execution(c: ml_collections.ConfigDict, mesh=None, *, evaluation: bool = False) -> Execution:
    """The Execution for training (or, evaluation=True, for the eval step: eval.dispatch when set) on `mesh`."""
    fields = c.execution.to_dict()
    if evaluation and c.eval.dispatch:
        fields["dispatch"] = c.eval.dispatch
    try:
        return Execution(**fields, mesh=mesh)
    except (ConfigError, TypeError) as e:
        raise UserError(str(e)) from None


def fill_added_keys(c: ml_collections.ConfigDict) -> None:
    """A config saved before a key existed (a run's config.json) gets that key at the default that reproduces it
    (rundir.config_layout.ADDED_KEYS); nothing else is filled in."""
    for key, default in ADDED_KEYS.items():
        section, name = key.split(".")
        if section in c and name not in c[section]:
            c[section][name] = default


def check(c: ml_collections.ConfigDict) -> ModelConfig:
    """Validate the whole config (after fill_added_keys); returns the model config. Raises UserError naming the bad
    key."""
    fill_added_keys(c)
    check_types(c)
    mcfg = model_config(c)
    ex = execution(c)
    try:
        check_model(ex, mcfg)
    except ConfigError as e:
        raise UserError(str(e)) from None
    check_ranges(c)
    t = c.train
    if t.batch_size % t.grad_accum:
        raise UserError(f"train.batch_size ({t.batch_size}) must be divisible by train.grad_accum ({t.grad_accum})")
    if c.train.get("equal_targets", False) and not (c.data.task == "prefix" and c.train.prefix_loss):
        raise UserError("train.equal_targets subsamples the targets of train.prefix_loss: set data.task='prefix' and "
                        "train.prefix_loss=True, or drop it")
    if c.data.task == "prefix" and mcfg.mask == "bidirectional":
        raise UserError("data.task='prefix' trains next-token prediction: use model.mask causal, prefix or mixed")
    if c.data.task == "mlm" and mcfg.mask not in ("bidirectional", "mixed"):
        raise UserError(f"data.task='mlm' (masked LM) needs model.mask bidirectional or mixed, got {mcfg.mask!r}")
    if mcfg.mask == "prefix" and c.data.task != "prefix" or mcfg.mask == "mixed" and c.data.task == "lm":
        raise UserError(f"model.mask={mcfg.mask!r} needs a per-row prefix: set data.task='prefix'")
    if ex.attention_impl == "cudnn" and int(c.data.seq_len) % 2:
        raise UserError(f"execution.attention_impl='cudnn' trains only even sequence lengths (a cuDNN limit with "
                        f"a mask), got data.seq_len={c.data.seq_len}; use an even length or attention_impl='xla'")
    return mcfg


def check_mesh(c: ml_collections.ConfigDict, mcfg: ModelConfig, mesh) -> None:
    """What the executions need of the mesh: experts and tokens must split over it for expert parallelism."""
    seq = int(c.data.seq_len)
    batches = ((execution(c, mesh), c.train.batch_size // c.train.grad_accum * seq, "a micro-batch"),
               (execution(c, mesh, evaluation=True), c.eval.batch_size * seq, "an evaluation batch"))
    try:
        for ex, tokens, what in batches:
            check_model(ex, mcfg)
            check_tokens(ex, tokens, what)
    except ConfigError as e:
        raise UserError(str(e)) from None


def causality_warning(c: ml_collections.ConfigDict, mcfg: ModelConfig) -> str | None:
    """A dropping dispatch decides which copy to drop from the whole group of tokens, so under a causal mask an
    earlier position's output can depend on later tokens: say so when a causal run trains that way."""
    d = c.execution.dispatch
    if mcfg.mask == "causal" and d in DROPPING_DISPATCH:
        return (f"warning: execution.dispatch={d} drops token copies by priority over the whole "
                f"{'sequence' if d == 'capacity' else 'device batch'}, so a position's output can depend on later "
                "tokens (not strictly causal); dispatch=dropless has no such leak (docs/training.md)")
    return None


def state_bytes(mcfg: ModelConfig, model_parallel: int) -> int:
    """One device's share of the fp32 params, their gradients and Adam's two moments (16 bytes per parameter),
    assuming every parameter splits over all model-parallel devices (fsdp x expert x tensor): a lower bound."""
    return 16 * param_counts(mcfg)["total"] // max(model_parallel, 1)


def activation_bytes(c: ml_collections.ConfigDict, mcfg: ModelConfig, data_parallel: int) -> int:
    """A lower bound on one device's activation memory for a train step: one chunk of fp32 logits (and its
    gradient; execution.loss_chunks) and, with einsum or blockwise attention, the [H, L, L] scores and
    probabilities of every layer kept for the backward pass (one layer with remat; blockwise under a causal mask
    keeps only its blocks' (n + 1) / 2n of the square)."""
    rows = max(c.train.batch_size // c.train.grad_accum // max(data_parallel, 1), 1)
    L = c.data.seq_len
    ex = c.execution
    logits = rows * (L // chunk_count(L, ex.loss_chunks)) * mcfg.vocab_size * 4 * 2
    layers = 1 if ex.remat else mcfg.n_layers
    square = 1.0 if ex.attention_impl in ("einsum", "blockwise") else 0.0
    if ex.attention_impl == "blockwise" and mcfg.mask == "causal":
        n = causal_blocks(L)
        square = (n + 1) / (2 * n)
    attention = int(rows * mcfg.n_heads * L * L * 4 * 2 * layers * square)
    return logits + attention


def device_memory_bytes(device) -> int | None:
    """Memory one device can use: the accelerator's limit, or the host's RAM for CPU devices (shared by all
    the fake CPU devices, so the bound stays loose there)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend reports memory
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def check_memory(c: ml_collections.ConfigDict, mcfg: ModelConfig, mesh, device) -> None:
    """Refuse, before anything is written, a shape whose train state and activations cannot fit on a device.
    Both terms are lower bounds, so nothing that fits is refused; what passes can still run out of memory."""
    shape = dict(mesh.shape)
    dp, mp = shape["data"] * shape["fsdp"], shape["fsdp"] * shape["expert"] * shape["tensor"]
    state, act, have = state_bytes(mcfg, mp), activation_bytes(c, mcfg, dp), device_memory_bytes(device)
    if have is not None and state + act > have:
        raise UserError(f"this shape needs at least {(state + act) / 2**30:.1f} GiB per device (train state "
                        f"{state / 2**30:.1f} GiB, activations {act / 2**30:.1f} GiB) but the device has "
                        f"{have / 2**30:.1f} GiB; shrink the model (model.*), lower data.seq_len ({c.data.seq_len}) "
                        f"or train.batch_size ({c.train.batch_size}), raise train.grad_accum or mesh.fsdp, or set "
                        "execution.remat=true")


def to_json(c: ml_collections.ConfigDict, resolved: Execution | None = None) -> str:
    """The run config as config.json holds it; `resolved`: the execution's `auto` choices as made on this
    platform (Execution.resolved), recorded beside the config as "resolved_execution"."""
    doc = c.to_dict()
    if resolved is not None:
        doc[RESOLVED_KEY] = {k: getattr(resolved, k) for k in RESOLVED_FIELDS}
    return json.dumps(doc, sort_keys=True, indent=1)


def resolved_line(resolved: Execution, c: ml_collections.ConfigDict) -> str:
    """One line: the platform and what each `auto` became there."""
    parts = [f"{k}={getattr(resolved, k)}" + (" (auto)" if c.execution.get(k) == "auto" else "")
             for k in RESOLVED_FIELDS[1:]]
    return f"execution on {resolved.platform}: {', '.join(parts)}"
