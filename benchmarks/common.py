"""Shared by the benchmarks: presets, timing, device facts."""

import datetime
import os
import platform
import time

import jax

# Shapes per preset. cpu: small enough for a shared 2-core box (figures show relative cost only);
# gpu: the H100 goal shapes (bf16, sequence 2048).
PRESETS = {
    "cpu": dict(model=dict(d_model=128, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=32, d_ff=512,
                           first_k_dense=1, vocab_size=4096, n_routed_experts=8, n_shared_experts=1, top_k=2,
                           moe_d_ff=128, dtype="float32"),
                batch=4, seq_len=256, steps=3),
    "gpu": dict(model=dict(d_model=2048, n_layers=4, n_heads=16, n_kv_heads=16, head_dim=128, d_ff=8192,
                           first_k_dense=1, vocab_size=32768, n_routed_experts=64, n_shared_experts=1, top_k=6,
                           moe_d_ff=1024, dtype="bfloat16"),
                batch=8, seq_len=2048, steps=10),
}
DISPATCHES = ("dropless", "capacity", "expert_parallel")


def time_fn(fn, *args, steps: int) -> float:
    """Median seconds per call after one compile-and-warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def peak_memory_gb() -> float | None:
    """Peak bytes in use on device 0 since start (None where the backend does not report it, e.g. CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def describe() -> str:
    dev = jax.devices()[0]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return (f"{datetime.date.today()} | jax {jax.__version__} | backend {jax.default_backend()} | "
            f"device {dev.device_kind} x{jax.device_count()} | host {cpu}, nproc {os.cpu_count()}")


def table(rows: list[dict]) -> str:
    """A Markdown table from dicts with the same keys."""
    keys = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("n/a" if v is None else str(v))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)
