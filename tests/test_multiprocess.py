"""Several JAX processes over loopback: 2 processes x 4 fake CPU devices (gloo collectives) train exactly like
1 process x 8 devices (mesh data=4, expert=2: expert-parallel all_to_all within each process, data parallel
across), and their checkpoints resume in a 1-process run and back; an all_to_all over an expert axis spanning
both processes equals the reference. The 1-process runs happen in this (8-device) test process."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import FAST_COMPILE_XLA_FLAGS, tiny_config
from train.loop import run

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = {"train.steps": 4, "log.every": 1, "eval.every": 100, "checkpoint.every": 2,
             "checkpoint.async_save": False, "mesh.data": -1, "mesh.expert": 2,
             "execution.dispatch": "expert_parallel_dropless"}

WORKER = """
import sys, jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
from configs.tiny import get_config
from train.loop import run
c = get_config()
c.log.update(progress=False, peak_flops=1e12, tensorboard=False)
for key, value in {overrides!r}.items():
    node = c
    *path, leaf = key.split(".")
    for p in path:
        node = node[p]
    node[leaf] = value
run(c, sys.argv[1], log=lambda *a: None)
if len(sys.argv) > 2:  # an all_to_all that crosses processes: the expert axis spans all 8 devices
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    from moe import router, sharding
    from moe.dispatch import expert_parallel, experts
    mesh = sharding.make_mesh(1, 1, 8, 1)
    rng = np.random.default_rng(0)
    x, w_router = rng.normal(size=(64, 12)).astype("f4"), rng.normal(size=(12, 8)).astype("f4")
    ws = [rng.normal(size=s).astype("f4") * 0.3 for s in [(8, 12, 10), (8, 12, 10), (8, 10, 12)]]
    _, ids, gates = router.route(x, w_router, np.zeros(8, "f4"), top_k=2)
    ids, gates = np.asarray(ids), np.asarray(gates)
    want = np.asarray(experts.reference(x, ids, gates, *ws))
    rep = NamedSharding(mesh, PartitionSpec())
    args = [jax.make_array_from_callback(a.shape, rep, lambda i, a=a: a[i]) for a in (x, ids, gates, *ws)]
    y, _ = jax.jit(lambda *a: expert_parallel.dispatch(*a, mesh=mesh))(*args)
    print("EP_MAX_ERR", max(float(np.abs(np.asarray(s.data) - want[s.index]).max()) for s in y.addressable_shards))
jax.distributed.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_two_processes(workdir, cache_dir, *extra):
    port = _free_port()
    procs = []
    for i in range(2):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {FAST_COMPILE_XLA_FLAGS}",
               "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i),
               "PYTHONPATH": str(ROOT),
               # The second 2-process run reuses the first one's compiled programs.
               "JAX_COMPILATION_CACHE_DIR": str(cache_dir), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
               "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER.format(overrides=OVERRIDES), str(workdir), *extra],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


def _wait(procs) -> list[str]:
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out.decode()[-3000:]
        outs.append(out.decode())
    return outs


def _run_here(workdir):
    run(tiny_config(**OVERRIDES), workdir, log=lambda *a: None)


def _losses(workdir) -> dict:
    """step -> loss, the last row written for each step (a resumed run appends)."""
    rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _rewind_to_step_2(src, dst):
    shutil.copytree(src, dst)
    shutil.rmtree(Path(dst) / "checkpoints" / "4")


@pytest.mark.slow
def test_two_processes_match_one_and_checkpoints_cross_over(tmp_path):
    # The 2 processes run while the 1-process reference trains here.
    procs = _start_two_processes(tmp_path / "two", tmp_path / "jax_cache", "check_ep")
    _run_here(tmp_path / "one")
    for out in _wait(procs):  # expert-parallel all_to_all across the 2 processes == the loop reference
        assert float(out.split("EP_MAX_ERR")[1].split()[0]) < 1e-5, out[-2000:]
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    np.testing.assert_allclose([two[s] for s in one], list(one.values()), rtol=1e-5)

    # Resume across process counts from step 2: 2-process checkpoint in 1 process, 1-process one in 2.
    _rewind_to_step_2(tmp_path / "one", tmp_path / "one_then_two")
    _rewind_to_step_2(tmp_path / "two", tmp_path / "two_then_one")
    procs = _start_two_processes(tmp_path / "one_then_two", tmp_path / "jax_cache")
    _run_here(tmp_path / "two_then_one")
    _wait(procs)
    for name in ("one_then_two", "two_then_one"):
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        # Step 4 was trained again (its checkpoint is back) and logged once (the stopped run's row was dropped).
        assert (tmp_path / name / "checkpoints" / "4").is_dir(), f"{name}: step 4 was not re-run"
        assert sum(r["step"] == 4 and "loss" in r for r in rows) == 1, f"{name}: step 4 logged twice"
        resumed = _losses(tmp_path / name)
        np.testing.assert_allclose([resumed[3], resumed[4]], [one[3], one[4]], rtol=1e-5)
