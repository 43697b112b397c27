"""rundir/compile_cache.py: JAX's persistent compilation cache, on for training runs; a re-run loads its programs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from configs.base import base_config
from rundir import compile_cache

ROOT = Path(__file__).resolve().parents[1]

# A fresh process without the suite's own cache (JAX opens its cache once per process): every way to call enable(),
# then one compile; prints what it saw.
SCRIPT = """
import json, os, sys
import jax, jax.numpy as jnp
from rundir import compile_cache
tmp, notes = sys.argv[1], []
blocked = os.path.join(tmp, "a_file")
open(blocked, "w").close()
assert compile_cache.enable("", notes.append) is None
jax.config.update("jax_enable_compilation_cache", False)  # JAX_ENABLE_COMPILATION_CACHE=false
assert compile_cache.enable("~/cache", notes.append) is None
jax.config.update("jax_enable_compilation_cache", True)
for _ in range(2):  # reported once
    assert compile_cache.enable(os.path.join(blocked, "cache"), notes.append, "FIX") is None
assert not jax.config.jax_compilation_cache_dir
path = compile_cache.enable("~/cache", notes.append)
assert compile_cache.enable(os.path.join(tmp, "other"), notes.append) == path  # the first directory set wins
hits = []
jax.monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None)
x = jnp.ones((8, 8))
jax.block_until_ready(jax.jit(lambda x: jnp.sin(x) @ x.T)(x))
print(json.dumps({"path": path, "notes": notes, "hits": len(hits)}))
"""


def _run_without_the_suites_cache(script: str, tmp_path, **env_vars) -> str:
    """stdout of `script` (argv[1]: tmp_path) in a fresh process whose HOME is tmp_path and that inherits none of
    the suite's cache settings (tests/conftest.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(ROOT), **env_vars)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _fresh_process(tmp_path) -> dict:
    out = _run_without_the_suites_cache(SCRIPT, tmp_path, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    return json.loads(out.strip().splitlines()[-1])


def test_enable_writes_the_cache_and_a_second_process_loads_from_it(tmp_path):
    first = _fresh_process(tmp_path)
    assert first["path"] == str(tmp_path / "cache")  # ~ expanded
    assert len(first["notes"]) == 1 and "a_file/cache" in first["notes"][0]  # unwritable: off, with one line
    assert first["notes"][0].endswith("; FIX") and "\n" not in first["notes"][0]
    assert first["hits"] == 0 and list((tmp_path / "cache").glob("*-cache"))
    assert not (tmp_path / "other").exists()
    second = _fresh_process(tmp_path)
    assert second["hits"] >= 1


# Prepended to a script: the JAX compiler's log messages (its cache hits and misses name the program) in `records`.
COMPILER_LOG = """
import logging
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logger = logging.getLogger("jax._src.compiler")
logger.setLevel(logging.DEBUG)
logger.addHandler(Keep())
"""

RERUN = COMPILER_LOG + """
import sys
from configs.tiny import get_config  # not tests.conftest: importing it would set the suite's cache directory
from train import loop
config = get_config()
config.train.steps = 2
config.execution.grouped_matmul = "auto"  # CPU's default (slab): configs/tiny.py's ragged_dot step can compile in under 1 s
config.log.update(progress=False, peak_flops=1e12, tensorboard=False)
for name in ("first", "second"):
    records.clear()
    loop.run(config, sys.argv[1] + "/" + name, log=lambda *a: None)
print("SECOND", " ".join(m for m in records if "cache hit" in m or "CACHE MISS" in m))
"""


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """(HOME, the second run's compiler log): RERUN in a process without the suite's cache, HOME a fresh directory
    (so the config's default ~/.cache/moe-lm/jax is inside it); the runs are HOME/first and HOME/second."""
    home = tmp_path_factory.mktemp("home")
    return home, _run_without_the_suites_cache(RERUN, home).split("SECOND", 1)[1]


def test_a_second_run_loads_its_train_step_from_the_configs_cache(two_runs):
    """The loop turns the cache on from train.compile_cache_dir (default ~/.cache/moe-lm/jax) in a process without
    the suite's cache: a second run of the same config in the same process (a new program object, traced again)
    loads its train step from disk, under JAX's default 1 s compile-time threshold. A host callback in the step, or
    a run-specific constant, would make it compile again."""
    home, second = two_runs
    assert "hit for 'jit_sharded_step'" in second and "MISS for 'jit_sharded_step'" not in second, second[:2000]
    assert list((home / ".cache" / "moe-lm" / "jax").glob("jit_sharded_step-*"))


# A reader of a run (analysis, export, generation) in a fresh process: open_run, then one jitted forward pass;
# prints the cache directory in use and the compiler's cache hits and misses for the forward pass.
READ = COMPILER_LOG + """
import json, sys
import jax, jax.numpy as jnp
from flax import nnx
from rundir import open_run
run = open_run(sys.argv[1] + "/first", log=lambda *a: None)
graphdef, state = nnx.split(run.model)
def forward(state, tokens):
    return nnx.merge(graphdef, state)(tokens)
jax.block_until_ready(jax.jit(forward)(state, jnp.zeros((1, 8), jnp.int32)))
print(json.dumps({"dir": jax.config.jax_compilation_cache_dir,
                  "log": [m for m in records if "'jit_forward'" in m and ("cache hit" in m or "MISS" in m)]}))
"""


def test_a_second_reader_of_a_run_loads_its_forward_pass_from_the_runs_cache(two_runs):
    """open_run turns on the reader's default cache (~/.cache/moe-lm/jax, in HOME): a second process reading the
    run loads its forward pass from disk."""
    home, _ = two_runs
    read = lambda: json.loads(_run_without_the_suites_cache(
        READ, home, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0").strip().splitlines()[-1])
    first, second = read(), read()
    assert first["dir"] == str(home / ".cache" / "moe-lm" / "jax")
    assert any("MISS for 'jit_forward'" in m for m in first["log"]), first
    assert any("hit for 'jit_forward'" in m for m in second["log"]), second
    assert not any("MISS for 'jit_forward'" in m for m in second["log"]), second


def test_a_reader_never_caches_where_the_runs_config_says():
    """A run's config comes from wherever the run was written: its cache path is not the reader's to write."""
    assert compile_cache.reader_dir("/elsewhere/cache") == compile_cache.DEFAULT_DIR
    assert base_config().train.compile_cache_dir == compile_cache.DEFAULT_DIR
    assert compile_cache.reader_dir("") == ""  # a run with the cache off is read with it off
