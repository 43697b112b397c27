"""train/compile_cache.py: JAX's persistent compilation cache, on for training runs; a re-run loads its programs."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]

# A fresh process without the suite's own cache (JAX opens its cache once per process): every way to call enable(),
# then one compile; prints what it saw.
SCRIPT = """
import json, os, sys
import jax, jax.numpy as jnp
from train import compile_cache
tmp, notes = sys.argv[1], []
blocked = os.path.join(tmp, "a_file")
open(blocked, "w").close()
assert compile_cache.enable("", notes.append) is None
assert compile_cache.enable(os.path.join(blocked, "cache"), notes.append) is None
assert not jax.config.jax_compilation_cache_dir
path = compile_cache.enable("~/cache", notes.append)
assert compile_cache.enable(os.path.join(tmp, "other"), notes.append) == path  # the first directory set wins
hits = []
jax.monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None)
x = jnp.ones((8, 8))
jax.block_until_ready(jax.jit(lambda x: jnp.sin(x) @ x.T)(x))
print(json.dumps({"path": path, "notes": notes, "hits": len(hits),
                  "max_size": jax.config.jax_compilation_cache_max_size}))
"""


def _fresh_process(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(ROOT), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_enable_writes_the_cache_and_a_second_process_loads_from_it(tmp_path):
    first = _fresh_process(tmp_path)
    assert first["path"] == str(tmp_path / "cache")  # ~ expanded
    assert len(first["notes"]) == 1 and "a_file/cache" in first["notes"][0]  # unwritable: off, with one line
    assert "compile_cache_dir" in first["notes"][0] and "\n" not in first["notes"][0]
    assert first["max_size"] == 4 << 30  # least recently used entries are evicted past it
    assert first["hits"] == 0 and list((tmp_path / "cache").glob("*-cache"))
    assert not (tmp_path / "other").exists()
    second = _fresh_process(tmp_path)
    assert second["hits"] >= 1


def test_a_rerun_loads_the_train_step_from_the_cache(tiny_run, tmp_path, caplog, monkeypatch):
    """The session's tiny run (tests/conftest.py, same config) compiled its programs into the suite's cache: a
    second run with that config compiles none of them (no host callback or run-specific constant in them)."""
    from train import compile_cache, loop

    seen = []
    monkeypatch.setattr(compile_cache, "enable", lambda d, say: seen.append(d) or os.environ["JAX_COMPILATION_CACHE_DIR"])
    with caplog.at_level(logging.DEBUG, logger="jax._src.compiler"):
        loop.run(tiny_config(**{"log.tensorboard": True}), tmp_path / "again", log=lambda *a: None)
    assert seen == ["~/.cache/moe-lm/jax"]  # the loop turns the cache on from the config, before compiling
    hits = " ".join(r.getMessage() for r in caplog.records if "cache hit" in r.getMessage())
    misses = " ".join(r.getMessage() for r in caplog.records if "CACHE MISS" in r.getMessage().upper())
    assert "'jit_sharded_step'" in hits and "'jit_eval_step'" in hits  # the train step (train/loop.py) and eval
    assert not misses, misses[:2000]
