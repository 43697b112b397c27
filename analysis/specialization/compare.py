"""Each headline routing metric of one or several runs of one config (seeds) beside the same metric for the
untrained router (step 0), the load-matched null and the token-identity null (baselines.py), with its interval
over the runs.

    measured = [measure(run, split=None, max_tokens=4096, n_shuffles=20) for run in runs]
    doc = document(runs, measured, None, 4096, 20)    # specialization.json
    print(table(doc))
"""

import numpy as np
from scipy import stats

from analysis.routing.stats import favourite_agreement, plain_json
from analysis.specialization import baselines
from plumbing.errors import UserError
from rundir.config_layout import ADDED_KEYS
from rundir.provenance import provenance

# Metrics the token-identity null leaves unchanged by construction (it keeps every token's expert counts and
# every expert's load): their null band is the trained value, and "above the null" cannot be asked of them.
KEPT_BY_TOKEN_NULL = ("vocab_spec", "maxvio")

# Keys that may differ between runs of "one config": the seed, and where and how often the run wrote files.
FREE_KEYS = ("train.seed", "checkpoint.", "log.")


def flat_keys(sections: dict) -> dict:
    """{"train.steps": 400, ...} from a run config's sections."""
    return {f"{name}.{k}": v for name, section in sections.items() for k, v in section.items()}


def check_same_config(runs):
    """UserError naming the first key (other than FREE_KEYS) whose value differs between the runs. A key added to
    the config after a run was saved counts as its reproducing default (rundir.config_layout.ADDED_KEYS): a seed
    resumed by a later version is still a seed of the same config."""
    first = flat_keys(runs[0].config.to_dict())
    for run in runs[1:]:
        other = flat_keys(run.config.to_dict())
        for key in sorted(set(first) | set(other)):
            a, b = first.get(key, ADDED_KEYS.get(key)), other.get(key, ADDED_KEYS.get(key))
            if key.startswith(FREE_KEYS) or a == b:
                continue
            raise UserError(f"--workdir {run.workdir} is not a seed of {runs[0].workdir}: config key {key} is "
                            f"{other.get(key)!r} there and {first.get(key)!r} in the first; pass runs of one config")


def measure(run, split, max_tokens, n_shuffles, batch_size=None):
    """{"n_tokens": N, "trained": {metric: [L]}, "step0": {metric: [L]}, "random": {metric: [n_shuffles, L]},
    "token_null": {metric: [n_shuffles, L]}, "step0_source": str, "favourite_vs_step0": ...} for one run."""
    record = baselines.route_record(run.model, run.config, split, max_tokens, batch_size)
    if not record.batches or not any(b["valid"].any() for b in record.batches):
        raise UserError(f"no tokens to analyse in split {split or run.config.data.eval_split!r}; check --split")
    model0, source = baselines.untrained(run)
    init = baselines.route_record(model0, run.config, split, max_tokens, batch_size)
    trained, step0 = baselines.accumulate(record), baselines.accumulate(init)
    agree_L, chance_L, n_ids = favourite_agreement(trained["tok_counts_LxVxE"], step0["tok_counts_LxVxE"],
                                                   trained["tok_n_V"], trained["vocab_min_count"])
    return {"n_tokens": int(trained["n_tokens"]), "trained": baselines.headline(trained),
            "step0": baselines.headline(step0), "step0_source": source,
            "random": baselines.random_router(record, n_shuffles, seed=run.config.train.seed),
            "token_null": baselines.token_null(record, n_shuffles, seed=run.config.train.seed),
            "favourite_vs_step0": {"agree": agree_L, "chance": chance_L, "n_ids": n_ids}}


def interval(values_RxL):
    """Mean, min, max over runs (axis 0) and, with 3 or more, the 95% t-interval of the mean (else NaN)."""
    v = np.asarray(values_RxL, np.float64)
    n, mean = v.shape[0], v.mean(0)
    half = (stats.t.ppf(0.975, n - 1) * v.std(0, ddof=1) / np.sqrt(n)) if n >= 3 else np.full_like(mean, np.nan)
    return {"mean": mean, "min": v.min(0), "max": v.max(0), "ci95_low": mean - half, "ci95_high": mean + half,
            "n": n}


def band(values_NxL):
    """A null's band over every permutation of every run: mean and the 2.5%..97.5% quantiles."""
    v = np.asarray(values_NxL, np.float64)
    return {"mean": v.mean(0), "low": np.quantile(v, 0.025, 0), "high": np.quantile(v, 0.975, 0), "n": len(v)}


def above(trained_RxL, band_high_L):
    """Per run and layer: is the trained value above the null band's 97.5% quantile?"""
    return np.asarray(trained_RxL, np.float64) > np.asarray(band_high_L, np.float64)[None]


def aggregate(per_run):
    """Per metric: trained and step-0 intervals over runs; the load-matched ("random") and token-identity
    ("token_null") nulls as bands over runs x shuffles, and per run and layer whether the trained value is above
    each band (the token-identity null not asked of the metrics it keeps by construction)."""
    out = {}
    for name in per_run[0]["trained"]:
        trained_RxL = [m["trained"][name] for m in per_run]
        rand, null = (band(np.concatenate([m[key][name] for m in per_run])) for key in ("random", "token_null"))
        out[name] = {"what": baselines.HEADLINE[name],
                     "trained": dict(interval([m["trained"][name] for m in per_run]),
                                     per_run=[m["trained"][name] for m in per_run]),
                     "step0": dict(interval([m["step0"][name] for m in per_run]),
                                   per_run=[m["step0"][name] for m in per_run]),
                     "random": dict(rand, above=above(trained_RxL, rand["high"])),
                     "token_null": dict(null, above=None if name in KEPT_BY_TOKEN_NULL
                                        else above(trained_RxL, null["high"]),
                                        kept_by_construction=name in KEPT_BY_TOKEN_NULL)}
    return out


def aggregate_agreement(per_run):
    """A token's favourite expert, trained against step 0: agreement and its chance level, over runs."""
    runs = [m["favourite_vs_step0"] for m in per_run]
    return {"what": "share of token ids (seen >= 10 times) whose favourite expert is the same as at step 0",
            "agree": dict(interval([r["agree"] for r in runs]), per_run=[r["agree"] for r in runs]),
            "chance": dict(interval([r["chance"] for r in runs]), per_run=[r["chance"] for r in runs]),
            "n_ids": [r["n_ids"] for r in runs]}


def table(doc):
    """One line per metric and layer: trained (range over runs), step 0, the two null bands."""
    lines = [f"{len(doc['runs'])} run(s), {doc['n_tokens']} tokens each; nulls: {doc['n_shuffles']} permutations "
             f"per run (2.5-97.5% band); step 0: {'; '.join(sorted(set(doc['step0_source'])))}"]
    for name, m in doc["metrics"].items():
        for i, layer in enumerate(doc["layer_ids"]):
            t, s, r, z = m["trained"], m["step0"], m["random"], m["token_null"]
            rng = f" [{t['min'][i]:.3f}, {t['max'][i]:.3f}]" if t["n"] > 1 else ""
            null = ("= trained by construction" if z["kept_by_construction"]
                    else f"{z['mean'][i]:.3f} [{z['low'][i]:.3f}, {z['high'][i]:.3f}]")
            lines.append(f"{name:>15} layer {layer}: trained {t['mean'][i]:.3f}{rng}  step 0 {s['mean'][i]:.3f}  "
                         f"load-matched null {r['mean'][i]:.3f} [{r['low'][i]:.3f}, {r['high'][i]:.3f}]  "
                         f"token-identity null {null}")
    fav = doc["favourite_vs_step0"]
    for i, layer in enumerate(doc["layer_ids"]):
        lines.append(f"favourite expert = step 0's, layer {layer}: {fav['agree']['mean'][i]:.3f} of token ids "
                     f"(chance {fav['chance']['mean'][i]:.3f})")
    return "\n".join(lines)


def document(runs, per_run, split, max_tokens, n_shuffles):
    """specialization.json as plain JSON types: the runs, the settings and `aggregate(per_run)`."""
    ref = runs[0]
    return plain_json({"runs": [{"workdir": str(r.workdir), "step": r.step, "seed": r.config.train.seed} for r in runs],
                   "step0_source": [m["step0_source"] for m in per_run],
                   "nulls": {"random": "load-matched: top-k sets permuted across all analysed tokens",
                             "token_null": "token identity kept: top-k sets permuted among the occurrences of "
                                           "each token id"},
                   "provenance": provenance(),
                   "split": split or ref.config.data.eval_split, "max_tokens": max_tokens,
                   "n_tokens": per_run[0]["n_tokens"], "n_shuffles": n_shuffles, "layer_ids": ref.moe_layer_ids,
                   "top_k": ref.model.cfg.top_k, "n_experts": ref.model.cfg.n_routed_experts,
                   "metrics": aggregate(per_run), "favourite_vs_step0": aggregate_agreement(per_run)})
