"""The study's input->output task for the encoder-decoder (experiments/encdec/model.py), scored on exactly the
decoder-only model's targets.

A prefix row (packing.prefix_rows) has n real tokens, the first p of them the input, and scores targets
tokens[p .. n-1] at positions p-1 .. n-2, each from tokens[0 .. i]. Its encoder-decoder form:
  source   tokens[0 : p]            (the input, padded to S)
  decoder  tokens[p-1 : n-1]        (starts with the last input token, as a BOS that carries no new information)
  targets  targets[p-1 : n-1]       (= tokens[p : n]: the same targets, in the same order)
so decoder position j predicts tokens[p+j] from the whole input and tokens[p .. p+j-1]: the information a
prefix-LM has at position p-1+j. Row losses and validation losses therefore compare token for token.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from moe.model import merge_model
from train.data.tokenizer import PAD_ID

# Output-position buckets [e_i, e_i+1) (the last open): position 0 is the first output token, the one that
# depends most on the end of the input.
POSITION_EDGES = (0, 1, 2, 4, 8, 16, 32, 64)
ROW_KEYS = ("src", "src_segment_ids", "tokens", "targets", "segment_ids", "loss_mask", "domains")


def lengths(seq_len: int, prefix_frac: float) -> tuple[int, int]:
    """(S, T): the source and decoder lengths that hold every prefix row of seq_len (prefix_rows takes
    p = round(frac * n), clipped to [1, n-1], for n <= seq_len + 1 real tokens)."""
    n = seq_len + 1
    S = min(seq_len, math.ceil(prefix_frac * n + 0.5))
    T = min(seq_len, math.ceil((1 - prefix_frac) * n + 0.5))
    return S, T


def encdec_rows(rows: dict, S: int, T: int) -> dict:
    """Prefix rows (tokens, targets, segment_ids, loss_mask, prefix_len, domains; [B, L]) in encoder-decoder
    form (ROW_KEYS; source [B, S], decoder [B, T]). Only the scored targets are kept: loss_mask decides, so a row
    that trains on every token (train.prefix_loss) still scores the output here."""
    B = len(rows["tokens"])
    # n real tokens per row: positions with a real target are 0 .. n-2 (a row cut at seq_len holds its last
    # token only as the last target)
    end_B = ((rows["segment_ids"] > 0) & (rows["targets"] != PAD_ID)).sum(-1).astype(np.int64)
    n_B = end_B + 1
    p_B = rows["prefix_len"].astype(np.int64)
    if (p_B > S).any() or (n_B - p_B > T).any():
        raise ValueError(f"a row does not fit S={S}, T={T} (max input {p_B.max()}, max output {(n_B - p_B).max()})")
    out = {"src": np.full((B, S), PAD_ID, np.int32), "src_segment_ids": np.zeros((B, S), np.int32),
           "tokens": np.full((B, T), PAD_ID, np.int32), "targets": np.full((B, T), PAD_ID, np.int32),
           "segment_ids": np.zeros((B, T), np.int32), "loss_mask": np.zeros((B, T), np.float32),
           "domains": np.zeros((B, T), np.int32)}
    for b in range(B):
        p, n = int(p_B[b]), int(n_B[b])
        if p < 1 or n - p < 1:  # an empty document (prefix_rows gives it no input and no scored target)
            continue
        out["src"][b, :p] = rows["tokens"][b, :p]
        out["src_segment_ids"][b, :p] = 1
        m = n - p  # decoder positions: rows' positions p-1 .. n-2
        out["tokens"][b, :m] = rows["tokens"][b, p - 1:n - 1]
        out["targets"][b, :m] = rows["targets"][b, p - 1:n - 1]
        out["segment_ids"][b, :m] = 1
        out["loss_mask"][b, :m] = rows["loss_mask"][b, p - 1:n - 1]
        out["domains"][b, :m] = rows["domains"][b, p - 1:n - 1]
    return out


def forward(graphdef, params, bias, batch, ex):
    """train.step's forward contract for the encoder-decoder: (masked ce [B, T], aux)."""
    model = merge_model(graphdef, params, bias)
    logits, aux = model(batch["src"], batch["tokens"], src_segment_ids_BxS=batch["src_segment_ids"],
                        tgt_segment_ids_BxT=batch["segment_ids"], execution=ex)
    ce_BxT = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return ce_BxT * batch["loss_mask"], aux


def row_loss_fn(forward_fn, graphdef, ex):
    """jitted (state, batch) -> per-row mean scored cross-entropy [B] (nan for a row with no scored token)."""

    @jax.jit
    def losses(state, batch):
        ce_BxT, _ = forward_fn(graphdef, state["params"], state["bias"], batch, ex)
        n_B = batch["loss_mask"].sum(-1)
        return jnp.where(n_B > 0, ce_BxT.sum(-1) / jnp.maximum(n_B, 1), jnp.nan)

    return losses


def output_position_loss_fn(forward_fn, graphdef, ex, edges=POSITION_EDGES):
    """jitted (state, batch) -> [B, 2, len(edges)]: per row and output-position bucket, the summed scored
    cross-entropy and the number of scored tokens. A token's output position is its rank among the row's scored
    tokens (0 = the first output token), so a prefix row and its encoder-decoder form (encdec_rows) put every
    target in the same bucket."""
    edges_K = jnp.asarray(edges)

    @jax.jit
    def losses(state, batch):
        ce_BxT, _ = forward_fn(graphdef, state["params"], state["bias"], batch, ex)
        scored_BxT = batch["loss_mask"] > 0
        rank_BxT = jnp.cumsum(scored_BxT, axis=-1) - 1
        bucket_BxTxK = jax.nn.one_hot(jnp.searchsorted(edges_K, rank_BxT, side="right") - 1, len(edges))
        bucket_BxTxK = bucket_BxTxK * scored_BxT[..., None]
        return jnp.stack([jnp.einsum("bt,btk->bk", ce_BxT, bucket_BxTxK), bucket_BxTxK.sum(1)], axis=1)

    return losses


def by_output_position(sums_Bx2xK, edges=POSITION_EDGES) -> dict:
    """The per-row bucket sums of output_position_loss_fn, totalled: {edges, loss (None where no token), tokens}."""
    ce_K, n_K = np.asarray(sums_Bx2xK, np.float64).sum(0)
    return {"edges": list(edges), "loss": [float(c / n) if n else None for c, n in zip(ce_K, n_K)],
            "tokens": [int(n) for n in n_K]}
