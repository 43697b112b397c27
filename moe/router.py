"""DeepSeek-V3 routing as pure functions (all in fp32).

Shapes: T tokens, E routed experts, K experts per token, G expert groups, B sequences of length L.

  s_{t,i} = sigmoid(u_t . e_i)                          affinity scores
  chosen  = top-K of (s + b), among the best `topk_group` groups when G > 1
  g_{t,i} = s_{t,i} / sum_{j chosen} s_{t,j} * routed_scaling_factor   (the bias b never enters g)

`score="softmax"` (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2) replaces the sigmoid by a softmax over all E experts; the
rest is the same function (their routers have no bias, so b = 0; norm_topk_prob picks whether the chosen K are
renormalized). A group scores as the sum of its two best (s + b) (DeepSeek-V3), or `group_score="max"` as its best
one (DeepSeek-V2's group_limited_greedy).
"""

import jax
import jax.numpy as jnp


def affinity_scores(u_TxD: jax.Array, router_DxE: jax.Array, score: str = "sigmoid") -> jax.Array:
    """Affinities s_{t,i} (sigmoid, or softmax over the E experts), computed in fp32 whatever the compute dtype."""
    logits_TxE = jnp.dot(u_TxD.astype(jnp.float32), router_DxE.astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
    if score == "softmax":
        return jax.nn.softmax(logits_TxE, axis=-1)
    return jax.nn.sigmoid(logits_TxE)


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


def route(u_TxD, router_DxE, bias_E, *, top_k, n_group=1, topk_group=1, routed_scaling_factor=1.0,
          normalize=True, score="sigmoid", group_score="top2_sum"):
    """scores [T,E], chosen ids [T,K], gates [T,K] for a flat batch of tokens."""
    scores_TxE = affinity_scores(u_TxD, router_DxE, score)
    ids_TxK = select_experts(scores_TxE, jax.lax.stop_gradient(bias_E), top_k, n_group, topk_group, group_score)
    gates_TxK = gate_weights(scores_TxE, ids_TxK, routed_scaling_factor, normalize)
    return scores_TxE, ids_TxK, gates_TxK
