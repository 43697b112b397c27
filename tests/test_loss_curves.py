"""train/loss_plot.py and its command, analysis/loss_curves.py: reading metrics.jsonl (torn lines), the series (repeated steps, missing values),
the figure (what each panel holds) and the CLI (one-line error, exit 2)."""

import json
import math

import numpy as np
import pytest

from analysis import loss_curves as loss_curves_cli
from rundir.metrics import read_rows
from train import loss_plot as loss_curves

PNG = b"\x89PNG\r\n\x1a\n"


def _rows():
    """Train rows every 5 steps, evals every 10 with two domains; a resume repeats steps 15-20 with new values,
    and a few values are None / NaN / not numbers."""
    rows = [{"step": s, "loss": 10.0 - 0.1 * s, "lr": 1e-3} for s in range(5, 25, 5)]
    rows += [{"step": s, "val/loss": 9.0 - 0.1 * s, "val/loss/code": 9.5 - 0.1 * s, "val/loss/law": 8.5 - 0.1 * s}
             for s in (10, 20)]
    rows += [{"step": 15, "loss": 1.5}, {"step": 20, "loss": 2.0},  # resumed: the last row of a step wins
             {"step": 25, "loss": None}, {"step": 30, "loss": float("nan")}, {"step": 35, "loss": "x"},
             {"step": 40, "loss": True}, {"loss": 3.0}, {"step": None, "loss": 3.0}, "not a dict", None,
             {"step": 30, "val/loss": 8.0, "val/loss/code": None, "val/loss/law": 7.0}]
    return rows


@pytest.fixture
def figures(monkeypatch):
    """The figures plot_loss_curves draws, captured before they are saved and closed."""
    captured, real_save = [], loss_curves.save
    monkeypatch.setattr(loss_curves, "save", lambda fig, path, **kw: (captured.append(fig), real_save(fig, path))[1])
    return captured


def test_read_rows_skips_blank_torn_and_non_object_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = [{"step": 5, "loss": 9.0}, {"step": 10, "val/loss": 8.0}]
    path.write_bytes(b"\n".join([json.dumps(good[0]).encode(), b"", b"[1, 2]", b"\xff\xfe garbage",
                                 json.dumps(good[1]).encode(), b'{"step": 15, "lo']))  # torn last line
    assert read_rows(path) == good


def test_series_keeps_the_last_row_of_a_step_and_skips_missing_values():
    steps, loss = loss_curves.series(_rows(), "loss")
    np.testing.assert_array_equal(steps, [5, 10, 15, 20])
    np.testing.assert_allclose(loss, [9.5, 9.0, 1.5, 2.0])
    steps, code = loss_curves.series(_rows(), "val/loss/code")
    np.testing.assert_array_equal(steps, [10, 20])  # step 30's None is skipped
    assert loss_curves.domain_keys(_rows()) == ["val/loss/code", "val/loss/law"]
    assert loss_curves.series([], "loss")[0].shape == (0,)


def test_figure_panels_hold_train_validation_and_domains(tmp_path, figures):
    out = loss_curves.plot_loss_curves(_rows(), tmp_path / "loss.png", title="run")
    assert out == tmp_path / "loss.png" and out.read_bytes()[:8] == PNG
    ax, ax_dom = figures[0].axes[:2]
    raw, smoothed, val = ax.get_lines()
    np.testing.assert_allclose(raw.get_ydata(), [9.5, 9.0, 1.5, 2.0])
    assert smoothed.get_linewidth() > raw.get_linewidth() and raw.get_alpha() < 1
    np.testing.assert_allclose(val.get_xdata(), [10, 20, 30])
    labels = [t.get_text() for t in ax_dom.get_legend().get_texts()]
    assert labels == ["code 7.500", "law 7.000", "all 8.000"]  # sorted by the last value, overall last


def test_without_evaluations_the_domain_panel_says_so(tmp_path, figures):
    rows = [{"step": s, "loss": 5.0 + math.sin(s)} for s in range(1, 50)]
    loss_curves.plot_loss_curves(rows, tmp_path / "loss.png")
    texts = [t.get_text() for t in figures[0].axes[1].texts]
    assert texts == ["no evaluation yet"]
    loss_curves.plot_loss_curves([], tmp_path / "empty.png")  # nothing logged yet: still a PNG, no error
    assert (tmp_path / "empty.png").read_bytes()[:8] == PNG
    assert [t.get_text() for t in figures[1].axes[0].texts] == ["no loss logged yet"]


def test_cli_without_metrics_is_one_line_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        loss_curves_cli.main(["--workdir", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no metrics.jsonl in") and err.count("\n") == 1
    with pytest.raises(SystemExit) as e:
        loss_curves_cli.main(["--bogus"])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def test_cli_on_the_tiny_run_writes_the_png(tiny_run, tmp_path, capsys):
    out = loss_curves_cli.main(["--workdir", str(tiny_run), "--out", str(tmp_path / "sub" / "loss.png")])
    assert out.read_bytes()[:8] == PNG
    assert "2 evaluations" in capsys.readouterr().out  # tiny: 20 steps, eval.every 10
