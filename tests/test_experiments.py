"""experiments.masks_round1: bootstrap CI, CLI parsing, and the compare-masks study end to end on tiny settings,
including resuming an interrupted study."""

import json

import numpy as np
import pytest

from experiments.masks_round1.report import bootstrap_ci
from experiments.masks_round1.runner import Interrupted, compare_masks, fingerprint, parse_flags, variant_name
from plumbing.errors import UserError
from tests.conftest import tiny_config


def test_bootstrap_ci():
    m, lo, hi = bootstrap_ci([1.0, 2.0, 3.0])
    assert m == pytest.approx(2.0) and 1.0 <= lo < m < hi <= 3.0
    assert bootstrap_ci([5.0, 5.0]) == (5.0, 5.0, 5.0)
    v = np.random.default_rng(0).normal(size=200)
    m, lo, hi = bootstrap_ci(v)
    se = v.std(ddof=1) / np.sqrt(len(v))
    assert lo == pytest.approx(m - 1.96 * se, abs=0.3 * se) and hi == pytest.approx(m + 1.96 * se, abs=0.3 * se)


def test_fingerprint_ignores_what_does_not_change_a_run():
    """Cached results stay valid across the 2026-11-26 defaults: blockwise attention computes einsum's function
    (the runs cached before it used einsum); the loss's chunking (8 by default; every earlier run had none) and
    scanned layers change rounding only."""
    c = tiny_config()
    assert c.execution.attention_impl == "blockwise" and c.execution.loss_chunks == 8
    before = tiny_config(**{"execution.attention_impl": "einsum"}).to_dict()
    del before["execution"]["loss_chunks"]
    assert fingerprint(c) == fingerprint(type(c)(before))
    assert fingerprint(c) != fingerprint(tiny_config(**{"execution.attention_impl": "xla"}))
    assert fingerprint(c) == fingerprint(tiny_config(**{"execution.loss_chunks": 1}))
    assert fingerprint(c) == fingerprint(tiny_config(**{"execution.scan_layers": True}))
    assert fingerprint(c) == fingerprint(tiny_config(**{"execution.permute_grad": "gather"}))
    assert fingerprint(c) == fingerprint(tiny_config(**{"train.compile_cache_dir": ""}))
    assert fingerprint(c) != fingerprint(tiny_config(**{"execution.dtype": "bfloat16"}))



def test_committed_results_keep_their_fingerprint():
    """A config field added later at its default (MLA, YaRN, MTP: rundir.config_layout.ADDED_KEYS) must not change
    the fingerprint of a run finished before it, or re-running a study into its folder refuses its own results."""
    import json
    from pathlib import Path

    from experiments.encdec import runner as encdec
    from experiments.masks_round2.config import get_config
    from experiments.masks_round2.runner import arm_config

    root = Path(__file__).resolve().parents[1] / "experiments"
    r = json.loads((root / "masks_round2/results/study-cpu-r2/finished/causal/seed0/result.json").read_text())
    assert r["fingerprint"] == fingerprint(arm_config(get_config(), "causal", 0, r["steps"]))
    r = json.loads((root / "encdec/results/encdec-cpu/finished/decoder_P/seed0/result.json").read_text())
    assert r["key"] == encdec.run_key(*encdec.cell_config(get_config(), "decoder_P", 0, r["steps"], "causal"))

def test_parse_flags():
    config, masks, seeds, steps, nope, out, report_only = parse_flags(
        ["x", "compare-masks", "--masks", "causal,prefix", "--seeds", "2", "--steps", "7", "--nope",
         "--out", "/tmp/s", "--config.train.batch_size=4"])
    assert masks == ["causal", "prefix"] and (seeds, steps, nope, out, report_only) == (2, 7, True, "/tmp/s", False)
    assert config.train.batch_size == 4 and config.data.task == "prefix"
    for bad in (["x", "compare-masks", "--masks", "causal,bidirectional"], ["x", "compare-masks", "--seeds", "0"],
                ["x", "compare", "--seeds", "2"], ["x", "compare-masks", "--masks", "causal,causal"]):
        with pytest.raises(UserError):
            parse_flags(bad)
    assert variant_name("prefix", False) == "prefix-nope"


def _config():
    return tiny_config(**{"data.task": "prefix", "data.seq_len": 32, "eval.rows_per_domain": 1,
                          "train.warmup_steps": 1, "model.n_layers": 2})


@pytest.mark.slow
def test_compare_masks_end_to_end_and_resume(tmp_path):
    from train.loop import run
    from train.preflight import to_json

    base, out = _config(), tmp_path / "study"
    calls, logs = [], []

    def killed_after_one_step(config, workdir, log):
        """Trains prefix seed 1 only to step 1, as if the study were killed there (config.json as the full run's)."""
        calls.append(str(workdir))
        if workdir.parent.name == "prefix" and workdir.name == "seed1":
            short = config.copy_and_resolve_references()
            short.train.steps = 1
            run(short, workdir, log=log)
            (workdir / "config.json").write_text(to_json(config))
            return
        run(config, workdir, log=log)

    with pytest.raises(Interrupted):
        compare_masks(base, ["causal", "prefix"], 2, 2, False, out, log=logs.append, run_fn=killed_after_one_step)
    assert len(calls) == 4  # seed-major order: prefix seed 1 is the last run and not (out / "prefix" / "seed1" / "result.json").exists()
    partial = compare_masks(base, ["causal", "prefix"], 2, 2, False, out, log=logs.append, report_only=True)
    assert "Partial study**: 1 runs not finished: prefix seed 1" in partial.read_text()

    calls.clear()
    report = compare_masks(base, ["causal", "prefix"], 2, 2, False, out, log=logs.append,
                           run_fn=lambda c, w, log: (calls.append(str(w)), run(c, w, log=log)))
    assert calls == [str(out / "prefix" / "seed1")]  # finished runs come from their cached result
    assert any("resuming" in str(m) and "from step 1" in str(m) for m in logs)

    results = json.loads((report.parent / "results.json").read_text())
    assert sorted((r["mask"], r["seed"]) for r in results) == [("causal", 0), ("causal", 1), ("prefix", 0),
                                                               ("prefix", 1)]
    assert all(r["steps"] == 2 and np.isfinite(r["val_loss"]) for r in results)
    # same data order and initial weights per seed: identical parameter counts, and causal heads full rank
    assert len({r["params"]["total"] for r in results}) == 1
    causal = [r for r in results if r["mask"] == "causal"]
    assert all(np.all(np.asarray(r["attention"]["full"]["rank_frac"]) == 1.0) for r in causal)
    text = report.read_text()
    assert "| prefix - causal |" in text and "95% CI" in text
    for png in ("val_loss.png", "loss_curves.png", "attention_rank.png"):
        assert (report.parent / png).stat().st_size > 1000

    calls.clear()
    compare_masks(base, ["causal", "prefix"], 2, 2, False, out, log=logs.append,
                  run_fn=lambda c, w, log: calls.append(w))
    assert calls == []  # everything cached

    with pytest.raises(UserError, match="different config"):
        compare_masks(base, ["causal"], 1, 3, False, out, log=logs.append)
