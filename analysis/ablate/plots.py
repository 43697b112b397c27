"""The figures of `python -m analysis.ablate` (arrays of analysis.ablate.ablation.ablate, as numpy or lists)."""

import numpy as np
from matplotlib.colors import TwoSlopeNorm
from scipy import stats

from analysis.figures import grid, plt, save
from analysis.routing.scales import CHANCE_CMAP, chance_norm, shared_colorbar


def _per_layer(result, layer):
    """Rows of `layer`'s ablations and the MoE-layer index of `layer`."""
    rows = [a for a, (lay, _) in enumerate(result["ablations"]) if lay == layer]
    return rows, list(result["layer_ids"]).index(layer)


def _abs_max(z):
    z = np.abs(np.asarray(z, float))
    return max(float(np.nanmax(z)) if np.isfinite(z).any() else 0.0, 1e-6)


def spearman(x, y):
    """Rank correlation (NaN when either side is constant or has fewer than 3 points)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(stats.spearmanr(x, y)[0])


def plot_importance_vs_share(result, path, zero=None, controls=None):
    """Per ablated layer: each expert's routing share (x) against the validation-loss change when it is
    removed (y, +- one standard error over rows), with the rank correlation in the title. `zero` (ablate's
    result with mode "zero", same ablations) adds the zeroed-output changes beside the rerouted ones; `controls`
    (analysis.ablate.controls) puts the layer's all-routed-experts control in the title. Two panels per row
    at most, so the text stays readable where a notebook or a README scales the image to its width."""
    layers = sorted({lay for lay, _ in result["ablations"]})
    fig, axes = grid(len(layers), 2, 4.8, 3.8)
    k = float(np.sum(result["share_LxE"][0]))
    for ax, layer in zip(axes, layers):
        rows, li = _per_layer(result, layer)
        experts = [result["ablations"][a][1] for a in rows]
        x = np.asarray(result["share_LxE"][li], float)[experts]
        y, se = np.asarray(result["delta_A"], float)[rows], np.asarray(result["se_A"], float)[rows]
        label = {"reroute": "rerouted (next choice)", "zero": "output zeroed"}[result.get("mode", "reroute")]
        ax.errorbar(x, y, yerr=se, fmt="o", color="tab:blue", ecolor="0.6", markersize=5, capsize=2, label=label)
        if zero is not None:
            zy, zse = np.asarray(zero["delta_A"], float)[rows], np.asarray(zero["se_A"], float)[rows]
            ax.errorbar(x, zy, yerr=zse, fmt="s", color="tab:orange", ecolor="0.75", markersize=4, capsize=2,
                        alpha=0.8, label="output zeroed, not rerouted")
        at = {}  # experts at the same point (e.g. two never-chosen ones) share one label
        for e, xi, yi in zip(experts, x, y):
            at.setdefault((round(xi, 6), round(yi, 7)), []).append(str(e))
        for (xi, yi), es in at.items():
            ax.annotate(",".join(es), (xi, yi), textcoords="offset points", xytext=(4, 3), fontsize=8)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.axvline(k / len(result["share_LxE"][li]), color="crimson", linestyle="--", linewidth=1,
                   label="uniform share K/E")
        n_experts = len(result["share_LxE"][li])
        ax.set_xlabel("routing share (top-k choices, sums to K)", fontsize=9)
        ax.set_ylabel("loss change when removed (nats)", fontsize=9)
        counted = f"{len(rows)} of {n_experts}" if len(rows) < n_experts else f"{len(rows)}"
        title = f"layer {layer}: Spearman rho {spearman(x, y):.2f} ({counted} experts)"
        if controls is not None and f"routed experts, layer {layer}" in controls["names"]:
            c = controls["names"].index(f"routed experts, layer {layer}")
            title += f"\nall {n_experts} routed zeroed: {float(controls['delta_A'][c]):+.3f}"
        ax.set_title(title, fontsize=10)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.margins(x=0.08)  # room for the expert labels right of the outermost points
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(f"Does an expert's routing share predict its importance?\n(validation loss {float(result['base_loss']):.3f} "
                 "without masking; bars: one standard error over rows)", fontsize=11)
    return save(fig, path)


def plot_domains(result, path):
    """Per ablated layer a row of three heatmaps over experts: loss change per domain, routing share per domain
    (white = uniform K/E), loss change per target-token class. Loss changes share one symmetric scale."""
    layers = sorted({lay for lay, _ in result["ablations"]})
    names, classes = result["domain_names"], result["class_names"]
    delta_AxD, delta_AxC = np.asarray(result["delta_AxD"], float), np.asarray(result["delta_AxC"], float)
    dnorm, cnorm = (TwoSlopeNorm(0.0, -lim, lim) for lim in (_abs_max(delta_AxD), _abs_max(delta_AxC)))
    share_LxDxE = np.asarray(result["share_LxDxE"], float)
    n_experts = share_LxDxE.shape[-1]
    k = float(np.nansum(share_LxDxE[0, 0]))
    snorm = chance_norm(np.nanmax(share_LxDxE), k / n_experts)
    fig, axes = plt.subplots(len(layers), 3, figsize=(16, 0.32 * len(names) * len(layers) + 1.8 * len(layers) + 0.8),
                             squeeze=False, layout="constrained")
    for row, layer in zip(axes, layers):
        rows, li = _per_layer(result, layer)
        experts = [result["ablations"][a][1] for a in rows]
        panels = ((delta_AxD[rows].T, names, dnorm, "coolwarm", "loss change per domain"),
                  (share_LxDxE[li][:, experts], names, snorm, CHANCE_CMAP, "routing share per domain"),
                  (delta_AxC[rows].T, classes, cnorm, "coolwarm",
                   "loss change per target-token class"))
        for ax, (z, ylabels, norm, cmap, title) in zip(row, panels):
            im = ax.imshow(np.ma.masked_invalid(z), aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
            ax.set_yticks(np.arange(len(ylabels)))
            ax.set_yticklabels(ylabels, fontsize=7)
            ax.set_xticks(np.arange(len(experts)))
            ax.set_xticklabels([str(e) for e in experts], fontsize=6 if len(experts) > 16 else 7)
            ax.set_xlabel("masked expert", fontsize=8)
            ax.set_title(f"layer {layer}: {title}", fontsize=9)
            if "share" in title:
                shared_colorbar(fig, im, [ax], k / n_experts, "share", "uniform K/E")
            else:
                cb = fig.colorbar(im, ax=ax, fraction=0.05, pad=0.02)
                cb.ax.tick_params(labelsize=6)
                cb.set_label("nats / token", fontsize=7)
    fig.suptitle("Which domains and tokens need each expert? Loss change when the expert is masked out of the "
                 "selection (red = worse), beside its routing share\n(loss changes: one symmetric scale per column; "
                 "share: ratio to uniform K/E, log scale)", fontsize=10)
    return save(fig, path)


def correlations(result):
    """Per ablated layer the Spearman correlation of routing share and loss change: over experts (overall
    share, overall change) and over (expert, domain) pairs."""
    out = {}
    for layer in sorted({lay for lay, _ in result["ablations"]}):
        rows = [a for a, (lay, _) in enumerate(result["ablations"]) if lay == layer]
        li = list(result["layer_ids"]).index(layer)
        experts = [result["ablations"][a][1] for a in rows]
        share_DxA = np.asarray(result["share_LxDxE"])[li][:, experts]
        out[layer] = {"experts": spearman(np.asarray(result["share_LxE"])[li][experts],
                                                 np.asarray(result["delta_A"])[rows]),
                      "expert_domain_pairs": spearman(
                          share_DxA.T.ravel(), np.asarray(result["delta_AxD"])[rows].ravel())}
    return out
