"""Where a result came from: the commit, the JAX version and the machine. Every study's result.json and every
analysis's JSON carry it (`provenance()`), so a number can be traced to the software and the host that made it:
training repeats to the printed digit on one machine, not across CPUs (docs/training.md)."""

import functools
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def provenance() -> dict:
    """{"commit": short hash (+"+changes" with uncommitted changes to tracked files), "jax", "machine"}."""
    import jax  # here, not at import: a reader of run directories needs no JAX

    def git(*args) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown (not a git checkout)"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+changes"
    return {"commit": commit, "jax": jax.__version__, "machine": machine()}


def machine() -> str:
    """'x86_64, AMD EPYC 7B13, 2 cores' (the CPU model from /proc/cpuinfo where there is one)."""
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return ", ".join(p for p in (platform.machine(), model, f"{os.cpu_count()} cores") if p)
