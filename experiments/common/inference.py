"""The statistics docs/inference.md's rules need, beside the paired-seed basics of experiments/common/stats.py:

    wilcoxon_p(d), hodges_lehmann(d)      # the rank-based test and estimate beside the t-interval (exact, small n)
    tost_p(d, margin)                     # equivalence: two one-sided t-tests against +-margin
    equivalence_margin(effect)            # the margin: a fixed fraction of the reference's effect above chance
    slow_seeds(loss_by_seed)              # seeds that stalled: more than SLOW_MARGIN above the cell's fast half
    seed_slopes(x, y_by_seed)             # a trend when seeds are shared across cells: one slope per seed,
    clustered(values)                     #   then a t-interval over seeds (not over cells x seeds)
    family(members)                       # Holm across the declared family, and each member's verdict
    seeds_for_halfwidth(d, 0.05)          # how many seeds a +-0.05 interval would take at the observed spread

Plain NumPy and math, like stats.py; tests/test_inference_rules.py checks each against SciPy or by hand.
"""

import itertools
import math

import numpy as np

from experiments.common.stats import holm, paired_t_interval, paired_t_p, t_cdf, t_quantile

ALPHA = 0.05
# "Equivalent" means the contrast moves the reference's effect above chance by less than this fraction of it.
EQUIVALENCE_FRACTION = 0.1
# A seed stalled when its final loss is this many nats above the mean of its cell's faster half. The committed
# causal-target cells split there (rederive prints the pooled distances): seeds that did not stall sit <= 0.16
# above their cell's fast half, the ones whose curves lag from the first evaluations >= 0.23.
SLOW_MARGIN = 0.2
# The target width for a headline interval, either side of the mean (nats for a loss; accuracy points
# for the choice probe).
HEADLINE_HALFWIDTH = 0.05


def _ranks(a) -> np.ndarray:
    """Mid-ranks (1-based) of `a`: tied values share the mean of their ranks."""
    a = np.asarray(a, np.float64)
    order = np.argsort(a, kind="stable")
    ranks = np.empty(a.size)
    ranks[order] = np.arange(1, a.size + 1)
    for v in np.unique(a):
        tie = a == v
        ranks[tie] = ranks[tie].mean()
    return ranks


def wilcoxon_p(diffs) -> float:
    """Exact two-sided p of the Wilcoxon signed-rank test (zero differences dropped, mid-ranks for ties): every
    one of the 2^n sign assignments enumerated. Its floor is 2 / 2^n: 0.125 at 4 seeds, 0.0625 at 5."""
    d = np.asarray(diffs, np.float64)
    d = d[d != 0]
    if d.size == 0:
        return 1.0
    if d.size > 20:
        raise ValueError(f"exact enumeration is for small n; got {d.size} differences")
    r = _ranks(np.abs(d))
    w = float(r[d > 0].sum())
    null = np.array(list(itertools.product((0, 1), repeat=d.size)), np.float64) @ r  # W+ under every sign pattern
    eps = 1e-9 * r.sum()
    lower, upper = float(np.mean(null <= w + eps)), float(np.mean(null >= w - eps))
    return min(1.0, 2.0 * min(lower, upper))


def hodges_lehmann(diffs) -> float:
    """The signed-rank test's estimate of the centre: the median of the Walsh averages (d_i + d_j) / 2, i <= j. One
    outlying seed moves it little, so a mean that one seed drives shows up as a sign disagreement."""
    d = np.asarray(diffs, np.float64)
    i, j = np.triu_indices(d.size)
    return float(np.median((d[i] + d[j]) / 2.0))


def tost_p(diffs, margin: float | None) -> float:
    """Equivalence within +-margin: the larger p of the one-sided paired t-tests of mean <= -margin and mean >=
    +margin (p < alpha exactly when the (1 - 2 alpha) t-interval lies inside the margin)."""
    d = np.asarray(diffs, np.float64)
    if margin is None or margin <= 0:
        return 1.0
    se = float(d.std(ddof=1) / math.sqrt(d.size))
    if se == 0.0:
        return 0.0 if abs(float(d.mean())) < margin else 1.0
    m, df = float(d.mean()), d.size - 1
    return max(1.0 - t_cdf((m + margin) / se, df), t_cdf((m - margin) / se, df))


def equivalence_margin(effect_above_chance: float, fraction: float = EQUIVALENCE_FRACTION) -> float | None:
    """The margin for "no difference": `fraction` of what the reference learned beyond chance (its loss below the
    strongest cheap baseline, its accuracy above chance); None when it learned nothing to compare with."""
    return fraction * effect_above_chance if effect_above_chance > 0 else None


def slow_seeds(loss_by_seed: dict, margin: float = SLOW_MARGIN) -> list:
    """Seeds whose loss is more than `margin` above the mean of the cell's ceil(n/2) lowest losses. The fast half,
    not the median: with two stalled seeds of four the median falls between the two modes."""
    if len(loss_by_seed) < 2:
        return []
    losses = np.sort(np.asarray(list(loss_by_seed.values()), np.float64))
    fast = float(losses[: math.ceil(losses.size / 2)].mean())
    return sorted(s for s, v in loss_by_seed.items() if v - fast > margin)


def seed_slopes(x, y_by_seed: dict) -> dict:
    """{seed: least-squares slope of that seed's y on x} (y_by_seed[seed][k] measured at x[k])."""
    x = np.asarray(x, np.float64)
    xc = x - x.mean()
    return {s: float(xc @ (np.asarray(y, np.float64) - np.mean(y)) / (xc @ xc)) for s, y in y_by_seed.items()}


def clustered(values) -> dict:
    """Mean, 95% t-interval and t-test p over one value per seed: the interval for a statistic (a slope, a
    contrast over several cells) whose cells share seeds, so the seed, not the cell, is the unit."""
    m, lo, hi = paired_t_interval(values)
    return {"mean": m, "lo": lo, "hi": hi, "p": paired_t_p(values)}


def seeds_for_halfwidth(diffs, halfwidth: float = HEADLINE_HALFWIDTH, most: int = 1000) -> int | None:
    """The fewest seeds n whose 95% t-interval half-width t(0.975, n-1) * sd / sqrt(n) is at most `halfwidth`,
    taking the observed spread of the per-seed differences as the truth (a plan, not a guarantee: the spread is
    itself estimated from few seeds); None when more than `most` would be needed."""
    sd = float(np.std(np.asarray(diffs, np.float64), ddof=1))
    narrow = lambda n: t_quantile(0.975, n - 1) * sd / math.sqrt(n) <= halfwidth  # false, then true, as n grows
    if not narrow(most):
        return None
    lo, hi = 1, most  # narrow(hi) holds; narrow(lo) does not (an interval needs 2 seeds)
    while hi - lo > 1:  # bisection: t_quantile is itself a bisection, too slow to step through every n
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if narrow(mid) else (mid, hi)
    return hi


def _verdict(m: dict) -> str:
    if not m["gate_passed"]:
        return "not interpretable"
    if m["p_holm"] < ALPHA:
        if np.sign(m["hodges_lehmann"]) != np.sign(m["mean"]):
            return "null (one seed drives the mean)"
        return m["labels"][m["mean"] > 0]
    if m["p_equiv_holm"] < ALPHA:
        return "equivalent"
    return "null"


def family(members: list[dict], size: int | None = None) -> list[dict]:
    """Every member's statistics, Holm across the whole family (each member's t-test p for "different", its TOST p
    for "equivalent"), and its verdict. A member: "diffs" (one value per seed), "gate_passed", "labels" (what a
    negative and a positive mean say, e.g. ("a better", "a worse") for a loss), optional "margin". Members whose
    gate fails stay in the count: the family is fixed before the results. size: the declared family's size where
    some of its tests have not run yet; each missing one counts as p = 1, so Holm never shrinks the family."""
    missing = 0 if size is None else size - len(members)
    if missing < 0:
        raise ValueError(f"{len(members)} members in a family declared with {size}")
    out = []
    for m in members:
        d = list(m["diffs"])
        mean, lo, hi = paired_t_interval(d)
        out.append({**m, "n": len(d), "mean": mean, "lo": lo, "hi": hi, "p": paired_t_p(d),
                    "wilcoxon_p": wilcoxon_p(d), "hodges_lehmann": hodges_lehmann(d),
                    "p_equiv": tost_p(d, m.get("margin")), "seeds_for_halfwidth": seeds_for_halfwidth(d)})
    pad = [1.0] * missing
    for m, p, q in zip(out, holm([m["p"] for m in out] + pad), holm([m["p_equiv"] for m in out] + pad)):
        m["p_holm"], m["p_equiv_holm"] = p, q
        m["verdict"] = _verdict(m)
    return out
