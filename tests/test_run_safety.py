"""What docs/reliability.md promises: the lock, metrics that stay one row per step across kills and torn lines,
bitwise resume after SIGKILL during a save and after a full disk, signals from process start, and readers
that fall back past a damaged newest checkpoint."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from analysis.rank import cli as rank
from rundir import RunDir, metrics
from rundir.checkpoints import steps_in
from rundir.lock import RunLock
from tests.conftest import tiny_config
from train import export, generate
from train.__main__ import main
from train.loop import run

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.py")
KEYS = ("loss", "grad_norm", "param_norm", "moe/layer_1/bias_range")
# Bitwise comparisons need the same device count in the subprocess as in this process (conftest: 8).
ENV = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A small tmpfs mounted at `path` for the test (root only; skipped with the reason otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)])


def _train_rows(workdir) -> dict:
    rows = [r for r in metrics.read_rows(Path(workdir) / "metrics.jsonl") if "loss" in r]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r for r in rows}


def _cli(workdir, *args):
    return [sys.executable, "-m", "train", f"--config={TINY}", f"--workdir={workdir}", "--config.log.progress=False",
            "--config.log.peak_flops=1e12", "--config.log.tensorboard=False", *args]


# ---------------------------------------------------------------- metrics.jsonl


def test_truncate_after_drops_later_rows_and_torn_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": float(s)} for s in (1, 2, 3, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "lo')
    assert [r["step"] for r in metrics.read_rows(path)] == [1, 2, 3, 4]  # the torn line is skipped
    assert metrics.truncate_after(path, 2) == 3
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in rows[:2])
    assert metrics.truncate_after(path, 2) == 0  # nothing to do: the file is left alone
    path.write_text(path.read_text() + "not json\n[1, 2]\n")
    assert metrics.truncate_after(path, 10) == 2 and len(metrics.read_rows(path)) == 2


# ---------------------------------------------------------------- the lock


def test_stale_lock_is_taken_over(tmp_path):
    work = tmp_path / "run"
    work.mkdir()
    (work / ".lock").write_text("pid 999999 on gone-host\n")  # a process that died without unlocking
    logs = []
    run(tiny_config(**{"train.steps": 2, "eval.every": 100, "checkpoint.every": 100}), work, log=logs.append)
    assert any("took over the lock" in line and "999999" in line for line in logs), logs
    assert (work / ".lock").read_text() == ""  # released at the end
    assert RunLock(work / ".lock").acquire().previous == ""


@pytest.mark.slow
def test_second_process_is_refused_naming_the_holder(tiny_run, tmp_path):
    work = tmp_path / "copy"
    shutil.copytree(tiny_run, work)
    before = (work / "metrics.jsonl").read_bytes()
    with RunLock(work / ".lock"):
        r = subprocess.run(_cli(work, "--config.train.steps=40"), cwd=ROOT, env=ENV, capture_output=True,
                           text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and f"pid {os.getpid()}" in r.stderr, r.stderr
    assert (work / "metrics.jsonl").read_bytes() == before


# ---------------------------------------------------------------- kills, torn lines, full disk


@pytest.fixture(scope="module")
def reference(tiny_run):
    """The shared uninterrupted tiny run (configs/tiny.py, 20 steps, logged every 5): every interrupted run of
    the same config must reproduce its rows bitwise."""
    return _train_rows(tiny_run)


@pytest.mark.slow
def test_sigkill_during_saves_then_bitwise_resume_without_duplicate_rows(tmp_path, reference):
    work = tmp_path / "run"
    # A checkpoint every step, saved synchronously: most of the run's time is spent saving, so the kill lands
    # in (or right next to) a save.
    p = subprocess.Popen(_cli(work, "--config.checkpoint.every=1", "--config.checkpoint.async_save=False"),
                         cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while time.time() < deadline and metrics.last_step(work / "metrics.jsonl") < 10:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    with open(work / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "loss": 1.')  # and a torn last line, as a kill mid-write leaves
    logs = []
    run(tiny_config(), work, log=logs.append)
    assert any("resuming" in line for line in logs), logs
    rows = _train_rows(work)
    assert sorted(rows) == sorted(reference)
    for step, ref in reference.items():
        for key in KEYS:
            assert rows[step][key] == ref[key], (step, key)


@pytest.mark.slow
def test_full_disk_keeps_the_last_checkpoint_and_resumes_bitwise(tmp_path, reference):
    with tmpfs(tmp_path / "small_disk", "size=24m") as mnt:
        work = mnt / "run"
        # ~10 MB per tiny checkpoint: steps 5 and 10 fit, 15 does not.
        r = subprocess.run(_cli(work, "--config.checkpoint.every=5", "--config.checkpoint.keep=100"),
                           cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "disk is full" in r.stderr, r.stderr
        saved = steps_in(RunDir(work).checkpoints)
        assert saved and saved[-1] < 20, saved
        subprocess.run(["mount", "-o", "remount,size=200m", str(mnt)], check=True)  # space freed
        logs = []
        run(tiny_config(**{"checkpoint.every": 5}), work, log=logs.append)
        assert any(f"from step {saved[-1]}" in line for line in logs), logs
        rows = _train_rows(work)
        for step, ref in reference.items():
            for key in KEYS:
                assert rows[step][key] == ref[key], (step, key)
        assert not list((work / "checkpoints").glob("*tmp*")), "the failed save's temporary directory is left"


def test_read_only_file_system_is_one_line(tmp_path, capsys):
    with tmpfs(tmp_path / "ro", "ro,size=1m") as mnt:
        with pytest.raises(SystemExit) as e:
            main(["train", f"--config={TINY}", f"--workdir={mnt / 'run'}", "--config.log.peak_flops=1e12"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "read-only" in err and str(mnt) in err, err


# ---------------------------------------------------------------- signals


@pytest.mark.slow
def test_sigterm_during_startup_exits_0_without_traceback(tmp_path):
    p = subprocess.Popen(_cli(tmp_path / "run", "--config.train.steps=1000"), cwd=ROOT, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)  # imports and compilation: before the first step
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0 and "Traceback" not in err, err
    assert "SIGTERM" in out


@pytest.mark.slow
def test_sigint_saves_a_checkpoint_and_says_where_it_resumes(tmp_path):
    """Also the CLI smoke run: the real entry point logs every metric, TensorBoard events and a checkpoint."""
    work = tmp_path / "run"
    p = subprocess.Popen(_cli(work, "--config.train.steps=100000", "--config.log.every=1",
                              "--config.checkpoint.every=100000", "--config.eval.every=100000",
                              "--config.log.tensorboard=True"),
                         cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and metrics.last_step(work / "metrics.jsonl") < 3:
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in err, err
    saved = steps_in(RunDir(work).checkpoints)
    assert saved and f"resume from step {saved[-1]}" in out, out
    rows = _train_rows(work)
    assert {"tokens_per_sec", "mfu", "peak_flops", "lr", "balance_loss", "moe/layer_1/maxvio",
            "moe/layer_1/dead_experts"} <= set(rows[3])
    assert rows[3]["peak_flops"] == 1e12 and list((work / "tensorboard").iterdir())


# ---------------------------------------------------------------- readers fall back past a damaged checkpoint


@pytest.fixture(scope="module")
def damaged_run(tiny_run, tmp_path_factory):
    work = tmp_path_factory.mktemp("damaged") / "run"
    shutil.copytree(tiny_run, work)
    for f in (work / "checkpoints" / "20" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    return work


def _quiet_ok(capsys):
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "Traceback" not in captured.out
    return captured


def test_export_falls_back_to_the_previous_checkpoint(damaged_run, tmp_path, capsys):
    export.main(["--workdir", str(damaged_run), "--out", str(tmp_path / "o"), "--format", "safetensors"])
    err = _quiet_ok(capsys).err  # diagnostics on stderr
    assert "checkpoint 20" in err and "unreadable" in err
    assert json.loads((tmp_path / "o" / "moe-export.json").read_text())["step"] == 10


def test_generate_and_rank_fall_back_to_the_previous_checkpoint(damaged_run, tmp_path, capsys):
    generate.main(["--workdir", str(damaged_run), "--prompt", "The", "--max_new_tokens", "3"])
    captured = _quiet_ok(capsys)
    assert "unreadable" in captured.err and "unreadable" not in captured.out  # the text alone on stdout
    rank.main(["--workdir", str(damaged_run), "--out", str(tmp_path / "rank"), "--sequences", "2"])
    _quiet_ok(capsys)
    assert json.loads((tmp_path / "rank" / "rank.json").read_text())["step"] == 10


def test_generate_warns_past_the_trained_length(tiny_run, capsys):
    generate.main(["--workdir", str(tiny_run), "--prompt", "The", "--max_new_tokens", "70"])
    err = capsys.readouterr().err
    assert "warning" in err and "past the 64" in err
