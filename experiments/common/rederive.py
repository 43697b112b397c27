"""Every committed conclusion of the decoder-only page under docs/inference.md's rules, from the per-run results in
the study folders (no training, no model): one declared family, Holm across it, each contrast gated on its
reference cell against the strongest cheap baseline of its targets, the rank test beside the t-interval, the
stall rate, equivalence margins relative to the effect above chance, seed-clustered intervals.

    python -m experiments.common.rederive            # prints the tables, writes experiments/<study>/results/rederived.json

The MLM baseline is experiments/mlm/results/mlm-r2/neighbour_bigram.json (python -m experiments.mlm.neighbour_bigram).
"""

import json
import math
from pathlib import Path

import numpy as np

from experiments.common.inference import HEADLINE_HALFWIDTH, SLOW_MARGIN, family, seed_slopes
from experiments.common.stats import sign_test
from experiments.common.verdicts import cell_gate, member
from rundir.atomic import write_text

ROOT = Path(__file__).resolve().parents[1]
R1 = ROOT / "masks_round1/results"
R2 = ROOT / "masks_round2/results"
HS = ROOT / "head_sweep/results/head-sweep-cpu"
ED = ROOT / "encdec/results/encdec-cpu"
MLM = ROOT / "mlm/results/mlm-r2"
HEAD_DIMS = (64, 32, 16, 8)  # n_in / d_head = 128 / d_head
ACC = ("a worse", "a better")  # an accuracy: higher is better



def _below(margin: float) -> str:
    """'0.123 below' / '1.917 ABOVE' for a loss `margin` nats below (positive) or above (negative) a baseline."""
    return f"{margin:.3f} below" if margin >= 0 else f"{-margin:.3f} ABOVE"


def gate_line(study: str, cell: str, g: dict, width: int = 24) -> str:
    """One cell's gate (verdicts.cell_gate) as a printed line."""
    gap = f"{g['input_gap']:+.3f}" if g["input_gap"] is not None else "-"
    return (f"  {study:{width}s} {cell:{width - 2}s} {_below(g['beats_baseline_by'])} {g['baseline']:.4f}, input gap "
            f"{gap}, {'passes' if g['passed'] else 'FAILS'}, seeds passing {g['seeds_passing']}, "
            f"stalled {g['stall_rate']} {g['slow_seeds'] or ''}")

def runs(folder: Path) -> dict:
    """{cell: {seed: result}} from folder/<cell>/seed<k>/result.json."""
    out = {}
    for f in sorted(folder.glob("*/seed*/result.json")):
        r = json.loads(f.read_text())
        out.setdefault(f.parent.parent.name, {})[int(r["seed"])] = r
    return out


def head_sweep_slope(cells: dict, baseline: float) -> dict:
    """The trend of prefix - causal on log2(n_in / d_head) with the seed as the unit: one slope per seed."""
    x = [math.log2(128 / d) for d in HEAD_DIMS]
    seeds = sorted(set.intersection(*(set(cells[d]["prefix"]) & set(cells[d]["causal"]) for d in HEAD_DIMS)))
    y = {s: [cells[d]["prefix"][s]["val_loss"] - cells[d]["causal"][s]["val_loss"] for d in HEAD_DIMS] for s in seeds}
    slopes = seed_slopes(x, y)
    gates = [cell_gate(cells[d]["causal"], baseline) for d in HEAD_DIMS]
    return {"study": "head_sweep", "contrast": "slope of prefix - causal per doubling of n_in / d_head",
            "old": "null", "seeds": seeds, "diffs": [slopes[s] for s in seeds],
            "gate_passed": all(g["passed"] for g in gates), "gate": {"per_d_head": gates}, "margin": None,
            "labels": ("falls with n_in / d_head", "rises with n_in / d_head"), "slow_seeds": [],
            "mean_without_slow_seeds": None}


def members() -> tuple[list[dict], dict]:
    """The declared family (docs/inference.md lists it) and each study's cell gates."""
    r2, refs = runs(R2 / "study-cpu-r2/finished"), json.loads((R2 / "study-cpu-r2/results.json").read_text())
    r2.update(runs(R2 / "study-cpu-nope/finished"))
    half6 = runs(R2 / "study-half6/finished")
    bigram = refs["references"]["bigram"]
    out = [member("masks_round2", "prefix - causal", "null", r2["prefix"], r2["causal"], bigram, an="prefix"),
           member("masks_round2", "mixed - causal", "null", r2["mixed"], r2["causal"], bigram, an="mixed"),
           member("masks_round2", "causal_all - causal", "causal_all better", r2["causal_all"], r2["causal"], bigram,
                  an="causal_all")]
    out += [member("masks_round2", f"{a} - causal, 4-way choice accuracy", old, r2[a], r2["causal"], bigram,
                   "choice_accuracy", ACC, an=a)
            for a, old in (("prefix", "null"), ("mixed", "equivalent"), ("causal_all", "null"))]
    out += [member("masks_round2", "causal_half - causal (6 seeds)", "null", half6["causal_half"], half6["causal"],
                   bigram, an="causal_half"),
            member("masks_round2", "causal_all - causal_half", "causal_all better", r2["causal_all"],
                   r2["causal_half"], bigram, an="causal_all"),
            member("masks_round2", "causal_nope - causal", "causal_nope worse", r2["causal_nope"], r2["causal"], bigram,
                   an="causal_nope"),
            member("masks_round2", "prefix_nope - prefix", "prefix_nope worse", r2["prefix_nope"], r2["prefix"], bigram,
                   an="prefix_nope")]
    inter = member("masks_round2", "(causal_nope - causal) - (prefix_nope - prefix)", "null", r2["causal_nope"],
                   r2["causal"], bigram, an="the causal mask's NoPE cost")
    inter["diffs"] = [r2["causal_nope"][s]["val_loss"] - r2["causal"][s]["val_loss"]
                      - (r2["prefix_nope"][s]["val_loss"] - r2["prefix"][s]["val_loss"]) for s in inter["seeds"]]
    inter["gate_passed"] = inter["gate_passed"] and cell_gate(r2["prefix"], bigram)["passed"]
    inter["slow_seeds"], inter["mean_without_slow_seeds"] = [], None
    inter["labels"] = ("causal mask's NoPE cost smaller", "causal mask's NoPE cost larger")
    out.append(inter)
    hs = {d: runs(HS / f"finished/d{d}") for d in HEAD_DIMS}
    out += [member("head_sweep", f"prefix - causal at d_head {d} (n_in / d_head {128 // d})", "null", hs[d]["prefix"],
                   hs[d]["causal"], bigram, an="prefix") for d in HEAD_DIMS]
    out.append(head_sweep_slope(hs, bigram))
    ed, ed_bigram = runs(ED / "finished"), json.loads((ED / "finished/references.json").read_text())["bigram"]
    for a, b, old in (("encdec_P", "decoder_P", "null"), ("encdec_2P", "decoder_2P", "encdec_2P worse"),
                      ("encdec_P", "decoder_2P", "null"), ("decoder_2P", "decoder_P", "null"),
                      ("encdec_2P", "encdec_P", "null")):
        out.append(member("encdec", f"{a} - {b}", old, ed[a], ed[b], ed_bigram, an=a))
    mlm, nb = runs(MLM / "finished"), json.loads((MLM / "neighbour_bigram.json").read_text())
    out.append(member("mlm", "mixed - bidirectional", "mixed worse", mlm["mixed"], mlm["bidirectional"],
                      nb[nb["strongest"]], an="mixed"))
    cells = {"masks_round2": {c: cell_gate(r2[c], bigram) for c in sorted(r2)},
             "masks_round2 (6 seeds)": {c: cell_gate(half6[c], bigram) for c in sorted(half6)},
             "head_sweep": {f"d{d}/{c}": cell_gate(hs[d][c], bigram) for d in HEAD_DIMS for c in sorted(hs[d])},
             "encdec": {c: cell_gate(ed[c], ed_bigram) for c in sorted(ed)},
             "mlm": {c: cell_gate(mlm[c], nb[nb["strongest"]]) for c in sorted(mlm)}}
    return out, {"cells": cells, "mlm_baselines": nb, "first_cpu_round": first_round(), "round_one": round_one()}


def first_round() -> dict:
    """The 60-step first CPU round of masks_round2: its gate (no contrast is read when it fails)."""
    r = json.loads((R2 / "study-cpu/results.json").read_text())
    causal = {x["seed"]: x for x in r["results"] if x["arm"] == "causal"}
    return cell_gate(causal, r["references"]["bigram"])


def round_one() -> dict:
    """Round 1's causal (RoPE) arm in each of its three result sets against the bigram of its targets
    (experiments/masks_round1/references.py; round 1 measured no input gap)."""
    bigram = json.loads((R1 / "references.json").read_text())["bigram"]
    out = {}
    for name in ("compare-masks", "compare-masks-400", "compare-masks-default"):
        rs = json.loads((R1 / name / "results.json").read_text())
        out[name] = cell_gate({r["seed"]: r for r in rs if r["mask"] == "causal" and r["rope"]}, bigram)
    return out


def status(m: dict) -> str:
    """The old claim under the rules: confirmed (it still follows), null (no effect claimed, none shown) or
    withdrawn (the claim no longer follows)."""
    new = m["verdict"]
    if m["old"] == "null":
        return "null" if new.startswith("null") or new in ("not interpretable", "equivalent") else f"new: {new}"
    return "confirmed" if new == m["old"] else "withdrawn"


def slow_distances() -> list[float]:
    """Every causal-target seed's distance above its cell's fast half (the rule's SLOW_MARGIN sits in its gap)."""
    groups = [runs(R2 / "study-cpu-r2/finished"), runs(R2 / "study-cpu-nope/finished"), runs(ED / "finished"),
              *(runs(HS / f"finished/d{d}") for d in HEAD_DIMS if d != 32)]
    groups[0].update(runs(R2 / "study-half6/finished"))  # causal and causal_half at 6 seeds
    out = []
    for g in groups:
        for cell in g.values():
            v = np.sort([r["val_loss"] for r in cell.values()])
            out += list(v - v[: math.ceil(v.size / 2)].mean())
    return sorted(float(x) for x in out if x > 0)


def fmt(m: dict) -> str:
    f = f"{m['mean']:+.3f} [{m['lo']:+.3f}, {m['hi']:+.3f}]"
    margin = f"{m['margin']:.3f}" if m["margin"] else "-"
    need = m["seeds_for_halfwidth"] or ">1000"
    return (f"| {m['study']} | {m['contrast']} | {m['n']} | {f} | {m['p']:.4f} | **{m['p_holm']:.3f}** | "
            f"{m['wilcoxon_p']:.3f} | {m['hodges_lehmann']:+.3f} | {margin} | {m['p_equiv_holm']:.3f} | "
            f"{'passes' if m['gate_passed'] else 'FAILS'} | {m['verdict']} | {m['old']} -> **{status(m)}** | {need} |")


def main():
    fam, extra = members()
    fam = family(fam)
    for m in fam:
        m["status"] = status(m)
        m["labels"] = list(m["labels"])
    print(f"Family: {len(fam)} tests, Holm across all of them (alpha 0.05).\n")
    print("| study | contrast | n | mean [95% t] | t p | Holm p | Wilcoxon p | HL | margin | equiv Holm p | gate "
          f"| verdict | old -> now | seeds for +-{HEADLINE_HALFWIDTH} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m in fam:
        print(fmt(m))
    print("\nCell gates (mean over seeds vs the strongest cheap baseline; need >= 0.3 below it and an input gap >= 0.1)")
    for study, cells in extra["cells"].items():
        for c, g in cells.items():
            print(gate_line(study, c, g))
    fr = extra["first_cpu_round"]
    print(f"\nFirst CPU round (60 steps): causal {_below(fr['beats_baseline_by'])} the bigram, input gap "
          f"{fr['input_gap']:+.3f}: {'passes' if fr['passed'] else 'FAILS'}")
    for name, g in extra["round_one"].items():
        print(f"Round 1 {name}: causal {_below(g['beats_baseline_by'])} the bigram ({g['baseline']:.4f}): "
              f"{'passes' if g['passed'] else 'FAILS'}, seeds passing {g['seeds_passing']}")
    nb = extra["mlm_baselines"]
    print("MLM masked targets: " + ", ".join(f"{k} {nb[k]:.4f}" for k in
                                             ("unigram", "left_bigram", "right_bigram", "neighbour_bigram")))
    ed = [m for m in fam if m["study"] == "encdec" and m["contrast"].startswith("encdec")]
    seeds_all_worse = [all(m["diffs"][i] > 0 for m in ed) for i in range(len(ed[0]["seeds"]))]
    print(f"Enc-dec worse in every enc-dec/decoder pairing of a seed: {sum(seeds_all_worse)} / {len(seeds_all_worse)} "
          f"seeds (sign p {sign_test([1.0] * sum(seeds_all_worse)):.3f}; the 16 pairings share 4 seeds)")
    d = slow_distances()
    print(f"Seeds above their cell's fast half (causal targets), sorted: {', '.join(f'{x:.3f}' for x in d)}; "
          f"SLOW_MARGIN {SLOW_MARGIN}")
    for study in ("masks_round2", "head_sweep", "encdec", "mlm"):
        doc = {"command": "python -m experiments.common.rederive", "rules": "docs/inference.md",
               "family": [f"{m['study']}: {m['contrast']}" for m in fam],
               "members": [m for m in fam if m["study"] == study], "cells": extra["cells"].get(study, {})}
        if study == "masks_round2":
            doc.update(cells_6_seeds=extra["cells"]["masks_round2 (6 seeds)"], first_cpu_round=fr,
                       slow_seed_distances=d)
        if study == "mlm":
            doc["baselines"] = nb
        if study == "encdec":
            doc["seeds_enc_dec_worse_in_every_pairing"] = sum(seeds_all_worse)
        path = ROOT / study / "results" / "rederived.json"
        write_text(path, json.dumps(doc, indent=1) + "\n")
        print(f"wrote {path.relative_to(ROOT.parent)}")
    doc = {"command": "python -m experiments.common.rederive", "rules": "docs/inference.md",
           "gates": extra["round_one"], "verdict": "withdrawn: no result set passes the gate; no test is read"}
    write_text(R1 / "rederived.json", json.dumps(doc, indent=1) + "\n")
    print(f"wrote {(R1 / 'rederived.json').relative_to(ROOT.parent)}")


if __name__ == "__main__":
    main()
