"""The figures of `python -m analysis.dynamics`: saturation, load and routing biases over the checkpoints.
`traj` is the dict of trajectory.trajectory; `series` {layer: (steps, values)} from metrics.jsonl."""

import numpy as np

from analysis.figures import grid, plt, save
from analysis.routing.scales import line_colors
from train.loss_plot import smooth


def _mark_step0(ax, steps):
    if len(steps) and steps[0] == 0:
        ax.annotate("step 0 = initialization", (0, 0), xycoords=("data", "axes fraction"), xytext=(3, 3),
                    textcoords="offset points", fontsize=7, color="0.4")


def plot_saturation(traj, path):
    """Saturation per MoE layer against the checkpoint step, K/E dashed (two unrelated routers)."""
    steps, sat_SxL = np.asarray(traj["steps"]), np.asarray(traj["saturation_SxL"], float)
    chance = traj["top_k"] / traj["n_experts"]
    fig, ax = plt.subplots(figsize=(7.0, 4.0))
    for i, color in enumerate(line_colors(sat_SxL.shape[1])):
        ax.plot(steps, sat_SxL[:, i], "o-", color=color, markersize=4, label=f"layer {traj['layer_ids'][i]}")
    ax.axhline(chance, color="crimson", linestyle="--", linewidth=1.2, label=f"unrelated routers K/E = {chance:.3f}")
    ax.set_ylim(0, 1.03)
    ax.set_xlabel("checkpoint step")
    ax.set_ylabel(f"share of step {traj['final_step']}'s top-k already picked")
    ax.set_title(f"When does routing settle? Router saturation vs the final checkpoint (step {traj['final_step']}),"
                 f"\n{traj['n_tokens']:,} validation tokens", fontsize=10)
    _mark_step0(ax, steps)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return save(fig, path)


def plot_load(traj, series, path):
    """Left: MaxVio per checkpoint on the analysed tokens (markers) over the per-batch training MaxVio (faint,
    smoothed strong). Right: dead experts (no token of the analysed ones) per checkpoint."""
    steps = np.asarray(traj["steps"])
    maxvio_SxL, dead_SxL = np.asarray(traj["maxvio_SxL"], float), np.asarray(traj["dead_SxL"])
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11.0, 4.0), gridspec_kw={"width_ratios": [2, 1]})
    colors = line_colors(maxvio_SxL.shape[1])
    for i, (layer, color) in enumerate(zip(traj["layer_ids"], colors)):
        if layer in series:
            s, v = (np.asarray(a, float) for a in series[layer])
            keep = np.isfinite(v)
            ax.plot(s[keep], v[keep], color=color, alpha=0.25, linewidth=0.8)
            ax.plot(s[keep], smooth(v[keep]), color=color, linewidth=1.2, alpha=0.8)
        ax.plot(steps, maxvio_SxL[:, i], "o", color=color, markersize=5, markeredgecolor="black",
                markeredgewidth=0.5, label=f"layer {layer}")
        ax2.plot(steps, dead_SxL[:, i], "o-", color=color, markersize=4, label=f"layer {layer}")
    ax.set_xlabel("training step")
    ax.set_ylabel("MaxVio = (max load - mean) / mean")
    ax.set_title("Is the load balanced? MaxVio per checkpoint on validation tokens (dots),\n"
                 "per training batch from metrics.jsonl (faint; smoothed line)", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax2.set_xlabel("checkpoint step")
    ax2.set_ylabel("experts with no token")
    ax2.set_title(f"Dead experts (of {traj['n_experts']}) on validation tokens", fontsize=9)
    ax2.set_ylim(-0.3, max(1, int(dead_SxL.max())) + 0.5)
    ax2.yaxis.get_major_locator().set_params(integer=True)
    ax2.grid(alpha=0.3)
    _mark_step0(ax, steps)
    return save(fig, path)


def plot_bias(traj, bias_range, path):
    """One panel per MoE layer: every expert's routing bias minus the layer's mean bias, per checkpoint,
    coloured by the expert's load at the final checkpoint. Only differences between biases change a top-k, and
    the sign update moves all of them together whenever more experts are under- than over-loaded, so the
    common drift (the mean, in the title) is taken out. Last panel: the bias range of every logged step."""
    steps, bias_SxLxE = np.asarray(traj["steps"]), np.asarray(traj["bias_SxLxE"], float)
    load_LxE = np.asarray(traj["load_SxLxE"], float)[-1]
    n_layers, n_experts = bias_SxLxE.shape[1:]
    fig, axes = grid(n_layers + 1, 2, 5.2, 3.6, layout="constrained")
    cmap = plt.get_cmap("viridis")
    share_LxE = load_LxE / np.maximum(load_LxE.sum(-1, keepdims=True), 1) * traj["top_k"]
    vmin, vmax = float(share_LxE.min()), max(float(share_LxE.max()), float(share_LxE.min()) + 1e-9)
    mean_SxL = bias_SxLxE.mean(-1)
    for i, ax in enumerate(axes[:n_layers]):
        for e in range(n_experts):
            ax.plot(steps, bias_SxLxE[:, i, e] - mean_SxL[:, i], "-", marker=".", linewidth=1,
                    color=cmap((share_LxE[i, e] - vmin) / (vmax - vmin)))
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xlabel("checkpoint step", fontsize=8)
        ax.set_ylabel("bias - mean bias of the layer", fontsize=8)
        ax.set_title(f"layer {traj['layer_ids'][i]}: {n_experts} experts (mean bias at step {int(steps[-1])}: "
                     f"{mean_SxL[-1, i]:+.2f}, gamma = {traj['bias_update_rate']:g})", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(vmin, vmax))
    cb = fig.colorbar(sm, ax=axes[:n_layers], fraction=0.03, pad=0.02)
    cb.set_label(f"share of top-{traj['top_k']} choices at step {traj['final_step']} (sums to K; uniform K/E = "
                 f"{traj['top_k'] / n_experts:.3f})",
                 fontsize=7)
    ax = axes[n_layers]
    for layer, color in zip(traj["layer_ids"], line_colors(n_layers)):
        if layer in bias_range:
            s, v = bias_range[layer]
            ax.plot(s, v, color=color, linewidth=1.2, label=f"layer {layer}")
    ax.set_xlabel("training step", fontsize=8)
    ax.set_ylabel("max bias - min bias", fontsize=8)
    ax.set_title("bias range of every logged step (metrics.jsonl)", fontsize=9)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if bias_range:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no metrics.jsonl", ha="center", va="center", transform=ax.transAxes, color="0.4")
    fig.suptitle("How does aux-loss-free balancing steer the router? Routing bias per checkpoint", fontsize=10)
    return save(fig, path)
