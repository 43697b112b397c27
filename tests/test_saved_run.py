"""A run saved by an earlier version (tests/data/run_saved_1e3cd62: written by commit 1e3cd62, before the code
moved into its layered packages) still opens with the same numbers, resumes, exports and analyzes."""

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from analysis import routing
from rundir import open_run
from train import export
from train.loop import run as train

DATA = Path(__file__).parent / "data"
SAVED = DATA / "run_saved_1e3cd62"


@pytest.fixture
def saved_run(tmp_path):
    """A private copy: the committed run is never written to."""
    return Path(shutil.copytree(SAVED, tmp_path / "run"))


def test_the_saved_run_computes_what_it_computed_when_saved(saved_run):
    """Logits and chosen experts on fixed tokens, as recorded by the version that wrote the run."""
    ref = np.load(DATA / "run_saved_1e3cd62_forward.npz")
    run = open_run(saved_run, log=lambda *a: None)
    assert run.step == 4
    logits, aux = run.model(jnp.asarray(ref["tokens"]), return_routing=True)
    np.testing.assert_allclose(np.asarray(logits)[:, :, :32], ref["logits"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(aux["routing"][0]["expert_ids"]), ref["expert_ids"])


def test_the_saved_run_resumes(saved_run):
    config = ml_collections.ConfigDict(json.loads((saved_run / "config.json").read_text()))
    config.train.steps = 6
    config.checkpoint.every = 6
    train(config, saved_run, log=lambda *a: None)
    rows = [json.loads(line) for line in (saved_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [2, 4, 6]
    assert open_run(saved_run, log=lambda *a: None).step == 6


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_the_saved_run_exports(saved_run, tmp_path, fmt):
    out = export.export(saved_run, tmp_path / "export", fmt=fmt)
    assert (out / "tokenizer.json").is_file() and (out / "moe-export.json").is_file()


def test_the_saved_run_analyzes(saved_run, tmp_path):
    routing.main(["--workdir", str(saved_run), "--out", str(tmp_path / "routing"), "--max_tokens", "200",
                  "--no_progress"])
    doc = json.loads((tmp_path / "routing" / "routing.json").read_text())
    assert doc["step"] == 4 and doc["layer_ids"] == [1]
