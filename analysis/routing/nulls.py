"""Chance levels of routing locality that keep part of the structure, as exact expectations over a permutation
(numpy only; no sampling, so a streamed and a one-pass analysis give the same numbers).

- load-matched null (`load_matched_locality`): every analysed token's top-k set dealt at random to the analysed
  positions. Each expert keeps its load; context, domain and token identity no longer decide.
- token-identity null (`token_null_locality`): the sets dealt at random among the occurrences of each token id.
  Each token keeps its distribution over experts; everything beyond token identity is destroyed, so locality
  above this null is locality the token ids do not explain.

Shape key: C candidates (routed + zero experts), V vocabulary, E routed experts, P distinct token pairs.
"""

import numpy as np


def load_matched_locality(first_load_C, load_C, top_k):
    """Locality expected when the analysed tokens' top-k sets are permuted across all analysed positions (each
    candidate keeps its load): a consecutive pair is two distinct tokens drawn without replacement, so
    P[same first choice] = sum_c f_c (f_c - 1) / (N (N - 1)) over first-choice loads f (summing to N), and
    E[|A & B|] / K = sum_c l_c (l_c - 1) / (N (N - 1)) / K over top-k loads l. Returns (first, overlap); NaN below
    two tokens. With an even load these are (N/E - 1) / (N - 1) ~ 1/E and ~ K/E, the uniform values."""
    f_C, l_C = np.asarray(first_load_C, np.float64), np.asarray(load_C, np.float64)
    n = f_C.sum()
    if n < 2:
        return float("nan"), float("nan")
    pairs = n * (n - 1)
    return float((f_C * (f_C - 1)).sum() / pairs), float((l_C * (l_C - 1)).sum() / pairs / top_k)


def _pair_match(a_PxE, b_PxE, same_P, n_P):
    """Per token pair (u, v): sum_e a_u(e) b_v(e) / (n_u n_v), or for u == v (two distinct occurrences of one id)
    sum_e a_u(e) (a_u(e) - 1) / (n_u (n_u - 1)). a, b: per-token counts; n: the token's occurrences."""
    cross_P = (a_PxE * b_PxE).sum(-1)
    self_P = (a_PxE * (a_PxE - 1)).sum(-1)
    n2_P = np.where(same_P, n_P * (n_P - 1), 1.0)
    return np.where(same_P, self_P / np.maximum(n2_P, 1), cross_P)


def token_null_locality(first_VxE, topk_VxE, tok_n_V, pair_keys_P, pair_counts_P, vocab_size, top_k, chunk=16384):
    """Locality expected when top-k sets are permuted among the occurrences of each token id (a token's
    distribution over experts kept, everything beyond its identity destroyed). For a consecutive pair of ids
    (u, v) each position draws from its own id's occurrences (distinct occurrences when u == v):
    P[same first choice] = sum_e p_u(e) p_v(e) with p the first-choice shares, E[|A & B|] / K likewise with the
    top-k shares; averaged over the observed pairs, `pair_keys_P` = u * V + v with their counts. Returns (first,
    overlap). A router that is a function of the token id gives exactly its observed locality here."""
    keys_P, w_P = np.asarray(pair_keys_P, np.int64), np.asarray(pair_counts_P, np.float64)
    if w_P.sum() == 0:
        return float("nan"), float("nan")
    n_V = np.asarray(tok_n_V, np.float64)
    sums = np.zeros(2)
    for start in range(0, len(keys_P), chunk):
        u_P, v_P = keys_P[start:start + chunk] // vocab_size, keys_P[start:start + chunk] % vocab_size
        same_P, w = u_P == v_P, w_P[start:start + chunk]
        n_u, n_v = n_V[u_P], n_V[v_P]
        norm_P = np.where(same_P, 1.0, 1.0 / np.maximum(n_u * n_v, 1))
        for i, table in enumerate((first_VxE, topk_VxE)):
            a_PxE, b_PxE = (np.asarray(table[idx], np.float64) for idx in (u_P, v_P))
            sums[i] += (w * _pair_match(a_PxE, b_PxE, same_P, n_u) * norm_P).sum()
    first, overlap = sums / w_P.sum()
    return float(first), float(overlap / top_k)


class PairCounts:
    """Sparse counts of int64 keys (consecutive token-id pairs u * V + v), merged every `merge_every` added keys."""

    def __init__(self, merge_every=1 << 20):
        self.keys, self.counts, self.pending = np.zeros(0, np.int64), np.zeros(0, np.int64), []
        self.merge_every = merge_every

    def add(self, keys):
        self.pending.append(np.asarray(keys, np.int64))
        if sum(len(p) for p in self.pending) > self.merge_every:
            self.merge()

    def merge(self):
        if self.pending:
            new = np.concatenate(self.pending)
            keys, inv = np.unique(np.concatenate([self.keys, new]), return_inverse=True)
            self.counts = np.bincount(inv, weights=np.concatenate([self.counts, np.ones(len(new), np.int64)]),
                                      minlength=len(keys)).astype(np.int64)
            self.keys, self.pending = keys, []
        return self.keys, self.counts


def grown(table_LxC, n_cols):
    """table with zero columns appended up to n_cols (candidate tables grow as zero experts are seen)."""
    extra = n_cols - table_LxC.shape[-1]
    return np.concatenate([table_LxC, np.zeros(table_LxC.shape[:-1] + (extra,), table_LxC.dtype)], -1) if extra > 0 \
        else table_LxC
