"""The DeepSeek-V3 MoE FFN: shared experts plus fine-grained routed experts.

  FFN(u) = sum_i Shared_i(u) + sum_{i chosen} g_i Routed_i(u)      (the residual add is in the block)

(Qwen2-MoE's shared_expert_gate scales the shared term by sigmoid(u . w) when cfg.shared_expert_gate.)

The routing bias is a `RoutingBias` variable, not an `nnx.Param`: the optimizer never sees it; the training loop
updates it from the expert load that every forward call returns (aux-loss-free balancing).

Which routed-expert algorithm runs is `ex.dispatch` of the Execution the caller passes (moe/execution.py lists
them); the mesh for expert parallelism is `ex.mesh`. Router statistics (load, balance loss) always follow the
router's choice, dropped copies included, and count the bias-steered selection (the experts that actually
run), as DeepSeek-V3 does; `dropped_frac` is the fraction of valid token copies that got no expert.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from moe import expert_parallel, experts, kernels, router
from moe.execution import Execution, check_tokens
from moe.layers import MLP, param


def routed_experts(ex: Execution, x_TxD, ids_TxK, gates_TxK, w_gate, w_up, w_down, group_size: int):
    """(y_TxD, keep_TxK or None when nothing can be dropped) by `ex.dispatch`."""
    if ex.dispatch == "capacity":
        return experts.capacity_with_stats(x_TxD, ids_TxK, gates_TxK, w_gate, w_up, w_down,
                                           capacity_factor=ex.capacity_factor, group_size=group_size)
    grouped = kernels.grouped_swiglu_for(ex.grouped_matmul, ex.platform or None)
    if ex.dispatch in ("expert_parallel", "expert_parallel_dropless"):
        check_tokens(ex, x_TxD.shape[0])
        cf = ex.capacity_factor if ex.dispatch == "expert_parallel" else None
        y_TxD, keep_TxK = expert_parallel.dispatch(x_TxD, ids_TxK, gates_TxK, w_gate, w_up, w_down,
                                                   mesh=ex.mesh, capacity_factor=cf, grouped_matmul=grouped,
                                                   permute=ex.permute_grad)
        return y_TxD, keep_TxK if cf is not None else None
    if ex.dispatch == "reference":
        return experts.reference(x_TxD, ids_TxK, gates_TxK, w_gate, w_up, w_down), None
    return experts.dropless(x_TxD, ids_TxK, gates_TxK, w_gate, w_up, w_down, grouped=grouped,
                            constrain=ex.constrain, permute=ex.permute_grad), None


class RoutingBias(nnx.Variable):
    """Per-expert selection bias b (fp32). Steers top-k selection only; never enters the gate values."""


class MoE(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        D, E, F = cfg.d_model, cfg.n_routed_experts, cfg.moe_d_ff
        self.router = param(rngs, (D, E), ("embed", None), cfg.init_std)
        self.bias = RoutingBias(jnp.zeros((E,), jnp.float32), out_sharding=(None,))
        self.w_gate = param(rngs, (E, D, F), ("expert", "embed", "mlp"), cfg.init_std)
        self.w_up = param(rngs, (E, D, F), ("expert", "embed", "mlp"), cfg.init_std)
        self.w_down = param(rngs, (E, F, D), ("expert", "mlp", "embed"), cfg.out_init_std)
        # N shared experts are one SwiGLU of width N * F (mathematically the same sum; HF stores it this way),
        # or of width shared_d_ff when given (Qwen2-MoE's shared_expert_intermediate_size).
        self.shared = MLP(D, cfg.shared_width, cfg, rngs) if cfg.n_shared_experts else None
        if cfg.shared_expert_gate:  # Qwen2-MoE: one scalar gate per token on the shared output
            self.shared_gate = param(rngs, (D,), ("embed",), cfg.init_std)
        self.cfg = cfg

    def __call__(self, u_BxLxD, valid_BxL, ex: Execution):
        """Returns (out_BxLxD, routing) with routing = expert_ids [B,L,K], gates [B,L,K], scores [B,L,E],
        load [E] (valid tokens per expert, every top-k choice counted), balance_loss (unweighted) and
        dropped_frac (fraction of valid token copies dropped by a capacity bound; 0 for dropless)."""
        cfg = self.cfg
        B, L, D = u_BxLxD.shape
        u_TxD = u_BxLxD.reshape(B * L, D)
        scores_TxE, ids_TxK, gates_TxK = router.route(
            u_TxD, self.router[...], self.bias[...], top_k=cfg.top_k, n_group=cfg.n_group,
            topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
            normalize=cfg.norm_topk_prob, score=cfg.router_score, group_score=cfg.router_group_score)
        # Kept under remat_policy="save_moe" with the experts' rows they index: a router rerun in the backward pass
        # (its bf16 inputs recomputed, maybe fused otherwise) could flip a choice and misalign every saved row.
        ids_TxK, gates_TxK = kernels.saved(ids_TxK), kernels.saved(gates_TxK)
        dt = u_BxLxD.dtype
        w = [self.w_gate[...].astype(dt), self.w_up[...].astype(dt), self.w_down[...].astype(dt)]
        routed_TxD, keep_TxK = routed_experts(ex, u_TxD, ids_TxK, gates_TxK, *w, group_size=L)
        out_BxLxD = routed_TxD.reshape(B, L, D)
        if self.shared is not None:
            shared_BxLxD = self.shared(u_BxLxD, ex)
            if cfg.shared_expert_gate:
                g_BxL = jax.nn.sigmoid(jnp.einsum("bld,d->bl", u_BxLxD.astype(jnp.float32),
                                                  self.shared_gate[...], precision=jax.lax.Precision.HIGHEST))
                shared_BxLxD = shared_BxLxD * g_BxL[..., None].astype(dt)
            out_BxLxD = out_BxLxD + shared_BxLxD
        out_BxLxD = ex.constrain(out_BxLxD, ("batch", "length", "act_embed"))

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
