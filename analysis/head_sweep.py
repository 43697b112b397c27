"""Head-size sweep (issue 14, item 5, second half): does the prefix-LM's loss against the causal decoder move
with n / d_head, as Su's low-rank argument needs? His argument: softmax(Q K^T) over an n x n bidirectional block has
rank at most ~d_head when n >> d_head, while the causal (triangular) one stays full rank; if that bottleneck costs
quality, prefix - causal should rise with n / d_head.

    python -m analysis.head_sweep --out runs/head_sweep [--config configs/study_masks.py] [--head_dims 64,32,16,8]
        [--seeds 2] [--steps N] [--probe_rows 24,8,8] [--report_only] [--config.KEY=VALUE ...]

For each d_head the attention width n_heads * head_dim and the query/kv group ratio stay the config's (d_model
128: 2 heads of 64 ... 16 heads of 8), so every d_head has the same parameters and attention FLOPs. Each d_head is
a two-arm study (causal, prefix) in OUT/d<d_head> by analysis.study's runner, with its own gate and report (runs
finished there are reused: copy runs/study_masks/{causal,prefix} into OUT/d32 to reuse a mask round's). Then the
trained logits' rank (analysis.rank_logits) of every run is measured and OUT/head_sweep.{json,md,png} give, per
n_in / d_head (n_in: the input block, seq_len * prefix_frac), the paired prefix - causal loss difference (Holm over
the d_heads), the effective rank of each model's input block under its own mask, and the slope of the difference
on log2(n_in / d_head) over the gate-passing d_heads.
"""

import copy
import json
import sys
from pathlib import Path

import numpy as np

from analysis.study import DEFAULT_CONFIG, DEFAULT_PROBE_ROWS, probe_sizes, run_study
from analysis.study_cli import run_cli, seeds_and_steps, study_parser, use_compilation_cache
from analysis.study_stats import holm, t_quantile
from analysis.study_verdicts import ALPHA, contrasts, verdict
from moe.cli import ArgParser
from moe.errors import UserError
from rundir.atomic import write_text
from train.cli import config_from_argv

ARMS = ("causal", "prefix")
HEAD_DIMS = (64, 32, 16, 8)  # with the study's 128-token input block: n_in / d_head = 2, 4, 8, 16


def head_config(base, d_head: int):
    """The base config with heads of d_head at the same attention width and query/kv group ratio."""
    m = base.model
    width, group = m.n_heads * m.head_dim, m.n_heads // m.n_kv_heads
    if d_head < 2 or width % d_head or (width // d_head) % group:
        raise UserError(f"--head_dims: {d_head} must divide the attention width n_heads * head_dim = {width} into a "
                        f"multiple of {group} heads (the config's query/kv group); pick divisors of {width // group}")
    c = copy.deepcopy(base)
    c.model.update(n_heads=width // d_head, n_kv_heads=width // d_head // group, head_dim=d_head)
    return c


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


def input_erank(workdir, mask: str) -> float | None:
    """Effective rank / n of the trained model's input block under its own mask, mean over layers and rows; None
    for a run kept as result.json alone (a finished run copied without its checkpoint)."""
    from analysis.rank_logits import measure_run
    from rundir import RunDir
    from rundir.checkpoints import steps_in

    if not steps_in(RunDir(Path(workdir)).checkpoints):
        return None
    return measure_run(workdir)[f"{mask}_input"]["erank"]


def plot(rows, path):
    from analysis.figures import grid, save
    from analysis.study_plots import fit_axis_to_seeds

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


def run_sweep(base, head_dims, seeds: int, steps: int, out, log=print, run_fn=None, report_only=False,
              sizes=None, rank_fn=input_erank) -> Path:
    out = Path(out)
    n_in = int(base.data.seq_len * base.data.prefix_frac)
    cells = []
    for d in head_dims:
        cell_out = out / f"d{d}"
        log(f"== d_head {d} (n_in / d_head = {n_in / d:g}) -> {cell_out}")
        report = run_study(head_config(base, d), ARMS, seeds, steps, cell_out, log, run_fn, report_only, sizes)
        saved = json.loads((report.parent / "results.json").read_text())
        ranks = {a: [rank_fn(cell_out / a / f"seed{r['seed']}", a) for r in saved["results"] if r["arm"] == a]
                 for a in ARMS}
        ranks = {a: [v for v in vs if v is not None] for a, vs in ranks.items()}
        cells.append({"d_head": d, "n_over_d": n_in / d, "results": saved["results"], "gate": saved["gate"],
                      "ranks": ranks})
    rows = sweep_rows(cells)
    return write_report(rows, trend(rows), out, steps)


def parser() -> ArgParser:
    dims = (("--head_dims",), {"default": ",".join(map(str, HEAD_DIMS)),
                                "help": f"comma-separated d_head values (default {','.join(map(str, HEAD_DIMS))})"})
    p = study_parser("python -m analysis.head_sweep", __doc__, DEFAULT_CONFIG, "runs/head_sweep", 2,
                     "paired seeds per arm and d_head", extra=(dims,))
    p.add_argument("--probe_rows", default=DEFAULT_PROBE_ROWS, help="as in analysis.study")
    return p


def parse_flags(argv):
    config, _, rest = config_from_argv(list(argv[1:]), DEFAULT_CONFIG)
    args = parser().parse_args(rest)
    try:
        dims = [int(x) for x in args.head_dims.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--head_dims takes comma-separated integers, got {args.head_dims!r}") from None
    if len(dims) < 2 or len(set(dims)) != len(dims):
        raise UserError(f"--head_dims needs at least 2 distinct values, got {args.head_dims!r}")
    sizes = probe_sizes(args.probe_rows)
    if config.data.task != "prefix":
        raise UserError("the sweep needs input->output rows: set --config.data.task=prefix")
    for d in dims:
        head_config(config, d)
    steps = seeds_and_steps(args, config, min_seeds=2)
    return config, dims, args.seeds, steps, args.out, args.report_only, sizes


def main(argv=None):
    def run(argv):
        config, dims, seeds, steps, out, report_only, sizes = parse_flags(argv)
        use_compilation_cache(out)
        return run_sweep(config, dims, seeds, steps, out, report_only=report_only, sizes=sizes)

    run_cli(sys.argv if argv is None else argv, parser, run, "sweep")


if __name__ == "__main__":
    main()
