"""JAX's persistent compilation cache, on for every training run (`train.compile_cache_dir`).

A program compiled once is loaded from disk the next time the same program is built with the same JAX and
flags: a resumed run, another seed or learning rate, a study's next arm, the evaluation step of the next run. The
default `python -m train` for 30 steps took 45 s of wall time the first time and 24 s the second
(docs/performance.md). MaxText turns the same cache on by default.

The cache is JAX's own (`jax_compilation_cache_dir`): entries are keyed by the program, the devices, the flags and
the JAX version, so a stale entry is never used. It writes from process 0 only; the other hosts of a multi-host run
compile unless the directory is on a shared file system. It is a cache: a directory that cannot be written turns it
off with one line, never the run. JAX writes an entry in place, so a process killed mid-write leaves one that JAX
warns about and compiles past; deleting the directory clears it.
"""

import os
import tempfile

import jax

# Least recently used entries are evicted past this size (JAX's default is no limit). A 64-expert step of the
# default config takes ~1 MB; configs/gpu_1b.py's steps take more. JAX's eviction also locks the directory around
# each write (the `filelock` package), so runs that share it do not write one entry at once.
MAX_BYTES = 4 << 30


def enable(cache_dir: str, say=print) -> str | None:
    """Turn the cache on in `cache_dir` (`~` expanded; "" leaves it off) and return the directory in use, or None.
    A directory already set wins: JAX_COMPILATION_CACHE_DIR in the environment (the tests set their own), or an
    earlier call in this process (JAX opens its cache once, at the first compile after it is set)."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    if not cache_dir:
        return None
    path = os.path.abspath(os.path.expanduser(cache_dir))
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        say(f"compile cache off: cannot write {path} ({e.strerror or e}); set --config.train.compile_cache_dir to a "
            "writable directory, or to '' to turn the cache off without this note")
        return None
    if jax.config.jax_compilation_cache_max_size == -1:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    jax.config.update("jax_compilation_cache_dir", path)
    return path
