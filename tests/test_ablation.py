"""analysis.ablation / analysis.ablate: token classes, the row-level standard error, a never-chosen expert
changes the loss by exactly 0, a used one does not, the CLI's outputs and bad input."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from analysis import ablate, ablation
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
    after = [np.asarray(b) for b in routing_biases(run.model)]
    return result, busiest, biases, after


def test_never_chosen_expert_changes_the_loss_by_exactly_zero(ablated):
    result, busiest, _, _ = ablated
    assert result["ablations"] == [(1, 0), (1, busiest)] and busiest != 0
    assert result["share_LxE"][0][0] == 0
    assert result["delta_A"][0] == 0.0 and not result["delta_AxD"][0].any() and not result["delta_AxC"][0].any()
    assert result["delta_A"][1] != 0.0  # masking the busiest expert re-routes its tokens: the loss moves


def test_ablation_restores_the_biases_and_counts_every_scored_token(ablated):
    result, _, before, after = ablated
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_allclose(np.sum(result["share_LxDxE"], -1), 2.0)  # top-2 shares sum to K per domain
    assert result["n_DxC"].sum() > 0 and np.isfinite(result["base_loss_D"]).all()


def test_ablate_cli_outputs(tiny_run, tmp_path):
    ablate.main(["--workdir", str(tiny_run), "--out", str(tmp_path), "--experts", "0", "1", "--rows_per_domain", "1"])
    doc = json.loads((tmp_path / "ablation.json").read_text())
    assert doc["ablations"] == [[1, 0], [1, 1]] and len(doc["delta_AxD"][0]) == 9
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
