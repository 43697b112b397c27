"""experiments/deepseek_parts: the arms differ only in the part each takes away (or, for the controls, in the
parameters or compute the MTP module adds), and the runner trains, scores (main head only), caches and reports
them under docs/inference.md's rules."""

import json
from pathlib import Path

import pytest

from experiments.deepseek_parts import runner as study
from moe import param_counts, train_flops_per_token
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
    # the controls: one more layer (parameters within 2% of the MTP arm's), or the MTP module's FLOPs as steps
    assert same("mla_deep", "mla", {"n_layers"}) and m["mla_deep"].n_layers == m["mla"].n_layers + 1
    assert abs(param_counts(m["mla_deep"])["total"] / param_counts(m["mla_mtp"])["total"] - 1) < 0.02
    seq = base.data.seq_len
    ratio = train_flops_per_token(m["mla_mtp"], seq) / train_flops_per_token(m["mla"], seq)
    assert cfgs["mla_long"].train.steps == round(10 * ratio) > 10 and same("mla_long", "mla", set())
    assert study.arm_config(base, "mla", 0, 10, lr=1e-3).train.lr == 1e-3


@pytest.mark.slow  # trains 3 arms x 2 seeds of a tiny model for 2 steps
def test_study_end_to_end_and_cached(tmp_path):
    from tests.conftest import tiny_config

    base = tiny_config(**{"model.attention": "mla", "model.kv_lora_rank": 16, "model.qk_nope_head_dim": 8,
                              "model.qk_rope_head_dim": 8, "model.v_head_dim": 8, "model.mtp_depth": 1,
                              "eval.rows_per_domain": 2, "checkpoint.every": 100, "data.seq_len": 32})
    logs = []
    arms = ("gqa", "mla", "mla_mtp", "mla_long")  # mla_deep: one more layer of the same model, nothing new to run
    report = study.run_study(base, 2, 2, tmp_path, rows_per_domain=2, log=logs.append, arms=arms)
    text = report.read_text()
    assert "| mla - gqa | 2 |" in text and "| mla_mtp - mla | 2 |" in text and "| mla_mtp - gqa | 2 |" in text
    assert "| mla_mtp - mla_long | 2 |" in text and "not interpretable" in text
    assert json.loads((tmp_path / "mla_long" / "seed0" / "result.json").read_text())["steps"] > 2
    res = json.loads((tmp_path / "mla_mtp" / "seed1" / "result.json").read_text())
    assert res["kv_bytes_per_token"] == 4 * 2 * (16 + 8) and res["tokens_per_sec"] > 0
    gqa = json.loads((tmp_path / "gqa" / "seed1" / "result.json").read_text())
    assert gqa["bigram"] == res["bigram"] and gqa["targets"] == res["targets"]
    logs.clear()
    study.run_study(base, 2, 2, tmp_path, rows_per_domain=2, log=logs.append, arms=arms)
    assert sum("cached" in line for line in logs) == 8


def test_committed_report_regenerates_from_its_results(tmp_path):
    """experiments/deepseek_parts/results/: the report is a function of the committed per-run results."""
    committed = Path(__file__).resolve().parents[1] / "experiments" / "deepseek_parts" / "results"
    results = json.loads((committed / "results.json").read_text())["results"]
    # the first design's runs: three arms at one shared rate (its family now holds mla_mtp - gqa too)
    assert sorted((r["arm"], r["seed"]) for r in results) == [(a, s) for a in ("gqa", "mla", "mla_mtp")
                                                                for s in range(3)]
    assert study.report(results, tmp_path).read_text() == (committed / "report.md").read_text()
