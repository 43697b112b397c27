"""From the study's per-run results to pre-registered verdicts: the gate, then every contrast against causal with a
paired t-interval, a sign count, Holm-adjusted p-values and the +-0.02 equivalence test. Pure functions of result
dicts (experiments.masks_round2.runner.summarize) so that tests can feed them numbers.

A verdict is one of:
  "not interpretable"   the gate failed: the causal model does not use its input enough for a mask to matter
  "A better" / "A worse" Holm-adjusted paired t-test p < 0.05 (lower loss = better)
  "equivalent"           the paired 95% interval lies inside +-EQUIVALENCE_MARGIN nats
  "inconclusive"         neither: the data cannot tell (absence of evidence is not evidence of absence)
"""

from collections import defaultdict

import numpy as np

from experiments.common.stats import equivalent, gate, holm, paired_t_interval, paired_t_p, sign_test

EQUIVALENCE_MARGIN = 0.02
ALPHA = 0.05
PRIMARY = ("prefix", "mixed", "causal_all")  # the pre-registered family: each against causal
NOPE_TWINS = {"causal_nope": "causal", "prefix_nope": "prefix"}  # the NoPE family: each against its RoPE twin
# the equal-targets control (added after the second round): causal_all - causal = (causal_all - causal_half), the
# extra targets at the same spread, + (causal_half - causal), the spread over the input at the same count
EQUAL_TARGETS = (("causal_half", "causal"), ("causal_all", "causal_half"))


def by_arm(results) -> dict:
    """{arm: {seed: result}} in first-seen order."""
    out = defaultdict(dict)
    for r in results:
        out[r["arm"]][r["seed"]] = r
    return dict(out)


def paired(groups, a: str, b: str, key: str = "val_loss") -> tuple[list[int], list[float]]:
    """(seeds, per-seed differences a - b) over the seeds both arms finished."""
    seeds = sorted(set(groups[a]) & set(groups[b]))
    return seeds, [groups[a][s][key] - groups[b][s][key] for s in seeds]


def study_gate(groups, refs) -> dict:
    """The gate on the causal arm, mean over its seeds, plus each seed's own gate for the record."""
    runs = groups["causal"]
    loss = float(np.mean([r["val_loss"] for r in runs.values()]))
    gap = float(np.mean([r["input_replacement_gap"] for r in runs.values()]))
    g = gate(loss, refs["bigram"], loss + gap)
    g["per_seed"] = {s: gate(r["val_loss"], refs["bigram"], r["val_loss"] + r["input_replacement_gap"])["passed"]
                     for s, r in sorted(runs.items())}
    return g


def contrasts(groups, gate_passed: bool, key: str = "val_loss", lower_is_better: bool = True,
              margin: float = EQUIVALENCE_MARGIN, family=None) -> list[dict]:
    """Each (arm, reference) of `family` (default: every PRIMARY arm present against causal) on `key`,
    Holm-corrected over the family."""
    family = family or [(a, "causal") for a in PRIMARY if a in groups]
    rows = []
    for a, ref in family:
        if a not in groups or ref not in groups:
            continue
        seeds, d = paired(groups, a, ref, key)
        row = {"contrast": f"{a} - {ref}", "arm": a, "seeds": seeds, "diffs": d, "n": len(d)}
        if len(d) >= 2:
            m, lo, hi = paired_t_interval(d)
            row.update(mean=m, lo=lo, hi=hi, p=paired_t_p(d), sign_p=sign_test(d),
                       wins=int(np.sum(np.asarray(d) < 0) if lower_is_better else np.sum(np.asarray(d) > 0)),
                       equivalent=equivalent(d, margin))
        rows.append(row)
    tested = [r for r in rows if "p" in r]
    for r, p_adj in zip(tested, holm([r["p"] for r in tested])):
        r["p_holm"] = p_adj
    for r in rows:
        r["verdict"] = verdict(r, gate_passed, lower_is_better)
    return rows


def nope_interaction(groups, gate_passed: bool) -> dict | None:
    """Does the causal mask make dropping positions cost less? Per seed (causal_nope - causal) - (prefix_nope -
    prefix), negative = the causal model loses less; tested like a contrast (its own family of one). None unless
    all four arms are present."""
    arms = ("causal_nope", "causal", "prefix_nope", "prefix")
    if any(a not in groups for a in arms):
        return None
    seeds = sorted(set.intersection(*(set(groups[a]) for a in arms)))
    d = [(groups["causal_nope"][s]["val_loss"] - groups["causal"][s]["val_loss"])
         - (groups["prefix_nope"][s]["val_loss"] - groups["prefix"][s]["val_loss"]) for s in seeds]
    row = {"contrast": "(causal_nope - causal) - (prefix_nope - prefix)", "arm": "causal mask", "seeds": seeds,
           "diffs": d, "n": len(d)}
    if len(d) >= 2:
        m, lo, hi = paired_t_interval(d)
        p = paired_t_p(d)
        row.update(mean=m, lo=lo, hi=hi, p=p, p_holm=p, sign_p=sign_test(d), wins=int(np.sum(np.asarray(d) < 0)),
                   equivalent=equivalent(d))
    row["verdict"] = verdict(row, gate_passed)
    return row


def verdict(row, gate_passed: bool, lower_is_better: bool = True) -> str:
    if not gate_passed:
        return "not interpretable"
    if "p_holm" not in row:
        return "inconclusive (fewer than 2 paired seeds)"
    if row["p_holm"] < ALPHA:
        better = row["mean"] < 0 if lower_is_better else row["mean"] > 0
        return f"{row['arm']} {'better' if better else 'worse'}"
    if row["equivalent"]:
        return "equivalent"
    return "inconclusive"
