"""A checkpoint write that hits a file-size limit (EFBIG, `ulimit -f`) is treated like a full disk: one line on
stderr, exit 2, no traceback, the last complete checkpoint kept, and the run resumes once the limit is raised."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from plumbing.errors import os_error, storage_full
from rundir.checkpoints import steps_in
from rundir.layout import RunDir
from tests.conftest import tiny_config
from train.loop import run

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 1 << 20  # bytes per file: a tiny checkpoint's largest data file is a few MB


def _train(workdir, steps, limit=None):
    cmd = [sys.executable, "-m", "train", f"--config={ROOT / 'configs' / 'tiny.py'}", f"--workdir={workdir}",
           f"--config.train.steps={steps}", "--config.log.progress=False", "--config.log.peak_flops=1e12",
           "--config.log.tensorboard=False"]
    if limit:  # set by the shell that execs the run: no Python in a child forked from this multithreaded process
        assert limit % 1024 == 0
        cmd = ["bash", "-c", f"ulimit -f {limit // 1024} && exec \"$@\"", "bash", *cmd]
    # Python ignores SIGXFSZ, so a write past the limit fails with EFBIG instead of killing the process.
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_storage_errors_are_recognised_through_wrappers():
    efbig = OSError(27, "File too large")
    assert storage_full(RuntimeError("write failed")) is None
    assert storage_full(efbig)[0] == "a file reached the file-size limit"
    wrapped = ValueError("tensorstore: write failed")
    wrapped.__cause__ = efbig
    assert storage_full(wrapped)[0] == "a file reached the file-size limit"
    assert storage_full(RuntimeError("No space left on device"))[0] == "the disk is full"
    assert "ulimit -f" in str(os_error(efbig))


@pytest.mark.slow
def test_a_file_size_limit_keeps_the_last_checkpoint_and_resumes(tiny_run, tmp_path):
    work = tmp_path / "run"
    shutil.copytree(tiny_run, work)
    shutil.rmtree(work / "checkpoints" / "20")  # the run as it stood after its checkpoint at step 10
    limited = _train(work, 20, limit=LIMIT)
    err = limited.stderr.strip()
    assert limited.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("error: a file reached the file-size limit") and "ulimit -f" in err, err
    assert steps_in(RunDir(work).checkpoints) == [10]
    logs = []
    run(tiny_config(), work, log=logs.append)  # the limit raised: the same run resumes
    assert any("from step 10" in line for line in logs), logs
    assert steps_in(RunDir(work).checkpoints) == [10, 20]
    assert not list((work / "checkpoints").glob("*tmp*")), "the failed save's temporary directory is left"
