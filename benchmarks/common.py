"""Shared by the benchmarks: presets, timing, device facts."""

import argparse
import datetime
import importlib
import os
import platform
import time

import jax

from moe.dispatch.execution import REMAT_POLICIES
from moe.dispatch.experts import PERMUTES
from train import host_memory

MAXTEXT_MLA = dict(attention="mla", q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=48, qk_rope_head_dim=16,
                   v_head_dim=64)

# Shapes per preset. cpu: small enough for a shared 2-core box (figures show relative cost only);
# gpu: configs/gpu_1b.py (bf16, sequence 2048, top-6 of 64 experts of width 320), one micro-batch of 16 rows.
# `batch` is per device (the train-step benchmark multiplies it by the device count).
PRESETS = {
    "cpu": dict(model=dict(d_model=128, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=32, d_ff=512,
                           first_k_dense=1, vocab_size=4096, n_routed_experts=8, n_shared_experts=1, top_k=2,
                           moe_d_ff=128),
                execution=dict(dtype="float32"), batch=4, seq_len=256, steps=3),
    "gpu": dict(model="configs.gpu_1b", batch=16, seq_len=2048, steps=10),
    # Toy shapes: checks that a script runs end to end (tests, `gpu_report --tiny`), says nothing about speed.
    "tiny": dict(model=dict(d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=16, d_ff=64, first_k_dense=1,
                            vocab_size=256, n_routed_experts=8, n_shared_experts=1, top_k=2, moe_d_ff=16),
                 execution=dict(dtype="float32"), batch=1, seq_len=32, steps=1),
    # benchmarks/maxtext_side_by_side.py: the DeepSeek-style shape trained in both projects (the CPU shape of the speed goals;
    # the GPU one is configs/gpu_1b.py's widths).
    # Both sides run MaxText's deepseek3-tiny attention at these widths: MLA with a query latent of 32 and a kv
    # latent of 16, 48 + 16 (roped) query/key dims and 64-wide values per head (MAXTEXT_MLA).
    "maxtext_cpu": dict(model=dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=64, d_ff=512,
                                   first_k_dense=1, vocab_size=4096, n_routed_experts=16, n_shared_experts=1,
                                   top_k=4, moe_d_ff=128, **MAXTEXT_MLA),
                        execution=dict(dtype="float32"), batch=8, seq_len=256, steps=3),
    "maxtext_gpu": dict(model=dict(d_model=1024, n_layers=16, n_heads=16, n_kv_heads=16, head_dim=64, d_ff=2816,
                                   first_k_dense=1, vocab_size=8192, n_routed_experts=64, n_shared_experts=2,
                                   top_k=6, moe_d_ff=320, **MAXTEXT_MLA),
                        execution=dict(dtype="bfloat16", remat=True), batch=8, seq_len=2048, steps=10),
    # configs/default.py, what `python -m train` trains (16 experts top-2, d_model 192, batch 16 x 256).
    "default": dict(model="configs.default", batch=16, seq_len=256, steps=3),
}


def preset(name: str, n_experts: int | None = None) -> dict:
    """The preset with its model fields resolved; n_experts changes the routed-expert count only (top-k and
    expert width fixed), dropping group-limited routing where the groups would no longer fit."""
    p = dict(PRESETS[name])
    if isinstance(p["model"], str):
        config = importlib.import_module(p["model"]).get_config()
        p["model"], p["execution"] = config.model.to_dict(), config.execution.to_dict()
    m = p["model"] = dict(p["model"])
    if n_experts is not None:
        m["n_routed_experts"] = n_experts
        g = m.get("n_group", 1)
        if n_experts % g or n_experts // g < 2 or m.get("topk_group", 1) * (n_experts // g) < m["top_k"]:
            m["n_group"] = m["topk_group"] = 1
    return p


DISPATCHES = ("dropless", "capacity", "expert_parallel")
GROUPED = ("dropless", "expert_parallel")  # the dispatches that run a grouped matmul (execution.grouped_matmul)
# The dispatches whose permuted rows' backward a `:scatter` / `:gather` suffix picks (execution.permute_grad).
PERMUTED = ("dropless", "expert_parallel", "expert_parallel_dropless")


def variants(dispatches: list[str], grouped_matmuls: list[str]) -> list[tuple[str, str]]:
    """(dispatch, grouped_matmul) pairs to time: every grouped matmul for the paths that have one."""
    return [(d, g) for d in dispatches for g in (grouped_matmuls if d.split(":")[0] in GROUPED else ["-"])]


def time_fn(fn, *args, steps: int) -> float:
    """Median seconds per call after one compile-and-warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def time_fns(calls: list, steps: int) -> list[float]:
    """Median seconds per call of each (fn, args) in `calls`, timed round-robin: every fn is compiled and warmed
    up first, then each round times every fn once, so load changes on a shared machine hit all of them alike and
    their ratios stay meaningful."""
    for fn, args in calls:
        jax.block_until_ready(fn(*args))
    times = [[] for _ in calls]
    for _ in range(steps):
        for i, (fn, args) in enumerate(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[i].append(time.perf_counter() - t0)
    return [sorted(t)[len(t) // 2] for t in times]


def peak_memory_gb() -> float | None:
    """Peak bytes in use on device 0 since the process started (None where the backend does not report it, e.g.
    CPU). JAX cannot reset it: a row's own peak is known only where it raises the process's (`row_peak_gb`)."""
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def row_peak_gb(peak_before: float | None) -> float | None:
    """The process's peak memory if the row run since `peak_before` raised it, else None: a row that peaks
    below an earlier row's peak in the same process cannot be told apart from it (an 8-expert row after a
    64-expert one would show the 64-expert row's peak)."""
    now = peak_memory_gb()
    return now if now is not None and (peak_before is None or now > peak_before) else None


def planned_memory_gb(compiled) -> float | None:
    """What XLA planned for one call of a compiled train step: arguments + temporaries, in GiB; per program, so
    comparable between rows of one process (None where not reported). Outputs are left out: the training loop
    donates the state, whose update then takes the old state's buffers (the benchmark donates nothing, so its
    outputs would count the state twice)."""
    m = compiled.memory_analysis()
    return None if m is None else (m.argument_size_in_bytes + m.temp_size_in_bytes) / 2**30


def host_cpu() -> str:
    """The host's CPU model and core count (no JAX call: safe before the runs a script starts take the device)."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return f"host {cpu}, nproc {os.cpu_count()}"


def describe() -> str:
    dev = jax.devices()[0]
    return (f"{datetime.date.today()} | jax {jax.__version__} | backend {jax.default_backend()} | "
            f"device {dev.device_kind} x{jax.device_count()} | {host_cpu()} | {host_memory.status()}")


def table(rows: list[dict]) -> str:
    """A Markdown table from dicts: every key any row has, in first-seen order ("-" where a row lacks it)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("n/a" if v is None else str(v))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) if k in r else "-" for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def comma_subset(ap: argparse.ArgumentParser, flag: str, value: str, allowed) -> list[str]:
    """The non-empty comma-separated items of a flag's value, each one of `allowed`; else ap.error (exit 2)."""
    items = [v for v in value.split(",") if v]
    if not items or any(v not in allowed for v in items):
        ap.error(f"{flag} takes a comma-separated subset of {','.join(allowed)}, got {value!r}")
    return items


def add_scan_layers_flag(ap: argparse.ArgumentParser, where: str = "the train step's") -> None:
    """--scan_layers on|off: execution.scan_layers for one run ("": the preset's, off; moe/model.py)."""
    ap.add_argument("--scan_layers", default="", choices=["", "on", "off"],
                    help=f"{where} MoE blocks as one lax.scan (on: one compiled copy of the block) or unrolled (off); "
                         "default: the preset's (off)")


REMAT_CHOICES = ("off", *REMAT_POLICIES)  # --remat: no remat, or remat keeping what that remat_policy keeps


def add_remat_flag(ap: argparse.ArgumentParser, where: str = "the train step's") -> None:
    """--remat off|full|save_moe, comma-separated ("": the preset's): `remat_settings` reads it."""
    ap.add_argument("--remat", default="", help=f"{where} remat, comma-separated from {','.join(REMAT_CHOICES)} "
                                                "(execution.remat / remat_policy); default: the preset's")


def remat_settings(ap: argparse.ArgumentParser, value: str) -> list[str]:
    """The --remat values to run ([""]: the preset's); a bad one is ap.error (exit 2)."""
    return comma_subset(ap, "--remat", value, REMAT_CHOICES) if value else [""]


def remat_overrides(remat: str) -> dict:
    """execution.* for a --remat value ("": none, the preset's)."""
    if not remat:
        return {}
    return {"remat": remat != "off", "remat_policy": "full" if remat == "off" else remat}


def remat_label(ex) -> str:
    """An Execution's remat as a --remat value: off, or its policy."""
    return ex.remat_policy if ex.remat else "off"


def dispatch_list(ap: argparse.ArgumentParser, value: str, allowed=DISPATCHES) -> list[str]:
    """--dispatch's comma-separated paths, each one of `allowed`, those in PERMUTED optionally as NAME:scatter or
    NAME:gather (execution.permute_grad); else ap.error (exit 2), before any work starts."""
    def valid(item):
        name, colon, rule = item.partition(":")
        return name in allowed and (not colon or (name in PERMUTED and rule in PERMUTES))

    items = [v for v in value.split(",") if v]
    if not items or not all(map(valid, items)):
        ap.error(f"--dispatch takes a comma-separated subset of {','.join(allowed)}, with :scatter or :gather after "
                 f"{' / '.join(p for p in PERMUTED if p in allowed)}; got {value!r}")
    return items


def arg_parser(description: str) -> argparse.ArgumentParser:
    """The flags every benchmark takes: preset, dispatch paths, grouped matmuls, attention, expert counts, capacity
    factor. Lists are comma-separated; each combination is one row."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    ap.add_argument("--dispatch", default=",".join(DISPATCHES),
                    help="comma-separated dispatch paths; NAME:scatter / NAME:gather pick how dropless's or "
                         "expert_parallel's backward moves rows (execution.permute_grad; plain NAME: auto)")
    ap.add_argument("--grouped_matmul", default="auto", help="auto,ragged_dot,blocked,slab,tokamax (dropless/expert_parallel)")
    ap.add_argument("--attention_impl", default="blockwise", help="blockwise,einsum,xla,cudnn (train step only)")
    ap.add_argument("--experts", default="8,64")
    ap.add_argument("--capacity_factor", type=float, default=1.25)
    ap.add_argument("--batch", type=int, default=0, help="rows per device; 0: the preset's")
    ap.add_argument("--steps", type=int, default=0, help="timed calls per row (median); 0: the preset's")
    ap.add_argument("--peak_flops", type=float, default=0.0, help="per device; 0 measures a large matmul "
                                                                   "(train step only)")
    return ap
