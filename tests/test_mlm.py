"""train/inputs.MLMSampler and the masked-LM config checks (item 6: mixed vs bidirectional heads on a masked LM)."""

import json

import numpy as np
import pytest

from train.data.packing import TokenCache
from train.inputs import MLMSampler

MASK = 99


@pytest.fixture(scope="module")
def sampler():
    lengths = [40, 12, 33, 25]
    toks = (np.arange(sum(lengths)) * 7 % 50 + 3).astype(np.uint16)
    cache = TokenCache(toks, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                       np.array([0, 0, 1, 1], np.int32), ("a", "b"))
    return MLMSampler(cache, 16, seed=0, mask_id=MASK, rate=0.3)


def test_rows_mask_and_predict_in_place(sampler):
    rows = sampler.rows(0, 4)
    chosen = rows["loss_mask"] > 0
    real = rows["segment_ids"] > 0
    assert (chosen <= real).all() and (chosen.sum(-1) >= 1).all()
    assert (rows["tokens"][chosen] == MASK).all() and (rows["tokens"][real & ~chosen] != MASK).all()
    # targets are the original tokens at the same positions: unmasked positions show them unchanged
    np.testing.assert_array_equal(rows["targets"][real & ~chosen], rows["tokens"][real & ~chosen])
    np.testing.assert_array_equal(rows["prefix_len"], real.sum(-1))
    assert 0.1 < chosen.sum() / real.sum() < 0.5


def test_rows_are_fixed_by_seed_and_row(sampler):
    a, b = sampler.rows(0, 4), sampler.rows(2, 2)
    for k in ("tokens", "loss_mask"):
        np.testing.assert_array_equal(a[k][2:], b[k])
    other = MLMSampler(sampler.cache, 16, seed=1, mask_id=MASK, rate=0.3).rows(0, 4)
    assert not np.array_equal(other["loss_mask"], a["loss_mask"])


@pytest.mark.parametrize("mask,ok", [("bidirectional", True), ("mixed", True), ("causal", False), ("prefix", False)])
def test_config_masks_for_mlm(mask, ok):
    from plumbing.errors import UserError
    from tests.conftest import tiny_config
    from train.preflight import parse

    c = tiny_config(**{"data.task": "mlm", "model.mask": mask})
    if ok:
        parse(c)
    else:
        with pytest.raises(UserError):
            parse(c)


def test_verdict_gate_on_the_strongest_baseline_and_equivalence():
    from experiments.mlm.runner import verdict

    def runs(losses):
        return {s: {"val_loss": v} for s, v in enumerate(losses)}

    bl = {"unigram": 7.0, "left_bigram": 6.2, "right_bigram": 6.3, "neighbour_bigram": 6.0, "strongest":
          "neighbour_bigram", "targets": 10}
    bidir = [5.0, 5.1, 4.9, 5.05]
    v = verdict(runs(bidir), runs([b + 0.001 * (-1) ** i for i, b in enumerate(bidir)]), bl)
    assert v["verdict"] == "equivalent" and v["margin"] == pytest.approx(0.1 * (6.0 - 5.0125))
    assert verdict(runs(bidir), runs([b - 0.1 + 0.001 * i for i, b in enumerate(bidir)]), bl)["verdict"] == "mixed better"
    # 0.3 below the unigram but not below the neighbour bigram: the gate is on the strongest baseline
    v = verdict(runs(bidir), runs([b - 0.1 for b in bidir]), dict(bl, neighbour_bigram=5.2))
    assert not v["gate_passed"] and v["verdict"] == "not interpretable"


def test_mlm_compare_bad_flags(capsys):
    from experiments.mlm.runner import main

    with pytest.raises(SystemExit) as e:
        main(["prog", "--seeds", "1"])
    assert e.value.code == 2 and "--seeds" in capsys.readouterr().err


@pytest.mark.slow  # trains 2 arms x 2 seeds of the tiny model for 2 steps
def test_mlm_compare_end_to_end(tmp_path, monkeypatch):
    from experiments.mlm import runner as mlm_compare
    from experiments.mlm.runner import compare
    from tests.conftest import tiny_config
    from train.inputs import eval_rows

    monkeypatch.setattr(mlm_compare, "all_rows", eval_rows)  # final loss on the curve's rows, not every window

    base = tiny_config(**{"data.task": "mlm", "model.mask": "bidirectional", "data.tokenizer": "tokenizer_1k.json",
                          "model.vocab_size": 1025, "data.seq_len": 32, "eval.rows_per_domain": 2,
                          "checkpoint.every": 100})
    text = compare(base, 2, 2, tmp_path, log=lambda *a: None).read_text()
    assert "not interpretable" in text and (tmp_path / "mixed" / "seed1" / "result.json").exists()
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    r = json.loads((tmp_path / "mixed" / "seed1" / "result.json").read_text())
    # the final loss is the last checkpoint's, scored again: it equals the trainer's last evaluation on those rows
    assert r["steps"] == 2 and np.isclose(r["val_loss"], r["val_curve"][-1][1], rtol=1e-5)
    assert set(r["val_loss_by_domain"]) and r["train_seconds"] > 0
    # a run finished before the final loss was taken on every window is rescored from its checkpoint
    path = tmp_path / "mixed" / "seed1" / "result.json"
    path.write_text(json.dumps({k: v for k, v in r.items() if k != "val_loss_by_domain"} | {"val_loss": 99.0}))
    compare(base, 2, 2, tmp_path, log=lambda *a: None)
    assert json.loads(path.read_text()) == r
