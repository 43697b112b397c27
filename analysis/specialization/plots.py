"""The baselines figure of `python -m analysis.specialization`: one panel per headline metric, per MoE layer
the trained value(s) beside the load-matched null's band, the token-identity null's band and step 0, so a number
is read against what chance, token identity alone and the untrained router give."""

import numpy as np

from analysis.figures import grid, save

TRAINED, STEP0, RANDOM, TOKEN_NULL = "tab:blue", "tab:orange", "0.45", "tab:purple"


def plot_specialization(doc, path):
    """doc: specialization.json as a dict. Per layer, left to right: the load-matched null's 2.5-97.5% band (grey
    bar, its mean a tick), the token-identity null's (purple; none in a document written before it existed), step 0 (orange; one
    dot per run), trained (blue; one dot per run, the mean a diamond, the 95% t-interval over runs when there
    are 3 or more). A metric the token-identity null keeps by construction says so in its panel."""
    metrics, layers = doc["metrics"], doc["layer_ids"]
    n_runs = len(doc["runs"])
    fav = doc.get("favourite_vs_step0")
    fig, axes = grid(len(metrics) + (fav is not None), 3, 4.2, 3.3)
    x_L = np.arange(len(layers), dtype=float)
    for ax, m in zip(axes, metrics.values()):
        nulls = [("random", -0.33, RANDOM, "load-matched null: top-k sets permuted over all tokens")]
        if m.get("token_null") is not None:
            nulls.append(("token_null", -0.11, TOKEN_NULL, "token-identity null: permuted within each token id"))
        for key, dx, color, label in nulls:
            r = m[key]
            low, high, mean = (np.asarray(r[k], float) for k in ("low", "high", "mean"))
            ax.bar(x_L + dx, np.maximum(high - low, 0), 0.16, bottom=low, color=color, alpha=0.45,
                   label=f"{label} ({r['n']} perms, 95% band)")
            ax.hlines(mean, x_L + dx - 0.09, x_L + dx + 0.09, color=color, linewidth=1.5)
        if (m.get("token_null") or {}).get("kept_by_construction"):
            ax.text(0.02, 0.97, "token-identity null = trained\n(kept by construction)", transform=ax.transAxes,
                    fontsize=7, va="top", color=TOKEN_NULL)
        for key, dx, color, label in (("step0", 0.11, STEP0, "step 0 (untrained router)"),
                                      ("trained", 0.33, TRAINED, f"trained ({n_runs} run{'s' * (n_runs > 1)})")):
            vals_RxL = np.asarray(m[key]["per_run"], float)
            jitter = np.linspace(-0.035, 0.035, n_runs) if n_runs > 1 else np.zeros(1)
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
        ax.set_ylim(0, top * 1.3)  # room for the note in the top left
    if fav is not None:
        _plot_agreement(axes[len(metrics)], fav, layers, n_runs)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 2), fontsize=8)
    fig.suptitle(f"Is the routing specialization more than chance? ({doc['n_tokens']:,} validation tokens, "
                 f"top-{doc['top_k']} of {doc['n_experts']} experts)", fontsize=10)
    return save(fig, path, rect=(0, 0.035 * ((len(labels) + 1) // 2) + 0.02, 1, 1))


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
