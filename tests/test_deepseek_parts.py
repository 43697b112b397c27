"""experiments/deepseek_parts: the three arms differ only in the part each takes away, and the runner trains, scores
(main head only), caches and reports them under docs/inference.md's rules."""

import json
from pathlib import Path

import pytest

from experiments.deepseek_parts import runner as study
from train.preflight import parse


def test_arms_take_away_one_part_each():
    from configs.deepseek_mini import get_config

    base = get_config()
    cfgs = {a: study.arm_config(base, a, 0, 10) for a in study.ARMS}
    for c in cfgs.values():
        parse(c)
    m = {a: parse(c).model for a, c in cfgs.items()}
    assert (m["mla_mtp"].mtp_depth, m["mla"].mtp_depth, m["gqa"].mtp_depth) == (1, 0, 0)
    assert m["mla"].attention == m["mla_mtp"].attention == "mla" and m["gqa"].attention == "gqa"
    assert (m["gqa"].n_heads, m["gqa"].n_kv_heads, m["gqa"].head_dim) == (4, 2, 48)  # configs/default.py's
    same = lambda a, b, skip: {k: v for k, v in cfgs[a].model.items() if k not in skip} == \
        {k: v for k, v in cfgs[b].model.items() if k not in skip}
    assert same("mla", "mla_mtp", {"mtp_depth"})
    assert same("gqa", "mla", {"attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                               "v_head_dim", "rope_interleave", "n_kv_heads", "head_dim"})
    assert cfgs["gqa"].train.to_dict() == cfgs["mla_mtp"].train.to_dict()


@pytest.mark.slow  # trains 3 arms x 2 seeds of a tiny model for 2 steps
def test_study_end_to_end_and_cached(tmp_path):
    from tests.conftest import pipeline_config

    base = pipeline_config(**{"model.attention": "mla", "model.kv_lora_rank": 16, "model.qk_nope_head_dim": 8,
                              "model.qk_rope_head_dim": 8, "model.v_head_dim": 8, "model.mtp_depth": 1,
                              "eval.rows_per_domain": 2, "checkpoint.every": 100, "data.seq_len": 32})
    logs = []
    report = study.run_study(base, 2, 2, tmp_path, rows_per_domain=2, log=logs.append)
    text = report.read_text()
    assert "| mla - gqa | 2 |" in text and "| mla_mtp - mla | 2 |" in text and "not interpretable" in text
    res = json.loads((tmp_path / "mla_mtp" / "seed1" / "result.json").read_text())
    assert res["kv_bytes_per_token"] == 4 * 2 * (16 + 8) and res["tokens_per_sec"] > 0
    gqa = json.loads((tmp_path / "gqa" / "seed1" / "result.json").read_text())
    assert gqa["bigram"] == res["bigram"] and gqa["targets"] == res["targets"]
    logs.clear()
    study.run_study(base, 2, 2, tmp_path, rows_per_domain=2, log=logs.append)
    assert sum("cached" in line for line in logs) == 6


def test_committed_report_regenerates_from_its_results(tmp_path):
    """experiments/deepseek_parts/results/: the report is a function of the committed per-run results."""
    committed = Path(__file__).resolve().parents[1] / "experiments" / "deepseek_parts" / "results"
    results = json.loads((committed / "results.json").read_text())["results"]
    assert sorted((r["arm"], r["seed"]) for r in results) == [(a, s) for a in sorted(study.ARMS) for s in range(3)]
    assert study.report(results, tmp_path).read_text() == (committed / "report.md").read_text()
