"""analysis.counterfactual: the route-replacing forward equals the model's own loss with the chosen routes, gives
the same loss when the "random" experts are the chosen ones (the gates follow the router's rule) or the permutation
is the identity, and differs otherwise; random routes are K distinct candidates; frequency buckets and the row
standard error against hand cases; the CLI's outputs and bad input."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from analysis.ablate.ablation import eval_batches
from analysis.counterfactual import cli as counterfactual
from analysis.counterfactual import informative, routes
from moe import Execution
from moe.model import split_model
from rundir import open_run


def test_random_ids_and_valid_permutation():
    rng = np.random.default_rng(0)
    ids = routes.random_ids(2, 500, 8, 3, rng)
    assert ids.shape == (2, 500, 3) and ids.min() >= 0 and ids.max() < 8
    assert all(len(set(row)) == 3 for row in ids.reshape(-1, 3))
    assert np.bincount(ids.ravel(), minlength=8).min() > 300  # uniform: 3000 draws over 8, about 375 each
    valid = np.array([True, False, True, True, False, True])
    perm = routes.valid_permutation(valid, rng)
    assert perm[1] == 1 and perm[4] == 4 and sorted(perm[valid]) == [0, 2, 3, 5]


def test_frequency_buckets_and_row_se():
    counts = np.zeros(2000)
    counts[:1500] = np.arange(1500, 0, -1)  # id i has rank i + 1; ids past 1499 never occur
    b = informative.frequency_bucket([0, 9, 10, 99, 100, 999, 1000, 1700], counts)
    np.testing.assert_array_equal(b, [0, 0, 1, 1, 2, 2, 3, 3])
    # Two rows: tokens (1, 3) and (5): mean 3, row sums 4 and 5, residuals 4 - 6 and 5 - 3 -> se sqrt(2 * 8) / 3.
    mean, se = informative.grouped_mean_se(np.array([1.0, 3.0, 5.0]), np.zeros(3, int), np.array([0, 0, 1]), 1)
    assert mean[0] == pytest.approx(3.0) and se[0] == pytest.approx(np.sqrt(16) / 3)


@pytest.fixture(scope="module")
def setup(tiny_run):
    run = open_run(tiny_run, log=lambda *a: None)
    b = eval_batches(run.config)[0]
    batch = {k: b[k] for k in ("tokens", "targets", "loss_mask", "positions", "segment_ids")}
    graphdef, params, bias = split_model(run.model)
    loss = routes.make_route_loss(graphdef, Execution().resolved())
    return run, batch, params, bias, loss


def test_chosen_routes_give_the_models_loss_and_other_routes_do_not(setup):
    run, batch, params, bias, loss = setup
    T, K = batch["tokens"].size, run.model.cfg.top_k
    ident = np.arange(T, dtype=np.int32)
    ce = np.asarray(loss(params, bias, batch, np.zeros(1, np.int32), np.zeros((1, T, K), np.int32), ident))
    graphdef, state = nnx.split(run.model)

    @jax.jit
    def reference(state, batch):
        model = nnx.merge(graphdef, state)
        kw = {"positions_BxL": batch["positions"], "segment_ids_BxL": batch["segment_ids"]}
        return model.token_losses(batch["tokens"], batch["targets"], **kw)[0], model.inspect(batch["tokens"], **kw)[1]

    ref_ce, aux = reference(state, batch)
    np.testing.assert_allclose(ce, np.asarray(ref_ce) * batch["loss_mask"], atol=1e-5)
    chosen = np.asarray(jax.device_get(aux.routing[0].expert_ids)).reshape(1, T, K).astype(np.int32)
    as_random = np.asarray(loss(params, bias, batch, np.ones(1, np.int32), chosen, ident))
    as_perm = np.asarray(loss(params, bias, batch, np.full(1, 2, np.int32), chosen, ident))
    np.testing.assert_allclose(as_random, ce, atol=1e-5)  # the chosen experts with the router's own gates
    np.testing.assert_allclose(as_perm, ce, atol=1e-5)
    rand = routes.random_ids(1, T, run.model.cfg.n_candidates, K, np.random.default_rng(0))
    assert np.abs(np.asarray(loss(params, bias, batch, np.ones(1, np.int32), rand, ident)) - ce).max() > 1e-4


def test_counterfactual_cli_outputs(tiny_run, tmp_path):
    counterfactual.main(["--workdir", str(tiny_run), "--out", str(tmp_path), "--rows_per_domain", "1",
                         "--draws", "2"])
    doc = json.loads((tmp_path / "counterfactual.json").read_text())
    assert doc["variants"] == ["all layers, random", "all layers, permuted"] and doc["provenance"]["machine"]
    assert sum(doc["n_B"]) == doc["n_tokens"] == sum(doc["n_D"]) > 0
    assert all(np.isfinite(doc["delta_V"])) and any(d != 0 for d in doc["delta_V"])
    assert len(doc["delta_VxD"][0]) == len(doc["domain_names"]) and doc["tokens"]["most_informative"]
    assert (tmp_path / "counterfactual.png").stat().st_size > 10_000


def test_counterfactual_bad_input_one_line_exit_2(tiny_run, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        counterfactual.main(["--workdir", str(tiny_run), "--out", str(tmp_path), "--draws", "0"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--draws must be >= 1" in err, err
