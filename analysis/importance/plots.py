"""importance.png and super_experts.png: the figures of `python -m analysis.importance` (scores.importance's dict)."""

import numpy as np
from matplotlib.ticker import NullFormatter, ScalarFormatter

from analysis.figures import grid, save, title


def plot_importance(r, path):
    """Per MoE layer: each expert's REAP score (x) against its zeroing loss change (y, one s.e. over rows), with
    Spearman's rho of REAP and of the routing share in the title. Without the ablation, REAP against the share."""
    s = r["stats"]
    ablated = "zero_delta_LxE" in r
    fig, axes = grid(len(s["layer_ids"]), 2, 5.0, 4.0)
    for i, (ax, layer) in enumerate(zip(axes, s["layer_ids"])):
        x = np.asarray(s["reap_LxE"][i], float)
        if ablated:
            y, se = np.asarray(r["zero_delta_LxE"][i], float), np.asarray(r["zero_se_LxE"][i], float)
            ax.errorbar(x, y, yerr=np.nan_to_num(se), fmt="o", color="tab:blue", ecolor="0.6", markersize=5, capsize=2)
            ax.axhline(0, color="black", linewidth=0.8)
            ax.set_ylabel("loss change when zeroed (nats)", fontsize=8)
            c = r["correlations"].get(f"layer {layer}", {})
            ax.set_title(f"layer {layer}: Spearman rho REAP {c.get('reap_rho', np.nan):+.2f} (p {c.get('reap_p', np.nan):.2g}),"
                         f"\nshare {c.get('share_rho', np.nan):+.2f} (p {c.get('share_p', np.nan):.2g})", fontsize=9)
        else:
            y = np.asarray(s["share_LxE"][i], float)
            ax.plot(x, y, "o", color="tab:blue")
            ax.set_ylabel("routing share (sums to K)", fontsize=8)
            ax.set_title(f"layer {layer}", fontsize=9)
        for e, (xi, yi) in enumerate(zip(x, y)):
            if np.isfinite(xi) and np.isfinite(yi):
                ax.annotate(str(e), (xi, yi), textcoords="offset points", xytext=(4, 3), fontsize=7)
        ax.set_xlabel("REAP: mean over routed tokens of gate x ||expert output||", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    what = "the zeroing ablation" if ablated else "routing share"
    title(fig, f"Does REAP's gate x output norm predict what removing an expert costs? (against {what}; "
               f"{s['n_tokens']:,} scored tokens)", fontsize=10)
    return save(fig, path, rect=(0, 0, 1, 0.93))


def plot_super_experts(r, path):
    """Left: per MoE layer, each expert's largest output activation over the layer's median expert's (log scale),
    trained (bars) and at step 0 (black marks), the flagging factor dashed. Right: the residual stream's largest
    activation over its median magnitude after each block (massive activations), trained and at step 0."""
    s, layer_ids = r["stats"], r["stats"]["layer_ids"]
    ratio = np.asarray(r["outlier_ratio_LxE"], float)
    n_e = ratio.shape[1]
    fig, (ax, ax2) = grid(2, 2, 7.0, 4.2)
    xs = np.arange(len(layer_ids) * n_e)
    ax.bar(xs, ratio.ravel(), 0.8, color=np.repeat(["tab:blue", "tab:cyan"] * len(layer_ids), n_e)[:len(xs)],
           label="trained")
    if "step0" in r:
        ax.plot(xs, np.asarray(r["step0"]["outlier_ratio_LxE"], float).ravel(), "_", color="black", markersize=8,
                label="step 0 (initialization)")
    ax.axhline(r["factor"], color="crimson", linestyle="--", linewidth=1, label=f"flagged above {r['factor']:g}x")
    ax.set_yscale("log")
    ax.set_xticks([i * n_e + (n_e - 1) / 2 for i in range(len(layer_ids))])
    ax.set_xticklabels([f"layer {la}\n(experts 0-{n_e - 1})" for la in layer_ids], fontsize=7)
    ax.set_ylabel("max |expert output| / layer's median expert", fontsize=8)
    ax.set_title("Super experts? Each expert's largest activation on its routed tokens\n(no bar: no token routed to "
                 "the expert)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    blocks = np.arange(len(s["resid_max_Y"]))
    ax2.plot(blocks, s["resid_max_Y"] / s["resid_median_Y"], "o-", color="tab:blue", label="trained")
    if "step0" in r:
        s0 = r["step0"]["stats"]
        ax2.plot(blocks, s0["resid_max_Y"] / s0["resid_median_Y"], "s--", color="0.4", label="step 0")
    ax2.set_yscale("log")
    ax2.set_xticks(blocks)
    ax2.set_xticklabels([f"{b}" + (" (MoE)" if b in layer_ids else "") for b in blocks], fontsize=7)
    ax2.set_xlabel("block (residual stream after it)", fontsize=8)
    ax2.set_ylabel("max |x| / median |x|", fontsize=8)
    ax2.yaxis.set_major_formatter(ScalarFormatter())
    ax2.yaxis.set_minor_formatter(NullFormatter())
    ax2.set_title("Massive activations in the residual stream", fontsize=9)
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3)
    title(fig, f"Massive-activation scan ({s['n_tokens']:,} scored tokens)", fontsize=10)
    return save(fig, path, rect=(0, 0, 1, 0.93))
