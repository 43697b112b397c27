"""What is checked before a run writes anything: the config parsed once into its typed sections
(rundir/run_config.py), then what the machine must give it (the mesh, device memory), and the warnings it earns.

    rc = parse(config)                       # ConfigDict from configs/ and the command line, or a RunConfig
    check_mesh(rc, mesh); check_memory(rc, mesh, jax.devices()[0])

Every failure is a UserError whose one line names the key.
"""

import json
import os

from moe import ModelConfig, param_counts
from moe.attention import causal_blocks
from moe.dispatch.execution import DROPPING_DISPATCH, check_model, check_tokens
from moe.nn import chunk_count
from plumbing.errors import ConfigError, UserError
from rundir.config_layout import ADDED_KEYS, RESOLVED_FIELDS, RESOLVED_KEY
from rundir.run_config import RunConfig


def parse(config) -> RunConfig:
    """The typed run config of a ConfigDict or dict (a config saved before a key existed gets that key at the
    default that reproduces it: rundir.config_layout.ADDED_KEYS), or a RunConfig as it is."""
    if isinstance(config, RunConfig):
        return config
    values = config.to_dict() if hasattr(config, "to_dict") else {k: dict(v) for k, v in config.items()}
    for key, default in ADDED_KEYS.items():
        section, name = key.split(".")
        if section in values:
            values[section].setdefault(name, default)
    try:
        return RunConfig.parse(values)
    except (ConfigError, TypeError) as e:
        raise UserError(" ".join(str(e).split())) from None


def check_mesh(rc: RunConfig, mesh) -> None:
    """What the executions need of the mesh: experts and tokens must split over it for expert parallelism."""
    seq = rc.data.seq_len
    batches = ((rc.execution_on(mesh), rc.train.batch_size // rc.train.grad_accum * seq, "a micro-batch"),
               (rc.execution_on(mesh, evaluation=True), rc.eval.batch_size * seq, "an evaluation batch"))
    try:
        for ex, tokens, what in batches:
            check_model(ex, rc.model)
            check_tokens(ex, tokens, what)
    except ConfigError as e:
        raise UserError(str(e)) from None


def causality_warning(rc: RunConfig) -> str | None:
    """A dropping dispatch decides which copy to drop from the whole group of tokens, so under a causal mask an
    earlier position's output can depend on later tokens: say so when a causal run trains that way."""
    d = rc.execution.dispatch
    if rc.model.mask == "causal" and d in DROPPING_DISPATCH:
        return (f"warning: execution.dispatch={d} drops token copies by priority over the whole "
                f"{'sequence' if d == 'capacity' else 'device batch'}, so a position's output can depend on later "
                "tokens (not strictly causal); dispatch=dropless has no such leak (docs/training.md)")
    return None


def state_bytes(mcfg: ModelConfig, model_parallel: int) -> int:
    """One device's share of the fp32 params, their gradients and Adam's two moments (16 bytes per parameter),
    assuming every parameter splits over all model-parallel devices (fsdp x expert x tensor): a lower bound."""
    return 16 * param_counts(mcfg)["total"] // max(model_parallel, 1)


def activation_bytes(rc: RunConfig, data_parallel: int) -> int:
    """A lower bound on one device's activation memory for a train step: one chunk of fp32 logits (and its
    gradient; execution.loss_chunks) and, with einsum or blockwise attention, the [H, L, L] scores and
    probabilities of every layer kept for the backward pass (one layer with remat; blockwise under a causal mask
    keeps only its blocks' (n + 1) / 2n of the square)."""
    mcfg, ex = rc.model, rc.execution
    rows = max(rc.train.batch_size // rc.train.grad_accum // max(data_parallel, 1), 1)
    L = rc.data.seq_len
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


def check_memory(rc: RunConfig, mesh, device) -> None:
    """Refuse, before anything is written, a shape whose train state and activations cannot fit on a device.
    Both terms are lower bounds, so nothing that fits is refused; what passes can still run out of memory."""
    shape = dict(mesh.shape)
    dp, mp = shape["data"] * shape["fsdp"], shape["fsdp"] * shape["expert"] * shape["tensor"]
    state, act, have = state_bytes(rc.model, mp), activation_bytes(rc, dp), device_memory_bytes(device)
    if have is not None and state + act > have:
        raise UserError(f"this shape needs at least {(state + act) / 2**30:.1f} GiB per device (train state "
                        f"{state / 2**30:.1f} GiB, activations {act / 2**30:.1f} GiB) but the device has "
                        f"{have / 2**30:.1f} GiB; shrink the model (model.*), lower data.seq_len ({rc.data.seq_len}) "
                        f"or train.batch_size ({rc.train.batch_size}), raise train.grad_accum or mesh.fsdp, or set "
                        "execution.remat=true")


def to_json(rc: RunConfig, resolved=None) -> str:
    """The run config as config.json holds it; `resolved`: the execution's `auto` choices as made on this
    platform (Execution.resolved), recorded beside the config as "resolved_execution"."""
    doc = rc.to_dict()
    if resolved is not None:
        doc[RESOLVED_KEY] = {k: getattr(resolved, k) for k in RESOLVED_FIELDS}
    return json.dumps(doc, sort_keys=True, indent=1)


def resolved_line(resolved, rc: RunConfig) -> str:
    """One line: the platform and what each `auto` became there."""
    parts = [f"{k}={getattr(resolved, k)}" + (" (auto)" if getattr(rc.execution, k) == "auto" else "")
             for k in RESOLVED_FIELDS[1:]]
    return f"execution on {resolved.platform}: {', '.join(parts)}"
