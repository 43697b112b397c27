"""Routing plots (matplotlib, Agg). Each function takes a `RoutingAccumulator.finalize()` dict (or the arrays
named in its docstring) and a path, writes one PNG and returns the path.

Layers are labelled "layer L" everywhere (`layer_labels`): L is `result["layer_ids_L"]` when present (the
model-layer index of each MoE layer, which the CLI adds since leading dense layers shift it), else the
MoE-layer index. Heatmaps of several panels share one colour scale and one colourbar, so panels compare; where
a random router has a known value (uniform share K/E, co-activation (K-1)/(E-1)) the scale is the ratio to it
(`analysis.routing.scales`): white at chance, red above, blue below.
"""

import math

import numpy as np
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from analysis.figures import count, grid, plt, save, title
from analysis.routing.scales import CHANCE_CMAP, chance_norm, line_colors, shared_colorbar
from train.loss_plot import smooth

UNIFORM_STYLE = dict(color="crimson", linestyle="--", linewidth=1.2)


def layer_labels(result):
    """"layer L" per MoE layer of `result`, L the model-layer index (see the module docstring)."""
    ids = result.get("layer_ids_L")
    return [f"layer {int(ids[i]) if ids is not None else i}" for i in range(int(result["n_layers"]))]


def _layer_name(result, layer):
    return layer_labels(result)[layer]


def _expert_ticks(ax, n_experts, axis="x"):
    # Every label up to 32 experts; beyond that every 4th (labels at 64 would overlap) with minor ticks between.
    step = 1 if n_experts <= 32 else 4
    ticks = np.arange(0, n_experts, step)
    set_ticks, set_labels = (ax.set_xticks, ax.set_xticklabels) if axis == "x" else (ax.set_yticks, ax.set_yticklabels)
    set_ticks(ticks)
    set_labels([str(t) for t in ticks], fontsize=7 if n_experts > 16 else 8)
    if step > 1:
        set_ticks(np.arange(n_experts), minor=True)


def _domain_names(result, domain_names):
    return list(domain_names) if domain_names is not None else [f"domain {d}" for d in range(int(result["n_domains"]))]


def share_label(key, top_k):
    """What a share of `key` counts and what it sums to over the experts (a top-k share sums to K, not 1)."""
    if "top1" in key:
        return "share of first choices (sums to 1)"
    if "norm" in key:
        return f"share of top-{top_k} choices / K (sums to 1)"
    return f"share of top-{top_k} choices (sums to K = {top_k})"


def plot_domain_bars(result, layer, path, domain_names=None, key="share_LxDxE"):
    """One bar chart per domain of its tokens' distribution over experts at `layer` (top-k share, sums to K),
    with the uniform share K/E dashed and, where the result has them, per expert the load-matched null (black
    tick: the expert's share over all domains) and the token-identity null (purple: the share this domain's
    token mix predicts; analysis.routing.stats). The y axis is the same for every layer (the maximum over all layers),
    so the files of different layers compare. key="share_top1_LxDxE" plots first choices (uniform 1/E)."""
    share_LxDxE = result[key]
    share_DxE = share_LxDxE[layer]
    n_domains, n_experts = share_DxE.shape
    names = _domain_names(result, domain_names)
    k = 1 if "top1" in key or "norm" in key else int(result["top_k"])
    uniform = k / n_experts
    fig, axes = grid(n_domains, 3 if n_experts <= 24 else 2, max(4.0, 0.12 * n_experts + 1.5), 2.6)
    top1 = "_top1" if "top1" in key else ""
    scale = 1.0 / int(result["top_k"]) if "norm" in key else 1.0
    load_E = result.get(f"loadmatched_share{top1}_LxE")
    null_DxE = result.get(f"tokennull_share{top1}_LxDxE")
    drawn = [share_LxDxE, *([load_E * scale] if load_E is not None else []),
             *([null_DxE[:, :n_domains] * scale] if null_DxE is not None else [])]  # one y axis fits them all
    finite = [np.nanmax(t) for t in drawn if np.isfinite(t).any()]
    ymax = max(finite) * 1.08 if finite else 1.0
    x_E = np.arange(n_experts)
    for d, ax in enumerate(axes):
        ax.bar(x_E, np.nan_to_num(share_DxE[d]), color="tab:blue", width=0.8, label="this domain")
        # The nulls per expert: its share over all domains (load-matched), and what this domain's token mix
        # predicts if each token were routed as its id is everywhere (token-identity).
        if load_E is not None:
            ax.hlines(load_E[layer] * scale, x_E - 0.4, x_E + 0.4, color="black", linewidth=1.6,
                      label="load-matched null: the expert's share over all domains")
        if null_DxE is not None:
            ax.plot(x_E, null_DxE[layer, d] * scale, "D", color="tab:purple", markersize=3.5, linestyle="none",
                    label="token-identity null: this domain's tokens routed as over all domains")
        ax.axhline(uniform, **UNIFORM_STYLE, label=f"uniform {'K/E' if k > 1 else '1/E'} = {uniform:.3f}")
        ax.set_title(f"{_layer_name(result, layer)} - {names[d]} (n={count(result['n_tokens_D'][d])})", fontsize=9)
        ax.set_xlim(-0.6, n_experts - 0.4)
        ax.set_ylim(0, ymax)
        _expert_ticks(ax, n_experts)
        ax.set_xlabel("expert", fontsize=8)
        ax.set_ylabel(share_label(key, int(result["top_k"])).replace(" (", "\n("), fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    # One legend for the figure, above the panels: inside one it would cover a bar.
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", fontsize=8, frameon=False, ncol=2)
    return save(fig, path, rect=(0, 0, 1, 1 - 0.2 * (1 + (len(labels) + 1) // 2) / fig.get_figheight()))


def plot_domain_heatmaps(result, path, domain_names=None, layers=None, key="share_LxDxE"):
    """Domain x expert heatmap of the top-k share per selected layer (default all), on one colour scale
    (white = uniform K/E, or 1/E for first choices) with one colourbar."""
    share_LxDxE = result[key]
    layers = list(range(share_LxDxE.shape[0]) if layers is None else layers)
    n_domains, n_experts = share_LxDxE.shape[1:]
    names = _domain_names(result, domain_names)
    k = 1 if "top1" in key or "norm" in key else int(result["top_k"])
    shown = share_LxDxE[layers]
    norm = chance_norm(np.nanmax(shown) if np.isfinite(shown).any() else 1.0, k / n_experts)
    fig, axes = grid(len(layers), 1 if n_experts > 32 else 2, max(5.0, 0.16 * n_experts + 2.0),
                     0.3 * n_domains + 1.2, layout="constrained")
    for ax, layer in zip(axes, layers):
        im = ax.imshow(share_LxDxE[layer], aspect="auto", cmap=CHANCE_CMAP, norm=norm, interpolation="nearest")
        ax.set_yticks(np.arange(n_domains))
        ax.set_yticklabels(names, fontsize=8)
        _expert_ticks(ax, n_experts)
        ax.set_xlabel("expert", fontsize=8)
        ax.set_title(_layer_name(result, layer), fontsize=9)
    what = ("share of domain tokens whose first choice is the expert" if "top1" in key
            else "share of domain tokens' top-k choices that go to the expert" if "norm" in key
            else f"share of domain tokens with the expert in their top-{k} (sums to K = {k} over experts)")
    scale = "one colour scale for all layers; " if len(layers) > 1 else ""
    title(fig, f"{what}\n({scale}white = uniform {'1/E' if k == 1 else 'K/E'})")
    shared_colorbar(fig, im, axes, k / n_experts, share_label(key, int(result["top_k"])), "uniform")
    return save(fig, path)


def plot_token_experts(result, path, token_text, which="track", max_tokens=None):
    """Per token, a layer x expert heatmap of the share of its occurrences with the expert in their top-k.
    which="track" uses the requested ids (track_*), "freq" the most frequent ones (freq_*): every one routing.json
    reports, unless max_tokens caps them (the title says how many are shown).
    token_text: mapping or callable id -> string; titles use repr() so whitespace stays visible."""
    n = "T" if which == "track" else "N"  # finalize() names tracked tokens *_T, frequent ones *_N
    ids_T, n_T, share_TxLxE = result[f"{which}_ids_{n}"], result[f"{which}_n_{n}"], result[f"{which}_share_{n}xLxE"]
    text = token_text if callable(token_text) else (lambda i: token_text.get(int(i), f"<id {int(i)}>"))
    present = [t for t in range(len(ids_T)) if n_T[t] > 0]
    keep = present[:max_tokens]
    if not keep:
        fig, ax = plt.subplots(figsize=(5, 1.5))
        ax.text(0.5, 0.5, "no occurrences of the requested tokens", ha="center", va="center")
        ax.set_axis_off()
        return save(fig, path)
    n_layers, n_experts = share_TxLxE.shape[1:]
    fig, axes = grid(len(keep), 1 if n_experts > 32 else 2, max(5.0, 0.14 * n_experts + 2.0),
                     0.28 * n_layers + 1.3, layout="constrained")
    uniform = int(result["top_k"]) / n_experts
    norm = chance_norm(1.0, uniform)  # 1 = every occurrence: a fixed top, so tokens and runs compare
    for ax, t in zip(axes, keep):
        im = ax.imshow(share_TxLxE[t], aspect="auto", cmap=CHANCE_CMAP, norm=norm, interpolation="nearest")
        ax.set_title(f"token {text(ids_T[t])!r} (id {int(ids_T[t])}, n={count(n_T[t])})", fontsize=9)
        ax.set_yticks(np.arange(n_layers))
        ax.set_yticklabels(layer_labels(result), fontsize=7)
        _expert_ticks(ax, n_experts)
        ax.set_xlabel("expert", fontsize=8)
    which_tokens = (f"the {len(keep)} most frequent tokens" if which == "freq" else
                    f"the {len(keep)} tracked tokens (--token)")
    shown = f" ({len(keep)} of {len(present)} shown)" if len(keep) < len(present) else ""
    title(fig, f"{which_tokens}{shown}: share of a token's occurrences with the expert in their "
               f"top-{int(result['top_k'])} (white = uniform K/E)")
    shared_colorbar(fig, im, axes, uniform, f"share of occurrences (sums to K = {int(result['top_k'])})", "uniform")
    return save(fig, path)


LOCALITY = (("first", "same first choice"), ("any", "any top-k overlap"), ("overlap", "mean overlap fraction"))
# key in the result, label, marker, colour of each chance level drawn beside the trained bars.
LOCALITY_NULLS = (("loadmatched_{m}_L", "load-matched null (sets permuted over all tokens)", "_", "black"),
                  ("tokennull_{m}_L", "token-identity null (permuted within each token id)", "D", "tab:purple"))


def plot_locality(result, path):
    """One panel per locality measure (first-choice repeat, any top-k overlap, mean overlap fraction with the
    previous token of the same document): per layer the trained value (blue bar) and, where measured, the
    untrained router's (step0_*_L, orange bar), beside the load-matched null (black tick) and the token-identity
    null (purple diamond), both exact expectations (analysis.routing.nulls), and the uniform router (dashed;
    1/E, 1 - C(E-K,K)/C(E,K), K/E). Any-overlap has no exact null beyond the uniform one."""
    n_layers = int(result["n_layers"])
    x = np.arange(n_layers)
    step0 = "step0_loc_first_L" in result
    fig, axes = grid(3, 3, max(3.6, 0.32 * n_layers + 1.6), 3.6)
    width = 0.36 if step0 else 0.6
    for ax, (m, label) in zip(axes, LOCALITY):
        ax.bar(x - width / 2 * step0, result[f"loc_{m}_L"], width, color="tab:blue", label="trained")
        if step0:
            ax.bar(x + width / 2, result[f"step0_loc_{m}_L"], width, color="tab:orange", alpha=0.8,
                   label="step 0 (untrained router)")
        for key, null_label, marker, color in LOCALITY_NULLS:
            if key.format(m=m) in result:
                # Drawn on the trained bar they are the chance levels of; the diamond a little right of the tick.
                dx = -width / 2 * step0 + (0.0 if marker == "_" else width / 4)
                ax.plot(x + dx, result[key.format(m=m)], marker, color=color, linestyle="none",
                        markersize=16 if marker == "_" else 5, markeredgewidth=2.4, label=null_label, zorder=4)
        if not any(key.format(m=m) in result for key, *_ in LOCALITY_NULLS):
            ax.text(0.02, 0.97, "no exact null beyond the uniform router", transform=ax.transAxes, fontsize=7,
                    va="top", color="0.35")
        uniform = np.asarray(result.get(f"baseline_{m}_L", [result[f"baseline_{m}"]] * n_layers), np.float64)
        ax.plot(np.r_[x - 0.5, x[-1] + 0.5] if n_layers else x, np.r_[uniform, uniform[-1:]] if n_layers else uniform,
                drawstyle="steps-post", color="crimson", linestyle="--", linewidth=1.2,
                label=f"uniform router ({float(uniform[0]):.3f})")
        ax.set_xticks(x)
        ax.set_xticklabels(layer_labels(result), fontsize=7, rotation=45 if n_layers > 6 else 0)
        ax.set_xlim(-0.6, n_layers - 0.4)
        top = max(np.nanmax([np.nanmax(np.asarray(result[k], np.float64)) for k in
                             [f"loc_{m}_L", f"step0_loc_{m}_L", f"baseline_{m}_L"] if k in result]), 0.05)
        ax.set_ylim(0, min(1.04, top * 1.25))
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("share of consecutive token pairs\n(same document)", fontsize=8)
    order = ["trained", "step 0 (untrained router)"] + [lab for _, lab, _, _ in LOCALITY_NULLS]
    found = {lab: h for ax in axes for h, lab in zip(*ax.get_legend_handles_labels())}
    labels = [lab for lab in order if lab in found]
    handles = [found[lab] for lab in labels] + [Line2D([], [], color="crimson", linestyle="--", linewidth=1.2)]
    labels.append("uniform router (1/E; any-overlap 1 - C(E-K,K)/C(E,K); K/E)")
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=7)
    fig.suptitle(f"Routing locality vs the previous token (top-{int(result['top_k'])} of "
                 f"{int(result['n_experts'])}), beside its chance levels", fontsize=10)
    return save(fig, path, rect=(0, (0.25 + 0.16 * ((len(labels) + 1) // 2)) / fig.get_figheight(), 1, 1))


def plot_vocab_specialization(result, path):
    """Layer x expert heatmap of vocabulary specialization (mean over tokens whose top expert is e; grey = no
    such token); the per-layer mean is in the y labels."""
    spec_LxE = result["vocab_spec_LxE"]
    n_layers, n_experts = spec_LxE.shape
    fig, ax = plt.subplots(figsize=(max(7.0, 0.16 * n_experts + 4), max(3.4, 0.35 * n_layers + 1.8)))
    cmap = plt.get_cmap("viridis").with_extremes(bad="lightgrey")
    # The metric lives in [1/E, 1/K]: a token's favourite expert gets at least the mean share 1/E of its K*n
    # assignments, and at most n of them (1/K) when it is in that token's top-k every time.
    low, top = 1 / n_experts, 1 / int(result["top_k"])
    im = ax.imshow(np.ma.masked_invalid(spec_LxE), aspect="auto", cmap=cmap, vmin=low, vmax=top,
                   interpolation="nearest")
    ax.set_yticks(np.arange(n_layers))
    ax.set_yticklabels([f"{_layer_name(result, i)} (mean {result['vocab_spec_L'][i]:.3f})"
                        for i in range(n_layers)], fontsize=8)
    _expert_ticks(ax, n_experts)
    ax.set_xlabel("expert (tokens grouped by their most frequent expert; grey = none)", fontsize=8)
    ax.set_title(f"Vocabulary specialization ({int(result['vocab_n_eligible'])} token ids seen >= "
                 f"{int(result.get('vocab_min_count', 10))} times)", fontsize=9)
    cb = fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02)
    cb.set_label("share of a token's assignments\nto its most frequent expert", fontsize=8)
    # The two ends named, round values between them (not the odd fifths of [1/E, 1/K]), none so close to an
    # end that the labels overlap.
    inner = [t for t in MaxNLocator(nbins=5).tick_values(low, top) if low + 0.08 * (top - low) < t < top - 0.08 * (top - low)]
    cb.set_ticks([low, *inner, top])
    cb.set_ticklabels([f"uniform 1/E {low:.3g}"] + [f"{t:g}" for t in inner] + [f"always 1/K {top:.3g}"], fontsize=7)
    return save(fig, path)


def plot_coactivation(result, path, layers=None):
    """Expert co-activation N(e_i, e_j) / N(e_i) per selected layer (row i = the conditioning expert), on one
    colour scale: white = a random router's (K-1)/(E-1), grey = the diagonal (0 by definition)."""
    coact_LxExE = np.array(result["coact_LxExE"], np.float64)
    layers = list(range(coact_LxExE.shape[0]) if layers is None else layers)
    n_experts = coact_LxExE.shape[-1]
    coact_LxExE[:, np.arange(n_experts), np.arange(n_experts)] = np.nan
    chance = (int(result["top_k"]) - 1) / max(n_experts - 1, 1)
    shown = coact_LxExE[layers]
    norm = chance_norm(np.nanmax(shown) if np.isfinite(shown).any() else 1.0, chance)
    side = max(3.4, 0.09 * n_experts + 2.4)
    fig, axes = grid(len(layers), 1 if n_experts > 32 else 2, side, side, layout="constrained")
    for ax, layer in zip(axes, layers):
        im = ax.imshow(np.ma.masked_invalid(coact_LxExE[layer]), cmap=CHANCE_CMAP, norm=norm,
                       interpolation="nearest")
        _expert_ticks(ax, n_experts, "x")
        _expert_ticks(ax, n_experts, "y")
        ax.set_xlabel("co-activated expert j", fontsize=8)
        ax.set_ylabel("expert i", fontsize=8)
        ax.set_title(_layer_name(result, layer), fontsize=9)
    if len(layers) > 1:
        fig.suptitle("co-activation N(i,j) / N(i): of the tokens that chose expert i, the share that also chose j\n"
                     "(one colour scale for all layers; white = random router (K-1)/(E-1))", fontsize=10)
    else:  # one narrow panel: a title that fits its width
        fig.suptitle("co-activation N(i,j) / N(i):\nof the tokens that chose i,\nthe share that also chose j\n"
                     "(white = random router)", fontsize=9)
    shared_colorbar(fig, im, axes, chance, "N(i,j) / N(i)", "random")
    return save(fig, path)


def plot_maxvio_series(series, path, log=True):
    """MaxVio over training, one colour per layer: the per-batch values faint, smoothed strong
    (`figures.smooth`: two-sided exponential, no lag).
    series is `read_maxvio_series` output {model layer: (steps, values)}. The y axis is logarithmic (MaxVio
    falls by orders of magnitude as the bias balances the load) when log=True, every value is positive and
    they span more than a factor of 5, with plain-number ticks (0.1, 0.2, 0.5, 1, 2 ...)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    finite = [np.asarray(v, np.float64)[np.isfinite(v)] for _, v in series.values()]
    finite = np.concatenate(finite) if finite else np.array([])
    for color, (layer, (steps, values)) in zip(line_colors(len(series)), series.items()):
        steps, values = np.asarray(steps, np.float64), np.asarray(values, np.float64)
        keep = np.isfinite(values)
        ax.plot(steps[keep], values[keep], color=color, alpha=0.35, linewidth=0.9)
        ax.plot(steps[keep], smooth(values[keep]), color=color, linewidth=2.0, label=f"layer {layer}")
    if log and finite.size and finite.min() > 0 and finite.max() / finite.min() > 5:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("training step")
    ax.set_ylabel("MaxVio of the batch")
    ax.set_title("Load imbalance over training (faint: every logged batch; strong: smoothed)", fontsize=10)
    if series:
        ax.legend(fontsize=8, ncol=max(1, math.ceil(len(series) / 8)))
    else:
        ax.text(0.5, 0.5, "no moe/layer_L/maxvio in metrics.jsonl", ha="center", va="center",
                transform=ax.transAxes, color="0.4")
    ax.grid(alpha=0.3, which="major")
    return save(fig, path)


def plot_maxvio_global(result, path):
    """MaxVio_global per layer on the analysed tokens ((max load - mean) / mean; 0 = balanced)."""
    maxvio_L = result["maxvio_L"]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.4 * len(maxvio_L) + 2.5), 3.4))
    ax.bar(np.arange(len(maxvio_L)), maxvio_L, color="tab:purple", width=0.6)
    ax.set_xlim(-0.5 - 0.5 * (len(maxvio_L) < 3), len(maxvio_L) - 0.5 + 0.5 * (len(maxvio_L) < 3))  # one layer: no slab
    ax.set_xticks(np.arange(len(maxvio_L)))
    ax.set_xticklabels(layer_labels(result), fontsize=8, rotation=45 if len(maxvio_L) > 12 else 0)
    ax.set_ylabel("MaxVio_global")
    ax.set_title(f"Load imbalance on {int(result['n_tokens'])} analysed tokens")
    ax.grid(axis="y", alpha=0.3)
    return save(fig, path)


def plot_saturation(sat_by_step, path, final_step=None, random_baseline=None, layer_names=None):
    """Router saturation per layer: {checkpoint step: saturation_L}. One line per layer over steps, or bars
    per layer when a single earlier checkpoint is given. random_baseline (K/E: two independent random top-k
    sets) is drawn dashed when given. layer_names: a label per layer; pass `layer_labels(result)` so the
    layers read "layer L" with the model-layer index as in every other plot (default "layer i", i the
    MoE-layer index)."""
    steps = sorted(sat_by_step)
    sat_CxL = np.stack([np.asarray(sat_by_step[s]) for s in steps])
    n_layers = sat_CxL.shape[1]
    names = list(layer_names) if layer_names is not None else [f"layer {i}" for i in range(n_layers)]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.4 * n_layers + 3), 3.8))
    suffix = f" vs final step {final_step}" if final_step is not None else " vs final checkpoint"
    if len(steps) == 1:
        ax.bar(np.arange(n_layers), sat_CxL[0], color="tab:cyan", width=0.6)
        ax.set_xlim(-0.5 - 0.5 * (n_layers < 3), n_layers - 0.5 + 0.5 * (n_layers < 3))  # one layer: no slab
        ax.set_xticks(np.arange(n_layers))
        ax.set_xticklabels(names, fontsize=8, rotation=45 if n_layers > 12 else 0)
        ax.set_title(f"Router saturation at step {steps[0]}{suffix}")
    else:
        for layer, color in enumerate(line_colors(n_layers)):
            ax.plot(steps, sat_CxL[:, layer], marker="o", markersize=4, linewidth=1.8, color=color,
                    label=names[layer])
        ax.set_xlabel("checkpoint step")
        ax.set_title(f"Router saturation{suffix}")
    if random_baseline is not None:
        ax.axhline(random_baseline, **UNIFORM_STYLE, label=f"random K/E = {random_baseline:.3f}")
    n_labels = len(ax.get_legend_handles_labels()[1])
    if n_labels:
        ax.legend(fontsize=7, ncol=max(1, math.ceil(n_labels / 8)))
    ax.set_ylabel("share of final top-k matched")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    return save(fig, path)
