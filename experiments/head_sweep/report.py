"""The head-size sweep's report (experiments.head_sweep.runner writes it): per n_in / d_head the paired
prefix - causal contrast and each arm's input-block effective rank, and the seed-clustered slope of the difference
on log2(n_in / d_head), one family under docs/inference.md's rules; OUT/head_sweep.{json,md,png}."""

import json
from pathlib import Path

import numpy as np

from analysis.figures import grid, save
from experiments.common.inference import seed_slopes
from experiments.common.plots import fit_axis_to_seeds
from experiments.common.verdicts import by_arm, decide, member
from rundir.atomic import write_text

ARMS = ("causal", "prefix")
SLOPE = "slope of prefix - causal per doubling of n_in / d_head"


def slope_member(rows) -> dict | None:
    """The trend as one test with the seed as the unit (docs/inference.md rule 4): each seed's least-squares slope
    of prefix - causal on log2(n_in / d_head) over every d_head, then the t-interval over seeds; gated on every
    d_head's causal arm. None with fewer than 2 seeds common to all d_heads."""
    seeds = sorted(set.intersection(*(set(r["seeds"]) for r in rows)))
    if len(seeds) < 2 or len({r["n_over_d"] for r in rows}) < 2:
        return None
    y = {s: [r["diffs"][r["seeds"].index(s)] for r in rows] for s in seeds}
    per_seed = seed_slopes([np.log2(r["n_over_d"]) for r in rows], y)
    return {"study": "head_sweep", "contrast": SLOPE, "old": None, "seeds": seeds, "diffs": [per_seed[s] for s in seeds],
            "gate_passed": all(r["gate_passed"] for r in rows), "gate": {"per_d_head": [r["gate"] for r in rows]},
            "margin": None, "labels": ("falls with n_in / d_head", "rises with n_in / d_head"), "slow_seeds": [],
            "mean_without_slow_seeds": None}


def sweep_rows(cells) -> list[dict]:
    """The sweep's family, declared here before any run: prefix - causal at each d_head (gated on that d_head's
    causal arm against the bigram of the scored targets), then the seed-clustered slope; Holm across all of them
    (cells: [{d_head, n_over_d, results, bigram, ranks}]). Each row carries its d_head's input-block ranks."""
    rows = []
    for cell in cells:
        groups = by_arm(cell["results"])
        m = member("head_sweep", f"prefix - causal at d_head {cell['d_head']}", None, groups["prefix"],
                   groups["causal"], cell["bigram"], an="prefix")
        m.update(d_head=cell["d_head"], n_over_d=cell["n_over_d"],
                 erank={a: float(np.mean(v)) for a, v in cell["ranks"].items() if v})
        rows.append(m)
    trend = slope_member(rows)
    return decide(rows + ([trend] if trend else []))


def plot(rows, path):
    """rows: the per-d_head rows (the slope row left out)."""
    fig, (ax, ax_r) = grid(2, 2, 4.6, 3.6)
    x = np.array([r["n_over_d"] for r in rows])
    for r in rows:
        ax.scatter([r["n_over_d"]] * len(r["diffs"]), r["diffs"], color="0.6", s=14, zorder=2)
    have = [r for r in rows if "mean" in r]
    if have:
        m = np.array([r["mean"] for r in have])
        ax.errorbar([r["n_over_d"] for r in have], m, yerr=[m - [r["lo"] for r in have], [r["hi"] for r in have] - m],
                    fmt="o-", color="C0", capsize=3, label="mean, paired 95% t-interval")
    failed = [r for r in have if not r["gate_passed"]]
    if failed:
        ax.scatter([r["n_over_d"] for r in failed], [r["mean"] for r in failed], s=140, facecolors="none",
                   edgecolors="C3", zorder=4, label="gate failed: not interpretable")
    ax.axhline(0, color="0.2", linewidth=0.8)
    lo, hi = fit_axis_to_seeds(ax, rows)
    clipped = any(r["lo"] < lo or r["hi"] > hi for r in have)
    ax.set_ylabel("val loss, prefix - causal (nats)")
    ax.set_title("loss difference (grey: single seeds; > 0: causal better)"
                 + ("\nsome intervals run past the axis: see the table" if clipped else ""), fontsize=9)
    for i, (arm, label) in enumerate((("causal", "causal model, causal mask"), ("prefix", "prefix model, prefix mask"))):
        ax_r.plot(x, [r["erank"].get(arm, np.nan) for r in rows], marker="os"[i], color=f"C{i}", label=label)
    if not any(r["erank"] for r in rows):  # no run kept its checkpoint: nothing sets the log axis' range
        ax_r.set_xlim(x.min() / 1.25, x.max() * 1.25)
    ax_r.set_ylabel("effective rank / n of the input block")
    ax_r.set_ylim(0, 1.05)
    ax_r.set_title("trained attention, input block (mean over layers)", fontsize=9)
    for a in (ax, ax_r):
        a.set_xscale("log", base=2)
        a.set_xticks(x, [f"{v:g}" for v in x])
        a.set_xlabel("n_in / d_head")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    save(fig, path)


def write_report(rows, out: Path, steps: int) -> Path:
    """rows: sweep_rows' family (the per-d_head tests, then the slope when it could be estimated)."""
    per_d = [r for r in rows if r["contrast"] != SLOPE]
    trend = next((r for r in rows if r["contrast"] == SLOPE), None)
    write_text(out / "head_sweep.json", json.dumps({"rows": per_d, "trend": trend}, indent=1))
    plot(per_d, out / "head_sweep.png")
    lines = ["# Head-size sweep: prefix - causal against n_in / d_head", "",
             f"Each d_head is its own two-arm study (OUT/d<d_head>/report/report.md: gate, curves), {steps} steps per "
             "run, equal parameters and attention FLOPs across d_head.", "",
             f"The family under docs/inference.md's rules, declared in experiments/head_sweep/report.py before any "
             f"run: prefix - causal at each d_head and the slope of that difference on log2(n_in / d_head), "
             f"{len(rows)} tests, Holm across all of them. The slope is computed once per seed and its interval taken "
             "over seeds (the d_heads share seeds). Each d_head's test is gated on its causal arm against the bigram; "
             "the slope on every d_head's. \"equivalent\": Holm-corrected TOST p < 0.05 within a tenth of the causal "
             "arm's distance below the bigram.", "",
             "| test | gate on causal (seeds passing) | stalled | mean [95% t] | per seed | t p | Holm p | Wilcoxon p | "
             "HL | margin | equiv Holm p | verdict | input-block erank/n: causal, prefix (runs with a checkpoint) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r["gate"]
        gate = (f"{'passes' if g['passed'] else 'fails'} ({g['seeds_passing']})", g["stall_rate"]) if "passed" in g \
            else ("passes on every d_head" if r["gate_passed"] else "fails on a d_head", "-")
        er = ", ".join(f"{r['erank'].get(a, float('nan')):.3f}" for a in ARMS) if "erank" in r else "-"
        margin = f"{r['margin']:.4f}" if r["margin"] else "-"
        lines.append(f"| {r['contrast']} | {gate[0]} | {gate[1]} | {r['mean']:+.4f} [{r['lo']:+.4f}, {r['hi']:+.4f}] | "
                     f"{', '.join(f'{d:+.4f}' for d in r['diffs'])} | {r['p']:.4f} | {r['p_holm']:.3f} | "
                     f"{r['wilcoxon_p']:.3f} | {r['hodges_lehmann']:+.4f} | {margin} | {r['p_equiv_holm']:.3f} | "
                     f"**{r['verdict']}** | {er} |")
    if trend is None:
        lines += ["", "slope: not estimable (fewer than 2 seeds common to every d_head)"]
    lines += ["", "![sweep](head_sweep.png)", ""]
    write_text(out / "head_sweep.md", "\n".join(lines))
    return out / "head_sweep.md"
