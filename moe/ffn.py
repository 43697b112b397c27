"""The feed-forward side of a block: the dense SwiGLU, and the DeepSeek-V3 MoE (shared plus fine-grained routed
experts).

  MLP(x)  = down(silu(x W_gate) * x W_up)
  MoE(u)  = sum_i Shared_i(u) + sum_{i chosen} g_i Routed_i(u)      (the residual add is in the block)

(Qwen2-MoE's and Qwen3-Next's shared_expert_gate scales the shared term by sigmoid(u . w) when
cfg.shared_expert_gate; a router with gate_at "input" (Llama 4) runs Routed_i(g_i u) instead; a chosen zero expert,
cfg.n_zero_experts, contributes g_i u.)

The router (moe/router.py: `model.router`, or "hash" in the first model.n_hash_layers MoE layers, with this layer's
K from model.layer_top_k) picks the experts and their gates; which routed-expert algorithm then runs is
`ex.dispatch` of the Execution the caller passes (moe/dispatch/). The routing bias is a `RoutingBias`
variable, not an `nnx.Param`: the optimizer never sees it; the training loop updates it from the expert load that
every forward call returns (aux-loss-free balancing). Router statistics (load, balance loss) always follow the
router's choice, dropped copies included, and count the bias-steered selection (the experts that actually run), as
DeepSeek-V3 does; `dropped_frac` is the fraction of valid token copies that got no expert.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from moe import router
from moe.dispatch import experts, kernels, routed_experts
from moe.dispatch.execution import Execution
from moe.nn import param
from moe.router import Routing


class MLP(nnx.Module):
    """SwiGLU: down(silu(x W_gate) * x W_up)."""

    def __init__(self, d_model: int, d_ff: int, cfg, rngs: nnx.Rngs):
        self.w_gate = param(rngs, (d_model, d_ff), ("embed", "mlp"), cfg.init_std)
        self.w_up = param(rngs, (d_model, d_ff), ("embed", "mlp"), cfg.init_std)
        self.w_down = param(rngs, (d_ff, d_model), ("mlp", "embed"), cfg.out_init_std)

    def __call__(self, x_BxLxD, ex: Execution):
        dt = x_BxLxD.dtype
        B, L, D = x_BxLxD.shape
        # 2-D matmuls over all B*L rows: XLA:CPU runs the backward of the 3-D form (weight gradients contracted
        # over b and l) ~3x slower; the same math on every backend.
        x_NxD = x_BxLxD.reshape(B * L, D)
        h_NxF = jax.nn.silu(x_NxD @ self.w_gate[...].astype(dt)) * (x_NxD @ self.w_up[...].astype(dt))
        h_BxLxF = ex.constrain(h_NxF.reshape(B, L, -1), ("batch", "length", "act_mlp"))
        return (h_BxLxF.reshape(B * L, -1) @ self.w_down[...].astype(dt)).reshape(B, L, D)


class RoutingBias(nnx.Variable):
    """Per-expert selection bias b (fp32). Steers top-k selection only; never enters the gate values."""


class MoE(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs, layer: int | None = None):
        """The MoE of model layer `layer` (its router and K: cfg.layer_router, cfg.moe_top_k; None: the model's)."""
        D, E, F, Ec = cfg.d_model, cfg.n_routed_experts, cfg.moe_d_ff, cfg.n_candidates
        self.router = param(rngs, (D, Ec), ("embed", None), cfg.init_std)
        # A hash-routed layer keeps one too, always 0 (selection by token id reads none): every MoE layer holds the
        # same variables, rows of the train step's load and bias update.
        self.bias = RoutingBias(jnp.zeros((Ec,), jnp.float32), out_sharding=(None,))
        self.w_gate = param(rngs, (E, D, F), ("expert", "embed", "mlp"), cfg.init_std)
        self.w_up = param(rngs, (E, D, F), ("expert", "embed", "mlp"), cfg.init_std)
        self.w_down = param(rngs, (E, F, D), ("expert", "mlp", "embed"), cfg.out_init_std)
        # N shared experts are one SwiGLU of width N * F (mathematically the same sum; HF stores it this way),
        # or of width shared_d_ff when given (Qwen2-MoE's shared_expert_intermediate_size).
        self.shared = MLP(D, cfg.shared_width, cfg, rngs) if cfg.n_shared_experts else None
        if cfg.shared_expert_gate:  # Qwen2-MoE / Qwen3-Next: one scalar gate per token on the shared output
            self.shared_gate = param(rngs, (D,), ("embed",), cfg.init_std)
        if cfg.expert_bias:  # gpt-oss: biases on each expert's gate, up and down projections
            self.b_gate = nnx.Param(jnp.zeros((E, F), jnp.float32), out_sharding=("expert", "mlp"))
            self.b_up = nnx.Param(jnp.zeros((E, F), jnp.float32), out_sharding=("expert", "mlp"))
            self.b_down = nnx.Param(jnp.zeros((E, D), jnp.float32), out_sharding=("expert", "embed"))
        if cfg.router_logit_bias:  # gpt-oss: the router Linear's bias, trained (enters scores and gates)
            self.logit_bias = nnx.Param(jnp.zeros((Ec,), jnp.float32), out_sharding=(None,))
        self.cfg = cfg
        # Static, and equal across the MoE layers of a plain model: blocks differing only in their parameters share
        # one graph structure (execution.scan_layers scans them together). A hash layer's table seed is its layer.
        self.routes_by = cfg.layer_router(layer)
        self.top_k = cfg.moe_top_k(layer)
        self.hash_seed = layer if self.routes_by == "hash" else None

    def __call__(self, u_BxLxD, valid_BxL, ex: Execution, token_ids_BxL=None) -> tuple[jax.Array, Routing]:
        """(out [B,L,D], this call's Routing). token_ids [B,L]: the tokens' ids, which a hash-routed layer needs."""
        cfg, r = self.cfg, router.ROUTERS[self.routes_by]
        B, L, D = u_BxLxD.shape
        u_TxD = u_BxLxD.reshape(B * L, D)
        if r.selection == "hash" and token_ids_BxL is None:
            raise ValueError(f"MoE layer {self.hash_seed} routes by token id: call it with the tokens' ids "
                             "(Block passes BlockInputs.token_ids_BxL)")
        logit_bias_E = self.logit_bias[...] if cfg.router_logit_bias else None
        token_ids_T = None if token_ids_BxL is None else token_ids_BxL.reshape(-1)
        logits_TxE, scores_TxE, ids_TxK, gates_TxK = router.route_logits(
            u_TxD, self.router[...], self.bias[...], top_k=self.top_k, n_group=cfg.n_group, topk_group=cfg.topk_group,
            routed_scaling_factor=cfg.routed_scaling_factor, normalize=cfg.norm_topk_prob, router=self.routes_by,
            group_score=cfg.router_group_score, logit_bias_E=logit_bias_E, token_ids_T=token_ids_T,
            hash_seed=self.hash_seed or 0)
        # Kept under remat_policy="save_moe" with the experts' rows they index: a router rerun in the backward pass
        # (its bf16 inputs recomputed, maybe fused otherwise) could flip a choice and misalign every saved row.
        ids_TxK, gates_TxK = kernels.saved(ids_TxK), kernels.saved(gates_TxK)
        dt = u_BxLxD.dtype
        w = [self.w_gate[...].astype(dt), self.w_up[...].astype(dt), self.w_down[...].astype(dt)]
        if cfg.expert_bias or cfg.expert_act != "swiglu":  # gpt-oss's experts: the plain loop only
            biases = [self.b_gate[...], self.b_up[...], self.b_down[...]] if cfg.expert_bias else None
            clamp = (cfg.swiglu_limit, cfg.swiglu_alpha) if cfg.expert_act == "clamped_swiglu" else None
            routed_TxD, keep_TxK = experts.reference(u_TxD, ids_TxK, gates_TxK, *w, biases=biases, clamp=clamp), None
        else:
            routed_TxD, keep_TxK = routed_experts(ex, u_TxD, ids_TxK, gates_TxK, *w, group_size=L,
                                                  gate_input=r.gate_at == "input",
                                                  zero_experts=cfg.n_zero_experts > 0)
        out_BxLxD = routed_TxD.reshape(B, L, D)
        if self.shared is not None:
            shared_BxLxD = self.shared(u_BxLxD, ex)
            if cfg.shared_expert_gate:
                g_BxL = jax.nn.sigmoid(jnp.einsum("bld,d->bl", u_BxLxD.astype(jnp.float32),
                                                  self.shared_gate[...], precision=jax.lax.Precision.HIGHEST))
                shared_BxLxD = shared_BxLxD * g_BxL[..., None].astype(dt)
            out_BxLxD = out_BxLxD + shared_BxLxD
        out_BxLxD = ex.constrain(out_BxLxD, ("batch", "length", "act_embed"))

        K, E = self.top_k, cfg.n_candidates
        valid_T = valid_BxL.reshape(-1).astype(jnp.float32)
        if keep_TxK is None:
            dropped_frac = jnp.float32(0)
        else:
            n_dropped = ((1.0 - keep_TxK.astype(jnp.float32)) * valid_T[:, None]).sum()
            dropped_frac = n_dropped / jnp.maximum(valid_T.sum() * K, 1.0)
        ids_BxLxK = ids_TxK.reshape(B, L, K)
        scores_BxLxE = scores_TxE.reshape(B, L, E)
        # A hash-routed layer's selection is fixed by the token ids: there is no load to balance (and a loss on P
        # alone would only flatten its gates), so its balance terms are 0 and it is left out of every scope.
        balanced_BxL = valid_BxL if r.selection != "hash" else jnp.zeros_like(valid_BxL)
        return out_BxLxD, Routing(
            expert_ids=ids_BxLxK, gates=gates_TxK.reshape(B, L, K), scores=scores_BxLxE,
            load=router.expert_load(ids_TxK, E, valid_BxL.reshape(-1)),
            balance_loss=router.sequence_balance_loss(scores_BxLxE, ids_BxLxK, balanced_BxL), dropped_frac=dropped_frac,
            z_loss=router.router_z_loss(logits_TxE, valid_T),
            rows=router.balance_rows(scores_BxLxE, ids_BxLxK, balanced_BxL))
