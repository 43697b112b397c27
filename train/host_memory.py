"""Keep freed host memory for reuse on the CPU backend (glibc malloc settings), set once at start-up.

XLA:CPU mallocs every step's temporaries. glibc serves large blocks with fresh mmaps and lets its per-thread
arenas shrink, so each train step page-faults its whole working set in again, zero-filled by the kernel: ~100,000
to 120,000 faults (400-470 MiB) per step of the default config, 12-17% of its time. With large blocks taken from
one heap that is never trimmed, freed memory is reused as is: almost no faults after the first steps. The price
(docs/performance.md, 2026-11-27): compiling takes ~2 s longer (one arena for all threads) and the process keeps
its high-water mark, higher than before (3.3 GB against 1.7 GB for the default `python -m train`): fine for a
training process, which needs that memory again every step.

Only on the CPU backend (an accelerator's working set is device memory; host buffers there, e.g. a checkpoint
being written, may well be returned to the OS), and only from the start: a thread that already has its arena
keeps it, so the settings are made before JAX's backend starts its threads (or they change little; measured).
`MOE_KEEP_FREED_MEMORY=0` turns it off.
"""

import ctypes
import ctypes.util
import os

import jax

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
SETTINGS = ((M_MMAP_MAX, 0),  # no mmap for large blocks: they come from the heap and go back to it
            (M_TRIM_THRESHOLD, 2**31 - 1),  # never give the heap's free top back to the kernel (the largest value)
            (M_ARENA_MAX, 1))  # one arena for all threads: worker-thread arenas would shrink (and fault) anyway
# glibc's defaults, restored off the CPU (the trim threshold then stays fixed instead of adapting; 0 arenas: its
# own limit, 8 per core)
DEFAULTS = ((M_MMAP_MAX, 65536), (M_TRIM_THRESHOLD, 128 * 1024), (M_ARENA_MAX, 0))
ENV = "MOE_KEEP_FREED_MEMORY"

_applied = False


def _glibc():
    """The C library if it is glibc (has mallopt and gnu_get_libc_version), else None (macOS, musl, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


def keep_freed_memory() -> bool:
    """Apply the settings if this process computes on the CPU with glibc (idempotent); whether they are on.

    They are set before asking JAX for its backend: starting the backend starts XLA's threads, and a thread that
    has its own arena by then keeps it (page faults on some runs, measured). Off the CPU they are undone."""
    global _applied
    if _applied:
        return True
    libc = _glibc() if os.environ.get(ENV, "1") != "0" else None
    if libc is None or not all(libc.mallopt(param, value) == 1 for param, value in SETTINGS):
        return False
    if jax.default_backend() != "cpu":
        for param, value in DEFAULTS:
            libc.mallopt(param, value)
        return False
    _applied = True
    return True


def status() -> str:
    """For benchmark headers: whether the figures were measured with freed memory kept."""
    return "malloc: keep freed" if _applied else "malloc: glibc default"
