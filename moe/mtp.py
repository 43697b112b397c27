"""Multi-token prediction (DeepSeek-V3 section 2.2): model.mtp_depth sequential modules after the main model.

Key: B batch, L length, D model, V vocab.

Module k = 1 .. mtp_depth, at position i, with h^0 the main model's final-normed hidden state (what its LM head
reads, and what vLLM and SGLang feed DeepSeek-V3's MTP layer):

    h^k_i = Block_k(eh_proj [enorm(Emb(t_{i+k})) ; hnorm(h^{k-1}_i)])      embedding first, as DeepSeek stores eh_proj
    p(t_{i+k+1} | t_0 .. t_{i+k}) = softmax(head(head_norm_k(h^k_i)))

Emb and head are the main model's (shared); Block_k is a full Transformer block (layer n_layers + k - 1: MoE when
that index is, with its own routing bias) under the main model's causal mask. The causal chain holds: position i of
module k has seen t_0 .. t_{i+k} and predicts t_{i+k+1}. In packed rows a target in another document than its
position is not scored; the positions of that later document never attend to it (segment masking), and every
position that attends to a position whose input crossed into the next document predicts a token of that next
document itself, so it is not scored either (tests/test_mtp.py checks both by perturbation).

The loss of depth k is sum(weights_k * ce_k), normalized by the caller like the main loss (by the main loss's
target count, as the paper's 1/T); the training objective adds lambda / D * sum over k (train/step.py).
"""

import jax
import jax.numpy as jnp
from flax import nnx, struct

from moe.config import ModelConfig
from moe.lm_loss import cross_entropy, weighted_cross_entropy
from moe.nn import RMSNorm, matmul_rows, param


class MTPModule(nnx.Module):
    """One depth: its norms, eh_proj, `block` (the Block of layer n_layers + depth - 1, which the model builds) and
    the norm before the shared head."""

    def __init__(self, cfg: ModelConfig, block: nnx.Module, rngs: nnx.Rngs):
        D = cfg.d_model
        self.enorm = RMSNorm(D, cfg.norm_eps)
        self.hnorm = RMSNorm(D, cfg.norm_eps)
        # [2D, D]: rows 0..D-1 read the embedding, D..2D-1 the previous depth ("latent": not sharded by tensor)
        self.eh_proj = param(rngs, (2 * D, D), ("embed", "latent"), cfg.init_std)
        self.block = block
        self.head_norm = RMSNorm(D, cfg.norm_eps)  # DeepSeek's shared_head.norm: the head itself is shared

    def combine(self, emb_BxLxD, h_BxLxD):
        """eh_proj [enorm(emb); hnorm(h)]: the block's input."""
        dt = h_BxLxD.dtype
        x = jnp.concatenate([self.enorm(emb_BxLxD.astype(dt)), self.hnorm(h_BxLxD)], axis=-1)
        return matmul_rows(x, self.eh_proj[...].astype(dt))


def shift_left(x_BxL, k: int, fill):
    """out[:, i] = x[:, i + k]; `fill` for i + k >= L."""
    if k == 0:
        return x_BxL
    pad = jnp.full((x_BxL.shape[0], min(k, x_BxL.shape[1])), fill, x_BxL.dtype)
    return jnp.concatenate([x_BxL[:, k:], pad], axis=1)


def depth_targets(targets_BxL, weights_BxL, segment_ids_BxL, k: int):
    """(input tokens t_{i+k}, targets t_{i+k+1}, weights, same-document mask) of depth k at every position i, from
    the main targets (targets[:, i] = t_{i+1}) and weights; beyond the row's end and across documents the weight
    is 0."""
    tokens = shift_left(targets_BxL, k - 1, 0)
    targets = shift_left(targets_BxL, k, 0)
    if segment_ids_BxL is None:
        same = shift_left(jnp.ones_like(targets_BxL, bool), k, False)
    else:
        # the input t_{i+k} (position i + k) and the target t_{i+k+1} (position i + k + 1, when inside the row; the
        # row's last target is the main weights' to judge) in the document of position i
        seg = segment_ids_BxL
        row_end = jnp.arange(seg.shape[1]) + k + 1 >= seg.shape[1]
        same = ((shift_left(seg, k, -1) == seg) & ((shift_left(seg, k + 1, -1) == seg) | row_end) & (seg > 0))
    weights = shift_left(weights_BxL, k, 0).astype(jnp.float32) * same
    return tokens, targets, weights, same


@struct.dataclass
class MTPOutput:
    """The multi-token prediction modules' outputs (K = model.mtp_depth)."""

    ce: jax.Array  # [K, B, L] per-token cross-entropy of each depth (values only when fused)
    weights: jax.Array  # [K, B, L] its weights: the main weights shifted by k, 0 across documents and past the end
    objective: jax.Array | None  # [K] (fused) sum(weights * ce) per depth, differentiable (moe/lm_loss.py)
    routing: list  # the MoE modules' Routing, in depth order

    def total(self) -> jax.Array:
        """The depths' objective summed and divided by K: what lambda multiplies in the training loss."""
        if self.objective is not None:
            return self.objective.sum() / self.objective.shape[0]
        return (self.ce * self.weights).sum() / self.ce.shape[0]


def mtp_forward(model, h0_BxLxD, targets_BxL, weights_BxL, segment_ids_BxL, valid_BxL, ex, fused: bool,
                call_block) -> MTPOutput:
    """Run every MTP module of `model` on h^0 [B,L,D]. weights: the main loss's per-target weights (ones when
    there are none); valid: the main call's valid tokens; call_block(block, x, valid) -> (x, routing): one block
    under the main model's positions, mask and remat."""
    head, h_BxLxD = model.head(), h0_BxLxD
    ce, weights, objective, routing = [], [], [], []
    for k, module in enumerate(model.mtp, start=1):
        tokens_k, targets_k, w_k, same_k = depth_targets(targets_BxL, weights_BxL, segment_ids_BxL, k)
        x_BxLxD = module.combine(model.embed_tokens(tokens_k, ex), h_BxLxD)
        h_BxLxD, r = call_block(module.block, x_BxLxD, valid_BxL & same_k)
        if r is not None:
            routing.append(r)
        args = (module.head_norm(h_BxLxD), head, targets_k)
        if fused:
            obj, ce_k = weighted_cross_entropy(*args, w_k, ex.loss_chunks, ex.constrain)
            objective.append(obj)
        else:
            ce_k = cross_entropy(*args, ex.loss_chunks, ex.constrain)
        ce.append(ce_k)
        weights.append(w_k)
    return MTPOutput(ce=jnp.stack(ce), weights=jnp.stack(weights),
                     objective=jnp.stack(objective) if fused else None, routing=routing)
