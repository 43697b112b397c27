"""Keep freed host memory for reuse on the CPU backend (glibc malloc settings), set once at start-up.

XLA:CPU mallocs every step's temporaries. glibc serves large blocks with fresh mmaps and lets its per-thread
arenas shrink, so each train step page-faults its whole working set in again, zero-filled by the kernel:
~100,000 to 120,000 faults (390-460 MiB) per step of the default config. With large blocks taken from one heap
that is never trimmed, freed memory is reused as is: almost no faults after the first steps; the default
`python -m train` runs ~8% faster. The price: a few seconds more start-up (compiling with one arena for all
threads) and a higher resident high-water mark, kept for the life of the process.

Only where JAX will compute on the CPU, decided without starting JAX's backend: the settings must come before
its threads take their arenas (a thread keeps the arena it has; made afterwards, the settings remove none of
the faults), and an accelerator host keeps glibc's defaults, which glibc cannot fully restore once changed.
Only with glibc itself (not musl or macOS, nor an allocator preloaded in its place). `MOE_KEEP_FREED_MEMORY=0`
turns it off.
"""

import ctypes
import importlib.metadata
import importlib.util
import os
import pkgutil

import jax

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
SETTINGS = ((M_MMAP_MAX, 0),  # no mmap for large blocks: they come from the heap and go back to it
            (M_TRIM_THRESHOLD, 2**31 - 1),  # never give the heap's free top back to the kernel (the largest value)
            (M_ARENA_MAX, 1))  # one arena for all threads: worker-thread arenas would shrink (and fault) anyway
ENV = "MOE_KEEP_FREED_MEMORY"
PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

_state = None  # None: not decided yet; else (applied, reason) for status()


def glibc():
    """This process's C library if it is glibc's malloc (the symbols already loaded: no ldconfig), else None."""
    if any(a in os.environ.get("LD_PRELOAD", "") for a in PRELOADED_ALLOCATORS):
        return None
    try:
        libc = ctypes.CDLL(None)
    except (OSError, TypeError):  # TypeError: Windows
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


def cpu_only(platforms: str | None = None) -> bool:
    """Whether JAX will compute on the CPU here, decided without starting its backend: jax_platforms (what
    JAX_PLATFORMS set when jax was imported) names only cpu, or no accelerator plugin is installed (JAX finds PJRT
    plugins as `jax_plugins.*` modules or `jax_plugins` entry points; TPUs through `libtpu` or TPU_LIBRARY_PATH).
    Conservative: a CPU-only host with a CUDA plugin installed keeps glibc's defaults."""
    platforms = (jax.config.jax_platforms or "") if platforms is None else platforms
    if platforms:
        return {p.strip() for p in platforms.split(",") if p.strip()} == {"cpu"}
    try:
        import jax_plugins  # optional: the namespace CUDA / ROCm plugins install into (importing it loads none)
        if any(True for _ in pkgutil.iter_modules(jax_plugins.__path__)):
            return False
    except ImportError:
        pass
    if any(True for _ in importlib.metadata.entry_points(group="jax_plugins")):
        return False
    return importlib.util.find_spec("libtpu") is None and "TPU_LIBRARY_PATH" not in os.environ


def keep_freed_memory(libc=None) -> bool:
    """Apply the settings if this process computes on the CPU with glibc; whether they are on. Decided once per
    process; call it before JAX computes anything (train.loop.run and the benchmarks' mains do). libc: a stand-in
    for tests."""
    global _state
    if _state is None:
        if os.environ.get(ENV, "1") == "0":
            _state = (False, f"malloc: default ({ENV}=0)")
        elif (libc := libc or glibc()) is None or not cpu_only():
            _state = (False, "malloc: n/a")
        elif all(libc.mallopt(param, value) == 1 for param, value in SETTINGS):
            _state = (True, "malloc: keep freed")
        else:  # glibc refuses none of these values; if one ever did, say so rather than half-claim
            _state = (False, "malloc: glibc, mallopt refused")
    return _state[0]


def glibc_tunables() -> str:
    """SETTINGS as the GLIBC_TUNABLES environment value, for a child process that is not ours (a benchmark's other
    side) to allocate as this one does; mallopt and the tunables set the same three parameters."""
    return "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1"


def status() -> str:
    """For benchmark headers: whether the figures were measured with freed memory kept."""
    return _state[1] if _state else "malloc: not set"
