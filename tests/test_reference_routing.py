"""experiments.reference_routing: the controls on the tiny run, and the per-expert ablation summarized over seeds."""

import json

import numpy as np
import pytest
from scipy import stats

from analysis.ablate import cli as ablate
from experiments.reference_routing import ablation_seeds, controls


def test_controls_over_runs(tiny_run, tmp_path):
    out = tmp_path / "controls.json"
    per_run, summary = controls.run(controls.parse_args(
        ["--workdir", str(tiny_run), "--workdir", str(tiny_run), "--out", str(out)]), log=lambda *a: None)
    r = per_run[0]
    assert r["below_bigram"] == pytest.approx(r["bigram"] - r["val_loss"])
    assert set(r["controls"]) == {"all routed experts", "shared expert", "routed experts, layer 1"}
    assert summary["all routed experts"]["mean"][0] == pytest.approx(r["controls"]["all routed experts"])
    assert summary["val_loss"]["n"] == 2
    doc = json.loads(out.read_text())
    assert len(doc["runs"]) == 2 and "below_bigram" in doc["summary"]


def _ablation(reroute, zero, at_once, workdir="run"):
    """A synthetic `analysis.ablate --mode both` result: two MoE layers (ids 1, 2) of three experts."""
    return {"mode": "reroute", "workdir": workdir, "step": 7, "base_loss": 3.0, "layer_ids": [1, 2],
            "ablations": [[layer, e] for layer in (1, 2) for e in range(3)], "delta_A": reroute,
            "zero_output": {"delta_A": zero},
            "controls": {"names": ["all routed experts", "shared expert", "routed experts, layer 1",
                                   "routed experts, layer 2"], "delta_A": [1.0, 0.1, *at_once]},
            "spearman": {f"layer {i}": {"experts": 0.5, "expert_domain_pairs": 0.25} for i in (1, 2)}}


def test_ablation_over_seeds_reduces_each_run_to_layers_first(tmp_path):
    runs = [_ablation([0.01, 0.02, 0.03, 0.0, 0.1, 0.2], [0.02, 0.02, 0.05, 0.0, 0.1, 0.3], [0.1, 0.5]),
            _ablation([0.03, 0.02, 0.01, 0.2, 0.1, 0.0], [0.03, 0.03, 0.03, 0.2, 0.2, 0.2], [0.12, 0.6]),
            _ablation([0.0, 0.0, 0.03, 0.1, 0.1, 0.1], [0.0, 0.0, 0.03, 0.1, 0.1, 0.1], [0.06, 0.3])]
    paths = []
    for i, r in enumerate(runs):
        paths.append(tmp_path / f"ab{i}.json")
        paths[-1].write_text(json.dumps(r))
    out = tmp_path / "summary.json"
    per_run, summary = ablation_seeds.run(ablation_seeds.parse_args([*map(str, paths), "--out", str(out)]),
                                          log=lambda *a: None)
    first = per_run[0]["per_layer"]
    assert first["zeroed, max"] == pytest.approx([0.05, 0.3]) and first["zeroed, sum"] == pytest.approx([0.09, 0.4])
    assert first["zeroed - rerouted, mean"] == pytest.approx([0.01, 0.1 / 3])
    assert first["sum / at once"] == pytest.approx([0.9, 0.8])
    assert per_run[0]["model"]["layers zeroed one at a time, summed"] == pytest.approx(0.6)
    sums = np.array([[0.09, 0.4], [0.09, 0.6], [0.03, 0.3]])  # each run's per-layer sum of the zeroed effects
    half = stats.t.ppf(0.975, 2) * sums.std(0, ddof=1) / np.sqrt(3)
    s = summary["per_layer"]["zeroed, sum"]
    assert s["mean"] == pytest.approx(sums.mean(0)) and s["ci95_high"] == pytest.approx(sums.mean(0) + half)
    assert json.loads(out.read_text())["summary"]["model"]["all routed experts"]["n"] == 3


def test_ablation_over_seeds_rejects_a_reroute_only_result(tmp_path, capsys):
    bad = _ablation([0.0] * 6, [0.0] * 6, [0.1, 0.1])
    del bad["zero_output"]
    (tmp_path / "ab.json").write_text(json.dumps(bad))
    with pytest.raises(SystemExit) as e:
        ablation_seeds.main([str(tmp_path / "ab.json"), "--out", str(tmp_path / "s.json")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "--mode both" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "s.json").exists()


def test_ablation_over_seeds_reads_what_analysis_ablate_writes(tiny_run, tmp_path):
    ablate.main(["--workdir", str(tiny_run), "--mode", "both", "--out", str(tmp_path), "--rows_per_domain", "1"])
    per_run, summary = ablation_seeds.run(ablation_seeds.parse_args(
        [str(tmp_path / "ablation.json"), "--out", str(tmp_path / "s.json")]), log=lambda *a: None)
    layer = per_run[0]["per_layer"]
    assert len(layer["zeroed, sum"]) == len(per_run[0]["layers"]) >= 1
    assert np.isfinite(layer["layer zeroed at once"]).all() and summary["per_layer"]["zeroed, mean"]["n"] == 1
