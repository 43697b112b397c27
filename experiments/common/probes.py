"""Probes for the decoder-only study beyond the validation loss, on input -> output rows (train.inputs
PrefixSampler / packing.prefix_rows: one document per row, `prefix_len` input tokens, loss on the output).

    losses = row_losses(model, rows)               # per-row mean output cross-entropy (nats / token)
    gap = row_losses(model, replace_inputs(rows)).mean() - losses.mean()
                                                   # > 0 iff the model uses its input at all (the gate)
    shuffled = shuffle_inputs(rows, seed=0, keep_last=True)  # NoPE prefix-LMs are exactly invariant to this
    acc = continuation_choice(model, rows)         # zero-shot: the true output among 4 same-domain candidates

Rows are spliced, never re-tokenized: a new row is the input tokens of one row followed by the output tokens of
another, with positions, segment ids, loss mask and prefix_len rebuilt, so every probe scores exactly the
output tokens the training loss scores.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from train.data.tokenizer import PAD_ID


def parts(rows, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(input tokens, output tokens) of row b: the output is every real token after the prefix, so the
    (input, output) pair rebuilds the row's real tokens and its last target."""
    n = int(rows["segment_ids"][b].sum())
    P = int(rows["prefix_len"][b])
    seq = rows["tokens"][b, :n]
    if rows["targets"][b, n - 1] != PAD_ID:  # a row cut at seq_len: its last target is a real token too
        seq = np.append(seq, rows["targets"][b, n - 1])
    return seq[:P], seq[P:]


def splice(inputs, outputs, seq_len: int, domains=None) -> dict:
    """Rows made of inputs[i] followed by outputs[i] (cut to seq_len + 1 tokens), in prefix_rows' layout:
    loss exactly on the targets that are output tokens."""
    B, L = len(inputs), seq_len
    tok = np.full((B, L + 1), PAD_ID, np.int32)
    n_B, P_B = np.zeros(B, np.int64), np.zeros(B, np.int32)
    for i, (a, b) in enumerate(zip(inputs, outputs)):
        seq = np.concatenate([a, b])[: L + 1]
        tok[i, : len(seq)] = seq
        n_B[i], P_B[i] = len(seq), max(1, min(len(a), len(seq) - 1))
    idx = np.broadcast_to(np.arange(L), (B, L))
    real = idx < n_B[:, None]
    rows = {"tokens": tok[:, :L], "targets": tok[:, 1:], "segment_ids": real.astype(np.int32),
            "positions": np.where(real, idx, 0).astype(np.int32),
            "loss_mask": ((idx >= P_B[:, None] - 1) & (idx < n_B[:, None] - 1)).astype(np.float32),
            "prefix_len": P_B}
    rows["domains"] = np.zeros((B, L), np.int32) if domains is None else np.where(
        rows["segment_ids"] > 0, np.asarray(domains)[:, None], 0).astype(np.int32)
    return rows


def _row_domains(rows) -> np.ndarray:
    return rows["domains"][:, 0]


def donors(domains_B, seed: int, same_domain: bool = True) -> np.ndarray:
    """A derangement: donor[i] != i, from the same domain when that domain has another row."""
    rng = np.random.default_rng(seed)
    B = len(domains_B)
    out = np.empty(B, np.int64)
    for i in range(B):
        pool = [j for j in range(B) if j != i and (not same_domain or domains_B[j] == domains_B[i])]
        pool = pool or [j for j in range(B) if j != i]
        out[i] = rng.choice(pool)
    return out


def replace_inputs(rows, seed: int = 0) -> dict:
    """Every row's input replaced by another (same-domain) row's input, its output kept."""
    B, L = rows["tokens"].shape
    d = donors(_row_domains(rows), seed)
    split = [parts(rows, b) for b in range(B)]
    return splice([split[d[i]][0] for i in range(B)], [split[i][1] for i in range(B)], L, _row_domains(rows))


def shuffle_inputs(rows, seed: int = 0, keep_last: bool = False) -> dict:
    """Every row's input tokens in a random order, its output kept (order of the output unchanged). keep_last
    leaves the last input token in place: the first output token keeps its true predecessor, so the change of
    the loss measures the use of the input's ORDER alone, and a prefix-LM without positions is exactly
    invariant on every output token (without keep_last, on every output token but the first)."""
    B, L = rows["tokens"].shape
    rng = np.random.default_rng(seed)
    split = [parts(rows, b) for b in range(B)]
    shuffled = [np.append(rng.permutation(a[:-1]), a[-1:]) if keep_last else rng.permutation(a) for a, _ in split]
    return splice(shuffled, [b for _, b in split], L, _row_domains(rows))


@functools.lru_cache(maxsize=8)
def _scorer(graphdef):
    @jax.jit
    def score(state, tokens, targets, positions, segment_ids, loss_mask, prefix_len):
        model = nnx.merge(graphdef, state)
        logits, _ = model(tokens, positions_BxL=positions, segment_ids_BxL=segment_ids,
                          prefix_len_B=prefix_len if model.cfg.mask in ("prefix", "mixed") else None)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets) * loss_mask
        return ce.sum(-1), loss_mask.sum(-1)

    return score


def row_losses(model, rows, batch_size: int = 16) -> np.ndarray:
    """Mean output cross-entropy of every row (nats per token; NaN for a row without output targets)."""
    graphdef, state = nnx.split(model)
    score = _scorer(graphdef)
    keys = ("tokens", "targets", "positions", "segment_ids", "loss_mask", "prefix_len")
    B = len(rows["tokens"])
    sums, counts = [], []
    for i in range(0, B, batch_size):
        chunk = {k: np.asarray(rows[k][i:i + batch_size]) for k in keys}
        pad = batch_size - len(chunk["tokens"])
        if pad:  # one compiled shape: pad with copies of the last row, dropped below
            chunk = {k: np.concatenate([v, np.repeat(v[-1:], pad, 0)]) for k, v in chunk.items()}
        s, c = score(state, *(jnp.asarray(chunk[k]) for k in keys))
        sums.append(np.asarray(s)[: batch_size - pad])
        counts.append(np.asarray(c)[: batch_size - pad])
    s, c = np.concatenate(sums), np.concatenate(counts)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(c > 0, s / c, np.nan)


def continuation_choice(model, rows, n_candidates: int = 4, seed: int = 0, batch_size: int = 16,
                        score_fn=None) -> dict:
    """Zero-shot 4-way choice: for each row, its input followed by each of `n_candidates` outputs (its own and
    others of the same domain); correct when its own output has the lowest mean cross-entropy. Chance is
    1 / n_candidates. `score_fn(rows) -> per-row loss` replaces the model (tests)."""
    B, L = rows["tokens"].shape
    doms = _row_domains(rows)
    rng = np.random.default_rng(seed)
    split = [parts(rows, b) for b in range(B)]
    choices, inputs, outputs = [], [], []
    for i in range(B):
        pool = [j for j in range(B) if j != i and doms[j] == doms[i]] or [j for j in range(B) if j != i]
        others = rng.choice(pool, size=min(n_candidates - 1, len(pool)), replace=False).tolist()
        cands = [i, *others]
        choices.append(cands)
        inputs += [split[i][0]] * len(cands)
        outputs += [split[j][1] for j in cands]
    spliced = splice(inputs, outputs, L, np.repeat(doms, [len(c) for c in choices]))
    losses = score_fn(spliced) if score_fn is not None else row_losses(model, spliced, batch_size)
    correct, k = [], 0
    for cands in choices:
        ls = losses[k:k + len(cands)]
        correct.append(bool(np.nanargmin(ls) == 0))
        k += len(cands)
    return {"accuracy": float(np.mean(correct)), "chance": 1.0 / n_candidates, "n": B,
            "correct": correct}
