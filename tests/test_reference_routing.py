"""experiments.reference_routing.controls on the tiny run: per-run references and controls, summarized over runs."""

import json

import pytest

from experiments.reference_routing import controls


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
