"""The compare-masks report: validation loss per variant (mean and 95% bootstrap CI over seeds), paired
differences against the causal baseline and against the same mask with RoPE, loss curves, attention-rank
summaries. Writes report.md, results.json and PNGs into one directory."""

import json
import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np

from analysis.figures import plt, save

N_BOOT = 10000


def bootstrap_ci(values, n_boot: int = N_BOOT, level: float = 0.95, seed: int = 0):
    """(mean, lo, hi): the mean and the percentile bootstrap interval of the mean (resampling the values).

    With 3 seeds there are only 10 distinct resamples, so the interval is coarse: it is bounded by the extreme
    values and says nothing beyond the seeds' spread."""
    v = np.asarray(values, np.float64)
    if len(v) == 1:
        return float(v[0]), float(v[0]), float(v[0])
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), (n_boot, len(v)))].mean(1)
    a = (1 - level) / 2
    return float(v.mean()), float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def _name(r):
    return r["mask"] if r["rope"] else f"{r['mask']}-nope"


def group(results):
    """{variant: {seed: result}} in first-seen order."""
    out = defaultdict(dict)
    for r in results:
        out[_name(r)][r["seed"]] = r
    return dict(out)


def paired(groups, a: str, b: str):
    """Per-seed differences val_loss(a) - val_loss(b) over the seeds both have (same data order and init)."""
    seeds = sorted(set(groups[a]) & set(groups[b]))
    return [groups[a][s]["val_loss"] - groups[b][s]["val_loss"] for s in seeds]


def _fmt(ci, digits=4):
    m, lo, hi = ci
    return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def plot_val_loss(groups, path):
    names = list(groups)
    fig, ax = plt.subplots(figsize=(1.3 * len(names) + 2.5, 3.6))
    for i, n in enumerate(names):
        v = [r["val_loss"] for r in groups[n].values()]
        _ci_points(ax, i, v)
    _label_ci_axes(ax, names, "validation loss (output part)", "Final validation loss per variant")
    save(fig, path)


def _ci_points(ax, i, values):
    """At x = i: the mean with its 95% bootstrap CI, and each seed's value beside it."""
    m, lo, hi = bootstrap_ci(values)
    ax.errorbar([i], [m], yerr=[[m - lo], [hi - m]], fmt="o", color="C0", capsize=6, ms=7,
                label="mean, 95% bootstrap CI" if i == 0 else None)
    ax.scatter(np.full(len(values), i) + np.linspace(-0.12, 0.12, len(values)), values, color="C1", s=14,
               zorder=3, label="seeds" if i == 0 else None)


def _label_ci_axes(ax, labels, ylabel, title, label_size=None):
    """Axes drawn by _ci_points at x = 0..n-1: one tick label per point, y grid, legend, title."""
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=label_size)
    ax.set_xlim(-0.6, len(labels) - 0.4)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)


def plot_paired(groups, pairs, path):
    """Per-seed paired differences (variant - reference) with their mean and 95% bootstrap CI; 0 = no effect."""
    fig, ax = plt.subplots(figsize=(1.6 * len(pairs) + 2.5, 3.6))
    for i, (a, b) in enumerate(pairs):
        d = paired(groups, a, b)
        _ci_points(ax, i, d)
    ax.axhline(0, color="gray", linewidth=1)
    _label_ci_axes(ax, [f"{a}\n- {b}" for a, b in pairs], "validation loss difference",
                   "Paired by seed (same data order and initial weights); < 0: first is better", label_size=8)
    save(fig, path)


def _aligned(runs, key):
    """(steps, values [seeds, steps]) on the steps every seed logged (a resumed run logs a few extra steps)."""
    curves = [dict(r[key]) for r in runs.values()]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return np.array(steps), np.array([[c[s] for s in steps] for c in curves])


def plot_curves(groups, path):
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, (n, runs) in enumerate(groups.items()):
        style = dict(color=f"C{i % 10}", linestyle="-" if "nope" not in n else "--")
        steps, curves = _aligned(runs, "train_curve")
        axes[0].plot(steps, curves.mean(0), label=n, **style)
        axes[0].fill_between(steps, curves.min(0), curves.max(0), alpha=0.15, color=style["color"])
        vsteps, vals = _aligned(runs, "val_curve")
        axes[1].plot(vsteps, vals.mean(0), marker="o", ms=4, label=n, **style)
    axes[0].set_title("training loss (output part), mean over seeds, band = min..max", fontsize=9)
    axes[1].set_title("validation loss, mean over seeds", fontsize=9)
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    lo = min(v for rs in groups.values() for r in rs.values() for _, v in r["val_curve"])
    axes[0].set_ylim(lo - 0.3, lo + 3.0)
    save(fig, path)


def rank_table(groups):
    """{variant: {block: {key: [layer means over heads and seeds]}}}."""
    out = {}
    for n, runs in groups.items():
        out[n] = {}
        for blk in ("full", "prefix"):
            rs = [r["attention"][blk] for r in runs.values() if blk in r["attention"]]
            if rs:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN logdet of prefix-LM heads
                    out[n][blk] = {k: np.nanmean([np.asarray(r[k], np.float64) for r in rs], axis=(0, 2)).tolist()
                                   for k in ("rank_frac", "erank_frac", "logdet_per_token", "full_rank_share")}
        out[n]["collapse"] = {p: np.mean([r["collapse"][p]["l1linf"] for r in runs.values()], 0).tolist()
                              for p in next(iter(runs.values()))["collapse"]}
    return out


def plot_rank(table, path):
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = [("full", "erank_frac", "effective rank / n, real-token block"),
              ("prefix", "erank_frac", "effective rank / n, prefix block"),
              ("full", "rank_frac", "numerical rank / n, real-token block")]
    for ax, (blk, key, title) in zip(axes, panels):
        for i, (n, t) in enumerate(table.items()):
            if blk in t:
                y = t[blk][key]
                ax.plot(range(len(y)), y, marker="o", ms=4, color=f"C{i % 10}",
                        linestyle="-" if "nope" not in n else "--", label=n)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("layer")
        ax.set_xticks(range(len(y)))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Attention rank (mean over heads, validation sequences and seeds)", fontsize=10)
    save(fig, path)


def _compute_note(config) -> str:
    """What the runs executed: einsum computes the full L x L logits for every mask; blockwise (the default since
    2026-11-26) skips the key blocks above the diagonal for the causal mask only."""
    impl = config.execution.attention_impl if config is not None else "blockwise"
    if impl == "blockwise":
        return ("Attention ran blockwise: the causal variants skip the key blocks above the diagonal (about 37% "
                "fewer attention-score FLOPs at 4 query blocks); the other masks compute the full L x L square.")
    return f"Attention ran as {impl}: every mask computes the full L x L square, so executed FLOPs are identical."


def write_report(results, out, cost, base_config=None, missing=()) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    groups = group(results)
    (out / "results.json").write_text(json.dumps(results))
    plot_val_loss(groups, out / "val_loss.png")
    plot_curves(groups, out / "loss_curves.png")
    table = rank_table(groups)
    plot_rank(table, out / "attention_rank.png")
    (out / "rank_summary.json").write_text(json.dumps(table, indent=1))

    r0 = results[0]
    lines = ["# compare-masks report", "",
             f"{len(results)} runs: {len(groups)} variants x up to {max(len(g) for g in groups.values())} seeds, "
             f"{r0['steps']} steps each, {r0['params']['total'] / 1e6:.2f}M parameters "
             f"({r0['params']['active'] / 1e6:.2f}M active) in every variant.", ""]
    if missing:
        lines += [f"**Partial study**: {len(missing)} runs not finished: {', '.join(missing)}.", ""]
    if base_config is not None:
        m, d, t = base_config.model, base_config.data, base_config.train
        lines += [f"Model: d_model {m.d_model}, {m.n_layers} layers ({m.first_k_dense} dense), {m.n_heads} heads "
                  f"(kv {m.n_kv_heads}) x {m.head_dim}, {m.n_routed_experts} routed experts top-{m.top_k} + "
                  f"{m.n_shared_experts} shared. Data: {d.name}, one document per row, seq_len {d.seq_len}, "
                  f"input = first {d.prefix_frac:.0%} of the row, loss on the output only. Batch {t.batch_size}, "
                  f"lr {t.lr}, warmup {t.warmup_steps}, {t.schedule} schedule.", ""]
    lines += ["## Validation loss (output part; mean and 95% bootstrap CI over seeds)", "",
              "| variant | mean [95% CI] | per seed | train s/run (shared CPU) |", "|---|---|---|---|"]
    for n, runs in groups.items():
        v = [runs[s]["val_loss"] for s in sorted(runs)]
        secs = np.mean([r["train_seconds"] for r in runs.values()])
        lines.append(f"| {n} | {_fmt(bootstrap_ci(v))} | {', '.join(f'{x:.4f}' for x in v)} | {secs:.0f} |")
    lines += ["", "Paired differences (same seed = same data order and initial weights; negative = first is "
              "better):", "", "| difference | mean [95% CI] | per seed |", "|---|---|---|"]
    pairs = [(n, "causal") for n in groups if n != "causal" and "nope" not in n and "causal" in groups]
    pairs += [(n, n[: -len("-nope")]) for n in groups if n.endswith("-nope") and n[: -len("-nope")] in groups]
    for a, b in pairs:
        d = paired(groups, a, b)
        lines.append(f"| {a} - {b} | {_fmt(bootstrap_ci(d))} | {', '.join(f'{x:+.4f}' for x in d)} |")
    if pairs:
        plot_paired(groups, pairs, out / "paired_diff.png")
        lines += ["", "![paired differences](paired_diff.png)"]
    lines += ["", "![validation loss](val_loss.png)", "", "![loss curves](loss_curves.png)", "",
              "## Compute", "", _compute_note(base_config) + " The model FLOPs counted are the same for every "
              "mask. If only the attended entries were computed, the masks would differ by (validation rows):", "",
              "| mask | attended pairs per row | extra train FLOPs vs causal |", "|---|---|---|"]
    for mask in dict.fromkeys(r["mask"] for r in results):
        lines.append(f"| {mask} | {cost[mask]['pairs_per_row']:.0f} | {cost[mask]['extra_flop_share']:.2%} |")
    lines += ["", "## Attention rank (analysis.rank on 8 validation sequences per run)", "",
              "Per layer, mean over heads, sequences and seeds. rank/n: numerical rank (tolerance S.max * n * "
              "eps_float32) over the matrix size; erank/n: effective rank over n; the prefix block is the input "
              "part [:P, :P]; collapse: ||X - 1 mean(X)^T|| / ||X|| (composite l1/linf norm) after the last layer, "
              "trained model / MLPs removed / skips removed / pure attention.", "",
              "| variant | rank/n (full) | erank/n (full) | erank/n (prefix) | collapse (full/no_mlp/no_skip/pure) |",
              "|---|---|---|---|---|"]
    for n, t in table.items():
        f = lambda xs: " ".join(f"{x:.2f}" for x in xs)  # noqa: E731
        col = "/".join(f"{t['collapse'][p][-1]:.3g}" for p in ("full", "no_mlp", "no_skip", "pure_attn"))
        pre = f(t["prefix"]["erank_frac"]) if "prefix" in t else "-"
        lines.append(f"| {n} | {f(t['full']['rank_frac'])} | {f(t['full']['erank_frac'])} | {pre} | {col} |")
    lines += ["", "![attention rank](attention_rank.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    return out / "report.md"
