"""train.host_memory: with freed memory kept, a repeated XLA:CPU computation stops page-faulting its temporaries."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from train import host_memory

ROOT = Path(__file__).resolve().parent.parent

# Minor page faults of a call of a jitted function with ~50 MB of temporaries, after warm-up (the median of 9
# calls); prints "<applied> <faults>". Its own process: the settings are process-wide and act only before the first
# computation.
PROBE = """
import resource
import jax, jax.numpy as jnp
from train import host_memory
applied = host_memory.keep_freed_memory()
f = jax.jit(lambda x: (jnp.tanh(x) @ jnp.tanh(x.T) * 2).sum())
x = jnp.full((2048, 2048), 0.1, jnp.float32)
for _ in range(3):
    f(x).block_until_ready()
faults = []
for _ in range(9):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, sorted(faults)[4])
"""


def _probe(**env) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", **env}, check=True).stdout.split()
    return out[-2], float(out[-1])


@pytest.mark.skipif(host_memory._glibc() is None, reason="the settings are glibc's (Linux); elsewhere they are off")
def test_kept_memory_stops_the_per_call_page_faults():
    applied, faults = _probe()
    default, default_faults = _probe(**{host_memory.ENV: "0"})
    assert (applied, default) == ("True", "False")
    assert default_faults > 20_000  # glibc's default: the temporaries are faulted in (and zeroed) on every call
    assert faults < default_faults / 20


def test_off_the_cpu_or_when_turned_off_nothing_is_set(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", False)
    monkeypatch.setenv(host_memory.ENV, "0")
    assert host_memory.keep_freed_memory() is False
    monkeypatch.delenv(host_memory.ENV)
    monkeypatch.setattr(host_memory.jax, "default_backend", lambda: "gpu")
    assert host_memory.keep_freed_memory() is False
    assert host_memory.status() == "malloc: glibc default"
