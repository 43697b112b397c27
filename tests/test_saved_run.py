"""Runs and exports saved by earlier versions still open with the same numbers, resume, export, analyze and generate:

- tests/data/run_saved_1e3cd62: written by commit 1e3cd62, before the code moved into its layered packages;
- tests/data/saved_c87e198: a run with a multi-token prediction module and its orbax and safetensors exports,
  written by commit c87e198, before the model library moved into its rooms (moe/router.py's table, typed results).
tests/data/README.md says how each was made."""

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from analysis.routing import cli as routing
from rundir import open_run
from rundir.config_layout import RESOLVED_KEY, migrate
from train import export_dir
from train.export_dir import load_export
from train.loop import run as train

DATA = Path(__file__).parent / "data"
SAVED = {"1e3cd62": (DATA / "run_saved_1e3cd62", DATA / "run_saved_1e3cd62_forward.npz"),
         "c87e198": (DATA / "saved_c87e198" / "run", DATA / "saved_c87e198" / "forward.npz")}


@pytest.fixture(params=sorted(SAVED))
def saved(request, tmp_path):
    """(a private copy of the saved run, its recorded forward pass): the committed run is never written to."""
    run_dir, forward = SAVED[request.param]
    return Path(shutil.copytree(run_dir, tmp_path / "run")), np.load(forward)


def test_the_saved_run_computes_what_it_computed_when_saved(saved):
    """Logits and chosen experts on fixed tokens (and the MTP module's losses), as recorded by the version that
    wrote the run."""
    saved_run, ref = saved
    run = open_run(saved_run, log=lambda *a: None)
    assert run.step == 4
    tokens = jnp.asarray(ref["tokens"])
    logits, aux = nnx.jit(lambda m, t: m(t, return_routing=True))(run.model, tokens)
    np.testing.assert_allclose(np.asarray(logits)[:, :, :32], ref["logits"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(aux.routing[0].expert_ids), ref["expert_ids"])
    if "mtp_ce" in ref:
        _, aux = nnx.jit(lambda m, t, y: m.token_losses(t, y, mtp=True))(run.model, tokens, jnp.roll(tokens, -1, 1))
        np.testing.assert_allclose(aux.mtp.ce, ref["mtp_ce"], rtol=1e-5, atol=1e-6)


def test_the_saved_run_resumes(saved):
    """Resumed from its own config.json, read as every reader of a run reads it (today's layout)."""
    saved_run, _ = saved
    doc = migrate(json.loads((saved_run / "config.json").read_text()))
    doc.pop(RESOLVED_KEY, None)  # where it ran, recorded beside the config
    config = ml_collections.ConfigDict(doc)
    config.train.steps = 6
    config.checkpoint.every = 6
    train(config, saved_run, log=lambda *a: None)
    rows = [json.loads(line) for line in (saved_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [2, 4, 6]
    assert open_run(saved_run, log=lambda *a: None).step == 6


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_the_saved_run_exports(saved, tmp_path, fmt):
    out = export_dir.export(saved[0], tmp_path / "export", fmt=fmt)
    assert (out / "tokenizer.json").is_file() and (out / "moe-export.json").is_file()


def test_the_saved_run_analyzes(saved, tmp_path):
    routing.main(["--workdir", str(saved[0]), "--out", str(tmp_path / "routing"), "--max_tokens", "200",
                  "--no_progress"])
    doc = json.loads((tmp_path / "routing" / "routing.json").read_text())
    assert doc["step"] == 4 and doc["layer_ids"] == [1]


@pytest.mark.parametrize("fmt", ["orbax", "safetensors"])
def test_exports_saved_by_c87e198_load_with_the_runs_numbers(fmt):
    ref = np.load(SAVED["c87e198"][1])
    model, tokenizer = load_export(DATA / "saved_c87e198" / f"export_{fmt}")
    logits, _ = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(ref["tokens"]))
    np.testing.assert_allclose(np.asarray(logits)[:, :, :32], ref["logits"], rtol=1e-5, atol=1e-6)
    assert tokenizer.get_vocab_size() == 1024
