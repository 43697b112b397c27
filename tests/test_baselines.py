"""analysis.specialization: hand-computed chance levels (baselines.py), the step-0 model, intervals, the CLI."""

import json
import types

import jax
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx
from scipy import stats

from analysis.specialization import baselines, compare
from analysis.specialization import cli as specialization
from moe import RoutingBias
from plumbing.errors import UserError
from rundir import open_run
from tests.conftest import tiny_config
from train import mesh as mesh_lib
from train.preflight import parse
from train.state import init_state


def _record(ids_BxLxK, domains_BxL, n_experts):
    """A RoutingRecord of one batch and one MoE layer (every token valid, one document per row)."""
    ids = np.asarray(ids_BxLxK, np.int16)
    shape = ids.shape[:2]
    batch = {"tokens": np.zeros(shape, np.int32), "domains": np.asarray(domains_BxL), "valid": np.ones(shape, bool),
             "segment_ids": np.ones(shape, np.int32), "ids": [ids], "gates": [np.ones(ids.shape, np.float32)]}
    return baselines.RoutingRecord([batch], ["a", "b"], n_experts, ids.shape[-1], vocab_size=4)


def test_mutual_information_and_shuffled_locality_hand_cases():
    assert baselines.mutual_information_bits([[1, 0], [0, 1]]) == pytest.approx(1.0)
    assert baselines.mutual_information_bits([[2, 2], [1, 1]]) == pytest.approx(0.0, abs=1e-12)
    # Two experts chosen twice each: of the 4 x 3 ordered pairs of distinct tokens, 2 + 2 share a choice.
    assert baselines.shuffled_locality_first([2, 2]) == pytest.approx(4 / 12)


def test_random_router_matches_hand_computed_expectation():
    """Domain a's 50 tokens all go to expert 0, domain b's 50 to expert 1 (top-1 of 4). Trained: each domain's
    favourite expert takes all its tokens, I = 1 bit, consecutive tokens always agree. The random router with
    the same load deals the 100 choices (50 x e0, 50 x e1) at random: e0's count X in domain a is
    hypergeometric(100, 50, 50), so the favourite share is E[max(X, 50 - X)] / 50, and locality is
    sum c(c-1) / (N(N-1)) = 2 * 50 * 49 / (100 * 99). The load never changes."""
    ids = np.stack([np.zeros(50), np.ones(50)])[..., None]
    record = _record(ids, np.array([[0] * 50, [1] * 50]), n_experts=4)
    trained = baselines.headline(baselines.accumulate(record))
    assert trained["top1_max_share"][0] == 1.0 and trained["loc_first"][0] == 1.0
    assert trained["domain_mi_bits"][0] == pytest.approx(1.0)
    rand = baselines.random_router(record, n_shuffles=400, seed=0)
    x = np.arange(51)
    expected_max = float((stats.hypergeom(100, 50, 50).pmf(x) * np.maximum(x, 50 - x)).sum() / 50)
    for name, expected in (("top1_max_share", expected_max),
                           ("loc_first", baselines.shuffled_locality_first([50, 50, 0, 0]))):
        vals = rand[name][:, 0]
        assert abs(vals.mean() - expected) < 4 * vals.std() / np.sqrt(len(vals)) + 1e-9, (name, vals.mean(), expected)
    np.testing.assert_array_equal(rand["maxvio"][:, 0], trained["maxvio"][0])  # same load, every permutation
    assert rand["domain_mi_bits"].mean() < 0.05  # I(domain; expert) is gone (finite-sample bias only)


def test_permutation_keeps_every_experts_load_and_moves_only_valid_tokens():
    rng = np.random.default_rng(1)
    ids = np.stack([rng.permutation(4)[:2] for _ in range(30)]).reshape(3, 10, 2)
    record = _record(ids, np.zeros((3, 10), int), n_experts=4)
    record.batches[0]["valid"][2, 5:] = False
    before = baselines.accumulate(record)
    shuffled = baselines._permuted(record, np.random.default_rng(0))
    np.testing.assert_array_equal(shuffled[0]["ids"][0][2, 5:], ids[2, 5:])  # invalid slots untouched
    after = baselines.accumulate(record, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(after["load_LxE"], before["load_LxE"])
    np.testing.assert_allclose(after["coact_LxExE"], before["coact_LxExE"])  # sets move whole


def test_step0_model_is_the_trainers_initialization():
    """init_model rebuilds exactly what train.state.init_state starts from (jitted, sharded): same params,
    zero routing biases."""
    config = tiny_config(**{"train.seed": 3})
    mcfg = parse(config).model  # what train.loop.run builds the model from
    _, state, _ = init_state(mcfg, optax.sgd(0.1), config.train.seed, mesh_lib.make_mesh(config.mesh))
    run = types.SimpleNamespace(model=types.SimpleNamespace(cfg=mcfg), config=config)
    init = baselines.init_model(run)
    trainer = jax.tree.leaves(state["params"])
    ours = jax.tree.leaves(nnx.state(init, nnx.Param))
    assert len(trainer) == len(ours) > 5
    for a, b in zip(trainer, ours):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for b in jax.tree.leaves(nnx.state(init, RoutingBias)):
        assert not np.asarray(b).any()


def test_step0_of_a_trained_run_differs_from_its_checkpoint(tiny_run):
    run = open_run(tiny_run, 10, log=lambda *a: None)
    init = baselines.init_model(run)
    assert init.cfg == run.model.cfg
    trained = jax.tree.leaves(nnx.state(run.model, nnx.Param))
    assert any(not np.array_equal(a, b) for a, b in zip(trained, jax.tree.leaves(nnx.state(init, nnx.Param))))


def test_interval_hand_case():
    iv = compare.interval([[1.0], [2.0], [3.0]])
    half = stats.t.ppf(0.975, 2) * 1.0 / np.sqrt(3)
    assert iv["mean"][0] == 2.0 and iv["min"][0] == 1.0 and iv["max"][0] == 3.0 and iv["n"] == 3
    assert iv["ci95_low"][0] == pytest.approx(2 - half) and iv["ci95_high"][0] == pytest.approx(2 + half)
    assert np.isnan(compare.interval([[1.0], [2.0]])["ci95_low"][0])  # two runs: the range only


def test_check_same_config_names_the_differing_key():
    def fake(seed, lr):
        c = ml_collections.ConfigDict({"train": {"seed": seed, "lr": lr}, "log": {"every": seed}})
        return types.SimpleNamespace(config=c, workdir=f"runs/s{seed}")

    compare.check_same_config([fake(0, 1e-3), fake(1, 1e-3)])  # seeds and log settings may differ
    with pytest.raises(UserError, match="config key train.lr"):
        compare.check_same_config([fake(0, 1e-3), fake(1, 3e-3)])
    # a seed resumed by a later version carries keys added since, at their defaults: still the same config
    later = fake(1, 1e-3)
    later.config.train.mtp_weight = 0.3
    compare.check_same_config([fake(0, 1e-3), later])
    later.config.train.mtp_weight = 0.5
    with pytest.raises(UserError, match="config key train.mtp_weight"):
        compare.check_same_config([fake(0, 1e-3), later])


def test_specialization_cli_on_the_tiny_run(tiny_run, tmp_path):
    doc, out = specialization.run(specialization.parse_args(
        ["--workdir", str(tiny_run), "--out", str(tmp_path), "--max_tokens", "256", "--shuffles", "3"]),
        log=lambda *a: None)
    assert (out / "specialization.png").stat().st_size > 10_000
    saved = json.loads((out / "specialization.json").read_text())
    assert saved["layer_ids"] == [1] and saved["runs"][0]["step"] == 20 and saved["metrics"]["maxvio"]
    m = doc["metrics"]
    # The random router keeps the trained load, so its MaxVio is the trained one in every permutation.
    assert m["maxvio"]["random"]["low"] == pytest.approx(m["maxvio"]["trained"]["mean"])
    for name in baselines.HEADLINE:
        assert np.isfinite(m[name]["step0"]["mean"]).all(), name
    fav = saved["favourite_vs_step0"]
    assert 0 <= fav["agree"]["mean"][0] <= 1 and 0 < fav["chance"]["mean"][0] <= 1 and fav["n_ids"][0] > 0


@pytest.mark.parametrize("extra, expected", [
    (["--shuffles", "0"], "--shuffles must be >= 1"),
    (["--step", "7"], "available steps: [10, 20]"),
    (["--bogus"], "unrecognized arguments"),
])
def test_specialization_bad_input_one_line_exit_2(tiny_run, tmp_path, capsys, extra, expected):
    with pytest.raises(SystemExit) as e:
        specialization.main(["--workdir", str(tiny_run), "--out", str(tmp_path), *extra])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and expected in err, err


def test_same_workdir_twice_is_refused(tiny_run, capsys):
    with pytest.raises(SystemExit) as e:
        specialization.main(["--workdir", str(tiny_run), "--workdir", str(tiny_run)])
    assert e.value.code == 2 and "given twice" in capsys.readouterr().err
