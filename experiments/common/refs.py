"""Reference losses for the mask study, on exactly the targets the study scores: unigram and interpolated bigram
cross-entropy (train.ngram.ngram_pair_references) of the validation rows' loss-masked targets, overall
and per domain, with counts from every training token. A model that does not beat the bigram line has learned
nothing a mask could change. study_references caches them in a study directory."""

import json
from pathlib import Path

import numpy as np

from experiments.common.rows import all_rows
from experiments.common.runs import fingerprint
from rundir.atomic import write_text
from train.inputs import token_cache_for
from train.ngram import ngram_model, ngram_pair_references


def scored_pairs(rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(previous token, target, domain) of every loss-masked target of `rows` (prefix_rows layout)."""
    m = rows["loss_mask"] > 0
    return rows["tokens"][m], rows["targets"][m], rows["domains"][m]


def references(train_tokens, rows, vocab_size: int, domain_names) -> dict:
    """{"unigram", "bigram", "bigram_lambda", "by_domain": {name: {"unigram", "bigram"}}} in nats per token."""
    prev, nxt, dom = scored_pairs(rows)
    stats = ngram_model(train_tokens, vocab_size)
    out = ngram_pair_references(train_tokens, prev, nxt, vocab_size, stats=stats)
    out["by_domain"] = {}
    for d, name in enumerate(domain_names):
        sel = dom == d
        if sel.any():
            r = ngram_pair_references(train_tokens, prev[sel], nxt[sel], vocab_size, (out["bigram_lambda"],), stats)
            out["by_domain"][name] = {"unigram": r["unigram"], "bigram": r["bigram"]}
    return out


def study_references(base, out: Path, log=print) -> dict:
    """OUT/references.json (computed once): n-gram references of the scored validation targets."""
    path = out / "references.json"
    key = fingerprint(base)
    if path.exists():
        refs = json.loads(path.read_text())
        if refs.get("fingerprint") == key:
            return refs
    log("computing unigram / bigram references")
    train = token_cache_for(base.data, base.data.split)
    refs = references(np.asarray(train.tokens), all_rows(base), base.model.vocab_size, train.domain_names)
    refs["fingerprint"] = key
    write_text(path, json.dumps(refs, indent=1))
    return refs
