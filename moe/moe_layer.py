"""The DeepSeek-V3 MoE FFN: shared experts plus fine-grained routed experts.

  FFN(u) = sum_i Shared_i(u) + sum_{i chosen} g_i Routed_i(u)      (the residual add is in the block)

The routing bias is a `RoutingBias` variable, not an `nnx.Param`: the optimizer never sees it; the training loop
updates it from the expert load that every forward call returns (aux-loss-free balancing).
"""

import jax.numpy as jnp
from flax import nnx

from moe import experts, router
from moe.layers import MLP, param
from moe.sharding import constrain


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
        # N shared experts are one SwiGLU of width N * F (mathematically the same sum; HF stores it this way).
        self.shared = MLP(D, F * cfg.n_shared_experts, cfg, rngs) if cfg.n_shared_experts else None
        self.cfg = cfg

    def __call__(self, u_BxLxD, valid_BxL):
        """Returns (out_BxLxD, routing) with routing = expert_ids [B,L,K], gates [B,L,K], scores [B,L,E],
        load [E] (valid tokens per expert, every top-k choice counted) and balance_loss (unweighted)."""
        cfg = self.cfg
        B, L, D = u_BxLxD.shape
        u_TxD = u_BxLxD.reshape(B * L, D)
        scores_TxE, ids_TxK, gates_TxK = router.route(
            u_TxD, self.router.value, self.bias.value, top_k=cfg.top_k, n_group=cfg.n_group,
            topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
            normalize=cfg.norm_topk_prob)
        dt = u_BxLxD.dtype
        w = [self.w_gate.value.astype(dt), self.w_up.value.astype(dt), self.w_down.value.astype(dt)]
        routed_TxD = experts.DISPATCH[cfg.dispatch](u_TxD, ids_TxK, gates_TxK, *w)
        out_BxLxD = routed_TxD.reshape(B, L, D)
        if self.shared is not None:
            out_BxLxD = out_BxLxD + self.shared(u_BxLxD)
        out_BxLxD = constrain(out_BxLxD, ("batch", "length", "act_embed"))

        K, E = cfg.top_k, cfg.n_routed_experts
        ids_BxLxK = ids_TxK.reshape(B, L, K)
        scores_BxLxE = scores_TxE.reshape(B, L, E)
        routing = {
            "expert_ids": ids_BxLxK,
            "gates": gates_TxK.reshape(B, L, K),
            "scores": scores_BxLxE,
            "load": router.expert_load(ids_TxK, E, valid_BxL.reshape(-1)),
            "balance_loss": router.sequence_balance_loss(scores_BxLxE, ids_BxLxK, valid_BxL),
        }
        return out_BxLxD, routing
