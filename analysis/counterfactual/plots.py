"""counterfactual.png: the figure of `python -m analysis.counterfactual` (the dict of informative.counterfactual)."""

import numpy as np
from matplotlib.colors import TwoSlopeNorm

from analysis.figures import plt, save, title
from analysis.routing.scales import line_colors


def _fmt(v) -> str:
    return f"{v:+.3g}" if np.isfinite(v) else ""


def plot_counterfactual(result, path):
    """Left: mean loss change of each variant (counterfactual routes - the router's), one s.e. over rows. Middle:
    per domain and variant. Right: per frequency bucket of the routed token, with the share of tokens the chosen
    route beats."""
    names = list(result["variants"])
    d_V, se_V = np.asarray(result["delta_V"], float), np.asarray(result["se_V"], float)
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8), gridspec_kw={"width_ratios": [1, 1.2, 1.1]})
    ax = axes[0]
    y = np.arange(len(names))
    ax.barh(y, d_V, 0.6, xerr=np.nan_to_num(se_V), color=["tab:red" if "permuted" in n else "tab:blue" for n in names],
            error_kw={"ecolor": "0.3", "capsize": 3})
    for yi, v, se in zip(y, d_V, np.nan_to_num(se_V)):
        ax.annotate(_fmt(v), (v + (se if v >= 0 else -se), yi), xytext=(3 if v >= 0 else -3, 0),
                    textcoords="offset points", ha="left" if v >= 0 else "right", va="center", fontsize=7)
    ax.set_yticks(y)
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=0.8)
    ax.margins(x=0.3)
    ax.set_xlabel("loss change, nats / token (> 0: the router's choice helps)", fontsize=8)
    ax.set_title(f"Chosen route vs random routes of equal compute\n(loss {result['base_loss']:.3f}, "
                 f"{result['n_tokens']:,} tokens, {result['n_draws']} draws; red: load-matched)", fontsize=9)
    ax.grid(alpha=0.3, axis="x")

    ax = axes[1]
    z_DxV = np.asarray(result["delta_VxD"], float).T
    lim = max(float(np.nanmax(np.abs(z_DxV))) if np.isfinite(z_DxV).any() else 0.0, 1e-6)
    im = ax.imshow(np.ma.masked_invalid(z_DxV), cmap="coolwarm", norm=TwoSlopeNorm(0.0, -lim, lim), aspect="auto")
    for (d, v), val in np.ndenumerate(z_DxV):
        ax.text(v, d, _fmt(val), ha="center", va="center", fontsize=6)
    ax.set_xticks(np.arange(len(names)))
    ax.set_xticklabels([n.replace(", ", "\n") for n in names], fontsize=7)
    ax.set_yticks(np.arange(len(result["domain_names"])))
    ax.set_yticklabels(result["domain_names"], fontsize=7)
    ax.set_title("per domain (nats / token)", fontsize=9)
    cb = fig.colorbar(im, ax=ax, fraction=0.05, pad=0.02)
    cb.ax.tick_params(labelsize=7)

    ax = axes[2]
    x = np.arange(len(result["buckets"]))
    d_VxB, se_VxB = np.asarray(result["delta_VxB"], float), np.asarray(result["se_VxB"], float)
    better = np.asarray(result["better_VxB"], float)
    for v, (name, color) in enumerate(zip(names, line_colors(len(names)))):
        ax.errorbar(x + (v - (len(names) - 1) / 2) * 0.08, d_VxB[v], yerr=np.nan_to_num(se_VxB[v]), fmt="o-",
                    color=color, markersize=4, capsize=2, label=f"{name} (chosen better: "
                    + "/".join(f"{b:.0%}" if np.isfinite(b) else "-" for b in better[v]) + ")")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(x)
    ax.set_xticklabels([f"{b}\n({int(n):,} tokens)" for b, n in zip(result["buckets"], result["n_B"])], fontsize=7)
    ax.set_xlabel("frequency rank of the routed token in the split", fontsize=8)
    ax.set_ylabel("loss change, nats / token", fontsize=8)
    ax.set_title("per token frequency (one s.e. over rows)", fontsize=9)
    ax.legend(fontsize=6, loc="best")
    ax.grid(alpha=0.3)
    title(fig, "Counterfactual routing: where is the router informative?", fontsize=10)
    return save(fig, path, rect=(0, 0, 1, 0.95))
