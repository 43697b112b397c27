"""analysis.paths: pair counts and mutual information against hand cases (a deterministic path gives the first
choice's entropy, independent layers give the shuffled null), the same-token-id null equals the observed
information when both layers route by token id alone, the paths of a model with two MoE layers, the CLI's outputs
and its one-line refusal of a model with one MoE layer."""

import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

from analysis.paths import cli as paths
from analysis.paths import trace, transitions
from moe import Transformer
from rundir import open_run


def test_pair_counts_hand_case():
    a = np.array([[0, 1], [2, 3]])
    b = np.array([[1, 2], [1, 0]])
    c = transitions.pair_counts(a, b, 4)
    assert c[0, 1] == 1 and c[0, 2] == 1 and c[2, 1] == 1 and c[3, 0] == 1 and c.sum() == 8
    f = transitions.first_counts(a, b, 4)
    assert f[0, 1] == 1 and f[2, 1] == 1 and f.sum() == 2


def test_deterministic_and_independent_paths():
    rng = np.random.default_rng(0)
    n, e = 4000, 8
    first = rng.integers(0, e, n)
    a = np.stack([first, (first + 1) % e], -1)
    b = np.stack([(first * 3) % e, (first + 5) % e], -1)  # a bijection of layer l's choice
    r = transitions.path_information(a, b, rng.integers(0, 50, n), e, rng, n_shuffles=5)
    assert r["mi_first"] == pytest.approx(r["entropy_first_l"], abs=1e-9) and r["mi_first"] > 2.9
    assert max(r["nulls"]["shuffled tokens"]["first"]) < 0.02 and max(r["nulls"]["load-matched"]["first"]) < 0.02
    indep = np.array([rng.choice(e, 2, replace=False) for _ in range(n)])
    r = transitions.path_information(a, indep, rng.integers(0, 50, n), e, rng, n_shuffles=5)
    assert r["mi_topk"] < 3 * max(r["nulls"]["shuffled tokens"]["topk"]) < 0.05


def test_same_token_null_keeps_what_token_identity_explains():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 30, 3000)
    perm = transitions.same_token_permutation(tokens, rng)
    np.testing.assert_array_equal(tokens[perm], tokens)
    assert (perm != np.arange(len(tokens))).mean() > 0.9
    table_a, table_b = rng.integers(0, 8, (30, 1)), rng.integers(0, 8, (30, 1))  # routed by token id alone
    r = transitions.path_information(table_a[tokens], table_b[tokens], tokens, 8, rng, n_shuffles=3)
    assert r["mi_first"] > 0.5
    assert np.allclose(r["nulls"]["same token id"]["first"], r["mi_first"])


@pytest.fixture(scope="module")
def tiny(tiny_run):
    return open_run(tiny_run, log=lambda *a: None)


def test_paths_of_a_model_with_two_moe_layers(tiny):
    cfg = dataclasses.replace(tiny.model.cfg, n_layers=3)
    model = Transformer(cfg, nnx.Rngs(0))
    r = trace.expert_paths(model, tiny.config, max_tokens=128, n_shuffles=3)
    assert list(r["pairs"]) == ["layer 1 -> layer 2"] and r["n_tokens"] > 0
    p = r["pairs"]["layer 1 -> layer 2"]
    assert p["pairs_topk"].sum() == r["n_tokens"] * cfg.top_k ** 2
    assert p["mi_topk"] > max(p["nulls"]["shuffled tokens"]["topk"])  # a random router embedding routes by token


def test_paths_cli_outputs(tmp_path, tiny_run, monkeypatch):
    """The command on a run with two MoE layers: the tiny run's config with a third layer, at step 0."""
    run = open_run(tiny_run, log=lambda *a: None)
    model = Transformer(dataclasses.replace(run.model.cfg, n_layers=3), nnx.Rngs(0))
    monkeypatch.setattr("rundir.open_run", lambda *a, **k: dataclasses.replace(run, model=model))
    paths.main(["--workdir", str(tiny_run), "--out", str(tmp_path), "--max_tokens", "128", "--shuffles", "2"])
    doc = json.loads((tmp_path / "paths.json").read_text())
    pair = doc["pairs"]["layer 1 -> layer 2"]
    assert pair["mi_topk"] > 0 and len(pair["nulls"]["same token id"]["topk"]) == 2 and doc["provenance"]["commit"]
    assert pair["top_paths"] and (tmp_path / "paths.png").stat().st_size > 10_000


def test_paths_cli_refuses_one_moe_layer(tiny_run, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        paths.main(["--workdir", str(tiny_run), "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "at least two" in err, err
