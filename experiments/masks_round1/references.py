"""Round 1's n-gram references, which it never committed: unigram and interpolated bigram of the targets its
validation scored (eval.rows_per_domain windows per domain, the output half), counts from every training token.

    python -m experiments.masks_round1.references      # writes experiments/masks_round1/results/references.json

Computed with today's code on experiments/masks_round1/config.py, whose data settings config_default.py shares.
The committed runs predate config keys added since (their fingerprints no longer match), so these are the targets
today's code would score; a gate read from them is a re-derivation, not the round's own.
"""

import json
from pathlib import Path

import numpy as np

from experiments.common.refs import references
from experiments.masks_round1.config import get_config
from rundir.atomic import write_text
from train.inputs import eval_rows, token_cache_for

OUT = Path(__file__).resolve().parent / "results" / "references.json"


def main():
    c = get_config()
    rows = eval_rows(c)
    train = token_cache_for(c.data, c.data.split)
    refs = references(np.asarray(train.tokens), rows, c.model.vocab_size, train.domain_names)
    refs["targets"] = int((rows["loss_mask"] > 0).sum())
    write_text(OUT, json.dumps(refs, indent=1) + "\n")
    print(f"unigram {refs['unigram']:.4f}, bigram {refs['bigram']:.4f} (lambda {refs['bigram_lambda']}) on "
          f"{refs['targets']:,} targets; wrote {OUT}")


if __name__ == "__main__":
    main()
