"""Attention rank and rank collapse of a model on a batch of validation rows (`analyse`), with the measures
of metrics.py.

For each validation sequence (train.inputs.eval_rows, so prefix-task rows are one document each) and every
layer and head, on the square block of REAL tokens (padding, segment id 0, is dropped):
  rank       numerical rank of the attention probabilities (tolerance S.max * n * eps_float32, NumPy's default;
             also `rank_rel1e-6` with tolerance 1e-6 * S.max), and the same for the prefix block [:P, :P]
  erank      effective rank exp(H(s / sum s))
  logdet     log|det| where the matrix is (block-)triangular: causal heads, mixed heads; NaN for prefix-LM heads
Per layer, the rank-collapse measure ||X - 1 mean(X)^T|| / ||X|| (composite l1/linf norm, Dong et al. 2021;
Frobenius too) of the block outputs, for four paths through the SAME weights:
  full       the trained model;                  no_mlp     x + attn(norm(x)) (MLPs removed)
  no_skip    ffn(norm(attn(norm(x)))) (no skips); pure_attn  attn(norm(x)) (skips and MLPs removed)
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from analysis.rank import metrics as rm
from moe import Execution

PATHS = ("full", "no_mlp", "no_skip", "pure_attn")
EXECUTION = Execution()  # fp32, dropless; Block.attend without causal=True runs the einsum attention


def forward_paths(model, batch):
    """Attention probabilities [B,H,L,L] per layer (trained model) and block outputs [B,L,D] per path and layer
    (NumPy). Index 0 of each path's list is the embedding. Compiled once per model config."""
    graphdef, state = nnx.split(model)
    keys = ("tokens", "segment_ids", "positions", "prefix_len")
    arrays = {k: jnp.asarray(batch[k]) for k in keys if k in batch}
    fn = _compiled.get(graphdef)
    if fn is None:
        fn = _compiled[graphdef] = jax.jit(lambda st, b: _paths(nnx.merge(graphdef, st), b))
    probs, hidden = jax.device_get(fn(state, arrays))
    return [np.asarray(p) for p in probs], {p: [np.asarray(x) for x in xs] for p, xs in hidden.items()}


_compiled = {}


def _paths(model, batch):
    """The full path is the model's own inspection path (attention probabilities and residual stream); the ablated paths wire the model's own pieces (block_inputs, embed_tokens, Block.attend,
    Block.feed_forward) with the residual adds and/or the FFN switched off."""
    kw = dict(positions_BxL=batch["positions"], segment_ids_BxL=batch["segment_ids"],
              prefix_len_B=batch.get("prefix_len"))
    _, aux = model.inspect(batch["tokens"], execution=EXECUTION, attention=True, hidden=True, **kw)
    inputs = model.block_inputs(batch["tokens"], **kw)
    x0 = model.embed_tokens(batch["tokens"], EXECUTION)
    hidden = {"full": aux.hidden, **{p: [x0] for p in PATHS if p != "full"}}
    xs = dict.fromkeys(PATHS, x0)
    for block in model.blocks:
        for p in PATHS[1:]:
            a = block.attend(xs[p], inputs, EXECUTION)[0]
            if p == "no_mlp":
                xs[p] = xs[p] + a
            elif p == "no_skip":
                xs[p] = block.feed_forward(a, inputs.valid_BxL, EXECUTION)[0]
            else:
                xs[p] = a
            hidden[p].append(xs[p])
    return aux.attention, hidden


def documents(segment_ids_BxL, prefix_B=None) -> list[tuple[int, int, int, int]]:
    """(row, start, length, prefix length) of every document: packed rows hold several (segment ids 1, 2, ...;
    0 is padding), and each document's attention is its own square block. The prefix applies to one-document
    rows (the prefix task)."""
    docs = []
    for b, seg in enumerate(np.asarray(segment_ids_BxL)):
        for s in np.unique(seg[seg > 0]):
            idx = np.flatnonzero(seg == s)
            P = int(prefix_B[b]) if prefix_B is not None else 0
            docs.append((b, int(idx[0]), len(idx), P))
    return docs


def attention_stats(probs, docs):
    """Per layer, head and document: rank measures of the document's block and of its prefix block."""
    n_layers, H = len(probs), probs[0].shape[1]
    keys = ("rank", "rank_rel1e-6", "erank", "logdet", "n")
    out = {blk: {k: np.full((n_layers, H, len(docs)), np.nan) for k in keys} for blk in ("full", "prefix")}
    for i, (b, start, n, P) in enumerate(docs):
        for layer, p_BxHxLxL in enumerate(probs):
            doc = p_BxHxLxL[b, :, start:start + n, start:start + n]
            blocks = {"full": doc}
            if P > 1:
                blocks["prefix"] = doc[:, :P, :P]
            for blk, A in blocks.items():
                s = rm.singular_values(A)
                o = out[blk]
                o["rank"][layer, :, i] = np.sum(s > rm.default_tolerance(s, A.shape)[:, None], -1)
                o["rank_rel1e-6"][layer, :, i] = np.sum(s > 1e-6 * s.max(-1, keepdims=True), -1)
                o["erank"][layer, :, i] = rm.effective_rank(s=s)
                o["logdet"][layer, :, i] = (rm.block_triangular_logdet(A, P) if blk == "full"
                                            else rm.triangular_logdet(A))
                o["n"][layer, :, i] = A.shape[-1]
    return out


def summarize_attention(stats):
    """Mean over sequences, per layer and head: rank/n, erank/n, mean log diag (logdet/n), full-rank fraction."""
    summary = {}
    for blk, o in stats.items():
        n = o["n"]
        if np.all(np.isnan(n)):
            continue
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN logdet (prefix-LM heads): NaN is the answer
            summary[blk] = {
                "rank_frac": np.nanmean(o["rank"] / n, -1).tolist(),
                "rank_rel1e-6_frac": np.nanmean(o["rank_rel1e-6"] / n, -1).tolist(),
                "erank_frac": np.nanmean(o["erank"] / n, -1).tolist(),
                "full_rank_share": np.nanmean(np.where(np.isnan(n), np.nan, o["rank"] == n), -1).tolist(),
                "logdet_per_token": np.nanmean(o["logdet"] / n, -1).tolist(),
                "mean_n": float(np.nanmean(n)),
            }
    return summary


def collapse_stats(hidden, docs):
    """Per path and layer (0 = embedding): mean over documents of the residual ratio, both norms."""
    out = {}
    for p, xs in hidden.items():
        out[p] = {norm: [float(np.mean([rm.residual_ratio(x[b, start:start + n], norm) for b, start, n, _ in docs]))
                         for x in xs] for norm in ("l1linf", "fro")}
    return out


def analyse(model, batch):
    """The whole analysis of one batch of validation rows -> JSON-ready dict."""
    probs, hidden = forward_paths(model, batch)
    prefix = batch.get("prefix_len")
    docs = documents(batch["segment_ids"], None if prefix is None else np.asarray(prefix))
    if not docs:
        raise ValueError("no real tokens in the rows to analyse")
    stats = attention_stats(probs, docs)
    return {
        "mask": model.cfg.mask,
        "rope": bool(model.cfg.rope),
        "n_layers": model.cfg.n_layers,
        "n_heads": model.cfg.n_heads,
        "head_dim": model.cfg.head_dim,
        "sequences": int(len(batch["segment_ids"])),
        "documents": len(docs),
        "tolerance": "rank: S.max * n * eps(float32) (numpy matrix_rank default); rank_rel1e-6: 1e-6 * S.max",
        "collapse_norm": "l1linf: sqrt(||R||_1 ||R||_inf) (Dong et al. 2021); fro: Frobenius",
        "attention": summarize_attention(stats),
        "collapse": collapse_stats(hidden, docs),
        "spectrum": mean_spectra(probs, docs),
    }


def mean_spectra(probs, docs, points: int = 50):
    """Per layer and head: singular values / S.max on a common grid of index/n (mean over documents)."""
    grid = np.linspace(0, 1, points)
    out = []
    for p in probs:
        curves = []
        for b, start, n, _ in docs:
            s = rm.singular_values(p[b, :, start:start + n, start:start + n])
            s = s / s[:, :1]
            curves.append([np.interp(grid, np.arange(n) / max(n - 1, 1), s_h) for s_h in s])
        out.append(np.mean(curves, 0).tolist())
    return out


def select_rows(rows, sequences: int):
    """Up to `sequences` rows spread evenly over the validation set (so every domain is represented)."""
    n = len(rows["tokens"])
    idx = np.unique(np.linspace(0, n - 1, min(sequences, n)).round().astype(int))
    return {k: v[idx] for k, v in rows.items()}
