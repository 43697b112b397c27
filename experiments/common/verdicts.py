"""From a study's per-run results to verdicts under docs/inference.md's rules. Pure functions of result dicts
(experiments.masks_round2.runner.summarize, experiments.encdec.runner.train_cell) so that tests can feed them numbers.

    cell_gate(cell, baseline)          # one cell against the strongest cheap baseline, its seeds, its stall rate
    member(study, name, old, a, b, baseline, ...)   # one test a - b, gated on b, with its equivalence margin
    masks_family(groups, bigram)       # the mask study's declared family on the arms present
    decide(members)                    # inference.family (Holm across the family, verdicts) + display counts
    family_table(rows)                 # decide()'s rows as a report's Markdown table

A verdict is one of (experiments.common.inference): "<a> better" / "<a> worse" (Holm p < 0.05, the gate passes,
the rank estimate agrees), "equivalent" (Holm-corrected TOST p < 0.05 within the margin), "not interpretable"
(the reference cell's gate fails), "null" (none of these: no effect shown, and no absence either).
"""

import math
from collections import defaultdict

import numpy as np

from experiments.common.inference import equivalence_margin, family, slow_seeds
from experiments.common.stats import GATE_BIGRAM_MARGIN, GATE_INPUT_GAP, gate, sign_test

PRIMARY = ("prefix", "mixed", "causal_all")  # the mask study's first tests: each against causal
NOPE_TWINS = {"causal_nope": "causal", "prefix_nope": "prefix"}  # each NoPE arm against its RoPE twin
# the equal-targets control: causal_all - causal = (causal_all - causal_half), the extra targets at the same
# spread, + (causal_half - causal), the spread over the input at the same count
EQUAL_TARGETS = (("causal_half", "causal"), ("causal_all", "causal_half"))
LOSS = ("a better", "a worse")  # what a negative and a positive a - b say of a loss
ACC = ("a worse", "a better")  # ... and of an accuracy


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
    """The causal arm's gate for the report's header (mean over its seeds), each seed's own gate beside it."""
    runs = groups["causal"]
    loss = float(np.mean([r["val_loss"] for r in runs.values()]))
    gap = float(np.mean([r["input_replacement_gap"] for r in runs.values()]))
    g = gate(loss, refs["bigram"], loss + gap)
    g["per_seed"] = {s: gate(r["val_loss"], refs["bigram"], r["val_loss"] + r["input_replacement_gap"])["passed"]
                     for s, r in sorted(runs.items())}
    return g


def cell_gate(cell: dict, baseline: float) -> dict:
    """The gate on one cell (mean over its seeds), each seed's own gate counted beside it, and its stall rate."""
    loss = {s: r["val_loss"] for s, r in cell.items()}
    gaps = {s: r["input_replacement_gap"] for s, r in cell.items() if "input_replacement_gap" in r}
    beats = baseline - float(np.mean(list(loss.values())))
    gap = float(np.mean(list(gaps.values()))) if gaps else None
    ok = beats >= GATE_BIGRAM_MARGIN and (gap is None or gap >= GATE_INPUT_GAP)
    per_seed = sum(baseline - loss[s] >= GATE_BIGRAM_MARGIN and gaps.get(s, math.inf) >= GATE_INPUT_GAP
                   for s in loss)
    return {"baseline": baseline, "beats_baseline_by": beats, "input_gap": gap, "passed": bool(ok),
            "seeds_passing": f"{per_seed} / {len(loss)}", "slow_seeds": slow_seeds(loss),
            "stall_rate": f"{len(slow_seeds(loss))} / {len(loss)}"}


def member(study, name, old, a, b, baseline, key="val_loss", labels=LOSS, an="a") -> dict:
    """One contrast a - b over the seeds both cells have (`an`: a's name in the verdict), gated on b, the
    reference, with its equivalence margin; `old`: the verdict the page gave it before these rules."""
    seeds = sorted(set(a) & set(b))
    g = cell_gate(b, baseline)
    if key == "val_loss":
        effect = g["beats_baseline_by"]
    else:  # an accuracy: the reference's accuracy above chance
        effect = float(np.mean([b[s][key] - b[s]["choice_chance"] for s in seeds]))
    slow = set(slow_seeds({s: a[s]["val_loss"] for s in seeds})) | set(g["slow_seeds"])
    fast = [a[s][key] - b[s][key] for s in seeds if s not in slow]
    return {"study": study, "contrast": name, "old": old, "seeds": seeds, "diffs": [a[s][key] - b[s][key] for s in seeds],
            "gate_passed": g["passed"], "gate": g, "margin": equivalence_margin(effect), "effect_above_chance": effect,
            "labels": tuple(x.replace("a ", f"{an} ", 1) for x in labels), "slow_seeds": sorted(slow),
            "mean_without_slow_seeds": float(np.mean(fast)) if fast else None}


def interaction_member(groups, baseline: float) -> dict | None:
    """Does the causal mask make dropping positions cost less? Per seed (causal_nope - causal) - (prefix_nope -
    prefix), negative = it does; gated on both RoPE arms. None unless all four arms are present."""
    arms = ("causal_nope", "causal", "prefix_nope", "prefix")
    if any(a not in groups for a in arms):
        return None
    m = member("masks_round2", "(causal_nope - causal) - (prefix_nope - prefix)", None, groups["causal_nope"],
               groups["causal"], baseline)
    seeds = sorted(set.intersection(*(set(groups[a]) for a in arms)))
    g = {a: groups[a] for a in arms}
    m.update(seeds=seeds, diffs=[g["causal_nope"][s]["val_loss"] - g["causal"][s]["val_loss"]
                                 - (g["prefix_nope"][s]["val_loss"] - g["prefix"][s]["val_loss"]) for s in seeds],
             gate_passed=m["gate_passed"] and cell_gate(groups["prefix"], baseline)["passed"],
             slow_seeds=[], mean_without_slow_seeds=None,
             labels=("causal mask's NoPE cost smaller", "causal mask's NoPE cost larger"))
    return m


def masks_family(groups, baseline: float) -> list[dict]:
    """The mask study's family, declared here before any run, on the arms present (a test needs both of its arms
    and two paired seeds): PRIMARY - causal on the loss, then on 4-way choice accuracy; the equal-targets control;
    each NoPE arm - its RoPE twin; the mask x position interaction."""
    tests = [(a, "causal", "val_loss") for a in PRIMARY]
    tests += [(a, "causal", "choice_accuracy") for a in PRIMARY]
    tests += [(a, b, "val_loss") for a, b in (*EQUAL_TARGETS, *NOPE_TWINS.items())]
    out = []
    for a, b, key in tests:
        if a in groups and b in groups and len(set(groups[a]) & set(groups[b])) >= 2:
            acc = key != "val_loss"
            out.append(member("masks_round2", f"{a} - {b}" + (", 4-way choice accuracy" if acc else ""), None,
                              groups[a], groups[b], baseline, key, ACC if acc else LOSS, an=a))
    inter = interaction_member(groups, baseline)
    if inter is not None and len(inter["seeds"]) >= 2:
        out.append(inter)
    return out


def decide(members: list[dict]) -> list[dict]:
    """Holm across the whole family and every member's verdict (inference.family), with the display counts: seeds
    on the first label's side, the sign test's p."""
    out = family(members)
    for m in out:
        d = np.asarray(m["diffs"])
        m["wins"] = int(np.sum(d < 0))  # seeds where a - b < 0: the first label's side
        m["sign_p"] = sign_test(list(d))
        m["labels"] = list(m["labels"])
    return out


def family_table(rows) -> list[str]:
    """The Markdown table of decide()'s rows: one line per test, every statistic docs/inference.md asks for."""
    out = ["| test (a - b) | n | mean [95% paired t] | a lower / n | t p | Holm p | Wilcoxon p | HL | without stalled "
           "seeds | margin | equiv Holm p | gate on b | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = 3 if "accuracy" in r["contrast"] else 4
        fast = "-" if r["mean_without_slow_seeds"] is None or not r["slow_seeds"] else \
            f"{r['mean_without_slow_seeds']:+.{d}f} (without {', '.join(map(str, r['slow_seeds']))})"
        margin = f"{r['margin']:.{d}f}" if r["margin"] else "-"
        out.append(f"| {r['contrast']} | {r['n']} | {r['mean']:+.{d}f} [{r['lo']:+.{d}f}, {r['hi']:+.{d}f}] | {r['wins']} / {r['n']} | "
                   f"{r['p']:.4f} | {r['p_holm']:.3f} | {r['wilcoxon_p']:.3f} | {r['hodges_lehmann']:+.{d}f} | "
                   f"{fast} | {margin} | {r['p_equiv_holm']:.3f} | {'passes' if r['gate_passed'] else 'fails'} | "
                   f"**{r['verdict']}** |")
    return out
