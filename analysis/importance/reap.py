"""Per expert, on the tokens routed to it: REAP's importance (Lasby et al. 2025, router-weighted expert
activation) S_e = mean over tokens t routed to e of g_{t,e} ||f_e(u_t)||_2, and the largest activation of its
output max_t max_d |f_e(u_t)_d| (super experts, Su et al. 2025, are the few experts whose down projection emits
rare extreme outliers); per block, the residual stream's largest activation against its median magnitude (massive
activations, Sun et al. 2024).

    s = expert_stats(run.model, batches)        # batches: the validation rows (analysis.ablate.ablation.eval_batches)
    s["reap_LxE"], s["share_LxE"], s["max_act_LxE"], s["resid_max_Y"], s["resid_median_Y"]

f_e(u) is expert e's SwiGLU output before its gate, computed for every expert and token in one dense pass (the
model's own dispatch computes the layer's output; O(E) memory per token, for analysis only). A router that gates
the input (gate_at "input") scales u before the expert: f_e(u) here is still the ungated output. Tokens: those
with loss_mask > 0 (the scored tokens of the validation loss, so the same tokens as the ablation).

Shape key: T tokens of a batch, E experts, K top-k, F expert width, L MoE layers, Y blocks.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe import Execution


def expert_outputs(ffn, u_TxD):
    """(||f_e(u_t)||_2 [T, E], max_d |f_e(u_t)_d| [T, E]) of every routed expert on every token, fp32."""
    u = u_TxD.astype(jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    g_TxExF = jnp.einsum("td,edf->tef", u, ffn.w_gate[...].astype(jnp.float32), precision=hp)
    up_TxExF = jnp.einsum("td,edf->tef", u, ffn.w_up[...].astype(jnp.float32), precision=hp)
    y_TxExD = jnp.einsum("tef,efd->ted", jax.nn.silu(g_TxExF) * up_TxExF, ffn.w_down[...].astype(jnp.float32),
                         precision=hp)
    return jnp.sqrt((y_TxExD ** 2).sum(-1)), jnp.abs(y_TxExD).max(-1)


def make_stats_fn(graphdef, ex):
    """jit(state, batch) -> (per MoE layer (ids [T,K], gates [T,K], norm [T,E], max_act [T,E]), per block
    (max |x|, median |x|) of the residual stream after it)."""

    @jax.jit
    def stats(state, batch):
        model = nnx.merge(graphdef, state)
        inputs = model.block_inputs(batch["tokens"], positions_BxL=batch["positions"],
                                    segment_ids_BxL=batch["segment_ids"], prefix_len_B=batch.get("prefix_len"))
        x_BxLxD = model.embed_tokens(batch["tokens"], ex)
        B, L, D = x_BxLxD.shape
        layers, resid = [], []
        for block in model.blocks:
            h_BxLxD, _, _ = block.attend(x_BxLxD, inputs, ex)
            x_BxLxD = x_BxLxD + h_BxLxD
            u_BxLxD = block.ffn_norm(x_BxLxD)
            if block.is_moe:
                y_BxLxD, routing = block.ffn(u_BxLxD, inputs.valid_BxL, ex, inputs.token_ids_BxL)
                K = routing.expert_ids.shape[-1]
                norm_TxE, amax_TxE = expert_outputs(block.ffn, u_BxLxD.reshape(B * L, D))
                layers.append((routing.expert_ids.reshape(B * L, K), routing.gates.reshape(B * L, K), norm_TxE,
                               amax_TxE))
            else:
                y_BxLxD = block.ffn(u_BxLxD, ex)
            x_BxLxD = x_BxLxD + y_BxLxD
            a = jnp.abs(x_BxLxD.astype(jnp.float32))
            keep = batch["loss_mask"][..., None] > 0
            resid.append((jnp.where(keep, a, 0.0).max(), jnp.nanmedian(jnp.where(keep, a, jnp.nan))))
        return layers, resid

    return stats


def expert_stats(model, batches, ex=None) -> dict:
    """REAP score, routing share and largest output activation per MoE layer and expert, over the scored tokens of
    `batches`, and the residual stream's max / median magnitude per block (module docstring). An expert no scored
    token is routed to has NaN REAP and max activation."""
    cfg = model.cfg
    ex = (ex or Execution()).resolved()
    graphdef, state = nnx.split(model)
    fn = make_stats_fn(graphdef, ex)
    n_moe, E = len(cfg.moe_layer_ids), cfg.n_routed_experts
    gnorm, count = np.zeros((n_moe, E)), np.zeros((n_moe, E))
    max_act = np.full((n_moe, E), -np.inf)
    resid_max, resid_med, n_tokens = np.zeros(cfg.n_layers), [], 0
    for b in batches:
        batch = {k: b[k] for k in ("tokens", "loss_mask", "positions", "segment_ids", "prefix_len") if k in b}
        layers, resid = jax.device_get(fn(state, batch))
        valid_T = (b["loss_mask"] > 0).reshape(-1)
        n_tokens += int(valid_T.sum())
        for m, (ids, gates, norm, amax) in enumerate(layers):
            ids, gates = np.asarray(ids)[valid_T], np.asarray(gates, np.float64)[valid_T]
            norm, amax = np.asarray(norm, np.float64)[valid_T], np.asarray(amax, np.float64)[valid_T]
            rows = np.arange(len(ids))[:, None]
            routed = ids < E  # zero experts have no output
            e_k, t_k = ids[routed], np.broadcast_to(rows, ids.shape)[routed]
            np.add.at(gnorm[m], e_k, gates[routed] * norm[t_k, e_k])
            np.add.at(count[m], e_k, 1.0)
            np.maximum.at(max_act[m], e_k, amax[t_k, e_k])
        resid_max = np.maximum(resid_max, [float(mx) for mx, _ in resid])
        if valid_T.any():
            resid_med.append([float(md) for _, md in resid])
    with np.errstate(invalid="ignore", divide="ignore"):
        reap = np.where(count > 0, gnorm / np.maximum(count, 1), np.nan)
    return {"layer_ids": list(cfg.moe_layer_ids), "n_tokens": n_tokens, "reap_LxE": reap,
            "share_LxE": count / max(n_tokens, 1), "max_act_LxE": np.where(count > 0, max_act, np.nan),
            "resid_max_Y": resid_max, "resid_median_Y": np.median(np.asarray(resid_med), 0) if resid_med
            else np.full(cfg.n_layers, np.nan)}
