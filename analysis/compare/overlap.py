"""Expert-set overlap of two routers on the same tokens, against what the two loads alone would give, and the
routing-entropy change per domain (NumPy only).

    j_N = jaccard(ids_a_NxK, ids_b_NxK, n_experts)             # per token |A & B| / |A | B|
    uniform_jaccard(E, K)                                     # two independent uniform K-sets
    load_matched_jaccard(ids_a, ids_b, E, rng, n_shuffles)    # B's sets permuted across the tokens

Load-matched chance: B's top-k sets permuted across the analysed tokens keep both routers' loads (and B's set
frequencies) exactly, and break only which token gets which set: the overlap that two routers with these loads
reach with no shared token -> expert mapping. It lies above the uniform value when both loads favour the same
experts (two routers that both favour expert 3 share it often by chance) and below it when they favour
different ones.

Shape key: N tokens, K top-k, E experts (router candidates), D domains, S shuffles.
"""

import math

import numpy as np


def _sets(ids_NxK, n_experts):
    """One-hot membership [N, E] of each token's top-k set."""
    m_NxE = np.zeros((len(ids_NxK), n_experts), bool)
    m_NxE[np.arange(len(ids_NxK))[:, None], np.asarray(ids_NxK, np.int64)] = True
    return m_NxE


def jaccard(ids_a_NxK, ids_b_NxK, n_experts: int) -> np.ndarray:
    """|A_t & B_t| / |A_t | B_t| per token [N] (1: the same experts, 0: none shared)."""
    a_NxE, b_NxE = _sets(ids_a_NxK, n_experts), _sets(ids_b_NxK, n_experts)
    inter_N = (a_NxE & b_NxE).sum(-1)
    return inter_N / np.maximum((a_NxE | b_NxE).sum(-1), 1)


def uniform_jaccard(n_experts: int, top_k: int, top_k_b: int | None = None) -> float:
    """E[J] of two independent uniformly random sets of K (and K_b) distinct experts out of E: the overlap m is
    hypergeometric, J = m / (K + K_b - m)."""
    kb = top_k if top_k_b is None else top_k_b
    total = math.comb(n_experts, kb)
    return sum(math.comb(top_k, m) * math.comb(n_experts - top_k, kb - m) / total * m / (top_k + kb - m)
               for m in range(0, min(top_k, kb) + 1))


def load_matched_jaccard(ids_a_NxK, ids_b_NxK, n_experts: int, rng, n_shuffles: int = 20) -> np.ndarray:
    """Mean Jaccard [S] of A against B's sets permuted across the tokens, one value per permutation."""
    a_NxE, b_NxE = _sets(ids_a_NxK, n_experts), _sets(ids_b_NxK, n_experts)
    out = np.empty(n_shuffles)
    for s in range(n_shuffles):
        p_NxE = b_NxE[rng.permutation(len(b_NxE))]
        out[s] = ((a_NxE & p_NxE).sum(-1) / np.maximum((a_NxE | p_NxE).sum(-1), 1)).mean()
    return out


def per_domain_mean(values_N, domains_N, n_domains: int) -> np.ndarray:
    """Mean of values per domain [D] (NaN for a domain with no token)."""
    n_D = np.bincount(domains_N, minlength=n_domains).astype(np.float64)
    s_D = np.bincount(domains_N, weights=np.asarray(values_N, np.float64), minlength=n_domains)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n_D > 0, s_D / np.maximum(n_D, 1), np.nan)


def per_domain_se(values_N, domains_N, n_domains: int) -> np.ndarray:
    """Standard error of the per-domain mean over tokens [D] (tokens taken as independent: a lower bound for
    neighbouring tokens of one document; NaN below 2 tokens)."""
    out = np.full(n_domains, np.nan)
    for d in range(n_domains):
        v = np.asarray(values_N, np.float64)[domains_N == d]
        if len(v) > 1:
            out[d] = v.std(ddof=1) / math.sqrt(len(v))
    return out


def compare_layer(ids_a_NxK, ids_b_NxK, h_a_N, h_b_N, domains_N, n_domains: int, n_experts: int, rng,
                  n_shuffles: int = 20) -> dict:
    """Everything the comparison reports for one MoE layer: Jaccard (mean, per domain) beside the uniform and
    load-matched chance (mean and the 2.5-97.5% band of the permutations), and entropy per domain in bits
    (A, B, B - A with its standard error over tokens), with log2(E), the entropy of a router with no preference."""
    j_N = jaccard(ids_a_NxK, ids_b_NxK, n_experts)
    null_S = load_matched_jaccard(ids_a_NxK, ids_b_NxK, n_experts, rng, n_shuffles)
    dh_N = np.asarray(h_b_N, np.float64) - np.asarray(h_a_N, np.float64)
    return {
        "jaccard": float(j_N.mean()), "jaccard_D": per_domain_mean(j_N, domains_N, n_domains),
        "same_set": float((j_N == 1).mean()),
        "uniform_chance": uniform_jaccard(n_experts, ids_a_NxK.shape[-1], ids_b_NxK.shape[-1]),
        "load_matched_chance": float(null_S.mean()),
        "load_matched_band": [float(np.percentile(null_S, 2.5)), float(np.percentile(null_S, 97.5))],
        "entropy_a": float(np.mean(h_a_N)), "entropy_b": float(np.mean(h_b_N)),
        "entropy_a_D": per_domain_mean(h_a_N, domains_N, n_domains),
        "entropy_b_D": per_domain_mean(h_b_N, domains_N, n_domains),
        "entropy_change_D": per_domain_mean(dh_N, domains_N, n_domains),
        "entropy_change_se_D": per_domain_se(dh_N, domains_N, n_domains),
        "max_entropy": math.log2(n_experts),
    }
