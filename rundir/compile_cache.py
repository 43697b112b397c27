"""JAX's persistent compilation cache, on for every training run (`train.compile_cache_dir`).

A program compiled once is loaded from disk the next time the same program is built: on resume, for another seed,
for the evaluation step of a run with the same model and batch. `rundir.open_run` turns it on for the run's readers
(analysis, export, generation) in the default directory, so they load their programs on a second reading too.
What is traced into a program as a constant (the learning rate and its schedule's lengths, the model, the batch)
makes another program. The default `python -m train` took 188-190 s with the cache off and 158 s with a warm one
(docs/performance.md, eleventh session). MaxText turns the same cache on by default.
JAX_ENABLE_COMPILATION_CACHE=false keeps it off.

The cache is JAX's own (`jax_compilation_cache_dir`): an entry's key covers the program, the devices, the compile
options and XLA flags, and the jaxlib version, so a stale entry is never used. Only process 0 writes; the other
hosts of a multi-host run compile unless the directory is on a shared file system. It is left unbounded, JAX's
default (its size limit needs a lock around every read and write, and below jax 0.11 its eviction stops writing
for good once an entry's timestamp file is missing): 0.4-1.3 MB per program at the default config; deleting the
directory empties it. A directory that cannot be written turns the cache off with one line, never the run. JAX
writes an entry in place, so a process killed mid-write leaves one that JAX warns about and compiles past.
"""

import os
import tempfile

import jax

DEFAULT_DIR = "~/.cache/moe-lm/jax"  # train.compile_cache_dir's default, and every reader's directory
TRAIN_FIX = ("set --config.train.compile_cache_dir to a writable directory, or to '' to turn the cache off without "
             "this note")
_said = set()  # the unwritable directories already reported in this process: one line each


def reader_dir(run_setting: str) -> str:
    """The directory a reader of a run (analysis, export, generation) caches in: the reader's own default, or
    off when the run turned its cache off. A run's files never choose where a reader writes: the run may come from
    another machine or another user, and its config's path means nothing (or something else) here."""
    return DEFAULT_DIR if run_setting else ""


def enable(cache_dir: str, say=print, fix: str = TRAIN_FIX) -> str | None:
    """Turn the cache on in `cache_dir` (`~` expanded; "" leaves it off) and return the directory in use, or None.
    A directory already set wins: a non-empty JAX_COMPILATION_CACHE_DIR in the environment (the tests set their
    own), or an earlier call in this process (JAX opens its cache once, so a later run in the same process keeps
    the first directory, even a run whose config says ""). An unwritable directory is reported once per process,
    with `fix` (what the caller's user can do about it)."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    if not cache_dir or not jax.config.jax_enable_compilation_cache:  # off here, or by JAX_ENABLE_COMPILATION_CACHE
        return None
    path = os.path.abspath(os.path.expanduser(cache_dir))
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        if path not in _said:
            _said.add(path)
            say(f"compile cache off: cannot write {path} ({e.strerror or e}); {fix}")
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    return path
