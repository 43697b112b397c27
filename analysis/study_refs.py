"""Reference losses for the mask study, on exactly the targets the study scores: unigram and interpolated bigram
cross-entropy (analysis.study_stats.ngram_pair_references) of the validation rows' loss-masked targets, overall and
per domain, with counts from every training token. A model that does not beat the bigram line has learned nothing
a mask could change."""

import numpy as np

from analysis.study_stats import ngram_model, ngram_pair_references


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
