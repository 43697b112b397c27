"""Expert paths across consecutive MoE layers: the joint distribution of (expert in layer l, expert in layer l+1)
of the same token against the product of its marginals (NumPy only).

    c_ExE = pair_counts(ids_l_NxK, ids_m_NxK, E)     # tokens with i in layer l's top-k and j in layer m's
    mutual_information_bits(c_ExE)                  # I(l; m) of one choice drawn from each set, bits
    nulls = path_nulls(ids_l_NxK, ids_m_NxK, tokens_N, E, rng, n_shuffles=20)

Two joints: top-k (every pair of the K x K' choices of a token, each counted once) and first choice (the
highest-ranked expert of each layer). Mutual information of a plug-in estimate is biased upward by the finite
sample (about (E-1)^2 / (2 N ln 2) bits), so it is read against nulls on the same tokens:
  shuffled tokens  layer m's sets permuted across the tokens: both layers' loads kept exactly, no path structure:
                   the plug-in floor of these loads and this N
  load-matched     each layer's sets resampled independently (with replacement) from its own sets: a random
                   router per layer with that layer's load in expectation
  same token id    layer m's sets permuted among the occurrences of the same token id only: keeps what the
                   token's identity alone explains (two layers that both route by token id share information
                   through it); observed - this null is path information beyond token identity
Shape key: N tokens, K top-k, E experts, S shuffles.
"""

import numpy as np

from analysis.specialization.baselines import mutual_information_bits

NULLS = ("shuffled tokens", "load-matched", "same token id")


def _onehot(ids_NxK, n_experts):
    m_NxE = np.zeros((len(ids_NxK), n_experts), np.float64)
    np.add.at(m_NxE, (np.arange(len(ids_NxK))[:, None], np.asarray(ids_NxK, np.int64)), 1.0)
    return m_NxE


def pair_counts(ids_l_NxK, ids_m_NxK, n_experts: int) -> np.ndarray:
    """[E, E]: (i, j) counts every token with i among its layer-l choices and j among its layer-m choices."""
    return _onehot(ids_l_NxK, n_experts).T @ _onehot(ids_m_NxK, n_experts)


def first_counts(ids_l_NxK, ids_m_NxK, n_experts: int) -> np.ndarray:
    """[E, E] counts of (first choice in layer l, first choice in layer m)."""
    c = np.zeros((n_experts, n_experts), np.float64)
    np.add.at(c, (np.asarray(ids_l_NxK)[:, 0].astype(np.int64), np.asarray(ids_m_NxK)[:, 0].astype(np.int64)), 1.0)
    return c


def log2_lift(c_ExE) -> np.ndarray:
    """log2 p(i, j) / (p(i) p(j)) of a count table (NaN where a marginal or the cell is 0)."""
    c = np.asarray(c_ExE, np.float64)
    outer = c.sum(1, keepdims=True) * c.sum(0, keepdims=True) / max(c.sum(), 1e-300)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((c > 0) & (outer > 0), np.log2(c / outer), np.nan)


def same_token_permutation(tokens_N, rng) -> np.ndarray:
    """An index [N] that permutes positions only among the occurrences of the same token id."""
    tokens_N = np.asarray(tokens_N)
    order = np.argsort(tokens_N, kind="stable")
    perm = np.arange(len(tokens_N))
    bounds = np.flatnonzero(np.diff(tokens_N[order])) + 1
    for group in np.split(order, bounds):
        perm[group] = group[rng.permutation(len(group))]
    return perm


def _both(ids_l_NxK, ids_m_NxK, n_experts):
    return (mutual_information_bits(pair_counts(ids_l_NxK, ids_m_NxK, n_experts)),
            mutual_information_bits(first_counts(ids_l_NxK, ids_m_NxK, n_experts)))


def path_information(ids_l_NxK, ids_m_NxK, tokens_N, n_experts: int, rng, n_shuffles: int = 20) -> dict:
    """I(l; m) in bits, top-k and first choice, with every null of NULLS ({name: [S] values}, top-k and first),
    the entropies H(first choice) of both layers (the ceiling of the first-choice MI), and the pair tables."""
    n = len(ids_l_NxK)
    mi_topk, mi_first = _both(ids_l_NxK, ids_m_NxK, n_experts)
    nulls = {name: {"topk": [], "first": []} for name in NULLS}
    for _ in range(n_shuffles):
        draws = {"shuffled tokens": (ids_l_NxK, ids_m_NxK[rng.permutation(n)]),
                 "load-matched": (ids_l_NxK[rng.integers(0, n, n)], ids_m_NxK[rng.integers(0, n, n)]),
                 "same token id": (ids_l_NxK, ids_m_NxK[same_token_permutation(tokens_N, rng)])}
        for name, (a, b) in draws.items():
            t, f = _both(a, b, n_experts)
            nulls[name]["topk"].append(t)
            nulls[name]["first"].append(f)
    c_topk, c_first = pair_counts(ids_l_NxK, ids_m_NxK, n_experts), first_counts(ids_l_NxK, ids_m_NxK, n_experts)
    p_l, p_m = c_first.sum(1) / max(n, 1), c_first.sum(0) / max(n, 1)
    entropy = lambda p: float(-(p[p > 0] * np.log2(p[p > 0])).sum())
    return {"mi_topk": mi_topk, "mi_first": mi_first, "n_tokens": n,
            "entropy_first_l": entropy(p_l), "entropy_first_m": entropy(p_m),
            "nulls": {k: {kk: np.asarray(vv) for kk, vv in v.items()} for k, v in nulls.items()},
            "pairs_topk": c_topk, "pairs_first": c_first}


def top_paths(c_ExE, n: int = 10, min_count: float = 5) -> list[dict]:
    """The n (i, j) with the largest log2 lift among cells seen at least min_count times."""
    lift = log2_lift(c_ExE)
    cand = [(float(lift[i, j]), int(i), int(j)) for i, j in zip(*np.nonzero(np.asarray(c_ExE) >= min_count))]
    cand.sort(reverse=True)
    return [{"from": i, "to": j, "count": float(c_ExE[i, j]), "log2_lift": v} for v, i, j in cand[:n]]
