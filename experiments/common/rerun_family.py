"""The per-cell-rate reruns' family (docs/inference.md; declared 2026-12-02, before their comparison seeds ran): the
mask arms and the encoder-decoder 2x2, each cell at the learning rate it chose on held-out seed 1000 (rule 10), read
as one family of 11 tests with Holm across all 11. A test is computed once both of its cells have two paired
seeds; until then it counts as p = 1, so a half-finished rerun is never judged in a smaller family.

    python -m experiments.common.rerun_family    # prints the table, writes rerun_family.json beside each rerun's runs

Its inputs are the committed per-run results, each rerun's OUT without checkpoints: <rerun>/<cell>/seed<k>/result.json
beside <rerun>/references.json, for experiments/masks_round2/results/study-lr and experiments/encdec/results/encdec-lr.
"""

import json
from pathlib import Path

from experiments.common.inference import HEADLINE_HALFWIDTH, family
from experiments.common.rederive import gate_line, runs
from experiments.common.verdicts import ACC, LOSS, PRIMARY, cell_gate, member
from rundir.atomic import write_text

ROOT = Path(__file__).resolve().parents[1]
MASKS = ROOT / "masks_round2/results/study-lr"
ENCDEC = ROOT / "encdec/results/encdec-lr"
COMMAND = "python -m experiments.common.rerun_family"

# (study, a, b, key) in the declared order: a - b per seed, gated on b
DECLARED = (*(("masks_round2", a, "causal", "val_loss") for a in PRIMARY),
            *(("masks_round2", a, "causal", "choice_accuracy") for a in PRIMARY),
            *(("encdec", a, b, "val_loss") for a, b in (("encdec_P", "decoder_P"), ("encdec_2P", "decoder_2P"),
                                                        ("encdec_P", "decoder_2P"), ("decoder_2P", "decoder_P"),
                                                        ("encdec_2P", "encdec_P"))))


def name(study, a, b, key) -> str:
    return f"{study}: {a} - {b}" + (", 4-way choice accuracy" if key == "choice_accuracy" else "")


def _study(folder: Path) -> tuple[dict, float | None]:
    """({cell: {seed: result}}, the bigram of its scored targets) of one rerun; ({}, None) before it has run."""
    refs = folder / "references.json"
    bigram = json.loads(refs.read_text())["bigram"] if refs.exists() else None
    return (runs(folder) if folder.is_dir() else {}), bigram


def members(masks: Path = MASKS, encdec: Path = ENCDEC) -> tuple[list[dict], list[str], dict]:
    """(the tests that can be computed, the declared tests that cannot yet, each study's cell gates)."""
    studies = {"masks_round2": _study(masks), "encdec": _study(encdec)}
    out, waiting = [], []
    for study, a, b, key in DECLARED:
        cells, bigram = studies[study]
        if a in cells and b in cells and bigram is not None and len(set(cells[a]) & set(cells[b])) >= 2:
            out.append(member(study, name(study, a, b, key), None, cells[a], cells[b], bigram, key,
                              ACC if key == "choice_accuracy" else LOSS, an=a))
        else:
            waiting.append(name(study, a, b, key))
    gates = {study: {c: cell_gate(runs_, bigram) for c, runs_ in sorted(cells.items())}
             for study, (cells, bigram) in studies.items() if bigram is not None}
    return out, waiting, gates


def decide(masks: Path = MASKS, encdec: Path = ENCDEC) -> dict:
    """The family's rows (Holm across all of DECLARED), the tests still waiting for seeds, the cell gates."""
    present, waiting, gates = members(masks, encdec)
    rows = family(present, size=len(DECLARED))
    for r in rows:
        r["labels"] = list(r["labels"])
    return {"command": COMMAND, "rules": "docs/inference.md", "declared": [name(*t) for t in DECLARED],
            "members": rows, "waiting_for_seeds": waiting, "cells": gates}


def fmt(m: dict) -> str:
    d = 3 if "accuracy" in m["contrast"] else 4
    margin = f"{m['margin']:.{d}f}" if m["margin"] else "-"
    return (f"| {m['contrast']} | {m['n']} | {m['mean']:+.{d}f} [{m['lo']:+.{d}f}, {m['hi']:+.{d}f}] | {m['p']:.4f} | "
            f"**{m['p_holm']:.3f}** | {m['wilcoxon_p']:.3f} | {m['hodges_lehmann']:+.{d}f} | {margin} | "
            f"{m['p_equiv_holm']:.3f} | {'passes' if m['gate_passed'] else 'FAILS'} | {m['verdict']} | "
            f"{m['seeds_for_halfwidth'] or '>1000'} |")


def main():
    doc = decide()
    print(f"Family: {len(doc['declared'])} tests declared, Holm across all of them (alpha 0.05); "
          f"{len(doc['waiting_for_seeds'])} wait for seeds and count as p = 1.\n")
    print(f"| test (a - b) | n | mean [95% t] | t p | Holm p | Wilcoxon p | HL | margin | equiv Holm p | gate on b | "
          f"verdict | seeds for +-{HEADLINE_HALFWIDTH} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m in doc["members"]:
        print(fmt(m))
    for w in doc["waiting_for_seeds"]:
        print(f"| {w} | waiting for two paired seeds |" + " |" * 10)
    print("\nCell gates (mean over seeds vs the bigram of the scored targets; need >= 0.3 below it, input gap >= 0.1)")
    for study, cells in doc["cells"].items():
        for c, g in cells.items():
            print(gate_line(study, c, g, width=14))
    for study, folder in (("masks_round2", MASKS), ("encdec", ENCDEC)):
        if folder.is_dir():
            path = folder / "rerun_family.json"
            write_text(path, json.dumps({**doc, "members": [m for m in doc["members"] if m["study"] == study],
                                         "cells": doc["cells"].get(study, {})}, indent=1) + "\n")
            print(f"wrote {path.relative_to(ROOT.parent)}")


if __name__ == "__main__":
    main()
