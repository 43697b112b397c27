"""The head-size sweep (experiments.head_sweep) on synthetic results: configs with equal parameters across d_head,
one family (docs/inference.md) of the per-d_head tests and the seed-clustered slope, the report from finished runs."""

import json

import numpy as np
import pytest

from experiments.common.runs import fingerprint
from experiments.head_sweep import report as sweep_report
from experiments.head_sweep import runner as head_sweep
from experiments.masks_round2 import runner as study
from moe.accounting import param_counts
from plumbing.errors import UserError
from tests.test_study import REFS, fake_result
from train.preflight import parse


def study_base():
    from experiments.masks_round2.config import get_config

    return get_config()


def test_head_configs_keep_parameters_and_group_ratio():
    base = study_base()
    counts = set()
    for d in head_sweep.HEAD_DIMS:
        c = head_sweep.head_config(base, d)
        m = c.model
        assert m.head_dim == d and m.n_heads * d == 128 and m.n_heads == 2 * m.n_kv_heads
        counts.add(param_counts(parse(c).model)["total"])
        c.model.head_dim = base.model.head_dim  # the only changes: the head split
        c.model.n_heads, c.model.n_kv_heads = base.model.n_heads, base.model.n_kv_heads
        assert c.to_dict() == base.to_dict()
    assert len(counts) == 1
    with pytest.raises(UserError, match="--head_dims"):
        head_sweep.head_config(base, 128)  # one head: not a multiple of the group of 2


def cell(d, shift, causal=3.5, seeds=4, slope_noise=0.0):
    rs = []
    for s in range(seeds):
        o = 0.01 * (s - 1.5)
        rs += [fake_result("causal", s, causal + o),
               fake_result("prefix", s, causal + o + shift + o / 4 + slope_noise * s * np.log2(128 / d))]
    return {"d_head": d, "n_over_d": 128 / d, "results": rs, "ranks": {"causal": [0.3], "prefix": [0.2, 0.4]},
            "bigram": REFS["bigram"]}


def test_one_family_over_the_d_heads_and_the_seed_clustered_slope():
    cells = [cell(64, 0.0), cell(32, 0.05), cell(16, 0.10), cell(8, 0.15, causal=4.9)]
    rows = sweep_report.sweep_rows(cells)
    by_d = {r["d_head"]: r for r in rows if "d_head" in r}
    assert len(rows) == 5 and rows[-1]["contrast"] == sweep_report.SLOPE
    assert by_d[8]["verdict"] == "not interpretable"  # its causal arm is 0.1 below the bigram
    assert by_d[16]["verdict"] == "prefix worse" and by_d[16]["p_holm"] >= by_d[16]["p"]
    assert by_d[64]["verdict"] == "equivalent"
    assert by_d[32]["erank"] == {"causal": pytest.approx(0.3), "prefix": pytest.approx(0.3)}
    # one slope per seed (0.05 per doubling, the seeds' offsets cancel): 4 values, not 16 differences; the gate
    # fails on d_head 8, so the slope is not interpreted
    trend = rows[-1]
    assert trend["n"] == 4 and trend["mean"] == pytest.approx(0.05, abs=1e-3)
    assert trend["verdict"] == "not interpretable"
    trend = sweep_report.sweep_rows(cells[:3])[-1]
    assert trend["verdict"] == "rises with n_in / d_head"


def test_slope_interval_is_over_seeds_when_seeds_disagree():
    """Seeds whose slopes differ widen the interval: the seed, not the seed x d_head point, is the unit."""
    cells = [cell(d, 0.0, slope_noise=0.02) for d in (64, 32, 16)]
    trend = sweep_report.sweep_rows(cells)[-1]
    per_seed = trend["diffs"]
    assert per_seed == pytest.approx([0.02 * s * 1.0 + 0.0 for s in range(4)], abs=1e-9)  # slope 0.02 s per doubling
    assert trend["lo"] < trend["mean"] < trend["hi"] and trend["n"] == 4


def test_sweep_report_from_finished_runs(tmp_path):
    """--report_only over fabricated finished runs (the runner's own fingerprints): one study per d_head, the
    sweep's table, plot and json."""
    base, steps, dims = study_base(), 1500, (64, 16)
    for d, shift in zip(dims, (0.0, 0.08)):
        cfg = head_sweep.head_config(base, d)
        out = tmp_path / f"d{d}"
        for s in range(2):
            for arm in head_sweep.ARMS:
                r = fake_result(arm, s, 3.5 + 0.01 * s + (shift if arm == "prefix" else 0.0) + 0.002 * s * (arm == "prefix"))
                r["fingerprint"] = fingerprint(study.arm_config(cfg, arm, s, steps))
                (out / arm / f"seed{s}").mkdir(parents=True)
                (out / arm / f"seed{s}" / "result.json").write_text(json.dumps(r))
        refs = dict(REFS, fingerprint=fingerprint(study.arm_config(cfg, "causal", 0, steps)))
        (out / "references.json").write_text(json.dumps(refs))
    ranks = []

    def rank_fn(workdir, mask):  # seed 0 stands for a run kept without its checkpoint
        ranks.append((workdir.parent.name, mask))
        return None if workdir.name == "seed0" else {"causal": 0.3, "prefix": 0.6}[mask]

    report = head_sweep.run_sweep(base, dims, 2, steps, tmp_path, log=lambda m: None, report_only=True,
                                  rank_fn=rank_fn)
    assert sorted(ranks) == sorted([(a, a) for a in head_sweep.ARMS] * 2 * len(dims))
    text = report.read_text()
    assert "| prefix - causal at d_head 64 | passes (2 / 2) |" in text and "| prefix - causal at d_head 16 | passes" in text
    assert sweep_report.SLOPE in text
    saved = json.loads((tmp_path / "head_sweep.json").read_text())
    assert [r["mean"] for r in saved["rows"]] == pytest.approx([0.001, 0.081])
    assert saved["rows"][0]["erank"] == {"causal": pytest.approx(0.3), "prefix": pytest.approx(0.6)}
    assert (tmp_path / "head_sweep.png").stat().st_size > 1000
    assert (tmp_path / "d16" / "report" / "report.md").is_file()


@pytest.mark.parametrize("flags,msg", [(["--head_dims", "32"], "at least 2"), (["--head_dims", "32,x"], "integers"),
                                       (["--head_dims", "32,128"], "divide"), (["--seeds", "1"], "--seeds")])
def test_bad_flags_are_one_line_errors(flags, msg, capsys):
    with pytest.raises(SystemExit) as e:
        head_sweep.main(["prog", *flags])
    assert e.value.code == 2 and msg in capsys.readouterr().err
