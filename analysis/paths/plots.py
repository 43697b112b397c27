"""paths.png: the figure of `python -m analysis.paths` (the dict of trace.expert_paths)."""

import numpy as np
from matplotlib.colors import TwoSlopeNorm

from analysis.figures import grid, plt, save, title
from analysis.paths.transitions import NULLS, log2_lift

NULL_STYLE = {"shuffled tokens": ("black", "_"), "load-matched": ("0.5", "x"), "same token id": ("crimson", "D")}
MAX_HEATMAPS = 5


def _mi_panel(ax, result):
    names = list(result["pairs"])
    x = np.arange(len(names))
    for j, (kind, color) in enumerate((("topk", "tab:blue"), ("first", "tab:green"))):
        xs = x + (j - 0.5) * 0.38
        obs = [result["pairs"][n][f"mi_{kind}"] for n in names]
        ax.bar(xs, obs, 0.34, color=color, alpha=0.8,
               label="observed, " + ("top-k pairs" if kind == "topk" else "first choices"))
        for name in NULLS:
            c, m = NULL_STYLE[name]
            v = [np.asarray(result["pairs"][n]["nulls"][name][kind], float) for n in names]
            mid = np.array([a.mean() for a in v])
            lo, hi = mid - np.array([a.min() for a in v]), np.array([a.max() for a in v]) - mid
            ax.errorbar(xs, mid, yerr=[lo, hi], fmt=m, color=c, markersize=6 if m != "_" else 14, capsize=3,
                        label=f"null: {name}" if j == 0 else None)
    ax.set_xticks(x)
    ax.set_xticklabels([n.replace(" -> ", "\n-> ") for n in names], fontsize=8)
    ax.set_ylabel("I(expert in l; expert in l+1), bits", fontsize=8)
    ax.set_title(f"Do paths carry information? ({result['n_tokens']:,} tokens; nulls: mean, min-max of "
                 f"{result['shuffles']})", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(alpha=0.3, axis="y")


def plot_paths(result, path):
    """First panel: the mutual information per consecutive layer pair (top-k pairs and first choices) against
    the three nulls. Then per pair (the first MAX_HEATMAPS) the log2 lift p(i, j) / p(i) p(j) of the top-k pairs
    (red: the path is taken more often than the product of the loads says; grey: never seen)."""
    names = list(result["pairs"])[:MAX_HEATMAPS]
    fig, axes = grid(1 + len(names), 3, 5.2, 4.4)
    _mi_panel(axes[0], result)
    lifts = [log2_lift(result["pairs"][n]["pairs_topk"]) for n in names]
    lim = max([float(np.nanmax(np.abs(v))) for v in lifts if np.isfinite(v).any()] + [0.5])
    cmap = plt.get_cmap("coolwarm").with_extremes(bad="0.75")
    for ax, name, lift in zip(axes[1:], names, lifts):
        im = ax.imshow(np.ma.masked_invalid(lift), cmap=cmap, norm=TwoSlopeNorm(0.0, -lim, lim),
                       interpolation="nearest")
        a, b = name.split(" -> ")
        ax.set_ylabel(f"expert in {a}", fontsize=8)
        ax.set_xlabel(f"expert in {b}", fontsize=8)
        r = result["pairs"][name]
        ax.set_title(f"{name}: log2 lift of top-k pairs\nI = {r['mi_topk']:.3f} bits (same-token-id null "
                     f"{np.mean(r['nulls']['same token id']['topk']):.3f})", fontsize=9)
        ax.tick_params(labelsize=7)
        cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03)
        cb.ax.tick_params(labelsize=7)
        cb.set_label("log2 p(i, j) / p(i) p(j) (grey: never seen)", fontsize=7)
    if len(result["pairs"]) > MAX_HEATMAPS:
        axes[-1].annotate(f"(first {MAX_HEATMAPS} of {len(result['pairs'])} pairs shown)", (0, -0.2),
                          xycoords="axes fraction", fontsize=7)
    title(fig, "Expert paths across consecutive MoE layers against the product of the loads", fontsize=10)
    return save(fig, path, rect=(0, 0, 1, 0.95))
