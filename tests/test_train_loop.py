"""The training loop: bitwise resume, NaN stop, bad input (one line, exit 2), CLI smoke run, SIGTERM."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plumbing.errors import UserError
from rundir import open_run
from tests.conftest import tiny_config
from train.__main__ import main
from train.loop import run

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.py")


def _metrics(workdir):
    """Last logged value per (step, key) of the training rows."""
    rows = [json.loads(x) for x in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def _legacy_config(config: dict) -> dict:
    """A run config as versions before the model/execution split wrote it: execution keys and the balance-loss
    weight under "model", no "execution" section."""
    old = json.loads(json.dumps(config))
    execution = old.pop("execution")  # its keys added after the split did not exist then
    old["model"].update({k: execution[k] for k in ("dispatch", "capacity_factor", "grouped_matmul",
                                                   "attention_impl", "dtype", "remat")})
    old["model"]["balance_loss_weight"] = old["train"].pop("balance_loss_weight")
    return old


def _rewrite_as_legacy_run(workdir):
    """config.json and every checkpoint's metadata in the layout written before the split."""
    (workdir / "config.json").write_text(json.dumps(_legacy_config(json.loads((workdir / "config.json").read_text()))))
    rewritten = 0
    for path in (workdir / "checkpoints").rglob("*"):
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if isinstance(meta, dict) and {"config", "model", "tokenizer"} <= set(meta):
            meta["config"] = _legacy_config(meta["config"])
            meta["model"] = {**meta["model"], **{k: meta["config"]["model"][k] for k in
                                                 ("dispatch", "capacity_factor", "grouped_matmul", "attention_impl",
                                                  "dtype", "remat", "balance_loss_weight")}}
            path.write_text(json.dumps(meta))
            rewritten += 1
    assert rewritten, "no checkpoint metadata found to rewrite"


def test_resume_is_bitwise_exact(tmp_path):
    """Resuming gives the uninterrupted run's steps bit for bit, also for a run written before the
    model/execution split (its config and checkpoint metadata in the old layout)."""
    c = tiny_config(**{"train.steps": 8, "checkpoint.every": 4, "log.every": 1, "eval.every": 100})
    a, b = tmp_path / "a", tmp_path / "b"
    run(c, a, log=lambda *x: None)
    run(c, b, log=lambda *x: None)
    shutil.rmtree(b / "checkpoints" / "8")  # as if the run had been killed after saving step 4
    _rewrite_as_legacy_run(b)
    assert open_run(b).config.execution.dispatch == "dropless"  # read through the migration
    lines = []
    run(c, b, log=lambda *x: lines.append(" ".join(map(str, x))))  # resumes from step 4
    # The first step's wall time, compile included, is reported for the resumed run's first step.
    assert any(line.startswith("step 5: done") and "compiling the train step included" in line for line in lines)
    ma, mb = _metrics(a), _metrics(b)
    for step in range(5, 9):
        for key in ("loss", "grad_norm", "param_norm", "moe/layer_1/bias_range"):
            assert ma[step][key] == mb[step][key], (step, key)


def test_nan_stops_and_keeps_last_good_checkpoint(tmp_path):
    good = tiny_config(**{"train.steps": 4, "checkpoint.every": 2})
    run(good, tmp_path, log=lambda *x: None)
    bad = tiny_config(**{"train.steps": 8, "checkpoint.every": 1, "train.lr": 1e38, "train.warmup_steps": 1})
    with pytest.raises(UserError, match=r"NaN/Inf at step 5.*last good checkpoint is step 4"):
        run(bad, tmp_path, log=lambda *x: None)
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]


def _cli_error(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main(["train", f"--config={TINY}", *args])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize("args,expected", [
    (["--config.mesh.data=3"], "mesh"),
    (["--config.mesh.data=2", "--config.mesh.tensor=4", "--config.model.vocab_size=8194"], "does not split"),
    (["--config.train.batch_size=6"], "train.batch_size"),
    (["--config.train.no_such_key=1"], "no_such_key"),
    (["--config.model.top_k=99"], "model.top_k"),
    (["--config.execution.attention_impl=cudnn"], "execution.attention_impl"),  # tiny config is float32
    (["--config.execution.attention_impl=cudnn", "--config.execution.dtype=bfloat16", "--config.data.seq_len=33"],
     "data.seq_len=33"),
    (["--config.model.dispatch=capacity"], "is now execution.dispatch"),
    # 1-row micro-batches of 63 tokens cannot split over 8 expert-parallel devices
    (["--config.mesh.data=1", "--config.mesh.expert=8", "--config.execution.dispatch=expert_parallel",
      "--config.train.grad_accum=8", "--config.data.seq_len=63"], "data*fsdp*expert = 8"),
    (["--config.data.tokenizer=/nonexistent/tokenizer.json"], "tokenizer"),
    (["--config.data.name=no_such_dataset"], "no_such_dataset"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, args, expected):
    err = _cli_error(capsys, f"--workdir={tmp_path}", *args)
    assert expected in err


@pytest.mark.parametrize("content,expected", [(b"", "empty"), (b'{"text": "caf\xe9"}\n', "UTF-8")])
def test_bad_corpus_file(tmp_path, capsys, content, expected):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.jsonl").write_text(json.dumps({"text": "hello world " * 50}) + "\n")
    (corpus / "bad.jsonl").write_bytes(content)
    err = _cli_error(capsys, f"--workdir={tmp_path / 'run'}", f"--config.data.corpus_dir={corpus}",
                     f"--config.data.tfds_data_dir={tmp_path / 'tfds'}")
    assert "bad.jsonl" in err and expected in err


def test_incompatible_checkpoint(tiny_run, tmp_path, capsys):
    work = tmp_path / "copy"
    shutil.copytree(tiny_run, work)
    err = _cli_error(capsys, f"--workdir={work}", "--config.model.d_model=32")
    assert "model.d_model" in err and "new --workdir" in err


def _env():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.slow
def test_sigterm_saves_and_exits_0(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "train", f"--config={TINY}", f"--workdir={tmp_path}",
                          "--config.train.steps=100000", "--config.log.every=1", "--config.checkpoint.every=100000",
                          "--config.eval.every=100000", "--config.log.progress=False"],
                         cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    t0 = time.time()
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    assert time.time() - t0 < 30
    saved = [int(d.name) for d in (tmp_path / "checkpoints").iterdir() if d.name.isdigit()]
    assert saved and saved[0] >= 3


def test_damaged_latest_checkpoint_falls_back_to_previous(tiny_run, tmp_path):
    work = tmp_path / "copy"
    shutil.copytree(tiny_run, work)
    for f in (work / "checkpoints" / "20" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")  # damage every file of the newest checkpoint's state
    logs = []
    run(tiny_config(), work, log=logs.append)  # resumes from 10 and trains 11..20 again
    assert any("checkpoint 20" in line and "damaged" in line for line in logs), logs
    assert any("resuming" in line and "step 10" in line for line in logs), logs
    assert (work / "checkpoints" / "20.damaged").is_dir() and (work / "checkpoints" / "20").is_dir()
    rows = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["step"] == 20 and "loss" in r for r in rows) == 1  # trained again; the old row was dropped


def test_resuming_with_a_changed_schedule_says_what_changed(tmp_path):
    """A finished 4-step run resumed under a config that says 8 steps (and another peak rate) continues, and says
    which settings changed and that the schedule follows them from here."""
    run(tiny_config(**{"train.steps": 4, "checkpoint.every": 4, "eval.every": 100}), tmp_path, log=lambda *x: None)
    lines = []
    run(tiny_config(**{"train.steps": 8, "checkpoint.every": 4, "eval.every": 100, "train.lr": 1e-3}), tmp_path,
        log=lambda *x: lines.append(" ".join(map(str, x))))
    note = next(line for line in lines if line.startswith("note: the config differs"))
    assert "train.steps 4 -> 8" in note and "train.lr 0.003 -> 0.001" in note and "Steps 5 on" in note
    lines.clear()
    run(tiny_config(**{"train.steps": 8, "checkpoint.every": 4, "eval.every": 100, "train.lr": 1e-3}), tmp_path,
        log=lambda *x: lines.append(" ".join(map(str, x))))
    assert not any("differs" in line for line in lines)  # finished: nothing to resume, nothing to note
