"""Plots of an analysis.rank result (matplotlib, Agg): one PNG each, written into a directory."""

import numpy as np

from analysis.figures import grid, plt, save

PATH_STYLE = {"full": ("trained model", "C0", "-"), "no_mlp": ("MLPs removed", "C1", "--"),
              "no_skip": ("skips removed", "C2", "-."), "pure_attn": ("pure attention", "C3", ":")}


def plot_heads(result, path):
    """Per layer: numerical rank / n and effective rank / n per head, real-token block and prefix block."""
    att = result["attention"]
    L, H = result["n_layers"], result["n_heads"]
    fig, axes = grid(L, 4, 3.2, 2.8)
    bars = [(blk, key) for blk in att for key in ("rank_frac", "erank_frac")]
    width = 0.8 / len(bars)
    labels = {"rank_frac": "rank/n", "erank_frac": "eff. rank/n"}
    for layer, ax in zip(range(L), axes):
        for i, (blk, key) in enumerate(bars):
            ax.bar(np.arange(H) + (i - (len(bars) - 1) / 2) * width, att[blk][key][layer], width,
                   label=f"{blk} block {labels[key]}", color=f"C{i}")
        ax.set_title(f"Layer {layer}", fontsize=10)
        ax.set_xticks(np.arange(H))
        ax.set_xlabel("head", fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.grid(axis="y", alpha=0.3)
    handles, labels_ = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels_, loc="lower center", ncol=len(bars), fontsize=8, frameon=False)
    fig.suptitle(f"Attention rank, mask={result['mask']}, rope={result['rope']} "
                 f"({result['sequences']} val. sequences; tol = S.max*n*eps32)", fontsize=10)
    return save(fig, path, rect=(0, 0.08, 1, 1))


def plot_spectrum(result, path):
    """Per layer: mean normalized singular values s_i / s_1 of each head against i / n (log scale)."""
    spec = result["spectrum"]
    L = len(spec)
    fig, axes = grid(L, 4, 3.2, 2.8)
    frac_i = np.linspace(0, 1, len(spec[0][0]))
    for layer, ax in zip(range(L), axes):
        for h, s in enumerate(spec[layer]):
            ax.semilogy(frac_i, np.maximum(s, 1e-12), label=f"head {h}")
        ax.set_title(f"Layer {layer}", fontsize=10)
        ax.set_xlabel("i / n", fontsize=8)
        ax.set_ylabel("s_i / s_1", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Singular values of attention (real-token block), mask={result['mask']}", fontsize=10)
    return save(fig, path)


def plot_collapse(result, path):
    """Residual ratio ||X - 1 mean^T|| / ||X|| per layer, for the four paths, both norms."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, norm, title in zip(axes, ("l1linf", "fro"), ("composite l1/linf norm", "Frobenius norm")):
        for p, c in result["collapse"].items():
            label, color, ls = PATH_STYLE[p]
            ax.semilogy(np.arange(len(c[norm])), c[norm], ls, color=color, marker="o", ms=3, label=label)
        ax.set_xticks(np.arange(len(c[norm])))
        ax.set_xticklabels(["emb"] + [str(i) for i in range(len(c[norm]) - 1)])
        ax.set_xlabel("after layer")
        ax.set_ylabel("||X - 1 mean(X)^T|| / ||X||")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Rank collapse of token representations, mask={result['mask']}", fontsize=10)
    return save(fig, path)


def plot_all(result, out):
    return [plot_heads(result, out / "rank_heads.png"), plot_spectrum(result, out / "rank_spectrum.png"),
            plot_collapse(result, out / "rank_collapse.png")]
