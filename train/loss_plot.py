"""A run's loss curves (train and validation loss, validation loss per domain) as one figure: what the trainer
redraws into WORKDIR/loss_curves.png at every evaluation, and `python -m analysis.loss_curves` draws on demand.

`plot_loss_curves(rows, path)` takes rows already parsed from WORKDIR/metrics.jsonl (training rows: "step",
"loss"; evaluation rows: "step", "val/loss", "val/loss/<domain>"). Odd rows never raise: a missing, None, NaN or
non-numeric value is skipped, and a step logged twice (a resumed run repeats the steps after its last checkpoint)
keeps its last value.
"""

import math
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # no display: plots are files
import matplotlib.pyplot as plt  # noqa: E402

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


def _loss_ylim(ax, values, label: str):
    """Cut the first steps' loss (near log V, several times the rest) so the part of training that matters
    fills the panel; `label` is the y label, with the cut said in it."""
    ax.set_ylabel(label)
    values = np.concatenate([v for v in values if len(v)]) if any(len(v) for v in values) else np.array([])
    if len(values) < 4:
        return
    lo, hi = values.min(), values.max()
    top = np.quantile(values, 0.95)
    top = top + 0.15 * (top - lo)
    if hi > top:
        ax.set_ylim(lo - 0.05 * (top - lo), top)
        ax.set_ylabel(f"{label} (y axis cut: first steps are higher)")


def _curves_ylim(ax, curves, label: str):
    """Per-domain validation curves: every point after each curve's first evaluation stays in view (a short run has
    few, and the worst domain is the one to see); only the first evaluations, near log V, may be cut, which the
    y label then says."""
    ax.set_ylabel(label)
    later = [v[1:] for v in curves if len(v) > 1]
    if not later:
        return
    later = np.concatenate(later)
    lo, hi = min(v.min() for v in curves), later.max()
    top = hi + 0.08 * (hi - lo)
    if max(v[0] for v in curves) > top:
        ax.set_ylim(lo - 0.05 * (top - lo), top)
        ax.set_ylabel(f"{label} (y axis cut: the first evaluation is higher)")


def _marker(steps, size):
    # Markers show where the evaluations are; past ~40 they merge into a thick line that hides the others.
    return size if len(steps) <= 40 else 0


def _no_data(ax, text):
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=10, color="0.4", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def run_title(workdir, rows) -> str:
    """A figure title for the run in `workdir`: its directory's name and the last logged step ("default, step
    400"), not the path, which is long and says little."""
    name = Path(workdir).resolve().name or str(workdir)
    last = max((s for key in ("loss", "val/loss") for s in series(rows, key)[0]), default=None)
    return name if last is None else f"{name}, step {int(last):,}"


def plot_loss_curves(rows, path, title=None, references=None):
    """Two panels: train loss (raw, faint; EMA-smoothed, strong) with validation loss (markers) against step;
    validation loss per domain. Writes the PNG at `path` and returns it as a Path. title: e.g. `run_title`.
    references: train/references.py's unigram and bigram losses on the validation targets, drawn as lines."""
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
    for name, style in (("unigram", ":"), ("bigram", "--")) if references and len(val_N) else ():
        ax.axhline(references[name], color="0.35", linestyle=style, linewidth=1.0,
                   label=f"{name} on the validation targets, {references[name]:.3f}")
    if len(train_N) or len(val_N):
        _loss_ylim(ax, [train_N, val_N] + ([np.array([references["bigram"]])] if references else []), "loss")
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
        _curves_ylim(ax_dom, [v for _, _, v in curves] + ([val_N] if len(val_N) else []), "validation loss")
        ax_dom.set_xlabel("step")
        ax_dom.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="last value",
                      title_fontsize=8)
        ax_dom.grid(alpha=0.3)
    else:
        _no_data(ax_dom, "no evaluation yet")
    ax_dom.set_title("Validation loss per domain", fontsize=10)
    if title:
        fig.suptitle(title, fontsize=11)
    return save(fig, path)


def save(fig, path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path




def smooth(values_N, span=None):
    """A noisy series (training loss, batch MaxVio) smoothed with a symmetric exponential kernel w^|i-j|,
    normalized, so the curve has no lag behind the data (a one-sided EMA trails a falling loss); at the ends
    the kernel is one-sided. span (points, w = 1 - 1/span) defaults to 1/15 of the series, between 2 and 50:
    enough to see the trend of a long run without flattening a short one."""
    x_N = np.asarray(values_N, np.float64)
    span = min(max(len(x_N) / 15, 2.0), 50.0) if span is None else max(span, 1.0)
    w = 1 - 1 / span

    def one_sided(x):  # sum_{j<=i} w^(i-j) x_j and its weight sum
        acc, norm, sums, norms = 0.0, 0.0, np.empty_like(x), np.empty_like(x)
        for i, v in enumerate(x):
            acc, norm = w * acc + v, w * norm + 1.0
            sums[i], norms[i] = acc, norm
        return sums, norms

    fwd, fwd_n = one_sided(x_N)
    bwd, bwd_n = (a[::-1] for a in one_sided(x_N[::-1]))
    return (fwd + bwd - x_N) / (fwd_n + bwd_n - 1.0)  # x_i sits in both sums once
