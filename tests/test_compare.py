"""analysis.compare: Jaccard and its chance levels against hand values, a model against itself (overlap 1, entropy
change 0, the self swap exactly 0), the gate swap against a model that differs only in its routers (A's routers
in B give A's loss exactly), the CLI's outputs and bad input."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from analysis.compare import cli as compare
from analysis.compare import overlap, pair, swap
from rundir import open_run


def test_jaccard_and_uniform_chance_hand_cases():
    a = np.array([[0, 1], [0, 1], [2, 3]])
    b = np.array([[1, 0], [1, 2], [0, 1]])
    np.testing.assert_allclose(overlap.jaccard(a, b, 4), [1.0, 1 / 3, 0.0])
    # E = 4, K = 2: overlap 0 / 1 / 2 with probability 1/6, 4/6, 1/6 -> J = 0, 1/3, 1.
    assert overlap.uniform_jaccard(4, 2) == pytest.approx(4 / 6 / 3 + 1 / 6)
    rng = np.random.default_rng(0)
    sets = np.array([rng.choice(8, 2, replace=False) for _ in range(20_000)])
    mc = overlap.jaccard(sets, sets[rng.permutation(len(sets))], 8).mean()
    assert mc == pytest.approx(overlap.uniform_jaccard(8, 2), abs=0.01)


def test_load_matched_chance_follows_the_loads():
    rng = np.random.default_rng(0)
    same = np.tile([0, 1], (500, 1))  # both routers always pick {0, 1}: any permutation still overlaps fully
    assert overlap.load_matched_jaccard(same, same, 8, rng, 3).min() == 1.0
    disjoint = np.tile([2, 3], (500, 1))
    assert overlap.load_matched_jaccard(same, disjoint, 8, rng, 3).max() == 0.0
    uniform = np.array([rng.choice(8, 2, replace=False) for _ in range(5000)])
    assert overlap.load_matched_jaccard(uniform, uniform, 8, rng, 3).mean() == pytest.approx(
        overlap.uniform_jaccard(8, 2), abs=0.01)


@pytest.fixture(scope="module")
def runs(tiny_run):
    return open_run(tiny_run, 10, log=lambda *a: None), open_run(tiny_run, 20, log=lambda *a: None)


def test_a_model_against_itself(runs):
    a, _ = runs
    r = pair.compare_pair(a.model, a.model, a.config, a.tokenizer, max_tokens=128, shuffles=3, rows_per_domain=1)
    layer = r["layers"]["layer 1"]
    assert layer["jaccard"] == 1.0 and layer["same_set"] == 1.0
    assert np.nanmax(np.abs(layer["entropy_change_D"])) == 0.0
    assert 0 < layer["entropy_a"] <= layer["max_entropy"] == 3.0
    assert layer["load_matched_chance"] < 1.0  # the permutation breaks the token -> expert mapping
    s = r["swap_b_into_a"]
    assert s["names"] == ["self (control)", "other, all layers", "random (control)"]
    assert s["delta_A"][0] == 0.0 and s["delta_A"][1] == 0.0 and s["delta_A"][2] != 0.0


def test_gate_swap_restores_a_models_loss(runs):
    """B = A with random routers: A's routers put into B make it A again, so the change is loss(A) - loss(B)."""
    a, _ = runs
    b = open_run(a.workdir, 10, log=lambda *x: None)
    rand = swap.random_routers(b.model, seed=3)
    for ffn, r in zip(swap.moe_ffns(b.model), rand):
        ffn.router.set_value(jnp.asarray(r["router"]))
    before = [np.asarray(v).copy() for r in swap.routers_of(b.model) for v in r.values()]
    s = swap.gate_swap(b.model, a.model, a.config, a.tokenizer, rows_per_domain=1)
    back = swap.gate_swap(a.model, b.model, a.config, a.tokenizer, rows_per_domain=1)
    assert s["delta_A"][1] == pytest.approx(float(back["base_loss"] - s["base_loss"]), abs=1e-6)
    assert back["delta_A"][1] == pytest.approx(-s["delta_A"][1], abs=1e-6) and s["delta_A"][1] != 0
    after = [np.asarray(v) for r in swap.routers_of(b.model) for v in r.values()]
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x, y)  # every swap undone


def test_compare_cli_outputs(tiny_run, tmp_path):
    compare.main(["--workdir", str(tiny_run), "--step", "10", "--out", str(tmp_path), "--max_tokens", "128",
                  "--shuffles", "3", "--rows_per_domain", "1"])
    doc = json.loads((tmp_path / "compare.json").read_text())
    assert doc["a"]["step"] == 10 and doc["b"]["step"] == 20 and doc["provenance"]["jax"]
    layer = doc["layers"]["layer 1"]
    assert 0 <= layer["jaccard"] < 1 and len(layer["entropy_change_D"]) == len(doc["domain_names"])
    assert doc["swap_b_into_a"]["delta_A"][0] == 0.0 and doc["swap_a_into_b"]["delta_A"][0] == 0.0
    assert (tmp_path / "compare.png").stat().st_size > 10_000


@pytest.mark.parametrize("extra, expected", [
    (["--shuffles", "0"], "--shuffles must be >= 1"),
    (["--other_step", "7"], "available steps: [10, 20]"),
])
def test_compare_bad_input_one_line_exit_2(tiny_run, tmp_path, capsys, extra, expected):
    with pytest.raises(SystemExit) as e:
        compare.main(["--workdir", str(tiny_run), "--out", str(tmp_path), *extra])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and expected in err, err
