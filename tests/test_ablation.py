"""analysis.ablate (ablation.py, controls.py, the command): token classes, the row-level standard error,
a never-chosen expert changes the loss by exactly 0 whether rerouted or zeroed, a used one does not, every edit is
undone, the controls agree with expert-by-expert zeroing, the CLI's outputs and bad input."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from analysis.ablate import ablation
from analysis.ablate import cli as ablate
from analysis.ablate import controls as ablation_controls
from moe import routing_biases, set_routing_biases
from rundir import open_run


def test_token_classes():
    cases = {" the": "word start", "ing": "word piece", " 42": "number", "1": "number", ".": "punctuation",
             " (": "punctuation", "\n  ": "whitespace", " ": "whitespace"}
    for text, cls in cases.items():
        assert ablation.TOKEN_CLASSES[ablation.token_class(text)] == cls, text


def test_ratio_and_se_hand_case():
    # Two rows of 2 and 4 tokens whose summed changes are 0.2 and 0.2: delta = 0.4 / 6; residuals
    # 0.2 - 2/15 = 1/15 and 0.2 - 4/15 = -1/15, se = sqrt(2 * 2/225) / 6.
    delta, se = ablation._ratio_and_se(np.array([[0.2, 0.2]]), np.array([2.0, 4.0]))
    assert delta[0] == pytest.approx(0.4 / 6) and se[0] == pytest.approx(np.sqrt(4 / 225) / 6)


@pytest.fixture(scope="module")
def ablated(tiny_run):
    """Expert 0 of layer 1 made never-chosen (bias -1e6) before ablating it and the most used expert."""
    run = open_run(tiny_run, log=lambda *a: None)
    biases = [np.asarray(b).copy() for b in routing_biases(run.model)]
    biases[0][0] = -1e6
    set_routing_biases(run.model, [jnp.asarray(b) for b in biases])
    base = ablation.ablate(run.model, run.config, run.tokenizer, experts=[], rows_per_domain=1)
    busiest = int(np.argmax(base["share_LxE"][0]))
    result = ablation.ablate(run.model, run.config, run.tokenizer, experts=[0, busiest], rows_per_domain=1)
    zero = ablation.ablate(run.model, run.config, run.tokenizer, experts=[0, busiest], rows_per_domain=1,
                           mode="zero")
    after = [np.asarray(b) for b in routing_biases(run.model)]
    return result, busiest, biases, after, zero


def test_zeroing_a_never_chosen_expert_changes_nothing_and_a_used_one_differs_from_rerouting(ablated):
    result, busiest, _, _, zero = ablated
    assert zero["mode"] == "zero" and zero["ablations"] == result["ablations"]
    assert zero["delta_A"][0] == 0.0 and not zero["delta_AxD"][0].any()
    assert zero["delta_A"][1] != 0.0 and zero["delta_A"][1] != result["delta_A"][1]


def test_edits_are_undone_even_on_an_error(tiny_run):
    run = open_run(tiny_run, log=lambda *a: None)
    ffn = run.model.blocks[1].ffn
    before = [np.asarray(v[...]).copy() for v in (ffn.bias, ffn.w_down, ffn.shared.w_down)]
    with pytest.raises(RuntimeError):
        with ablation.edited(run.model, [("reroute", 1, 2), ("zero", 1, 3), ("zero_shared", 1, None)]):
            assert np.asarray(ffn.bias[...])[2] == ablation.MASK_BIAS and not np.asarray(ffn.w_down[...])[3].any()
            assert not np.asarray(ffn.shared.w_down[...]).any()
            raise RuntimeError("inside")
    for old, var in zip(before, (ffn.bias, ffn.w_down, ffn.shared.w_down)):
        np.testing.assert_array_equal(np.asarray(var[...]), old)


def test_controls_equal_zeroing_every_expert_one_by_one(tiny_run):
    run = open_run(tiny_run, log=lambda *a: None)
    scorer = ablation.Scorer(run.model, run.config, run.tokenizer, rows_per_domain=1)
    ctl = ablation_controls.controls(run.model, run.config, run.tokenizer, scorer=scorer)
    assert ctl["names"] == ["all routed experts", "shared expert", "routed experts, layer 1"]
    base_ce, n = scorer(run.model)
    every = [("zero", 1, e) for e in range(run.model.cfg.n_routed_experts)]
    with ablation.edited(run.model, every):
        ce, _ = scorer(run.model)
    assert ctl["delta_A"][0] == pytest.approx((ce - base_ce).sum() / n.sum(), rel=1e-6, abs=1e-9)
    assert ctl["delta_A"][0] == ctl["delta_A"][2]  # the tiny model has one MoE layer
    assert ctl["delta_A"][0] != 0 and ctl["delta_A"][1] != 0 and np.all(np.asarray(ctl["se_A"]) > 0)
    assert ablation_controls.control_lines(ctl)[0].startswith("all routed experts zeroed: ")


def test_never_chosen_expert_changes_the_loss_by_exactly_zero(ablated):
    result, busiest, _, _, _ = ablated
    assert result["ablations"] == [(1, 0), (1, busiest)] and busiest != 0
    assert result["share_LxE"][0][0] == 0
    assert result["delta_A"][0] == 0.0 and not result["delta_AxD"][0].any() and not result["delta_AxC"][0].any()
    assert result["delta_A"][1] != 0.0  # masking the busiest expert re-routes its tokens: the loss moves


def test_ablation_restores_the_biases_and_counts_every_scored_token(ablated):
    result, _, before, after, _ = ablated
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_allclose(np.sum(result["share_LxDxE"], -1), 2.0)  # top-2 shares sum to K per domain
    assert result["n_DxC"].sum() > 0 and np.isfinite(result["base_loss_D"]).all()


def test_ablate_cli_outputs(tiny_run, tmp_path):
    ablate.main(["--workdir", str(tiny_run), "--out", str(tmp_path), "--experts", "0", "1", "--rows_per_domain", "1"])
    doc = json.loads((tmp_path / "ablation.json").read_text())
    assert doc["ablations"] == [[1, 0], [1, 1]] and len(doc["delta_AxD"][0]) == 9 and doc["mode"] == "reroute"
    assert len(doc["zero_output"]["delta_A"]) == 2 and doc["controls"]["names"][0] == "all routed experts"
    assert "layer 1" in doc["spearman"]
    for name in ("ablation_importance.png", "ablation_domains.png"):
        assert (tmp_path / name).stat().st_size > 10_000


@pytest.mark.parametrize("extra, expected", [
    (["--layer", "0"], "valid MoE layers: [1]"),
    (["--experts", "8"], "experts 0..7"),
    (["--rows_per_domain", "0"], "--rows_per_domain must be >= 1"),
    (["--step", "7"], "available steps: [10, 20]"),
])
def test_ablate_bad_input_one_line_exit_2(tiny_run, tmp_path, capsys, extra, expected):
    with pytest.raises(SystemExit) as e:
        ablate.main(["--workdir", str(tiny_run), "--out", str(tmp_path), *extra])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "ablation.json").exists()
