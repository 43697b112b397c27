"""analysis.importance: expert output norms against the SwiGLU computed expert by expert, an expert whose down
projection is scaled by c gets c times its REAP score and largest activation (and is flagged as a super expert when
c is large) while the others keep theirs, a never-routed expert has no score, Spearman and the ablation table
against hand cases, the CLI's outputs and bad input."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from analysis.ablate.ablation import MASK_BIAS, eval_batches
from analysis.importance import cli as importance
from analysis.importance import reap, relate
from moe.dispatch.kernels.common import swiglu
from rundir import open_run


def test_expert_outputs_match_swiglu_per_expert():
    from tests.model_fixtures import tiny_model

    ffn = tiny_model().blocks[1].ffn
    u = np.random.default_rng(0).normal(size=(5, 32)).astype(np.float32)
    norm, amax = reap.expert_outputs(ffn, jnp.asarray(u))
    for e in range(8):
        y = np.asarray(swiglu(u, ffn.w_gate[...][e], ffn.w_up[...][e], ffn.w_down[...][e]))
        np.testing.assert_allclose(np.asarray(norm)[:, e], np.linalg.norm(y, axis=-1), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(amax)[:, e], np.abs(y).max(-1), rtol=1e-5)


def test_spearman_and_ablation_table():
    rho, p = relate.spearman([1, 2, 3, 4, np.nan], [10, 20, 30, 40, 0])
    assert rho == pytest.approx(1.0) and p < 0.05
    assert np.isnan(relate.spearman([1, 1, 1], [1, 2, 3])[0])
    zero = {"ablations": [(1, 0), (3, 2)], "delta_A": [0.5, -0.1]}
    d = relate.zero_delta_LxE(zero, [1, 3], 3)
    assert d[0, 0] == 0.5 and d[1, 2] == -0.1 and np.isnan(d).sum() == 4
    ratio = relate.outlier_ratio([[1.0, 2.0, 30.0, np.nan]])
    assert ratio[0, 2] == pytest.approx(15.0) and np.isnan(ratio[0, 3])
    assert relate.super_experts([[1.0, 2.0, 30.0, np.nan]], [4], 10) == [
        {"layer": 4, "expert": 2, "max_act": 30.0, "ratio": 15.0}]


@pytest.fixture(scope="module")
def tiny(tiny_run):
    run = open_run(tiny_run, log=lambda *a: None)
    return run, eval_batches(run.config, 1)


def test_scaled_expert_scales_its_scores_and_is_flagged(tiny):
    run, batches = tiny
    ffn = run.model.blocks[1].ffn
    base = reap.expert_stats(run.model, batches)
    e = int(np.nanargmax(base["share_LxE"][0]))
    old_w, old_b = ffn.w_down[...], ffn.bias[...]
    try:
        ffn.w_down.set_value(old_w.at[e].multiply(100.0))
        unused = (e + 1) % 8
        ffn.bias.set_value(old_b.at[unused].set(MASK_BIAS))
        scaled = reap.expert_stats(run.model, batches)
    finally:
        ffn.w_down.set_value(old_w)
        ffn.bias.set_value(old_b)
    assert scaled["reap_LxE"][0, e] == pytest.approx(100 * base["reap_LxE"][0, e], rel=1e-4)
    assert scaled["max_act_LxE"][0, e] == pytest.approx(100 * base["max_act_LxE"][0, e], rel=1e-4)
    assert np.isnan(scaled["reap_LxE"][0, unused]) and scaled["share_LxE"][0, unused] == 0
    assert [x["expert"] for x in relate.super_experts(scaled["max_act_LxE"], [1], 10.0)] == [e]
    assert relate.super_experts(base["max_act_LxE"], [1], 10.0) == []
    assert base["share_LxE"].sum() == pytest.approx(run.model.cfg.top_k)
    assert np.all(base["resid_max_Y"] > base["resid_median_Y"])


def test_importance_cli_outputs(tiny_run, tmp_path):
    importance.main(["--workdir", str(tiny_run), "--out", str(tmp_path), "--rows_per_domain", "1"])
    doc = json.loads((tmp_path / "importance.json").read_text())
    assert len(doc["zero_delta_LxE"][0]) == 8 and "layer 1" in doc["correlations"] and doc["provenance"]["jax"]
    assert doc["step0"]["stats"]["n_tokens"] == doc["stats"]["n_tokens"] > 0
    assert doc["step0"]["source"] == "the run's initializer and seed"
    for name in ("importance.png", "super_experts.png"):
        assert (tmp_path / name).stat().st_size > 10_000


@pytest.mark.parametrize("extra, expected", [
    (["--layer", "0"], "--layer 0 is not an MoE layer"),
    (["--factor", "1"], "--factor must be > 1"),
])
def test_importance_bad_input_one_line_exit_2(tiny_run, tmp_path, capsys, extra, expected):
    with pytest.raises(SystemExit) as e:
        importance.main(["--workdir", str(tiny_run), "--out", str(tmp_path), *extra])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and expected in err, err
