"""Where is the router informative? Per scored token, the loss under counterfactual routes minus the loss under
the router's own, averaged over random draws, then per domain and per token-frequency bucket.

    r = counterfactual(run.model, run.config, run.tokenizer, n_draws=4)
    r["variants"]                       # "all layers, random", "all layers, permuted", "layer L, random", ...
    r["delta_V"], r["se_V"]             # mean loss change per variant, nats / token, s.e. over rows
    r["delta_VxD"], r["delta_VxB"]      # per domain, per frequency bucket of the routed (input) token
    r["better_VxB"]                     # share of tokens whose loss the chosen route beats the draws' mean

A token's change is (loss with the variant's routes) - (loss with the chosen routes), both on the trainer's
validation rows (eval.rows_per_domain per domain; analysis/hf_rows.py), the variant's random routes drawn n_draws times
and averaged. Positive: the router's choice helps this token. The permuted variant is load-matched random
routing (each layer's chosen sets permuted across the batch's tokens, so every expert keeps its load): against it
the router is informative beyond sending the right amount of traffic to each expert. Frequency buckets rank the
routed token's id by its count in the whole split (BUCKETS: ranks 1-10, 11-100, 101-1000, beyond).

Shape key: V variants, D domains, B frequency buckets, N scored tokens, R rows, M MoE layers.
"""

import math

import jax
import numpy as np

from analysis import hf_rows
from analysis.counterfactual import routes
from moe import Execution
from moe.model import split_model

BUCKETS = ((1, 10), (11, 100), (101, 1000), (1001, math.inf))  # ranks of a token id by its count in the split


def bucket_names() -> list[str]:
    return [f"rank {lo}-{hi}" if math.isfinite(hi) else f"rank > {lo - 1}" for lo, hi in BUCKETS]


def frequency_bucket(token_ids, counts_V) -> np.ndarray:
    """BUCKETS index of each token id by the rank of its count (1 = the most frequent; unseen ids: the last)."""
    counts_V = np.asarray(counts_V)
    rank_V = np.empty(len(counts_V), np.int64)
    rank_V[np.argsort(-counts_V, kind="stable")] = np.arange(1, len(counts_V) + 1)
    rank_V[counts_V == 0] = np.iinfo(np.int64).max
    rank = rank_V[np.asarray(token_ids, np.int64)]
    return np.searchsorted([hi for _, hi in BUCKETS], rank, side="left").clip(0, len(BUCKETS) - 1)


def variants(layer_ids) -> list[tuple[str, np.ndarray]]:
    """(name, mode per MoE layer) in report order."""
    m = len(layer_ids)
    out = [("all layers, random", np.ones(m, np.int32)), ("all layers, permuted", np.full(m, 2, np.int32))]
    if m > 1:
        out += [(f"layer {layer}, random", np.eye(m, dtype=np.int32)[i]) for i, layer in enumerate(layer_ids)]
    return out


def grouped_mean_se(delta_N, group_N, row_N, n_groups: int):
    """Per group: the mean of delta over its tokens and the standard error over rows (ratio estimator: rows are
    the units; tokens of a row are not independent). NaN for an empty group."""
    mean_G, se_G = np.full(n_groups, np.nan), np.full(n_groups, np.nan)
    for g in range(n_groups):
        sel = group_N == g
        if not sel.any():
            continue
        rows, inv = np.unique(row_N[sel], return_inverse=True)
        s_R, n_R = np.bincount(inv, weights=delta_N[sel]), np.bincount(inv).astype(np.float64)
        mean_G[g] = s_R.sum() / n_R.sum()
        if len(rows) > 1:
            resid = s_R - mean_G[g] * n_R
            se_G[g] = math.sqrt(len(rows) / (len(rows) - 1) * (resid ** 2).sum()) / n_R.sum()
    return mean_G, se_G


def token_table(delta_N, token_N, tokenizer, min_count: int = 5, n: int = 10) -> dict:
    """The token ids seen >= min_count times with the largest and the smallest mean change."""
    ids, inv, cnt = np.unique(token_N, return_inverse=True, return_counts=True)
    mean = np.bincount(inv, weights=delta_N) / cnt
    keep = np.flatnonzero(cnt >= min_count)
    order = keep[np.argsort(-mean[keep], kind="stable")]
    row = lambda i: {"id": int(ids[i]), "text": tokenizer.decode([int(ids[i])]), "count": int(cnt[i]),
                     "delta": float(mean[i])}
    return {"most_informative": [row(i) for i in order[:n]], "least_informative": [row(i) for i in order[::-1][:n]]}


def counterfactual(model, config, tokenizer, rows_per_domain=None, n_draws: int = 4, seed: int = 0,
                   log=None, rows=None) -> dict:
    """Every variant's per-token loss change on the validation rows (module docstring); `rows`
    (analysis.hf_rows.Rows) replace the run's (a HF directory's)."""
    cfg = model.cfg
    layer_ids = list(cfg.moe_layer_ids)
    rows = rows or hf_rows.run_rows(config, rows_per_domain)
    batches, counts_V = rows.batches, rows.counts_V
    graphdef, params, bias = split_model(model)
    loss = routes.make_route_loss(graphdef, Execution().resolved())
    todo = variants(layer_ids)
    rng = np.random.default_rng(seed)
    k_max = max(cfg.moe_top_k(i) for i in layer_ids)
    zeros_M = np.zeros(len(layer_ids), np.int32)
    kept = {k: [] for k in ("domain", "row", "token", "base")}
    delta_V = [[] for _ in todo]
    row0 = 0
    for bi, b in enumerate(batches):
        batch = {k: b[k] for k in ("tokens", "targets", "loss_mask", "positions", "segment_ids", "prefix_len") if k in b}
        n_tokens = b["tokens"].size
        valid_T = (b["segment_ids"] > 0).reshape(-1)
        ident_T = np.arange(n_tokens, dtype=np.int32)
        no_ids = np.zeros((len(layer_ids), n_tokens, k_max), np.int32)
        base = np.asarray(jax.device_get(loss(params, bias, batch, zeros_M, no_ids, ident_T)))
        scored = b["loss_mask"] > 0
        for v, (_, mode_M) in enumerate(todo):
            acc = np.zeros_like(base)
            for _ in range(n_draws):
                rand = routes.random_ids(len(layer_ids), n_tokens, cfg.n_candidates, k_max, rng)
                perm = routes.valid_permutation(valid_T, rng)
                acc += np.asarray(jax.device_get(loss(params, bias, batch, mode_M, rand, perm))) - base
            delta_V[v].append((acc / n_draws)[scored])
        kept["domain"].append(b["domains"][scored])
        kept["row"].append(np.broadcast_to((row0 + np.arange(len(b["tokens"])))[:, None], scored.shape)[scored])
        kept["token"].append(b["tokens"][scored])
        kept["base"].append(base[scored])
        row0 += len(b["tokens"])
        if log:
            log(f"batch {bi + 1}/{len(batches)}: {len(todo)} variants x {n_draws} draws")
    flat = {k: np.concatenate(v) for k, v in kept.items()}
    delta_VxN = np.stack([np.concatenate(d) for d in delta_V])
    names, n_dom = list(rows.domain_names), len(rows.domain_names)
    bucket_N = frequency_bucket(flat["token"], counts_V)
    one_N = np.zeros(len(bucket_N), np.int64)
    out = {"variants": [n for n, _ in todo], "modes": [m.tolist() for _, m in todo], "layer_ids": layer_ids,
           "domain_names": names, "buckets": bucket_names(), "n_draws": n_draws, "n_tokens": len(bucket_N),
           "base_loss": float(flat["base"].mean()), "n_D": np.bincount(flat["domain"], minlength=n_dom),
           "n_B": np.bincount(bucket_N, minlength=len(BUCKETS))}
    for key, group, n_groups in (("V", one_N, 1), ("VxD", flat["domain"], n_dom), ("VxB", bucket_N, len(BUCKETS))):
        stats = [grouped_mean_se(d, group, flat["row"], n_groups) for d in delta_VxN]
        out[f"delta_{key}"] = np.array([m for m, _ in stats]).squeeze(-1) if key == "V" else np.array([m for m, _ in stats])
        out[f"se_{key}"] = np.array([s for _, s in stats]).squeeze(-1) if key == "V" else np.array([s for _, s in stats])
    out["better_VxB"] = np.array([[(d[bucket_N == g] > 0).mean() if (bucket_N == g).any() else np.nan
                                   for g in range(len(BUCKETS))] for d in delta_VxN])
    out["tokens"] = token_table(delta_VxN[0], flat["token"], tokenizer)
    return out
