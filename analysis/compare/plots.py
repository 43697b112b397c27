"""compare.png: the figure of `python -m analysis.compare` (the dict of pair.compare_pair, numpy or lists)."""

import numpy as np
from matplotlib.colors import TwoSlopeNorm
from matplotlib.ticker import MaxNLocator

from analysis.figures import plt, save, title


def _swap_panel(ax, result, names_ab):
    rows = [result[k] for k in ("swap_b_into_a", "swap_a_into_b") if k in result]
    names = list(rows[0]["names"])
    y = np.arange(len(names))
    h = 0.8 / len(rows)
    for j, (r, label, color) in enumerate(zip(rows, names_ab, ("tab:blue", "tab:orange"))):
        d, se = np.asarray(r["delta_A"], float), np.asarray(r["se_A"], float)
        ax.barh(y + (j - (len(rows) - 1) / 2) * h, d, h, xerr=se, color=color, alpha=0.85, label=label,
                error_kw={"ecolor": "0.3", "capsize": 2})
        for yi, di, si in zip(y + (j - (len(rows) - 1) / 2) * h, d, np.nan_to_num(se)):
            ax.annotate(f"{di:+.3g}", (di + (si if di >= 0 else -si), yi), xytext=(3 if di >= 0 else -3, 0),
                        textcoords="offset points", ha="left" if di >= 0 else "right", va="center", fontsize=7)
    ax.set_yticks(y)
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel("validation loss change (nats / token; bars: one s.e. over rows)", fontsize=8)
    ax.set_title("Gate swap: the other model's routers in each model", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    ax.margins(x=0.3, y=0.12)
    ax.xaxis.set_major_locator(MaxNLocator(5))
    ax.grid(alpha=0.3, axis="x")


def plot_compare(result, path, label_a: str, label_b: str):
    """Left: per MoE layer the mean expert-set Jaccard of A and B, against two independent uniform routers and
    the load-matched chance (B's sets permuted across tokens: the band of the permutations). Middle: routing
    entropy change B - A per domain and layer, bits. Right (with the gate swap): loss change of each swap and its
    controls."""
    layer_names = list(result["layers"])
    layers = [result["layers"][k] for k in layer_names]
    swapped = "swap_b_into_a" in result
    fig, axes = plt.subplots(1, 3 if swapped else 2, figsize=(16 if swapped else 11, 4.6), squeeze=False)
    axes = list(axes.flat)
    ax, x = axes[0], np.arange(len(layers))
    ax.bar(x, [r["jaccard"] for r in layers], 0.6, color="tab:blue", label="A vs B, per token, mean")
    lo = [r["load_matched_band"][0] for r in layers]
    hi = [r["load_matched_band"][1] for r in layers]
    mid = [r["load_matched_chance"] for r in layers]
    ax.errorbar(x, mid, yerr=[np.subtract(mid, lo), np.subtract(hi, mid)], fmt="_", color="black", markersize=22,
                capsize=6, linewidth=1.5, label="load-matched chance (B's sets permuted)")
    ax.axhline(layers[0]["uniform_chance"], color="crimson", linestyle="--", linewidth=1,
               label=f"uniform random sets ({layers[0]['uniform_chance']:.3f})")
    for xi, r in zip(x, layers):
        ax.annotate(f"{r['jaccard']:.3f}", (xi, r["jaccard"]), xytext=(0, 3), textcoords="offset points",
                    ha="center", fontsize=8)
    ax.set_xticks(x)
    ax.set_xticklabels(layer_names, fontsize=8)
    ax.set_ylim(0, 1.08)
    ax.set_ylabel("Jaccard |A & B| / |A | B| of the top-k sets", fontsize=8)
    ax.set_title(f"Do the routers pick the same experts? ({result['n_tokens']:,} tokens)", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(alpha=0.3, axis="y")

    ax = axes[1]
    dh_DxL = np.array([np.asarray(r["entropy_change_D"], float) for r in layers]).T
    lim = max(float(np.nanmax(np.abs(dh_DxL))) if np.isfinite(dh_DxL).any() else 0.0, 1e-3)
    im = ax.imshow(np.ma.masked_invalid(dh_DxL), cmap="coolwarm", norm=TwoSlopeNorm(0.0, -lim, lim), aspect="auto")
    for (d, li), v in np.ndenumerate(dh_DxL):
        if np.isfinite(v):
            ax.text(li, d, f"{v:+.2g}", ha="center", va="center", fontsize=7)
    ax.set_xticks(np.arange(len(layers)))
    ax.set_xticklabels(layer_names, fontsize=8)
    ax.set_yticks(np.arange(len(result["domain_names"])))
    ax.set_yticklabels(result["domain_names"], fontsize=7)
    means = ", ".join(f"{r['entropy_a']:.2f} -> {r['entropy_b']:.2f}" for r in layers)
    ax.set_title(f"Routing entropy B - A per domain, bits (max log2 E = {layers[0]['max_entropy']:.2f})\n"
                 f"mean A -> B: {means}", fontsize=9)
    cb = fig.colorbar(im, ax=ax, fraction=0.05, pad=0.02)
    cb.ax.tick_params(labelsize=7)
    cb.set_label("bits (red: B spreads more)", fontsize=7)
    if swapped:
        _swap_panel(axes[2], result, (f"B's routers in A (A's loss {float(result['swap_b_into_a']['base_loss']):.3f})",
                                      f"A's routers in B (B's loss {float(result['swap_a_into_b']['base_loss']):.3f})"))
    title(fig, f"Two routers on the same tokens: A = {label_a}, B = {label_b}", fontsize=10)
    return save(fig, path, rect=(0, 0, 1, 0.93))
