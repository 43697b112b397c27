"""The baselines figure of `python -m analysis.specialization`: one panel per headline metric, per MoE layer
the trained value(s) beside step 0 and the random-router band, so a number is read against its chance level."""

import numpy as np

from analysis.figures import grid, save

TRAINED, STEP0, RANDOM = "tab:blue", "tab:orange", "0.45"


def plot_specialization(doc, path):
    """doc: specialization.json as a dict. Per layer: the random router's 2.5-97.5% band (grey bar, its mean a
    tick), step 0 (orange; one dot per run), trained (blue; one dot per run, the mean a diamond, the 95%
    t-interval over runs when there are 3 or more)."""
    metrics, layers = doc["metrics"], doc["layer_ids"]
    n_runs = len(doc["runs"])
    fav = doc.get("favourite_vs_step0")
    fig, axes = grid(len(metrics) + (fav is not None), 3, 4.2, 3.3)
    x_L = np.arange(len(layers), dtype=float)
    for ax, m in zip(axes, metrics.values()):
        r = m["random"]
        low, high, mean = (np.asarray(r[k], float) for k in ("low", "high", "mean"))
        ax.bar(x_L - 0.22, high - low, 0.18, bottom=low, color=RANDOM, alpha=0.45,
               label=f"random router, same load ({r['n']} perms of all runs, 95% band)")
        ax.hlines(mean, x_L - 0.31, x_L - 0.13, color=RANDOM, linewidth=1.5)
        for key, dx, color, label in (("step0", 0.0, STEP0, "step 0 (initialization)"),
                                      ("trained", 0.22, TRAINED, f"trained ({n_runs} run{'s' * (n_runs > 1)})")):
            vals_RxL = np.asarray(m[key]["per_run"], float)
            jitter = np.linspace(-0.04, 0.04, n_runs) if n_runs > 1 else np.zeros(1)
            for j, vals_L in enumerate(vals_RxL):
                ax.plot(x_L + dx + jitter[j], vals_L, "o", color=color, markersize=4, alpha=0.8,
                        label=label if j == 0 else None)
            if n_runs > 1:
                ax.plot(x_L + dx, m[key]["mean"], "D", color=color, markersize=6, markeredgecolor="black",
                        markeredgewidth=0.6,
                        label=f"{key.replace('0', ' 0')} mean" + (" (bar: 95% t-interval)" if n_runs >= 3 else ""))
                ci = np.asarray([m[key]["ci95_low"], m[key]["ci95_high"]], float)
                if np.isfinite(ci).all():
                    ax.vlines(x_L + dx, ci[0], ci[1], color=color, linewidth=2)
        ax.set_xticks(x_L)
        ax.set_xticklabels([f"layer {i}" for i in layers], fontsize=8)
        ax.set_xlim(-0.6, len(layers) - 0.4)
        ax.set_title(_wrap(m["what"]), fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
        # Room above the highest marker: an autoscaled top sits on it and cuts the marker in half.
        top = ax.dataLim.y1 if np.isfinite(ax.dataLim.y1) and ax.dataLim.y1 > 0 else 1.0
        ax.set_ylim(0, top * 1.1)
    if fav is not None:
        _plot_agreement(axes[len(metrics)], fav, layers, n_runs)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8)
    fig.suptitle(f"Is the routing specialization more than chance? ({doc['n_tokens']:,} validation tokens, "
                 f"top-{doc['top_k']} of {doc['n_experts']} experts)", fontsize=10)
    return save(fig, path, rect=(0, 0.1 if len(labels) > 3 else 0.06, 1, 1))


def _plot_agreement(ax, fav, layers, n_runs):
    """Favourite expert trained = step 0's, per layer: one dot per run (blue) against the chance level of two
    independent favourites with the same marginals (grey tick)."""
    x_L = np.arange(len(layers), dtype=float)
    ax.hlines(np.asarray(fav["chance"]["mean"], float), x_L - 0.25, x_L + 0.25, color=RANDOM, linewidth=2)
    jitter = np.linspace(-0.04, 0.04, n_runs) if n_runs > 1 else np.zeros(1)
    for j, vals_L in enumerate(np.asarray(fav["agree"]["per_run"], float)):
        ax.plot(x_L + jitter[j], vals_L, "o", color=TRAINED, markersize=4, alpha=0.8)
    ax.set_xticks(x_L)
    ax.set_xticklabels([f"layer {i}" for i in layers], fontsize=8)
    ax.set_xlim(-0.6, len(layers) - 0.4)
    ax.set_title(_wrap(fav["what"] + " (grey: chance, independent favourites)"), fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="y", alpha=0.3)
    top = ax.dataLim.y1 if np.isfinite(ax.dataLim.y1) and ax.dataLim.y1 > 0 else 1.0
    ax.set_ylim(0, top * 1.25)


def _wrap(text, width=48):
    words, lines, cur = text.split(), [], ""
    for w in words:
        if cur and len(cur) + len(w) + 1 > width:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}".strip()
    return "\n".join(lines + [cur])
