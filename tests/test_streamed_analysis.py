"""benchmarks/streamed_analysis.py's table sizes models from their config.json fields: the parameter count of
DeepSeek-V2-Lite's equals the imported model's, and every model's the total its publisher states."""

import json

import pytest

from benchmarks import streamed_analysis
from moe.accounting import param_counts
from moe.hf import model_config

CONFIGS = json.loads((streamed_analysis.DATA / "moe_configs.json").read_text())


def test_the_table_counts_deepseek_v2_lite_as_the_import_builds_it():
    full = json.loads((streamed_analysis.DATA / "deepseek_v2_lite_config.json").read_text())
    cfg = model_config(full)
    sizes = streamed_analysis.sizes(CONFIGS["DeepSeek-V2-Lite"])
    assert sizes["params"] == param_counts(cfg)["total"]
    for field in ("hidden_size", "num_hidden_layers", "moe_intermediate_size", "n_routed_experts", "vocab_size",
                  "kv_lora_rank", "intermediate_size", "num_experts_per_tok"):
        assert CONFIGS["DeepSeek-V2-Lite"][field] == full[field], field


@pytest.mark.parametrize("name,total,active", [
    ("DeepSeek-V2-Lite", 15.7e9, 2.4e9),  # the model cards' totals; active counts include the embedding there
    ("Qwen3-30B-A3B", 30.5e9, 3.3e9),
    ("gpt-oss-120b", 116.8e9, 5.1e9),
    ("DeepSeek-V3", 671e9 + 14e9, 37e9),  # 671B main model + the 14B MTP module
])
def test_the_table_counts_the_published_totals(name, total, active):
    s = streamed_analysis.sizes(CONFIGS[name])
    c = CONFIGS[name]
    embed = c["vocab_size"] * c["hidden_size"]
    assert abs(s["params"] / total - 1) < 0.01, s["params"]
    assert abs((s["active"] + embed) / active - 1) < 0.1, s["active"]


def test_table_rows(capsys):
    rows = streamed_analysis.table_rows(read_mb_s=100, gflops=10)
    assert [r["model"] for r in rows] == [k for k in CONFIGS if not k.startswith("_")]
    v3 = rows[-1]
    assert float(v3["streamed (GB)"]) < float(v3["in memory, fp32 (GB)"]) / 20
