"""Routers: ONE table (`ROUTERS`) names every router the model trains and imports, and the pure functions they are
made of. All router math is fp32, whatever the compute dtype.

Shapes: T tokens, E routed experts, K experts per token, G expert groups, B sequences of length L.

A router turns the logits z_t = u_t . W (W: [D, E], fp32) into scores, chosen experts and gates:

  s_{t,i} = score(z_t)_i                                affinity scores, `Router.score`
  chosen  = top-K of (s + b), among the best `topk_group` of `n_group` groups when G > 1
  g_{t,i} = s_{t,i} [/ sum_{j chosen} s_{t,j}] * routed_scaling_factor      (the bias b never enters g)

The bias b (moe.ffn.RoutingBias) steers selection only; aux-loss-free balancing moves it by the expert load
(`update_bias`; train.bias_update_rate, 0 for routers trained without it). A group scores as the sum of its two
best (s + b) (DeepSeek-V3, `group_score="top2_sum"`) or as its best one (DeepSeek-V2's group_limited_greedy,
`"max"`); the brackets apply with model.norm_topk_prob.

Adding a router is one `Router` entry (and the score function it names) plus its tests: `ModelConfig` validates
`model.router` against the table, the HF families name their router in it, the export check reads `exports_as`.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

# The ModelConfig fields every top-K router reads.
TOP_K_FIELDS = ("top_k", "n_group", "topk_group", "router_group_score", "norm_topk_prob", "routed_scaling_factor")


@dataclasses.dataclass(frozen=True)
class Router:
    name: str  # model.router
    score: str  # a key of SCORES: the logits -> affinity scores
    selection: str  # "top_k": the K best (s + b), within the best groups when model.n_group > 1
    gates: str  # "scores": the chosen experts' unbiased scores, normalized to sum 1 with model.norm_topk_prob
    selection_bias: bool  # a RoutingBias steers selection (aux-loss-free balancing moves it)
    reads: tuple[str, ...]  # the ModelConfig fields it reads
    families: tuple[str, ...]  # the HF model types whose routers it reproduces
    exports_as: tuple[str, ...]  # the HF model types an export of a model with this router is exact in
    about: str


SCORES = {
    "sigmoid": jax.nn.sigmoid,
    "softmax": lambda z_TxE: jax.nn.softmax(z_TxE, axis=-1),
}
GROUP_SCORES = ("top2_sum", "max")

ROUTERS = {r.name: r for r in (
    Router("sigmoid", score="sigmoid", selection="top_k", gates="scores", selection_bias=True, reads=TOP_K_FIELDS,
           families=("deepseek_v3", "glm4_moe", "glm4_moe_lite"), exports_as=("glm4_moe", "deepseek_v3"),
           about="DeepSeek-V3: sigmoid affinities, top-K of score + bias (group-limited), normalized gates x "
                 "routed_scaling_factor"),
    Router("softmax", score="softmax", selection="top_k", gates="scores", selection_bias=True, reads=TOP_K_FIELDS,
           families=("deepseek_v2", "qwen2_moe", "qwen3_moe", "olmoe", "mixtral"), exports_as=(),
           about="Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2 (greedy, or group-limited with router_group_score='max'): "
                 "softmax over all E experts, then top-K"),
)}


@struct.dataclass
class Routing:
    """One MoE layer's routing of a call (read by attribute; `routing["expert_ids"]` reads the same field)."""

    expert_ids: jax.Array  # [B, L, K] the chosen experts (bias-steered: the experts that run)
    gates: jax.Array  # [B, L, K] their weights
    scores: jax.Array  # [B, L, E] affinity scores of every expert
    load: jax.Array  # [E] valid tokens per expert, every top-k choice counted
    balance_loss: jax.Array  # () the sequence-wise balance loss, unweighted
    dropped_frac: jax.Array  # () fraction of valid token copies a capacity bound dropped (0: dropless)

    def __getitem__(self, name: str):
        return getattr(self, name)


def affinity_scores(u_TxD: jax.Array, router_DxE: jax.Array, score: str = "sigmoid") -> jax.Array:
    """Affinities s_{t,i} = SCORES[score](u_t . e_i), computed in fp32 whatever the compute dtype."""
    logits_TxE = jnp.dot(u_TxD.astype(jnp.float32), router_DxE.astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
    return SCORES[score](logits_TxE)


def select_experts(scores_TxE, bias_E, top_k: int, n_group: int = 1, topk_group: int = 1,
                   group_score: str = "top2_sum"):
    """Top-K expert ids [T,K] by (score + bias), restricted to the best groups (node-limited routing).

    A group's score is the sum of its two highest (s + b) ("top2_sum"), or its highest ("max"); experts outside
    the `topk_group` best groups are masked to -inf, so they can never be chosen.
    """
    choice_TxE = scores_TxE + bias_E.astype(jnp.float32)
    if n_group > 1:
        T, E = choice_TxE.shape
        grouped_TxGxS = choice_TxE.reshape(T, n_group, E // n_group)
        if group_score == "max":
            group_score_TxG = grouped_TxGxS.max(-1)
        else:
            group_score_TxG = jax.lax.top_k(grouped_TxGxS, 2)[0].sum(-1)
        _, best_groups_TxKg = jax.lax.top_k(group_score_TxG, topk_group)
        keep_TxG = jnp.zeros((T, n_group), bool).at[jnp.arange(T)[:, None], best_groups_TxKg].set(True)
        keep_TxE = jnp.repeat(keep_TxG, E // n_group, axis=1)
        choice_TxE = jnp.where(keep_TxE, choice_TxE, -jnp.inf)
    _, ids_TxK = jax.lax.top_k(choice_TxE, top_k)
    return ids_TxK


def gate_weights(scores_TxE, ids_TxK, routed_scaling_factor: float = 1.0, normalize: bool = True):
    """Gates from the UNBIASED scores of the chosen experts; normalized ones sum to routed_scaling_factor."""
    s_TxK = jnp.take_along_axis(scores_TxE, ids_TxK, axis=-1)
    if normalize:
        s_TxK = s_TxK / (s_TxK.sum(-1, keepdims=True) + 1e-20)
    return s_TxK * routed_scaling_factor


def route(u_TxD, router_DxE, bias_E, *, top_k, n_group=1, topk_group=1, routed_scaling_factor=1.0,
          normalize=True, router="sigmoid", group_score="top2_sum"):
    """scores [T,E], chosen ids [T,K], gates [T,K] for a flat batch of tokens, by the `ROUTERS[router]` entry."""
    r = ROUTERS[router]
    scores_TxE = affinity_scores(u_TxD, router_DxE, r.score)
    bias_E = jax.lax.stop_gradient(bias_E) if r.selection_bias else jnp.zeros_like(bias_E)
    ids_TxK = select_experts(scores_TxE, bias_E, top_k, n_group, topk_group, group_score)
    gates_TxK = gate_weights(scores_TxE, ids_TxK, routed_scaling_factor, normalize)
    return scores_TxE, ids_TxK, gates_TxK


def route_for(cfg, u_TxD, router_DxE, bias_E):
    """`route` with the fields of model config `cfg` that its router reads."""
    return route(u_TxD, router_DxE, bias_E, top_k=cfg.top_k, n_group=cfg.n_group, topk_group=cfg.topk_group,
                 routed_scaling_factor=cfg.routed_scaling_factor, normalize=cfg.norm_topk_prob, router=cfg.router,
                 group_score=cfg.router_group_score)


def expert_load(ids_TxK, n_experts: int, valid_T=None):
    """Tokens routed to each expert [E] (every top-k choice counts; padding tokens don't)."""
    one_hot_TxKxE = jax.nn.one_hot(ids_TxK, n_experts, dtype=jnp.float32)
    if valid_T is not None:
        one_hot_TxKxE = one_hot_TxKxE * valid_T[:, None, None].astype(jnp.float32)
    return one_hot_TxKxE.sum((0, 1))


def sequence_balance_loss(scores_BxLxE, ids_BxLxK, valid_BxL=None):
    """DeepSeek-V3's sequence-wise balance loss sum_i f_i P_i, per sequence, averaged over the rows that hold
    at least one valid token. The selection counted in f_i is the bias-steered one (the experts that run).

    f_i = E / (K T) * #{t : i chosen for t},  P_i = mean_t s_{i,t} / sum_j s_{j,t}  (T valid tokens of the row).
    Multiply by alpha (balance_loss_weight) outside.
    """
    B, L, E = scores_BxLxE.shape
    K = ids_BxLxK.shape[-1]
    valid_BxL = jnp.ones((B, L), jnp.float32) if valid_BxL is None else valid_BxL.astype(jnp.float32)
    n_tokens_B = jnp.maximum(valid_BxL.sum(-1), 1.0)
    chosen_BxLxE = jax.nn.one_hot(ids_BxLxK, E, dtype=jnp.float32).sum(-2) * valid_BxL[..., None]
    f_BxE = chosen_BxLxE.sum(1) * E / (K * n_tokens_B[:, None])
    probs_BxLxE = scores_BxLxE / scores_BxLxE.sum(-1, keepdims=True)
    p_BxE = (probs_BxLxE * valid_BxL[..., None]).sum(1) / n_tokens_B[:, None]
    # Rows without a valid token (all padding, e.g. the last evaluation batch) have no load to balance: they are
    # left out of the mean rather than counted as perfectly balanced zeros.
    has_tokens_B = (valid_BxL.sum(-1) > 0).astype(jnp.float32)
    return ((f_BxE * p_BxE).sum(-1) * has_tokens_B).sum() / jnp.maximum(has_tokens_B.sum(), 1.0)


def update_bias(bias_E, load_E, gamma: float):
    """Aux-loss-free balancing: b_i += gamma * sign(mean_load - load_i). Pure; the train loop applies it."""
    load_E = load_E.astype(jnp.float32)
    return bias_E + gamma * jnp.sign(load_E.mean() - load_E)


def max_violation(load_xE):
    """MaxVio = (max_i load_i - mean load) / mean load over the last axis (0 = perfectly balanced, and 0 when
    nothing was routed). The one definition: training metrics and the analysis both use it."""
    load_xE = jnp.asarray(load_xE, jnp.float32)
    mean_x = load_xE.mean(-1)
    return (load_xE.max(-1) - mean_x) / jnp.maximum(mean_x, 1e-9)
