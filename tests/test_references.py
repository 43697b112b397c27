"""train/references.py: the unigram and bigram references of a run's validation targets, cached, printed by the
trainer's summary and by analysis.loss_curves, and drawn on the loss curves."""

import json
from pathlib import Path

import numpy as np

from analysis import loss_curves as loss_curves_cli
from rundir.layout import RunDir
from tests.conftest import tiny_config
from train import inputs, references
from train.data import packing
from train.loop import summary
from train.ngram import ngram_pair_references


def test_the_references_score_exactly_the_validation_targets(tmp_path):
    config = tiny_config(**{"data.token_cache_dir": str(tmp_path)})
    refs = references.references(config)
    rows = inputs.eval_rows(config)
    scored = rows["loss_mask"] > 0
    assert refs["targets"] == int(scored.sum()) > 0
    train = inputs.token_cache_for(config.data, config.data.split)
    want = ngram_pair_references(np.asarray(train.tokens), rows["tokens"][scored], rows["targets"][scored],
                                 config.model.vocab_size)
    assert refs["bigram"] == want["bigram"] and refs["unigram"] == want["unigram"]
    assert np.log(config.model.vocab_size) > refs["unigram"] > refs["bigram"] > 0
    cached = list(tmp_path.glob("references-*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text()) == refs
    assert references.references(config) == refs  # read back


def test_masked_lm_targets_have_no_next_token_reference():
    assert references.references(tiny_config(**{"data.task": "mlm"})) is None


def test_the_gap_line_says_above_or_below():
    refs = {"unigram": 7.2, "bigram": 5.1, "targets": 1234}
    assert references.gap_line(5.48, refs) == ("val loss 5.4800: 1.72 below the unigram (7.20), 0.38 ABOVE the "
                                               "bigram (5.10) on the same 1,234 targets")
    assert "0.60 below the bigram" in references.gap_line(4.5, refs)


def test_the_summary_and_loss_curves_print_the_gap(tiny_run, tmp_path, capsys):
    text = summary(RunDir(Path(tiny_run)), 20, 20, 10.0, 1000, {"loss": 8.0, "val/loss": 7.9},
                   {"unigram": 8.5, "bigram": 7.5, "targets": 99})
    assert "val loss 7.9000: 0.60 below the unigram (8.50), 0.40 ABOVE the bigram (7.50)" in text
    loss_curves_cli.main(["--workdir", str(tiny_run), "--out", str(tmp_path / "curves.png")])
    out = capsys.readouterr().out
    assert "step 20: val loss" in out and "the bigram (" in out and "targets" in out, out


def test_the_token_cache_says_what_it_holds():
    cache = inputs.token_cache_for(tiny_config().data, "validation")
    assert cache.key and cache.key.endswith(packing._file_hash(inputs.tokenizer_path(tiny_config().data)))
