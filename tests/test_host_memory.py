"""train.host_memory: with freed memory kept, a repeated XLA:CPU computation stops page-faulting its temporaries;
the settings are made only on the CPU with glibc, once, and not at all when turned off."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from train import host_memory

ROOT = Path(__file__).resolve().parent.parent

# Minor page faults of one call of a jitted function on a 16 MB operand, after warm-up: the median of 9 calls;
# prints "<applied> <faults>". Its own process: the settings are process-wide and must come before the first
# computation. Under jaxlib 0.10 glibc's defaults take ~170,000-265,000 faults per call (0.7-1 GiB: the
# matmul's worker threads allocate scratch too) and the kept settings 0-1. jaxlib 0.12 allocates far less per
# call (up to ~11,000 faults with the defaults, and kept ones in the thousands beside another test worker):
# little to remove, and the ratio is noise, so the test skips below 50,000 (200 MB per call).
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


def _probe(keep: str) -> tuple[str, float]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", host_memory.ENV: keep}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env=env, check=True).stdout.split()
    return out[-2], float(out[-1])


def _transparent_huge_pages_always() -> bool:
    """With THP 'always', glibc's default mmaps get 2 MiB pages and fault little: nothing to compare."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[always]" in path.read_text()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or os.environ.get("LD_PRELOAD"),
                    reason="the settings are glibc's malloc's; elsewhere they are off")
@pytest.mark.skipif(_transparent_huge_pages_always(), reason="huge pages hide the page faults this measures")
def test_kept_memory_stops_the_per_call_page_faults():
    assert host_memory.glibc() is not None  # found by an independent check above: it must be found here too
    applied, faults = _probe("1")
    default, default_faults = _probe("0")
    assert (applied, default) == ("True", "False")
    if default_faults < 50_000:  # this kernel or jaxlib does not fault them in each call: nothing to remove
        pytest.skip(f"glibc's defaults fault only {default_faults:.0f} pages per call here")
    assert faults < default_faults / 5


class FakeLibc:
    def __init__(self, result=1):
        self.calls, self.result = [], result

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return self.result


@pytest.fixture
def undecided(monkeypatch):
    monkeypatch.setattr(host_memory, "_state", None)
    monkeypatch.delenv(host_memory.ENV, raising=False)
    return FakeLibc()


def test_settings_made_once_on_the_cpu(undecided, monkeypatch):
    monkeypatch.setattr(host_memory, "cpu_only", lambda: True)
    assert host_memory.keep_freed_memory(undecided) and host_memory.keep_freed_memory(undecided)
    assert undecided.calls == list(host_memory.SETTINGS)  # once, in order
    assert host_memory.status() == "malloc: keep freed"


def test_nothing_set_off_the_cpu_or_when_turned_off(undecided, monkeypatch):
    monkeypatch.setattr(host_memory, "cpu_only", lambda: False)
    assert not host_memory.keep_freed_memory(undecided) and undecided.calls == []
    assert host_memory.status() == "malloc: n/a"
    monkeypatch.setattr(host_memory, "_state", None)
    monkeypatch.setattr(host_memory, "cpu_only", lambda: True)
    monkeypatch.setenv(host_memory.ENV, "0")
    assert not host_memory.keep_freed_memory(undecided) and undecided.calls == []
    assert host_memory.status() == "malloc: default (MOE_KEEP_FREED_MEMORY=0)"


def test_a_refused_setting_is_reported(undecided, monkeypatch):
    monkeypatch.setattr(host_memory, "cpu_only", lambda: True)
    assert not host_memory.keep_freed_memory(FakeLibc(result=0))
    assert "refused" in host_memory.status()


def test_cpu_only_reads_the_platforms_before_any_plugin(tmp_path, monkeypatch):
    assert host_memory.cpu_only()  # this process: JAX_PLATFORMS=cpu (tests/conftest.py)
    assert host_memory.cpu_only("cpu") and host_memory.cpu_only(" cpu ")
    assert not host_memory.cpu_only("cuda") and not host_memory.cpu_only("cpu,cuda") and not host_memory.cpu_only("tpu")
    assert host_memory.cpu_only("")  # no platforms named, no plugin installed here
    plugin = tmp_path / "jax_plugins" / "xla_fake"  # what a CUDA / ROCm PJRT plugin installs
    plugin.mkdir(parents=True)
    (plugin / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not host_memory.cpu_only("")
    monkeypatch.setenv("TPU_LIBRARY_PATH", "/opt/libtpu.so")
    assert not host_memory.cpu_only("cpu,tpu") and host_memory.cpu_only("cpu")
