"""train/step_log.py on its own: metrics pulled one step late, written every log.every steps and at the end, the
first step's compile line, evaluation rows, and a NaN stop that names the last good checkpoint."""

import json

import numpy as np
import pytest

from plumbing.errors import UserError
from rundir.layout import RunDir
from tests.conftest import tiny_config
from train.step_log import StepLog


def _metrics(loss=1.0):
    return {"loss": np.float32(loss), "grad_norm": np.float32(0.5), "param_norm": np.float32(3.0),
            "load": np.ones(1, np.float32)}


def _log(tmp_path, lines, saved=None, steps=7):
    config = tiny_config(**{"log.every": 3, "train.steps": steps})
    return StepLog(config, RunDir(tmp_path), 0, tokens_per_step=10, flops_per_step=100.0, peak=1e3,
                   moe_layer_ids=[1], last_checkpoint=lambda: saved, say=lines.append)


def test_rows_every_log_every_steps_and_at_the_end(tmp_path):
    lines = []
    log = _log(tmp_path, lines)
    for step in range(1, 8):
        log.push(step, _metrics(loss=step))
        assert log.pending[0] == step  # the step just dispatched waits; the one before it was pulled
    log.flush()
    log.evaluation(7, {"val/loss": 2.5})
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 6, 7, 7]
    assert rows[0]["loss"] == 3.0 and rows[0]["moe/layer_1/load"] == 1.0 and rows[0]["tokens_per_sec"] > 0
    assert rows[-1] == {"step": 7, "val/loss": 2.5}
    assert log.last["loss"] == 7.0 and log.last["val/loss"] == 2.5
    assert any("compiling the train step included" in x for x in lines)
    assert any(x.startswith("step 7: val loss 2.5000") for x in lines)


@pytest.mark.parametrize("saved, said", [(4, "the last good checkpoint is step 4"), (None, "no checkpoint was saved")])
def test_a_nan_step_stops_naming_the_last_checkpoint(tmp_path, saved, said):
    log = _log(tmp_path, [], saved=saved)
    log.push(1, _metrics())
    log.push(2, _metrics(loss=float("nan")))  # pulled only once step 3 is dispatched, or on flush
    with pytest.raises(UserError, match=f"NaN/Inf at step 2; stopped, {said}"):
        log.flush()
    log.close()
