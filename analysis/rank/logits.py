"""Attention rank before and after the softmax: the rank of attention LOGITS before the softmax and of the
PROBABILITIES after it, with the causal and the prefix mask applied to the SAME logits, against two baselines
that carry no learned bottleneck: uniform attention (zero logits: the mask's geometry alone) and random logits
Q K^T / sqrt(d) of rank d_head. Su's argument is that a bidirectional softmax of rank-d logits stays low rank
when n >> d while the causal (triangular) one is full rank; the sweep over n / d_head shows where that happens.

    python -m analysis.rank.logits --out DIR [--workdirs RUN1,RUN2 ...] [--n 128] [--heads 4]

Writes DIR/rank_logits.json and DIR/rank_logits.png. With --workdirs, each run's real logits (every layer and
head, on validation windows) are measured the same way and drawn at their n / d_head.
"""

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from analysis import figures
from analysis.figures import grid, save
from analysis.rank import metrics as rm
from analysis.rank.attention import forward_paths
from moe.attention import rope
from plumbing.args import ArgParser
from plumbing.errors import UserError, exit_with, os_error
from rundir import open_run
from rundir.atomic import write_text
from rundir.provenance import provenance
from train.inputs import eval_rows

MASKS = ("causal", "prefix")
D_HEADS = (64, 32, 16, 8)  # with n = 128: n / d_head = 2, 4, 8, 16


def mask_matrix(kind: str, n: int, P: int) -> np.ndarray:
    """bool [n, n]: the causal mask, or the prefix-LM mask (bidirectional inside the first P tokens)."""
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    if kind == "causal":
        return k <= q
    if kind == "prefix":
        return (k <= q) | ((k < P) & (q < P))
    raise ValueError(f"unknown mask {kind!r}; use causal or prefix")


def masked_softmax(logits_HxNxN, mask_NxN) -> np.ndarray:
    """Row softmax over the visible keys, in float32 like the model's attention."""
    x = np.where(mask_NxN, np.asarray(logits_HxNxN, np.float32), -np.inf)
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def random_logits(H: int, n: int, d_head: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """[H, n, n] logits scale * Q K^T / sqrt(d_head) with standard normal Q, K [n, d_head]: rank d_head."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, H, n, d_head))
    return (scale * np.einsum("hqd,hkd->hqk", q, k) / np.sqrt(d_head)).astype(np.float32)


def ranks(A_HxNxN) -> dict:
    """Mean over heads of numerical rank / n (float32 tolerance) and effective rank / n."""
    s = rm.singular_values(A_HxNxN)
    n = A_HxNxN.shape[-1]
    rank = np.sum(s > rm.default_tolerance(s, A_HxNxN.shape)[:, None], -1)
    return {"rank": float(np.mean(rank) / n), "erank": float(np.mean(rm.effective_rank(s=s)) / n)}


def measure(logits_HxNxN, P: int) -> dict:
    """The logits' own rank and, for each mask applied to these same logits, the probabilities' rank (whole
    matrix, and the input block [:P, :P] where the two masks differ)."""
    out = {"logits": ranks(logits_HxNxN)}
    n = logits_HxNxN.shape[-1]
    for m in MASKS:
        p = masked_softmax(logits_HxNxN, mask_matrix(m, n, P))
        out[m] = ranks(p)
        out[f"{m}_input"] = ranks(p[:, :P, :P])
    return out


def sweep(n: int = 128, H: int = 4, d_heads=D_HEADS, seeds=(0, 1), scales=(1.0, 4.0)) -> dict:
    """Random rank-d logits at n / d_head in n / d_heads, two logit scales (1: near-uniform softmax, 4: peaked),
    plus the uniform-attention baseline (zero logits) of each mask."""
    P = n // 2
    out = {"n": n, "P": P, "uniform": measure(np.zeros((1, n, n), np.float32), P), "random": []}
    for d in d_heads:
        for scale in scales:
            ms = [measure(random_logits(H, n, d, seed, scale), P) for seed in seeds]
            out["random"].append({"d_head": d, "n_over_d": n / d, "scale": scale,
                                  **{k: {q: float(np.mean([m[k][q] for m in ms])) for q in ms[0][k]}
                                     for k in ms[0]}})
    return out


def trained_logits(model, rows, max_rows: int = 4) -> tuple[list[np.ndarray], list[int]]:
    """Pre-softmax logits [H, n, n] of every layer of `model` on up to `max_rows` validation rows (real tokens
    only), computed from the trained model's own hidden states (its own mask), and each row's prefix length.
    Supports the plain attention options (no qkv bias, no qk norm)."""
    cfg = model.cfg
    if cfg.qkv_bias or cfg.qk_norm != "none":
        raise UserError("analysis.rank.logits supports models without qkv_bias / qk_norm")
    batch = {k: v[:max_rows] for k, v in rows.items()}
    _, hidden = forward_paths(model, batch)
    G = cfg.n_heads // cfg.n_kv_heads
    out, prefix = [], []
    for layer, block in enumerate(model.blocks):
        x = block.attn_norm(jnp.asarray(hidden["full"][layer]))
        q = jnp.einsum("bld,dhk->blhk", x, block.attn.wq[...])
        k = jnp.einsum("bld,dnk->blnk", x, block.attn.wk[...])
        if cfg.rope:
            pos = jnp.asarray(batch["positions"])
            q, k = rope(q, pos, cfg.rope_theta, cfg.rope_dim), rope(k, pos, cfg.rope_theta, cfg.rope_dim)
        k = jnp.repeat(k, G, axis=2)  # query head h uses kv head h // G
        logits = np.asarray(jnp.einsum("blhk,bshk->bhls", q, k) * cfg.head_dim ** -0.5)
        for b in range(len(logits)):
            n = int(batch["segment_ids"][b].sum())
            out.append(logits[b, :, :n, :n])
            if layer == 0:
                prefix.append(int(batch["prefix_len"][b]))
    return out, prefix


def measure_run(workdir, max_rows: int = 4) -> dict:
    """A trained run's logits, layer by layer, measured under both masks; mean over rows and layers."""
    run = open_run(workdir)
    logits, prefix = trained_logits(run.model, eval_rows(run.config), max_rows)
    rows_per_layer = len(prefix)
    ms = [measure(lg, prefix[i % rows_per_layer]) for i, lg in enumerate(logits)]
    n = float(np.mean([lg.shape[-1] for lg in logits]))
    return {"workdir": str(workdir), "trained_mask": run.model.cfg.mask, "n": n, "d_head": run.model.cfg.head_dim,
            "n_over_d": n / run.model.cfg.head_dim,
            **{k: {q: float(np.mean([m[k][q] for m in ms])) for q in ms[0][k]} for k in ms[0]}}


def plot(result, path):
    fig, axes = grid(3, 3, 4.0, 3.4)
    panels = [("logits", "logits (before softmax)"), ("causal", "probabilities, causal mask"),
              ("prefix_input", "probabilities, prefix mask: input block")]
    for ax, (key, title) in zip(axes, panels):
        for j, scale in enumerate(sorted({r["scale"] for r in result["random"]})):
            rs = [r for r in result["random"] if r["scale"] == scale]
            x = [r["n_over_d"] for r in rs]
            ax.plot(x, [r[key]["rank"] for r in rs], marker="o", color=f"C{j}",
                    label=f"random logits x{scale:g}: rank/n")
            ax.plot(x, [r[key]["erank"] for r in rs], marker="s", linestyle="--", color=f"C{j}",
                    label=f"random logits x{scale:g}: erank/n")
        if key != "logits":
            u = result["uniform"][key]
            ax.axhline(u["rank"], color="0.2", linestyle=":", label="uniform attention: rank/n")
            ax.axhline(u["erank"], color="0.5", linestyle=":", label="uniform attention: erank/n")
        for i, r in enumerate(result.get("trained", [])):
            ax.scatter([r["n_over_d"]], [r[key]["rank"]], marker="*", s=120, color=f"C{3 + i}", zorder=4,
                       label=f"trained {r['trained_mask']}: rank/n")
            ax.scatter([r["n_over_d"]], [r[key]["erank"]], marker="P", s=70, color=f"C{3 + i}", zorder=4,
                       label=f"trained {r['trained_mask']}: erank/n")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("n / d_head")
        ax.set_ylim(0, 1.05)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("rank / n")
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7)
    fig.suptitle(f"Rank of the same logits before / after the softmax under two masks (n = {result['n']}, "
                 f"P = n/2; trained runs at their own n)", fontsize=9)
    save(fig, path, rect=(0, 0.16, 1, 1))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = ArgParser(prog="python -m analysis.rank.logits", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output directory (created; files replaced)")
    p.add_argument("--workdirs", default="", help="comma-separated trained runs to measure too")
    p.add_argument("--n", type=int, default=128, help="sequence length of the random-logit sweep")
    p.add_argument("--heads", type=int, default=4, help="heads per random-logit point")
    try:
        args = p.parse_args(argv)
        if args.n < 16 or args.n % 16 or args.heads < 1:
            raise UserError(f"--n must be a multiple of 16 (>= 16) and --heads >= 1, got {args.n}, {args.heads}")
        d_heads = tuple(d for d in (args.n // 2, args.n // 4, args.n // 8, args.n // 16))
        result = sweep(args.n, args.heads, d_heads)
        result["provenance"] = provenance()
        result["trained"] = [measure_run(w.strip()) for w in args.workdirs.split(",") if w.strip()]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_text(out / "rank_logits.json", json.dumps(result, indent=1))
        trained = ", ".join(r["workdir"] for r in result["trained"])
        with figures.source(f"random logits, n {args.n}" + (f"; trained: {trained}" if trained else "")):
            plot(result, out / "rank_logits.png")
    except UserError as e:
        exit_with(e)
    except OSError as e:
        exit_with(os_error(e))
    print(f"wrote {Path(args.out) / 'rank_logits.png'}")


if __name__ == "__main__":
    main()
