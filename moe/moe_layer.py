"""The DeepSeek-V3 MoE FFN: shared experts plus fine-grained routed experts.

  FFN(u) = sum_i Shared_i(u) + sum_{i chosen} g_i Routed_i(u)      (the residual add is in the block)

(Qwen2-MoE's shared_expert_gate scales the shared term by sigmoid(u . w) when cfg.shared_expert_gate.)

The routing bias is a `RoutingBias` variable, not an `nnx.Param`: the optimizer never sees it; the training loop
updates it from the expert load that every forward call returns (aux-loss-free balancing).

Which routed-expert path runs (`cfg.dispatch`; see `routed_experts`):
  dropless         no active mesh, or mesh.expert == 1: sort + grouped matmul (cfg.grouped_matmul), auto-
                   sharded by XLA.
                   active mesh with expert > 1: expert-parallel (shard_map + all_to_all) with a bound that cannot
                   drop, so the result is the same as without the mesh (buffers: mesh.expert x the token copies).
  expert_parallel  shard_map + all_to_all with capacity_factor-sized buffers (drops counted); without a mesh
                   the same math on one shard.
  capacity         GShard one-hot einsums, one capacity group per sequence; auto-sharded by XLA.
  reference        the loop over experts (tests).
If the tokens do not divide over data*fsdp*expert (e.g. one-token decoding), the expert-parallel cases fall back
to the auto-sharded dropless path. Router statistics (load, balance loss) always follow the router's choice,
dropped copies included; `dropped_frac` is the fraction of valid token copies that got no expert.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from moe import expert_parallel, experts, router
from moe.layers import MLP, param
from moe.sharding import active_mesh, constrain


def routed_experts(cfg, x_TxD, ids_TxK, gates_TxK, w_gate, w_up, w_down, group_size: int):
    """(y_TxD, keep_TxK or None when nothing can be dropped) by `cfg.dispatch` and the active mesh."""
    mesh = active_mesh()
    T = x_TxD.shape[0]
    ep_mesh = mesh if mesh is not None and mesh.shape.get("expert", 1) > 1 else None
    fits = ep_mesh is not None and T % expert_parallel.token_shards(ep_mesh) == 0
    if cfg.dispatch == "capacity":
        return experts.capacity_with_stats(x_TxD, ids_TxK, gates_TxK, w_gate, w_up, w_down,
                                           capacity_factor=cfg.capacity_factor, group_size=group_size)
    if cfg.dispatch == "expert_parallel" and (fits or ep_mesh is None):
        return expert_parallel.dispatch(x_TxD, ids_TxK, gates_TxK, w_gate, w_up, w_down, mesh=ep_mesh,
                                        capacity_factor=cfg.capacity_factor, grouped_matmul=cfg.grouped_matmul)
    if cfg.dispatch == "dropless" and fits:
        y_TxD, _ = expert_parallel.dispatch(x_TxD, ids_TxK, gates_TxK, w_gate, w_up, w_down, mesh=ep_mesh,
                                            grouped_matmul=cfg.grouped_matmul)
        return y_TxD, None
    if cfg.dispatch == "reference":
        return experts.reference(x_TxD, ids_TxK, gates_TxK, w_gate, w_up, w_down), None
    return experts.dropless(x_TxD, ids_TxK, gates_TxK, w_gate, w_up, w_down, grouped=cfg.grouped_matmul), None


class RoutingBias(nnx.Variable):
    """Per-expert selection bias b (fp32). Steers top-k selection only; never enters the gate values."""


class MoE(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        D, E, F = cfg.d_model, cfg.n_routed_experts, cfg.moe_d_ff
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.router = param(rngs, (D, E), ("embed", None), cfg.init_std)
        self.bias = RoutingBias(jnp.zeros((E,), jnp.float32), out_sharding=(None,))
        self.w_gate = param(rngs, (E, D, F), ("expert", "embed", "mlp"), cfg.init_std)
        self.w_up = param(rngs, (E, D, F), ("expert", "embed", "mlp"), cfg.init_std)
        self.w_down = param(rngs, (E, F, D), ("expert", "mlp", "embed"), out_std)
        # N shared experts are one SwiGLU of width N * F (mathematically the same sum; HF stores it this way),
        # or of width shared_d_ff when given (Qwen2-MoE's shared_expert_intermediate_size).
        self.shared = MLP(D, cfg.shared_width, cfg, rngs) if cfg.n_shared_experts else None
        if cfg.shared_expert_gate:  # Qwen2-MoE: one scalar gate per token on the shared output
            self.shared_gate = param(rngs, (D,), ("embed",), cfg.init_std)
        self.cfg = cfg

    def __call__(self, u_BxLxD, valid_BxL):
        """Returns (out_BxLxD, routing) with routing = expert_ids [B,L,K], gates [B,L,K], scores [B,L,E],
        load [E] (valid tokens per expert, every top-k choice counted), balance_loss (unweighted) and
        dropped_frac (fraction of valid token copies dropped by a capacity bound; 0 for dropless)."""
        cfg = self.cfg
        B, L, D = u_BxLxD.shape
        u_TxD = u_BxLxD.reshape(B * L, D)
        scores_TxE, ids_TxK, gates_TxK = router.route(
            u_TxD, self.router.value, self.bias.value, top_k=cfg.top_k, n_group=cfg.n_group,
            topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
            normalize=cfg.norm_topk_prob, score=cfg.router_score)
        dt = u_BxLxD.dtype
        w = [self.w_gate.value.astype(dt), self.w_up.value.astype(dt), self.w_down.value.astype(dt)]
        routed_TxD, keep_TxK = routed_experts(cfg, u_TxD, ids_TxK, gates_TxK, *w, group_size=L)
        out_BxLxD = routed_TxD.reshape(B, L, D)
        if self.shared is not None:
            shared_BxLxD = self.shared(u_BxLxD)
            if cfg.shared_expert_gate:
                g_BxL = jax.nn.sigmoid(jnp.einsum("bld,d->bl", u_BxLxD.astype(jnp.float32),
                                                  self.shared_gate.value, precision=jax.lax.Precision.HIGHEST))
                shared_BxLxD = shared_BxLxD * g_BxL[..., None].astype(dt)
            out_BxLxD = out_BxLxD + shared_BxLxD
        out_BxLxD = constrain(out_BxLxD, ("batch", "length", "act_embed"))

        K, E = cfg.top_k, cfg.n_routed_experts
        valid_T = valid_BxL.reshape(-1).astype(jnp.float32)
        if keep_TxK is None:
            dropped_frac = jnp.float32(0)
        else:
            n_dropped = ((1.0 - keep_TxK.astype(jnp.float32)) * valid_T[:, None]).sum()
            dropped_frac = n_dropped / jnp.maximum(valid_T.sum() * K, 1.0)
        ids_BxLxK = ids_TxK.reshape(B, L, K)
        scores_BxLxE = scores_TxE.reshape(B, L, E)
        routing = {
            "expert_ids": ids_BxLxK,
            "gates": gates_TxK.reshape(B, L, K),
            "scores": scores_BxLxE,
            "load": router.expert_load(ids_TxK, E, valid_BxL.reshape(-1)),
            "balance_loss": router.sequence_balance_loss(scores_BxLxE, ids_BxLxK, valid_BxL),
            "dropped_frac": dropped_frac,
        }
        return out_BxLxD, routing
