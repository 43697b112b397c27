"""analysis.dynamics: saturation against hand-computed sets, the trajectory over the tiny run's checkpoints
(saturation 1 at the final one, zero biases at step 0), the CLI's outputs and bad input."""

import json

import numpy as np
import pytest

from analysis.dynamics import cli as dynamics
from analysis.dynamics import trajectory
from analysis.specialization import baselines


def _record(ids_BxLxK):
    ids = np.asarray(ids_BxLxK, np.int16)
    shape = ids.shape[:2]
    batch = {"valid": np.ones(shape, bool), "ids": [ids]}
    return baselines.RoutingRecord([batch], ["a"], 4, ids.shape[-1], vocab_size=4)


def test_saturation_and_load_hand_case():
    final = _record([[[0, 1], [2, 3]]])
    early = _record([[[1, 2], [3, 2]]])  # token 1 shares {1} of {0, 1}, token 2 both of {2, 3}: 3 of 4
    assert trajectory.saturation(early, final)[0] == pytest.approx(0.75)
    assert trajectory.saturation(final, final)[0] == 1.0
    np.testing.assert_array_equal(trajectory.load(early), [[0, 1, 2, 1]])


@pytest.fixture(scope="module")
def traj(tiny_run):
    return trajectory.trajectory(tiny_run, max_tokens=256, log=lambda *a: None)


def test_trajectory_over_every_checkpoint(traj):
    assert list(traj["steps"]) == [0, 10, 20] and traj["final_step"] == 20
    sat_SxL = traj["saturation_SxL"]
    assert sat_SxL[-1, 0] == 1.0 and (sat_SxL[:-1] < 1).all() and (sat_SxL >= 0).all()
    assert not traj["bias_SxLxE"][0].any() and traj["bias_SxLxE"][-1].any()  # step 0: zero biases
    np.testing.assert_array_equal(traj["load_SxLxE"].sum(-1), traj["n_tokens"] * traj["top_k"])


def test_dynamics_cli_outputs(tiny_run, tmp_path):
    dynamics.main(["--workdir", str(tiny_run), "--out", str(tmp_path), "--max_tokens", "256"])
    doc = json.loads((tmp_path / "dynamics.json").read_text())
    assert doc["steps"] == [0, 10, 20] and doc["saturation_SxL"][-1] == [1.0]
    assert doc["training"]["maxvio"]["1"]["steps"] and doc["training"]["bias_range"]["1"]["values"]
    for name in ("dynamics_saturation.png", "dynamics_load.png", "dynamics_bias.png"):
        assert (tmp_path / name).stat().st_size > 10_000


@pytest.mark.parametrize("extra, expected", [
    (["--final_step", "7"], "available steps: [10, 20]"),
    (["--max_tokens", "0"], "--max_tokens must be >= 1"),
])
def test_dynamics_bad_input_one_line_exit_2(tiny_run, tmp_path, capsys, extra, expected):
    with pytest.raises(SystemExit) as e:
        dynamics.main(["--workdir", str(tiny_run), "--out", str(tmp_path), *extra])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and expected in err, err


def test_dynamics_missing_workdir(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        dynamics.main(["--workdir", str(tmp_path / "nope")])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err
