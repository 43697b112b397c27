"""analysis.hf_rows and analysis.hf_args, what lets compare, paths, counterfactual and importance read a
HuggingFace directory: RowsScorer gives ablation.Scorer's numbers on a run's own rows, a token cache is cut into
rows per domain, the --workdir / --hf flags are refused one line at a time, and each command runs on tiny HF
directories (a random glm4_moe written by analysis.tiny_hf; with three layers for paths)."""

import argparse
import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

from analysis import hf_args, hf_rows, tiny_hf
from analysis.ablate.ablation import Scorer
from analysis.compare import cli as compare
from analysis.counterfactual import cli as counterfactual
from analysis.importance import cli as importance
from analysis.paths import cli as paths
from moe import Transformer
from moe.hf import write_hf_checkpoint
from plumbing.errors import UserError
from rundir import open_run
from train.data.tokenizer import DEFAULT_TOKENIZER


def test_rows_scorer_equals_the_runs_scorer(tiny_run):
    run = open_run(tiny_run, log=lambda *a: None)
    rows = hf_rows.run_rows(run.config, 1)
    ce, n = hf_rows.RowsScorer(run.model, rows, run.tokenizer)(run.model)
    ref_ce, ref_n = Scorer(run.model, run.config, run.tokenizer, 1)(run.model)
    np.testing.assert_array_equal(n, ref_n)
    np.testing.assert_allclose(ce, ref_ce, rtol=1e-6)
    assert rows.counts_V.sum() > n.sum() > 0 and len(rows.domain_names) == 9


def _args(**kw):
    base = dict(workdir=None, hf=None, text=None, seq_len=None, step=None, out=None, split=None)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("kw, expected", [
    ({}, "pass one of --workdir"), ({"workdir": "r", "hf": "h"}, "pass one of --workdir"),
    ({"workdir": "r", "text": ["a.txt"]}, "--text goes with --hf"), ({"hf": "h", "step": 3, "out": "o"}, "--step needs"),
    ({"hf": "h"}, "--out is required"), ({"hf": "h", "out": "o", "seq_len": 1}, "--seq_len must be >= 2"),
])
def test_source_flags_refused(kw, expected):
    with pytest.raises(UserError, match=expected):
        hf_args.check_source_flags(_args(**kw))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    for seed in (0, 1):
        tiny_hf.write(root / f"s{seed}", seed)
    cfg = tiny_hf.tiny_model().cfg
    write_hf_checkpoint(Transformer(dataclasses.replace(cfg, n_layers=3), nnx.Rngs(0)), str(root / "deep"),
                        str(DEFAULT_TOKENIZER), max_position_embeddings=256)
    (root / "law.txt").write_text("The court reads the law of the land as it is written. " * 40)
    (root / "code.txt").write_text("def f(x):\n    return x + 1\n\nfor i in range(10):\n    print(f(i))\n" * 30)
    return root


def test_cache_rows_cut_per_domain(hf_dirs):
    src = hf_args.open_hf(hf_dirs / "s0", _args(hf=str(hf_dirs / "s0"), text=[str(hf_dirs / "law.txt"),
                                                                               str(hf_dirs / "code.txt")], seq_len=32))
    rows = hf_rows.cache_rows(src.cache, src.run.config, 3)
    doms = np.concatenate([b["domains"][:, 0] for b in rows.batches])
    scored = np.concatenate([b["loss_mask"].sum(-1) for b in rows.batches])
    assert rows.domain_names == ["law", "code"] and list(doms[scored > 0]) == [0, 0, 0, 1, 1, 1]
    assert all(b["tokens"].shape[1] == 32 for b in rows.batches)


def test_the_commands_on_hf_directories(hf_dirs, tmp_path):
    texts = ["--text", str(hf_dirs / "law.txt"), "--text", str(hf_dirs / "code.txt"), "--seq_len", "32"]
    compare.main(["--hf", str(hf_dirs / "s0"), "--other_hf", str(hf_dirs / "s1"), "--out", str(tmp_path / "c"),
                  "--max_tokens", "64", "--rows_per_domain", "2", "--shuffles", "2", *texts])
    doc = json.loads((tmp_path / "c/compare.json").read_text())
    assert doc["domain_names"] == ["law", "code"] and doc["swap_b_into_a"]["delta_A"][0] == 0.0
    assert doc["layers"]["layer 1"]["jaccard"] < 1
    counterfactual.main(["--hf", str(hf_dirs / "s0"), "--out", str(tmp_path / "f"), "--rows_per_domain", "2",
                         "--draws", "1", *texts])
    assert json.loads((tmp_path / "f/counterfactual.json").read_text())["n_tokens"] > 0
    importance.main(["--hf", str(hf_dirs / "s0"), "--out", str(tmp_path / "i"), "--rows_per_domain", "2",
                     "--no_step0", *texts])
    doc = json.loads((tmp_path / "i/importance.json").read_text())
    assert "layer 1" in doc["correlations"] and "step0" not in doc
    paths.main(["--hf", str(hf_dirs / "deep"), "--out", str(tmp_path / "p"), "--max_tokens", "64", "--shuffles", "2",
                *texts])
    assert "layer 1 -> layer 2" in json.loads((tmp_path / "p/paths.json").read_text())["pairs"]
    for png in ("c/compare.png", "f/counterfactual.png", "i/importance.png", "i/super_experts.png", "p/paths.png"):
        assert (tmp_path / png).stat().st_size > 10_000, png
