"""The strongest cheap baseline of the masked-LM targets (docs/inference.md): bigrams of the visible neighbours.

    python -m experiments.mlm.neighbour_bigram [--config experiments/mlm/config.py] \
        [--out experiments/mlm/results/mlm-r2/neighbour_bigram.json]

A masked token x between visible neighbours l and r is scored by the interpolated bigram of the training text
read both ways: p(x | l, r) proportional to p(x | l) p(r | x), each p(b | a) = lam * count(a b) / count(a) + (1 -
lam) * unigram(b) (train.ngram's smoothing), normalised over the tokenizer's vocabulary. A neighbour that is
[MASK], padding or outside the row is not seen, so its factor is dropped (the left one falls back to the unigram).
lam is chosen on the last 10% of the training stream with counts from the first 90%, as train.ngram does.
Counting and scoring take seconds (the vocabulary is 1,025: the conditional table is dense).
"""

import json
import sys
from pathlib import Path

import numpy as np

from experiments.common.rows import all_rows
from plumbing.args import ArgParser
from plumbing.errors import UserError, exit_with
from rundir.atomic import write_text
from train.command_line import config_from_argv
from train.inputs import mask_id, token_cache_for
from train.ngram import LAMBDAS

DEFAULT_CONFIG = "experiments/mlm/config.py"
DEFAULT_OUT = "experiments/mlm/results/mlm-r2/neighbour_bigram.json"
MAX_VOCAB = 4096  # the dense V x V table


def counts(stream, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(add-one unigram probabilities [V], bigram counts [V, V]) of one token stream."""
    s = np.asarray(stream, np.int64)
    uni = (np.bincount(s, minlength=vocab_size) + 1.0) / (len(s) + vocab_size)
    pairs = np.bincount(s[:-1] * vocab_size + s[1:], minlength=vocab_size * vocab_size)
    return uni, pairs.reshape(vocab_size, vocab_size).astype(np.float64)


def conditional(uni, pair_counts, lam: float) -> np.ndarray:
    """[V, V] p(b | a): the interpolated bigram; the unigram for a context never seen."""
    ctx = pair_counts.sum(1, keepdims=True)
    p = lam * pair_counts / np.maximum(ctx, 1.0) + (1.0 - lam) * uni[None, :]
    return np.where(ctx > 0, p, uni[None, :])


def neighbour_nll(uni, cond, left, target, right, vocab: int, chunk: int = 4096) -> np.ndarray:
    """-log p(target | left, right) per target; left / right = -1 where that neighbour is not seen. Only the first
    `vocab` ids can be a target (the [MASK] id past them cannot)."""
    left, target, right = (np.asarray(a, np.int64) for a in (left, target, right))
    out = np.empty(target.size)
    for s in range(0, target.size, chunk):
        sl = slice(s, s + chunk)
        lv, rv = left[sl] >= 0, right[sl] >= 0
        q = np.where(lv[:, None], cond[np.maximum(left[sl], 0)], uni[None, :])
        q = q * np.where(rv[:, None], cond[:, np.maximum(right[sl], 0)].T, 1.0)
        q = q[:, :vocab] / q[:, :vocab].sum(1, keepdims=True)
        out[sl] = -np.log(q[np.arange(q.shape[0]), target[sl]])
    return out


def choose_lambda(stream, vocab_size: int, vocab: int, every: int = 37, lambdas=LAMBDAS) -> float:
    """The lam whose two-sided score of every `every`-th token of the last 10% of the stream (both neighbours seen,
    counts from the first 90%) is lowest."""
    s = np.asarray(stream, np.int64)
    cut = int(len(s) * 0.9)
    uni, pairs = counts(s[:cut], vocab_size)
    idx = np.arange(cut + 1, len(s) - 1, every)
    scores = {float(lam): float(neighbour_nll(uni, conditional(uni, pairs, lam), s[idx - 1], s[idx], s[idx + 1],
                                              vocab).mean()) for lam in lambdas}
    return min(scores, key=scores.get)


def masked_neighbours(rows, mask: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(left, target, right) of every masked target of MLM rows; -1 where the neighbour is [MASK], padding or
    outside the row."""
    b, i = np.nonzero(rows["loss_mask"] > 0)
    tok, real, L = rows["tokens"], rows["segment_ids"] > 0, rows["tokens"].shape[1]

    def seen(j):
        ok = (j >= 0) & (j < L)
        jj = np.clip(j, 0, L - 1)
        return np.where(ok & real[b, jj] & (tok[b, jj] != mask), tok[b, jj], -1)

    return seen(i - 1), rows["targets"][b, i], seen(i + 1)


def baselines(config) -> dict:
    """Unigram, left-only, right-only and both-neighbour bigram cross-entropy of every validation window's masked
    targets (nats per target), the lam used, and which is strongest."""
    vocab_size, mask = int(config.model.vocab_size), mask_id(config.data)
    if vocab_size > MAX_VOCAB:
        raise UserError(f"model.vocab_size {vocab_size} is too large for the dense table (at most {MAX_VOCAB})")
    stream = np.asarray(token_cache_for(config.data, config.data.split).tokens, np.int64)
    left, target, right = masked_neighbours(all_rows(config), mask)
    lam = choose_lambda(stream, vocab_size, mask)
    uni, pairs = counts(stream, vocab_size)
    cond = conditional(uni, pairs, lam)
    none = np.full_like(left, -1)
    out = {"targets": int(target.size), "bigram_lambda": lam,
           "left_seen": float(np.mean(left >= 0)), "right_seen": float(np.mean(right >= 0)),
           "unigram": float(neighbour_nll(uni, cond, none, target, none, mask).mean()),
           "left_bigram": float(neighbour_nll(uni, cond, left, target, none, mask).mean()),
           "right_bigram": float(neighbour_nll(uni, cond, none, target, right, mask).mean()),
           "neighbour_bigram": float(neighbour_nll(uni, cond, left, target, right, mask).mean())}
    out["strongest"] = min(("unigram", "left_bigram", "right_bigram", "neighbour_bigram"), key=out.get)
    return out


def main(argv=None):
    argv = sys.argv if argv is None else argv
    p = ArgParser(prog="python -m experiments.mlm.neighbour_bigram", description=__doc__.splitlines()[0])
    p.add_argument("--config", metavar="FILE", default=DEFAULT_CONFIG)
    p.add_argument("--out", default=DEFAULT_OUT)
    try:
        config, _, rest = config_from_argv(list(argv[1:]), DEFAULT_CONFIG)
        args = p.parse_args(rest)
        if config.data.task != "mlm":
            raise UserError("the neighbour bigram scores masked-LM targets: set --config.data.task=mlm")
        out = baselines(config)
    except UserError as e:
        exit_with(e)
    write_text(Path(args.out), json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
