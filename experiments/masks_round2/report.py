"""The study report, regenerated from saved results alone (no training, no model):

    python -m experiments.masks_round2.report --out runs/study_masks

reads OUT/<arm>/seed<k>/result.json, OUT/references.json and OUT/study.json (the base config) and writes
OUT/report/report.md, results.json and PNGs. Every conclusion passes through experiments.common.verdicts under
docs/inference.md's rules: the study's family declared in code (verdicts.masks_family), each test gated on its
reference arm against the bigram, Holm across the whole family, the rank test beside the t-interval, stall rates,
equivalence margins relative to the reference's distance below the bigram.
"""

import json
import sys
from pathlib import Path

import numpy as np

from experiments.common import lr_select, plots
from experiments.common.inference import equivalence_margin
from experiments.common.stats import GATE_BIGRAM_MARGIN, GATE_INPUT_GAP, paired_t_interval
from experiments.common.verdicts import (
    PRIMARY,
    by_arm,
    cell_gate,
    decide,
    family_table,
    masks_family,
    study_gate,
)
from plumbing.args import ArgParser
from plumbing.errors import UserError, exit_with, os_error
from rundir.atomic import write_text


def _mean_t(values):
    v = list(values)
    return paired_t_interval(v) if len(v) >= 2 else (v[0], v[0], v[0])


def setup_lines(base, results, own_rates: bool = False) -> list[str]:
    """own_rates: each arm ran at the rate it chose (its table below), not at the config's lr."""
    r0 = results[0]
    m, d, t = base["model"], base["data"], base["train"]
    lr = "each arm at its own learning rate (below)" if own_rates else f"lr {t['lr']}"
    return [f"Model: d_model {m['d_model']}, {m['n_layers']} layers ({m['first_k_dense']} dense), {m['n_heads']} "
            f"heads (kv {m['n_kv_heads']}) x {m['head_dim']}, {m['n_routed_experts']} routed experts top-"
            f"{m['top_k']} + {m['n_shared_experts']} shared, vocab {m['vocab_size']} ({d['tokenizer'] or 'default'}"
            f"). Data: {d['name']}, every document cut into {d['seq_len']}-token windows, input = first "
            f"{d['prefix_frac']:.0%} of a window. Batch {t['batch_size']}, {r0['steps']} steps "
            f"({r0['tokens_seen']:,} tokens per run), {lr}, warmup {t['warmup_steps']}, {t['schedule']}.",
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


def write_report(results, refs, out, base, missing=(), lr_choice=None) -> Path:
    """lr_choice: experiments.common.lr_select's per-arm selection, when the arms ran at their own rates."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base = base.to_dict() if hasattr(base, "to_dict") else base
    groups = by_arm(results)
    if "causal" not in groups:
        raise UserError("no finished causal run: the gate and every contrast need the causal arm")
    g = study_gate(groups, refs)
    rows = decide(masks_family(groups, refs["bigram"]))
    write_text(out / "results.json", json.dumps({"results": results, "references": refs, "gate": g,
                                                 "family": rows, "lr_selection": lr_choice or None}))
    primary = [r for r in rows if r["contrast"] in {f"{a} - causal" for a in PRIMARY}]
    plots.plot_contrasts(primary, out / "paired_loss.png", "validation loss difference (nats)",
                         "arm - causal, paired by seed; < 0: arm better",
                         equivalence_margin(g["beats_bigram_by"]))
    plots.plot_curves(groups, refs, out / "val_curves.png")
    plots.plot_domains(groups, refs, out / "domains.png")
    plots.plot_probes(groups, out / "probes.png")

    n_seeds = max(len(v) for v in groups.values())
    lines = ["# Mask study report", "",
             f"{len(results)} runs: {len(groups)} arms x up to {n_seeds} paired seeds (seed k: same data order and "
             "initial weights in every arm).", ""]
    if missing:
        lines += [f"**Partial study**: not finished: {', '.join(missing)}.", ""]
    lines += setup_lines(base, results, own_rates=bool(lr_choice)) + [""]
    lines += ["## Gate on the causal arm", "",
              f"The causal arm must beat the interpolated bigram reference by >= {GATE_BIGRAM_MARGIN} nats and "
              f"replacing each validation window's input by another same-domain window's must cost >= "
              f"{GATE_INPUT_GAP} nats (mean over causal seeds). Otherwise no test against causal is interpreted; "
              "every other reference arm's gate is in the table below.", "",
              "| quantity | value |", "|---|---|",
              f"| unigram reference (scored targets) | {refs['unigram']:.4f} |",
              f"| bigram reference (lambda {refs['bigram_lambda']:.2f}, chosen on training text) | "
              f"{refs['bigram']:.4f} |",
              f"| causal val loss, mean over seeds | {np.mean([r['val_loss'] for r in groups['causal'].values()]):.4f} |",
              f"| causal beats bigram by | {g['beats_bigram_by']:+.4f} (need >= {GATE_BIGRAM_MARGIN}) |",
              f"| input-replacement gap | {g['input_replacement_gap']:+.4f} (need >= {GATE_INPUT_GAP}) |",
              f"| per-seed gate | {', '.join(f'seed {s}: {p}' for s, p in g['per_seed'].items())} |",
              f"| **verdict** | **{g['verdict']}** |", ""]
    lines += lr_select.report_lines(lr_choice or {})
    lines += ["## Validation loss per arm", "",
              f"Stalled: seeds more than 0.2 nats above the mean of the arm's faster half (docs/inference.md rule 6). "
              f"Gate: the arm's mean at least {GATE_BIGRAM_MARGIN} below the bigram and an input gap of "
              f"{GATE_INPUT_GAP}; it gates every test that has the arm as its reference b.", "",
              "| arm | lr | mean [95% t-interval over seeds] | per seed | gate (seeds passing) | stalled | "
              "input-replacement gap | input-shuffle gap | input-order gap | 4-way choice accuracy | train s/run |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, runs in groups.items():
        rs = [runs[s] for s in sorted(runs)]
        m, lo, hi = _mean_t(r["val_loss"] for r in rs)
        per_seed = ", ".join(f"{r['val_loss']:.4f}" for r in rs)
        cg = cell_gate(runs, refs["bigram"])
        lines.append(f"| {arm} | {rs[0].get('lr', base['train']['lr']):g} | {m:.4f} [{lo:.4f}, {hi:.4f}] | "
                     f"{per_seed} | {'passes' if cg['passed'] else 'fails'} ({cg['seeds_passing']}) | "
                     f"{cg['stall_rate']} | {np.mean([r['input_replacement_gap'] for r in rs]):+.4f} | "
                     f"{np.mean([r['input_shuffle_gap'] for r in rs]):+.4f} | {order_gap_cell(rs)} | "
                     f"{np.mean([r['choice_accuracy'] for r in rs]):.3f} (chance {rs[0]['choice_chance']:.2f}, "
                     f"n {rs[0]['choice_n']}) | {np.mean([r['train_seconds'] for r in rs]):.0f} |")
    lines += ["", "![validation curves](val_curves.png)", "",
              "## The family under docs/inference.md's rules", "",
              f"Declared in experiments/common/verdicts.py (masks_family) before any run, on the arms present: "
              f"{len(rows)} tests, Holm across all of them. Loss: negative = a has the lower loss; accuracy: "
              "positive = a picks the true continuation more often. Each test is gated on its reference arm b. "
              "\"a better\" / \"a worse\": Holm p < 0.05, the gate passes and the Hodges-Lehmann estimate agrees in "
              "sign; \"equivalent\": Holm-corrected TOST p < 0.05 within the margin (a tenth of b's distance below "
              "the bigram, or of its accuracy above chance); \"null\": neither. The exact rank test cannot go below "
              f"p = 2/2^n ({2 / 2 ** n_seeds:.3f} here). The NoPE arms' input-order gap is in the table above: exactly "
              "0 for a prefix-LM without positions.", ""]
    lines += family_table(rows)
    lines += ["", "![paired loss differences](paired_loss.png)", ""]
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
