"""The study report, regenerated from saved results alone (no training, no model):

    python -m experiments.masks_round2.report --out runs/study_masks

reads OUT/<arm>/seed<k>/result.json, OUT/references.json and OUT/study.json (the base config) and writes
OUT/report/report.md, results.json and PNGs. Every conclusion passes through experiments.common.verdicts: the gate
first ("not interpretable" when it fails), then paired t-intervals, sign counts, Holm and the equivalence test.
"""

import json
import sys
from pathlib import Path

import numpy as np

from experiments.common import plots
from experiments.common.stats import GATE_BIGRAM_MARGIN, GATE_INPUT_GAP, paired_t_interval
from experiments.common.verdicts import (
    ALPHA,
    EQUAL_TARGETS,
    EQUIVALENCE_MARGIN,
    NOPE_TWINS,
    by_arm,
    contrasts,
    nope_interaction,
    study_gate,
)
from moe.cli import ArgParser
from moe.errors import UserError, exit_with, os_error
from rundir.atomic import write_text

ACCURACY_MARGIN = 0.05  # equivalence margin for continuation accuracy (pre-registered with the study)


def _ci(m, lo, hi, d=4):
    return f"{m:+.{d}f} [{lo:+.{d}f}, {hi:+.{d}f}]"


def _mean_t(values):
    v = list(values)
    return paired_t_interval(v) if len(v) >= 2 else (v[0], v[0], v[0])


def setup_lines(base, results) -> list[str]:
    r0 = results[0]
    m, d, t = base["model"], base["data"], base["train"]
    return [f"Model: d_model {m['d_model']}, {m['n_layers']} layers ({m['first_k_dense']} dense), {m['n_heads']} "
            f"heads (kv {m['n_kv_heads']}) x {m['head_dim']}, {m['n_routed_experts']} routed experts top-"
            f"{m['top_k']} + {m['n_shared_experts']} shared, vocab {m['vocab_size']} ({d['tokenizer'] or 'default'}"
            f"). Data: {d['name']}, every document cut into {d['seq_len']}-token windows, input = first "
            f"{d['prefix_frac']:.0%} of a window. Batch {t['batch_size']}, {r0['steps']} steps "
            f"({r0['tokens_seen']:,} tokens per run), lr {t['lr']}, warmup {t['warmup_steps']}, {t['schedule']}.",
            f"Validation: loss on the output half for every arm (also causal_all, which trains on every token). "
            f"Final losses, references and the gate: every validation window ({r0.get('n_val_rows', '?')}); "
            f"curves: every {base['eval']['every']} steps on the first {base['eval']['rows_per_domain']} windows of "
            f"each domain. Probes on the first windows of each domain: input replacement "
            f"{r0.get('n_gap_rows', '?')}, input shuffle {r0.get('n_shuffle_rows', '?')}, continuation choice "
            f"{r0.get('choice_n', '?')} (x4 candidates)."]


def order_gap_cell(rs) -> str:
    """Mean input-order gap over the runs that have it (results from before the probe may lack it)."""
    v = [r["input_order_gap"] for r in rs if "input_order_gap" in r]
    if not v:
        return "-"
    return f"{np.mean(v):+.4f}" + ("" if len(v) == len(rs) else f" ({len(v)} of {len(rs)} seeds)")


def contrast_table(rows, digits=4) -> list[str]:
    out = ["| contrast | mean [95% paired t-interval] | seeds better / n | sign p | t p | Holm p | "
           "equivalent | verdict |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "mean" not in r:
            out.append(f"| {r['contrast']} | - | - | - | - | - | - | {r['verdict']} |")
            continue
        out.append(f"| {r['contrast']} | {_ci(r['mean'], r['lo'], r['hi'], digits)} | {r['wins']} / {r['n']} | "
                   f"{r['sign_p']:.3f} | {r['p']:.3f} | {r['p_holm']:.3f} | {'yes' if r['equivalent'] else 'no'} | "
                   f"**{r['verdict']}** |")
    return out


def equal_targets_rows(groups, gate_passed: bool) -> list[dict]:
    """The equal-targets control's contrasts (none without the causal_half arm): does causal_all win by its extra
    targets or by where they sit?"""
    family = [(a, ref) for a, ref in EQUAL_TARGETS if a in groups and ref in groups]
    return contrasts(groups, gate_passed, family=family) if family else []


def equal_targets_lines(rows) -> list[str]:
    if not rows:
        return []
    lines = ["", "## Equal-targets control for causal_all (own Holm family; added after the round)", "",
             "causal_half: causal mask, loss on a random subset of every window's targets as large as its output "
             "half (so as many targets per step as causal, spread over input and output like causal_all's). "
             "causal_all - causal = (causal_all - causal_half: the extra targets) + (causal_half - causal: moving half "
             "of the targets onto the input). Negative = the first arm has the lower loss.", ""]
    return lines + contrast_table(rows)


def write_report(results, refs, out, base, missing=()) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base = base.to_dict() if hasattr(base, "to_dict") else base
    groups = by_arm(results)
    if "causal" not in groups:
        raise UserError("no finished causal run: the gate and every contrast need the causal arm")
    g = study_gate(groups, refs)
    loss_rows = contrasts(groups, g["passed"])
    acc_rows = contrasts(groups, g["passed"], "choice_accuracy", lower_is_better=False, margin=ACCURACY_MARGIN)
    eq_rows = equal_targets_rows(groups, g["passed"])
    write_text(out / "results.json", json.dumps({"results": results, "references": refs, "gate": g,
                                                 "loss_contrasts": loss_rows, "accuracy_contrasts": acc_rows,
                                                 **({"equal_targets_contrasts": eq_rows} if eq_rows else {})}))
    plots.plot_curves(groups, refs, out / "val_curves.png")
    plots.plot_contrasts(loss_rows, out / "paired_loss.png", "validation loss difference (nats)",
                               "arm - causal, paired by seed; < 0: arm better", EQUIVALENCE_MARGIN)
    plots.plot_domains(groups, refs, out / "domains.png")
    plots.plot_probes(groups, out / "probes.png")

    n_seeds = max(len(v) for v in groups.values())
    lines = ["# Mask study report (issue 14)", "",
             f"{len(results)} runs: {len(groups)} arms x up to {n_seeds} paired seeds (seed k: same data order and "
             "initial weights in every arm).", ""]
    if missing:
        lines += [f"**Partial study**: not finished: {', '.join(missing)}.", ""]
    lines += setup_lines(base, results) + [""]
    lines += ["## Gate (pre-registered)", "",
              f"The causal arm must beat the interpolated bigram reference by >= {GATE_BIGRAM_MARGIN} nats and "
              f"replacing each validation window's input by another same-domain window's must cost >= "
              f"{GATE_INPUT_GAP} nats (mean over causal seeds). Otherwise no contrast below is interpreted.", "",
              "| quantity | value |", "|---|---|",
              f"| unigram reference (scored targets) | {refs['unigram']:.4f} |",
              f"| bigram reference (lambda {refs['bigram_lambda']:.2f}, chosen on training text) | "
              f"{refs['bigram']:.4f} |",
              f"| causal val loss, mean over seeds | {np.mean([r['val_loss'] for r in groups['causal'].values()]):.4f} |",
              f"| causal beats bigram by | {g['beats_bigram_by']:+.4f} (need >= {GATE_BIGRAM_MARGIN}) |",
              f"| input-replacement gap | {g['input_replacement_gap']:+.4f} (need >= {GATE_INPUT_GAP}) |",
              f"| per-seed gate | {', '.join(f'seed {s}: {p}' for s, p in g['per_seed'].items())} |",
              f"| **verdict** | **{g['verdict']}** |", ""]
    lines += ["## Validation loss per arm", "", "| arm | mean [95% t-interval over seeds] | per seed | "
              "input-replacement gap | input-shuffle gap | input-order gap | 4-way choice accuracy | train s/run |",
              "|---|---|---|---|---|---|---|---|"]
    for arm, runs in groups.items():
        rs = [runs[s] for s in sorted(runs)]
        m, lo, hi = _mean_t(r["val_loss"] for r in rs)
        per_seed = ", ".join(f"{r['val_loss']:.4f}" for r in rs)
        lines.append(f"| {arm} | {m:.4f} [{lo:.4f}, {hi:.4f}] | {per_seed} | "
                     f"{np.mean([r['input_replacement_gap'] for r in rs]):+.4f} | "
                     f"{np.mean([r['input_shuffle_gap'] for r in rs]):+.4f} | {order_gap_cell(rs)} | "
                     f"{np.mean([r['choice_accuracy'] for r in rs]):.3f} (chance {rs[0]['choice_chance']:.2f}, "
                     f"n {rs[0]['choice_n']}) | {np.mean([r['train_seconds'] for r in rs]):.0f} |")
    lines += ["", "![validation curves](val_curves.png)", "",
              "## Primary contrasts: validation loss, arm - causal (Holm over these contrasts)", "",
              f"Negative = the arm has the lower loss. A difference is claimed when the Holm-adjusted paired t-test "
              f"p < {ALPHA}; \"equivalent\" only when the whole 95% interval lies inside +-{EQUIVALENCE_MARGIN} "
              "nats; anything else is inconclusive. With n seeds the sign test cannot go below p = 2/2^n "
              f"({2 / 2 ** n_seeds:.3f} here).", ""]
    lines += contrast_table(loss_rows)
    lines += ["", "![paired loss differences](paired_loss.png)", "",
              "## Secondary contrasts: 4-way continuation accuracy, arm - causal (own Holm family)", "",
              f"Positive = the arm picks the true continuation more often; equivalence margin +-{ACCURACY_MARGIN}.", ""]
    lines += contrast_table(acc_rows, 3)
    lines += equal_targets_lines(eq_rows)
    nope = [(a, ref) for a, ref in NOPE_TWINS.items() if a in groups and ref in groups]
    if nope:
        lines += ["", "## NoPE (no position encoding) against its RoPE twin (own Holm family)", "",
                  "Validation loss, NoPE - RoPE (negative = NoPE better). The input-order gap of each arm is in the "
                  "table above: the loss change when the input is shuffled but its last token kept, exactly 0 for a "
                  "prefix-LM without positions (the input-shuffle gap is not: the first output token loses its true "
                  "predecessor).",
                  ""]
        lines += contrast_table(contrasts(groups, g["passed"], family=nope))
        inter = nope_interaction(groups, g["passed"])
        if inter is not None:
            lines += ["", "Mask x position interaction (added after the NoPE arms were designed, so not pre-registered): "
                      "does dropping positions cost the causal model less than the prefix-LM, as \"the causal mask "
                      "carries position information\" predicts? Negative = it does.", ""]
            lines += contrast_table([inter])
    lines += ["", "![probes](probes.png)", "", "## Per domain (final validation loss, mean over seeds)", "",
              "| domain | unigram | bigram | " + " | ".join(groups) + " |", "|---" * (3 + len(groups)) + "|"]
    for name, ref in refs["by_domain"].items():
        vals = [np.mean([r["val_loss_by_domain"].get(name, np.nan) for r in runs.values()])
                for runs in groups.values()]
        lines.append(f"| {name} | {ref['unigram']:.3f} | {ref['bigram']:.3f} | "
                     + " | ".join(f"{v:.3f}" for v in vals) + " |")
    lines += ["", "![per-domain loss](domains.png)", ""]
    write_text(out / "report.md", "\n".join(lines))
    return out / "report.md"


def load(out) -> tuple[list, dict, dict, list]:
    """(results, references, base config dict, missing) from a study directory."""
    out = Path(out)
    for need in ("references.json", "study.json"):
        if not (out / need).is_file():
            raise UserError(f"{out} is not a study directory (no {need}); run python -m experiments.masks_round2 "
                            f"--out {out}")
    base = json.loads((out / "study.json").read_text())
    results, missing = [], []
    for arm in base["arms"]:
        for s in range(base["seeds"]):
            f = out / arm / f"seed{s}" / "result.json"
            if f.is_file():
                results.append(json.loads(f.read_text()))
            else:
                missing.append(f"{arm} seed {s}")
    if not results:
        raise UserError(f"no finished runs in {out}; run python -m experiments.masks_round2 --out {out} first")
    return results, json.loads((out / "references.json").read_text()), base["config"], missing


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = ArgParser(prog="python -m experiments.masks_round2.report", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the study directory given to python -m experiments.masks_round2")
    try:
        args = p.parse_args(argv)
        results, refs, base, missing = load(args.out)
        report = write_report(results, refs, Path(args.out) / "report", base, missing)
    except UserError as e:
        exit_with(e)
    except OSError as e:
        exit_with(os_error(e))
    print(f"wrote {report}")


if __name__ == "__main__":
    main()
