"""Loss curves of a run, without TensorBoard: training and validation loss, and validation loss per domain.

    python -m analysis.loss_curves --workdir runs/default        # writes runs/default/loss_curves.png
    python -m analysis.loss_curves --workdir runs/default --out /tmp/loss.png

`plot_loss_curves(rows, path)` takes rows already parsed from WORKDIR/metrics.jsonl (training rows: "step",
"loss"; evaluation rows: "step", "val/loss", "val/loss/<domain>"), so the training loop can redraw the figure
at every evaluation. Odd rows never raise: a missing, None, NaN or non-numeric value is skipped, and a step
logged twice (a resumed run repeats the steps after its last checkpoint) keeps its last value.
"""

import math
import sys
from pathlib import Path

import numpy as np

from analysis.figures import plt, save, smooth
from moe.errors import UserError, exit_with, os_error
from rundir import RunDir
from rundir.metrics import read_rows
from train.cli import ArgParser

VAL_PREFIX = "val/loss/"


def _number(x):
    # bool is an int subclass; a JSON true is not a loss.
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


def series(rows, key):
    """(steps_N, values_N) of `key`, sorted by step, the last row winning for a repeated step; rows without
    a numeric step or a finite value are skipped."""
    by_step = {}
    for row in rows:
        if not isinstance(row, dict):
            continue
        step, value = _number(row.get("step")), _number(row.get(key))
        if step is not None and value is not None:
            by_step[step] = value
    steps = np.array(sorted(by_step), np.float64)
    return steps, np.array([by_step[s] for s in steps], np.float64)


def domain_keys(rows):
    """Every "val/loss/<domain>" key in first-seen order (the order the training loop writes domains in)."""
    keys = {}
    for row in rows:
        if isinstance(row, dict):
            keys.update({k: None for k in row if isinstance(k, str) and k.startswith(VAL_PREFIX)})
    return list(keys)


def _loss_ylim(ax, values):
    """Cut the first steps' loss (near log V, several times the rest) so the part of training that matters
    fills the panel; the cut is said in the y label."""
    values = np.concatenate([v for v in values if len(v)]) if any(len(v) for v in values) else np.array([])
    if len(values) < 4:
        return
    lo, hi = values.min(), values.max()
    top = np.quantile(values, 0.95)
    top = top + 0.15 * (top - lo)
    if hi > top:
        ax.set_ylim(lo - 0.05 * (top - lo), top)
        ax.set_ylabel("loss (y axis cut: first steps are higher)")


def _marker(steps, size):
    # Markers show where the evaluations are; past ~40 they merge into a thick line that hides the others.
    return size if len(steps) <= 40 else 0


def _no_data(ax, text):
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=10, color="0.4", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_loss_curves(rows, path, title=None):
    """Two panels: train loss (raw, faint; EMA-smoothed, strong) with validation loss (markers) against step;
    validation loss per domain. Writes the PNG at `path` and returns it as a Path."""
    path = Path(path)
    train_S, train_N = series(rows, "loss")
    val_S, val_N = series(rows, "val/loss")
    fig, (ax, ax_dom) = plt.subplots(1, 2, figsize=(12.5, 4.4), gridspec_kw={"width_ratios": [1, 1.25]})

    if len(train_N):
        ax.plot(train_S, train_N, color="tab:blue", alpha=0.35, linewidth=0.9,
                label=f"train (raw), last {train_N[-1]:.3f}")
        ax.plot(train_S, smooth(train_N), color="tab:blue", linewidth=2.0, label="train (smoothed)")
    if len(val_N):
        ax.plot(val_S, val_N, color="tab:orange", marker="o", markersize=_marker(val_S, 4), linewidth=1.6,
                label=f"validation, last {val_N[-1]:.3f}")
    if len(train_N) or len(val_N):
        ax.set_ylabel("loss")
        _loss_ylim(ax, [train_N, val_N])
        ax.set_xlabel("step")
        ax.legend(fontsize=8, loc="upper right")
        ax.grid(alpha=0.3)
    else:
        _no_data(ax, "no loss logged yet")
    ax.set_title("Loss (cross-entropy, nats per token)", fontsize=10)

    keys = domain_keys(rows)
    curves = [(k[len(VAL_PREFIX):], *series(rows, k)) for k in keys]
    curves = [c for c in curves if len(c[1])]
    if curves:
        cmap = plt.get_cmap("tab10" if len(curves) <= 10 else "tab20")
        # Legend sorted by the last value, highest first, so it reads in the order of the line ends.
        for i, (name, steps, values) in sorted(enumerate(curves), key=lambda c: -c[1][2][-1]):
            ax_dom.plot(steps, values, color=cmap(i % cmap.N), marker="o", markersize=_marker(steps, 3), linewidth=1.4,
                        label=f"{name} {values[-1]:.3f}")
        if len(val_N):
            ax_dom.plot(val_S, val_N, color="black", linestyle="--", linewidth=1.2, label=f"all {val_N[-1]:.3f}")
        _loss_ylim(ax_dom, [v for _, _, v in curves])
        ax_dom.set_xlabel("step")
        ax_dom.set_ylabel("validation loss")
        ax_dom.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="last value",
                      title_fontsize=8)
        ax_dom.grid(alpha=0.3)
    else:
        _no_data(ax_dom, "no evaluation yet")
    ax_dom.set_title("Validation loss per domain", fontsize=10)
    if title:
        fig.suptitle(title, fontsize=11)
    return save(fig, path)


def main(argv=None):
    p = ArgParser(prog="python -m analysis.loss_curves", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="run directory with metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG to write (default: WORKDIR/loss_curves.png)")
    try:
        args = p.parse_args(sys.argv[1:] if argv is None else argv)
        metrics = RunDir(Path(args.workdir)).metrics
        if not metrics.is_file():
            raise UserError(f"no metrics.jsonl in {args.workdir}; pass the --workdir of a run "
                            "(python -m train writes it every log.every steps)")
        rows = read_rows(metrics)
        out = Path(args.out) if args.out else Path(args.workdir) / "loss_curves.png"
        if out.is_dir():
            raise UserError(f"--out {out} is a directory; pass the path of the PNG to write")
        if out.suffix.lower() not in (".png", ".pdf", ".svg"):
            raise UserError(f"--out {out} must end in .png, .pdf or .svg (the figure's format)")
        out.parent.mkdir(parents=True, exist_ok=True)
        plot_loss_curves(rows, out, title=str(args.workdir))
    except UserError as e:
        exit_with(e)
    except OSError as e:
        exit_with(os_error(e))
    n_eval = len(series(rows, "val/loss")[0])
    print(f"wrote {out} ({len(series(rows, 'loss')[0])} training rows, {n_eval} evaluations)")
    return out


if __name__ == "__main__":
    main()
