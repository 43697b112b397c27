"""Unigram and interpolated-bigram references: the cheapest models of a token stream, counted on training text
and scored on exactly the targets a model is scored on. A model that does not beat the bigram has learned little
beyond which token follows which (train/references.py applies them to a run)."""

import numpy as np

LAMBDAS = tuple(np.linspace(0.05, 0.95, 19))  # bigram interpolation weights tried


def ngram_model(stream, vocab_size: int):
    """(add-one unigram probabilities, {prev * V + next: count}, context counts) of one token stream."""
    stream = np.asarray(stream, np.int64)
    uni = (np.bincount(stream, minlength=vocab_size) + 1.0) / (len(stream) + vocab_size)
    keys, counts = np.unique(stream[:-1] * vocab_size + stream[1:], return_counts=True)
    ctx = np.bincount(stream[:-1], minlength=vocab_size).astype(np.float64)
    return uni, dict(zip(keys.tolist(), counts.tolist())), ctx


def bigram_nll(stats, prev, nxt, lam: float) -> float:
    """Mean -log(lam * p_bigram(next | prev) + (1 - lam) * p_unigram(next)) over the pairs."""
    uni, pair, ctx = stats
    prev, nxt = np.asarray(prev, np.int64), np.asarray(nxt, np.int64)
    V = len(uni)
    c = np.array([pair.get(k, 0) for k in (prev * V + nxt).tolist()], np.float64)
    p_bi = np.where(ctx[prev] > 0, c / np.maximum(ctx[prev], 1), 0.0)
    return float(-np.mean(np.log(lam * p_bi + (1 - lam) * uni[nxt])))


def bigram_lambda(train_tokens, vocab_size: int, lambdas=LAMBDAS) -> float:
    """The interpolation weight, chosen on the last 10% of the training stream (counts from the first 90%),
    never on validation."""
    train = np.asarray(train_tokens, np.int64)
    cut = int(len(train) * 0.9)
    held = ngram_model(train[:cut], vocab_size)
    return float(min(lambdas, key=lambda x: bigram_nll(held, train[cut:-1], train[cut + 1:], x)))


def ngram_pair_references(train_tokens, prev, nxt, vocab_size: int, lambdas=LAMBDAS, stats=None) -> dict:
    """Unigram (add-one) and interpolated bigram cross-entropy (nats/token) of the targets `nxt` given their
    previous tokens `prev`, with counts from `train_tokens` (a 1-D stream). `stats`: ngram_model(train_tokens)
    when the caller already has it; a single lambda skips the search."""
    train = np.asarray(train_tokens, np.int64)
    lam = float(lambdas[0]) if len(lambdas) == 1 else bigram_lambda(train, vocab_size, lambdas)
    full = stats if stats is not None else ngram_model(train, vocab_size)
    return {"unigram": float(-np.mean(np.log(full[0][np.asarray(nxt, np.int64)]))),
            "bigram": bigram_nll(full, prev, nxt, lam), "bigram_lambda": lam}


def ngram_references(train_tokens, val_tokens, vocab_size: int, lambdas=LAMBDAS) -> dict:
    """Unigram (add-one) and interpolated bigram cross-entropy (nats/token) of `val_tokens` given counts from
    `train_tokens` (1-D int arrays of one token stream each). The bigram weight is chosen on the last 10% of the
    training stream (counts from the first 90%), never on validation."""
    val = np.asarray(val_tokens, np.int64)
    return ngram_pair_references(train_tokens, val[:-1], val[1:], vocab_size, lambdas)
