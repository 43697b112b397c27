"""The head-size sweep's report (experiments.head_sweep.runner writes it): per n_in / d_head the paired
prefix - causal contrast (Holm over the d_heads) and each arm's input-block effective rank, the slope of the
difference on log2(n_in / d_head), OUT/head_sweep.{json,md,png}."""

import json
from pathlib import Path

import numpy as np

from analysis.figures import grid, save
from experiments.common.plots import fit_axis_to_seeds
from experiments.common.stats import holm, t_quantile
from experiments.common.verdicts import ALPHA, contrasts, verdict
from rundir.atomic import write_text

ARMS = ("causal", "prefix")


def slope(x, y) -> dict:
    """Least-squares slope of y on x with its 95% t-interval (df = n - 2); None where it cannot be estimated."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 3 or np.unique(x).size < 2:
        return None
    xc = x - x.mean()
    b = float(xc @ (y - y.mean()) / (xc @ xc))
    resid = y - y.mean() - b * xc
    se = float(np.sqrt(resid @ resid / (x.size - 2) / (xc @ xc)))
    half = t_quantile(0.975, x.size - 2) * se
    return {"slope": b, "lo": b - half, "hi": b + half, "n": int(x.size)}


def sweep_rows(cells) -> list[dict]:
    """One row per d_head from its study results (cells: [{d_head, n_over_d, results, gate, ranks}]): the
    prefix - causal loss contrast, Holm-adjusted over the d_heads, and each arm's mean input-block rank."""
    rows = []
    for cell in cells:
        groups = {a: {r["seed"]: r for r in cell["results"] if r["arm"] == a} for a in ARMS}
        (row,) = contrasts(groups, cell["gate"]["passed"], family=[("prefix", "causal")])
        row.update(d_head=cell["d_head"], n_over_d=cell["n_over_d"], gate=cell["gate"]["verdict"],
                   gate_passed=bool(cell["gate"]["passed"]),
                   erank={a: float(np.mean(v)) for a, v in cell["ranks"].items() if v})
        rows.append(row)
    tested = [r for r in rows if "p" in r]
    for r, p in zip(tested, holm([r["p"] for r in tested])):
        r["p_holm"] = p
    for r in rows:
        r["verdict"] = verdict(r, r["gate_passed"])
    return rows


def trend(rows) -> dict:
    """Slope of the per-seed differences on log2(n_in / d_head), gate-passing d_heads only."""
    ok = [r for r in rows if r["gate_passed"]]
    x = [np.log2(r["n_over_d"]) for r in ok for _ in r["diffs"]]
    fit = slope(x, [d for r in ok for d in r["diffs"]])
    if fit is not None:
        fit["verdict"] = ("rises with n/d_head" if fit["lo"] > 0 else "falls with n/d_head" if fit["hi"] < 0
                          else "no trend detected")
    return fit


def plot(rows, path):
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
    ax.axhspan(-0.02, 0.02, color="C2", alpha=0.15, label="equivalence margin +-0.02")
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


def write_report(rows, fit, out: Path, steps: int) -> Path:
    write_text(out / "head_sweep.json", json.dumps({"rows": rows, "trend": fit}, indent=1))
    plot(rows, out / "head_sweep.png")
    lines = ["# Head-size sweep: prefix - causal against n_in / d_head", "",
             f"Each d_head is its own two-arm study (OUT/d<d_head>/report/report.md: gate, curves), {steps} steps per "
             "run, equal parameters and attention FLOPs across d_head. A difference is claimed when the Holm-adjusted "
             f"(over the d_heads) paired t-test p < {ALPHA}; \"equivalent\" only inside +-0.02 nats.", "",
             "| d_head | n_in / d_head | gate | prefix - causal [95% t-interval] | per seed | Holm p | verdict | "
             "input-block erank/n: causal, prefix (runs with a checkpoint) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ci = f"{r['mean']:+.4f} [{r['lo']:+.4f}, {r['hi']:+.4f}]" if "mean" in r else "-"
        holm_p = f"{r['p_holm']:.3f}" if "p_holm" in r else "-"
        er = ", ".join(f"{r['erank'].get(a, float('nan')):.3f}" for a in ARMS)
        lines.append(f"| {r['d_head']} | {r['n_over_d']:g} | {r['gate']} | {ci} | "
                     f"{', '.join(f'{d:+.4f}' for d in r['diffs'])} | {holm_p} | {r['verdict']} | {er} |")
    lines += ["", "Trend: least-squares slope of the per-seed differences on log2(n_in / d_head), gate-passing d_heads "
              "only (seeds share data order across d_heads, so the interval is optimistic).", ""]
    lines.append(f"slope {fit['slope']:+.4f} nats per doubling [{fit['lo']:+.4f}, {fit['hi']:+.4f}] over {fit['n']} "
                 f"differences: **{fit['verdict']}**" if fit else "slope: not estimable (fewer than 3 differences at "
                 "2 or more gate-passing d_heads)")
    lines += ["", "![sweep](head_sweep.png)", ""]
    write_text(out / "head_sweep.md", "\n".join(lines))
    return out / "head_sweep.md"
