"""Shared test setup: 8 fake CPU devices, set before jax is imported anywhere."""

import atexit
import fcntl
import gc
import importlib.metadata
import os
import shutil
import tempfile
import warnings

# The suite is dominated by compiling tiny programs: LLVM at -O0 compiles them faster and runs them a little
# slower (tests compare programs built with the same flags; subprocesses inherit them). The SIGTERM test
# (tests/test_train_loop.py) sets its own XLA_FLAGS, so the default optimization level is still trained end to end.
# Below jaxlib 0.11, XLA:CPU's older fusion emitters compile the suite's programs in about half the time at
# -O0 (at the default -O level they take twice as long, so only here); jaxlib 0.11 removed the flag, and XLA
# aborts on an unknown flag.
try:
    _JAXLIB = tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2])
except (importlib.metadata.PackageNotFoundError, ValueError):
    _JAXLIB = (1, 0)  # unknown: no version-dependent flag
FAST_COMPILE_XLA_FLAGS = " ".join(["--xla_backend_optimization_level=0"]
                                  + ["--xla_cpu_use_fusion_emitters=false"] * (_JAXLIB < (0, 11)))
# The suite's flags replace any of the same name in the environment (the tests need 8 devices); xdist workers
# inherit the controller's flags and end up with the same string.
_OURS = ["--xla_force_host_platform_device_count=8", *FAST_COMPILE_XLA_FLAGS.split()]
_OUR_NAMES = {f.split("=")[0] for f in _OURS}
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in _OUR_NAMES] + _OURS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# glibc's malloc defaults in the test processes and their children: train.loop.run and the benchmarks' mains, run
# in-process here, would change them after the first computation (train/host_memory.py; tests/test_host_memory.py
# sets it per subprocess).
os.environ.setdefault("MOE_KEEP_FREED_MEMORY", "0")
# Identical programs compiled again by the processes the tests start (train, the analyses) hit this cache. The process
# that makes it removes it at exit (xdist workers and subprocesses inherit the variable and share it), so repeated
# runs do not pile caches up in the temp dir.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="moe-lm-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  (after XLA_FLAGS on purpose)
import pytest  # noqa: E402

from configs.tiny import get_config  # noqa: E402
from train.loop import run  # noqa: E402

# The test processes share that cache too, for the programs worth it: another seed's or another run's train step
# with the same shapes (a new jitted closure, so a miss in JAX's in-memory caches) loads in a fraction of its
# compile time. Programs compiled in under 0.1 s (most eager ops) are not written: kept in memory, they never
# reach it twice.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs():
    """Drop JAX's compiled programs after a test file once the process holds a third of the kernel's memory
    mappings. Each XLA:CPU executable holds ~30 mappings (its code and data sections) for as long as a jit cache
    keeps it, and the kernel allows a process 65,530 (vm.max_map_count): a long-lived xdist worker that kept every
    file's programs passed 42,000 mappings after 19 files (one file adds up to ~10,000), and at the limit LLVM's
    mmap fails ("Cannot allocate memory") and XLA segfaults mid-compile or mid-serialize. Cleared only when needed:
    later files reuse some programs (the session's fixtures, shared forwards)."""
    yield
    if MAX_MAPS and _mappings() > MAX_MAPS // 3:
        jax.clear_caches()
        gc.collect()
        if (held := _mappings()) > MAX_MAPS // 3:
            warnings.warn(f"this test process still holds {held:,} memory mappings after clearing JAX's caches, over a "
                          f"third of the kernel's limit of {MAX_MAPS:,}: something keeps compiled programs alive across "
                          f"files (a module-level Compiled object, a cache of jitted closures)", stacklevel=1)


def _max_mappings():
    """The kernel's per-process limit; Linux's default where the setting cannot be read; 0 (nothing to watch)
    where /proc/self/maps does not exist (not Linux)."""
    if not os.path.exists("/proc/self/maps"):
        return 0
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


MAX_MAPS = _max_mappings()


def _mappings():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def tiny_config(**overrides):
    """configs/tiny.py with dotted overrides, e.g. tiny_config(**{"train.steps": 4})."""
    c = get_config()
    c.log.progress = False
    c.log.peak_flops = 1e12  # skip the matmul measurement in tests
    c.log.tensorboard = False
    for key, value in overrides.items():
        node = c
        *path, leaf = key.split(".")
        for p in path:
            node = node[p]
        node[leaf] = value
    return c


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A trained tiny run (configs/tiny.py, 20 steps, checkpoints at 10 and 20), shared by the whole session and
    by every xdist worker (the first to need it trains it under a lock, the others wait and read it): its routing
    biases are non-zero. Treat it as read-only."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, above every worker's own
    workdir, done = root / "tiny_run_shared", root / "tiny_run_shared.done"
    with open(root / "tiny_run_shared.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(workdir, ignore_errors=True)  # a worker that died mid-training left a partial run
            run(tiny_config(**{"log.tensorboard": True}), workdir, log=lambda *a: None)
            done.touch()
    return workdir
