"""The model's forward pass with each MoE layer's route replaced, at equal compute.

    loss = make_route_loss(graphdef)      # jit(params, bias, batch, mode_M, random_ids_MxTxK, perm_T) -> ce [B,L]
    ce_BxL = loss(params, bias, batch, np.array([1, 0]), random_ids_MxTxK, perm_T)   # layer 0 random, layer 1 chosen

Per MoE layer m, mode_M[m] (MODES) says which K experts each token gets:
  0 chosen    the router's top-k (the model as it is: `route_losses` equals Transformer.token_losses)
  1 random    random_ids_MxTxK[m]: K distinct candidates drawn uniformly per token (`random_ids`)
  2 permuted  the router's sets permuted across the batch's tokens (perm_T): each expert keeps its load, which token
              gets which set is chance (load-matched random routing)
Whatever the experts, the gates are the router's own rule applied to them (moe/router.py `Router.gates`: the
unbiased scores of those experts, renormalized where the router normalizes, x routed_scaling_factor), so a random
route costs the same compute and has gates of the same scale. The router still runs on the (counterfactual)
residual stream, so a later layer's chosen route reacts to an earlier layer's replacement. Group limits (n_group)
are not imposed on random routes. Everything else (attention, shared expert and its gate, dense layers, the head)
is the model's.
"""

import jax
import jax.numpy as jnp
import numpy as np

from moe import router
from moe.dispatch import routed_experts
from moe.lm_loss import cross_entropy
from moe.model import merge_model


def random_ids(n_layers: int, n_tokens: int, n_candidates: int, top_k: int, rng) -> np.ndarray:
    """[M, T, K] int32: per layer and token, K distinct candidates uniformly at random."""
    keys = rng.random((n_layers, n_tokens, n_candidates))
    return np.argsort(keys, axis=-1)[..., :top_k].astype(np.int32)


def valid_permutation(valid_T, rng) -> np.ndarray:
    """[T] int32: a random permutation of the valid positions among themselves; invalid positions map to
    themselves."""
    perm = np.arange(len(valid_T))
    idx = np.flatnonzero(valid_T)
    perm[idx] = idx[rng.permutation(len(idx))]
    return perm.astype(np.int32)


def gates_of(ffn, logits_TxE, scores_TxE, ids_TxK):
    """The gates ffn's router gives the experts ids_TxK (moe.router.route_logits' rule for any set of ids)."""
    cfg, r = ffn.cfg, router.ROUTERS[ffn.routes_by]
    if r.gates == "softmax_logits":
        return router.softmax_gates(logits_TxE, ids_TxK, cfg.routed_scaling_factor)
    norm = {"scores": cfg.norm_topk_prob, "normalized": True, "raw": False}[r.gates]
    return router.gate_weights(scores_TxE, ids_TxK, cfg.routed_scaling_factor, norm, r.norm_floor)


def moe_routed(ffn, u_BxLxD, ex, token_ids_BxL, mode, rand_ids_TxK, perm_T):
    """ffn (moe.ffn.MoE) on u with its route replaced by `mode` (traced int: 0 chosen, 1 random, 2 permuted)."""
    cfg, r = ffn.cfg, router.ROUTERS[ffn.routes_by]
    B, L, D = u_BxLxD.shape
    u_TxD = u_BxLxD.reshape(B * L, D)
    logit_bias_E = ffn.logit_bias[...] if cfg.router_logit_bias else None
    logits_TxE, scores_TxE, ids_TxK, _ = router.route_logits(
        u_TxD, ffn.router[...], ffn.bias[...], top_k=ffn.top_k, n_group=cfg.n_group, topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor, normalize=cfg.norm_topk_prob, router=ffn.routes_by,
        group_score=cfg.router_group_score, logit_bias_E=logit_bias_E, token_ids_T=token_ids_BxL.reshape(-1),
        hash_seed=ffn.hash_seed or 0)
    ids_TxK = jnp.select([mode == 1, mode == 2], [rand_ids_TxK[:, :ffn.top_k], ids_TxK[perm_T]], ids_TxK)
    gates_TxK = gates_of(ffn, logits_TxE, scores_TxE, ids_TxK)
    dt = u_BxLxD.dtype
    w = [ffn.w_gate[...].astype(dt), ffn.w_up[...].astype(dt), ffn.w_down[...].astype(dt)]
    y_TxD, _ = routed_experts(ex, u_TxD, ids_TxK, gates_TxK, *w, group_size=L, gate_input=r.gate_at == "input",
                              zero_experts=cfg.n_zero_experts > 0)
    out_BxLxD = y_TxD.reshape(B, L, D)
    if ffn.shared is not None:
        shared_BxLxD = ffn.shared(u_BxLxD, ex)
        if cfg.shared_expert_gate:
            g_BxL = jax.nn.sigmoid(jnp.einsum("bld,d->bl", u_BxLxD.astype(jnp.float32), ffn.shared_gate[...],
                                              precision=jax.lax.Precision.HIGHEST))
            shared_BxLxD = shared_BxLxD * g_BxL[..., None].astype(dt)
        out_BxLxD = out_BxLxD + shared_BxLxD
    return out_BxLxD


def route_losses(model, batch, mode_M, rand_ids_MxTxK, perm_T, ex):
    """Masked next-token cross-entropy [B, L] of `model` on `batch` (train.inputs' eval batch) with the routes of
    mode_M (module docstring). `ex` resolved."""
    inputs = model.block_inputs(batch["tokens"], positions_BxL=batch["positions"],
                                segment_ids_BxL=batch["segment_ids"], prefix_len_B=batch.get("prefix_len"))
    x_BxLxD = model.embed_tokens(batch["tokens"], ex)
    m = 0
    for block in model.blocks:
        h_BxLxD, _, _ = block.attend(x_BxLxD, inputs, ex)
        x_BxLxD = x_BxLxD + h_BxLxD
        u_BxLxD = block.ffn_norm(x_BxLxD)
        if block.is_moe:
            h_BxLxD = moe_routed(block.ffn, u_BxLxD, ex, inputs.token_ids_BxL, mode_M[m], rand_ids_MxTxK[m], perm_T)
            m += 1
        else:
            h_BxLxD = block.ffn(u_BxLxD, ex)
        x_BxLxD = x_BxLxD + h_BxLxD
    ce_BxL = cross_entropy(model.final_norm(x_BxLxD), model.head(), batch["targets"], ex.loss_chunks)
    return ce_BxL * batch["loss_mask"]


def make_route_loss(graphdef, ex):
    """jit(params, bias, batch, mode_M, rand_ids_MxTxK, perm_T) -> masked ce [B, L]: compiled once per batch
    shape, every mode combination reusing it."""

    @jax.jit
    def loss(params, bias, batch, mode_M, rand_ids_MxTxK, perm_T):
        return route_losses(merge_model(graphdef, params, bias), batch, mode_M, rand_ids_MxTxK, perm_T, ex)

    return loss
