"""A run's reference losses: what a unigram and an interpolated bigram, counted on its training split, score on
exactly the validation targets the run is scored on (train/ngram.py). The trainer's summary and
`analysis.loss_curves` print the model's validation loss beside them; a model that does not end clearly below the
bigram has learned little beyond which token follows which.

Counting the training split takes seconds; the result is cached beside the token caches
(`data.token_cache_dir`), keyed by what the tokens and the targets are.
"""

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from train import inputs
from train.data import packing
from train.ngram import ngram_pair_references

TASKS = ("lm", "prefix")  # next-token targets; a masked target's bigram needs both neighbours (not here)


def references(rc) -> dict | None:
    """{"unigram", "bigram", "bigram_lambda", "targets"} in nats per validation target, or None for a task whose
    targets are not next tokens."""
    d = rc.data
    if d.task not in TASKS:
        return None
    train = inputs.token_cache_for(d, d.split)
    tgt = inputs.targets(rc, evaluation=True)
    spec = {"train": train.key, "split": d.eval_split, "seq_len": d.seq_len, "task": d.task,
            "prefix_frac": d.prefix_frac, "windows": d.windows, "rows": rc.eval.rows_per_domain,
            "targets": [tgt.prefix_loss, tgt.equal_targets], "vocab": rc.model.vocab_size}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(d.token_cache_dir or packing.DEFAULT_CACHE_DIR) / f"references-{key}.json"
    if train.key and path.is_file():
        return json.loads(path.read_text())
    rows = inputs.eval_rows(rc)
    scored = rows["loss_mask"] > 0
    refs = ngram_pair_references(np.asarray(train.tokens), rows["tokens"][scored], rows["targets"][scored],
                                 rc.model.vocab_size)
    refs["targets"] = int(scored.sum())
    if train.key:  # written beside, then renamed: a concurrent run never reads half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(refs))
        os.replace(tmp, path)
    return refs


def gap_line(val_loss: float, refs: dict | None) -> str:
    """One line: the validation loss against the references, e.g. "val loss 5.48: 1.73 below the unigram (7.21),
    0.38 ABOVE the bigram (5.10) on the same 180,224 targets"."""
    if refs is None:
        return f"val loss {val_loss:.4f} (no n-gram reference for this task)"

    def versus(name):
        gap = refs[name] - val_loss
        return f"{abs(gap):.2f} {'below' if gap >= 0 else 'ABOVE'} the {name} ({refs[name]:.2f})"

    return (f"val loss {val_loss:.4f}: {versus('unigram')}, {versus('bigram')} on the same "
            f"{refs['targets']:,} targets")
