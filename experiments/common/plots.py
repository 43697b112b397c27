"""The study report's figures. Every loss plot carries the unigram and bigram reference lines of the same scored
targets: a curve above the bigram line has learned nothing a mask could change."""

import textwrap

import numpy as np

from analysis.figures import grid, plt, save


def _refs(ax, refs, with_unigram=True):
    if with_unigram:
        ax.axhline(refs["unigram"], color="0.4", linestyle=":", linewidth=1.2, label=f"unigram {refs['unigram']:.2f}")
    if "bigram" in refs:  # "bigram_name": the masked LM's is the bigram of both neighbours
        name = refs.get("bigram_name", "bigram")
        ax.axhline(refs["bigram"], color="0.2", linestyle="--", linewidth=1.2, label=f"{name} {refs['bigram']:.2f}")


CURVES_TITLE = ("Validation loss per seed during training (output half of the first 16 validation windows per "
                "domain; references: all windows)")


def plot_curves(groups, refs, path, title=CURVES_TITLE, ylabel="validation loss, output half (nats)"):
    """One panel per arm: every seed's validation curve, the reference lines; y limits shared."""
    fig, axes = grid(len(groups), 4, 3.4, 3.0)
    lo = min(refs.get("bigram", np.inf),
             min(v for runs in groups.values() for r in runs.values() for _, v in r["val_curve"]))
    hi = max(refs["unigram"], max(v for runs in groups.values() for r in runs.values() for _, v in r["val_curve"]))
    hi += 0.15
    for ax, (arm, runs) in zip(axes, groups.items()):
        for s, r in sorted(runs.items()):
            steps, vals = zip(*r["val_curve"])
            ax.plot(steps, vals, marker="o", ms=3, linewidth=1, label=f"seed {s}")
        _refs(ax, refs)
        ax.set_ylim(lo - 0.1, hi)
        ax.set_title(arm, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(ylabel)
    axes[0].legend(fontsize=7)
    # Wrapped to the figure's width: with two or three panels one line would run past its edges.
    fig.suptitle(textwrap.fill(title, width=45 * min(len(groups), 4)), fontsize=9)
    save(fig, path)


def fit_axis_to_seeds(ax, rows, extra=()) -> tuple[float, float]:
    """Set the y limits to the rows' per-seed differences, their means, 0 and `extra`, with a margin: with 2
    seeds a t-interval is ~10x the seeds' own spread (t_0.975 = 12.7 at 1 degree of freedom) and would flatten
    them into a line. Returns the limits; the caller says where an interval runs past them."""
    pts = [float(d) for r in rows for d in r["diffs"]] + [r["mean"] for r in rows if "mean" in r] + [0.0, *extra]
    pad = max(0.05, 0.3 * (max(pts) - min(pts)))
    lo, hi = min(pts) - pad, max(pts) + pad
    ax.set_ylim(lo, hi)
    return lo, hi


def plot_contrasts(rows, path, ylabel, title, margin=None):
    """Per-seed paired differences (arm - causal), the mean with its 95% t-interval, the equivalence band."""
    fig, ax = plt.subplots(figsize=(1.8 * len(rows) + 2.5, 3.6))
    if margin is not None:
        ax.axhspan(-margin, margin, color="C2", alpha=0.15, label=f"equivalence +-{margin:.3g}")
    ax.axhline(0, color="gray", linewidth=1)
    for i, r in enumerate(rows):
        d = np.asarray(r["diffs"])
        ax.scatter(np.full(len(d), i) + np.linspace(-0.12, 0.12, len(d)), d, color="C1", s=16, zorder=3,
                   label="seeds" if i == 0 else None)
        if "mean" in r:
            ax.errorbar([i], [r["mean"]], yerr=[[r["mean"] - r["lo"]], [r["hi"] - r["mean"]]], fmt="o",
                        color="C0", capsize=6, ms=7, label="mean, 95% paired t-interval" if i == 0 else None)
    extra = [-margin, margin] if margin is not None else []
    lo, hi = fit_axis_to_seeds(ax, rows, extra)
    clipped = False
    for i, r in enumerate(rows):
        for past, y, dy in ((r.get("lo", lo) < lo, lo, 1), (r.get("hi", hi) > hi, hi, -1)):
            if past:  # an arrow at the axis edge where the interval goes on
                clipped = True
                ax.annotate("", xy=(i, y), xytext=(i, y + dy * 0.08 * (hi - lo)),
                            arrowprops={"arrowstyle": "->", "color": "C0"})
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["contrast"] for r in rows], fontsize=8)
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.set_ylabel(ylabel)
    ax.set_title(title + ("\nsome intervals run past the axis (arrows): see the table" if clipped else ""), fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, path)


def plot_domains(groups, refs, path):
    """Final validation loss per domain: each arm's seed mean, with that domain's unigram / bigram references."""
    names = list(refs["by_domain"])
    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(names) + 3), 3.8))
    x = np.arange(len(names))
    width = 0.8 / max(len(groups), 1)
    for i, (arm, runs) in enumerate(groups.items()):
        v = [np.mean([r["val_loss_by_domain"].get(n, np.nan) for r in runs.values()]) for n in names]
        ax.bar(x - 0.4 + width * (i + 0.5), v, width, label=arm, color=f"C{i}")
    for j, n in enumerate(names):
        ref = refs["by_domain"][n]
        ax.hlines(ref["bigram"], j - 0.45, j + 0.45, color="0.1", linestyle="--", linewidth=1.2,
                  label="bigram" if j == 0 else None)
        ax.hlines(ref["unigram"], j - 0.45, j + 0.45, color="0.4", linestyle=":", linewidth=1.2,
                  label="unigram" if j == 0 else None)
    ax.set_xticks(x)
    ax.set_xticklabels(names, fontsize=8, rotation=20)
    lo = min(min(r["bigram"] for r in refs["by_domain"].values()),
             min(v for runs in groups.values() for r in runs.values() for v in r["val_loss_by_domain"].values()))
    ax.set_ylim(lo - 0.3, max(r["unigram"] for r in refs["by_domain"].values()) + 0.2)
    ax.set_ylabel("validation loss, output half (nats)")
    ax.set_title("Per-domain final validation loss (mean over seeds) and that domain's references", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save(fig, path)


def plot_probes(groups, path):
    """Per arm and seed: the input-replacement, input-shuffle and input-order gaps and 4-way continuation
    accuracy (runs from before the input-order probe are left out of that panel)."""
    fig, axes = grid(4, 4, 3.4, 3.2)
    panels = [("input_replacement_gap", "input replaced (nats)", 0.1, "gate 0.1"),
              ("input_shuffle_gap", "input shuffled (nats)", None, None),
              ("input_order_gap", "input shuffled, last token kept (nats)", None, None),
              ("choice_accuracy", "4-way continuation accuracy", 0.25, "chance 0.25")]
    arms = list(groups)
    for ax, (key, title, line, line_label) in zip(axes, panels):
        for i, arm in enumerate(arms):
            v = [r[key] for _, r in sorted(groups[arm].items()) if key in r]
            if not v:
                continue
            ax.scatter(np.full(len(v), i) + np.linspace(-0.1, 0.1, len(v)), v, color=f"C{i}", s=18)
            ax.hlines(np.mean(v), i - 0.25, i + 0.25, color=f"C{i}")
        if line is not None:
            ax.axhline(line, color="gray", linestyle="--", linewidth=1, label=line_label)
            ax.legend(fontsize=7)
        ax.set_xticks(range(len(arms)))
        ax.set_xticklabels(arms, fontsize=8, rotation=15)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Does the model use its input? (dots: seeds, bars: mean)", fontsize=10)
    save(fig, path)


def plot_output_position(labels, table, path, title):
    """Loss per output-position bucket: one line per cell (mean over the seeds in `table`: {cell: (losses, n)})."""
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    x = np.arange(len(labels))
    for i, (cell, (loss, n)) in enumerate(table.items()):
        ax.plot(x, [np.nan if v is None else v for v in loss], marker="o", ms=4, color=f"C{i}",
                label=f"{cell} ({n} seed{'s' if n > 1 else ''})")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_xlabel("output token (1 = the first token after the input)")
    ax.set_ylabel("validation loss (nats)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path)
