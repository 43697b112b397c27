"""Routers: ONE table (`ROUTERS`) names every router the model trains and imports, and the pure functions they are
made of. All router math is fp32, whatever the compute dtype.

Shapes: T tokens, E router candidates (model.n_routed_experts routed experts, then model.n_zero_experts zero
experts), K experts per token, G expert groups, B sequences of length L.

A router turns the logits z_t = u_t . W [+ c] (W: [D, E], fp32; c: model.router_logit_bias, a trainable bias that
enters scores and gates) into scores, chosen experts and gates:

  s_{t,i} = score(z_t)_i                          affinity scores, `Router.score` (what the balance loss and the
                                                  analyses read)
  chosen  = top-K of (r_t + b)                    `Router.selection` "top_k": r = s or z (`Router.ranks`), among
                                                  the best `topk_group` of `n_group` groups when G > 1
          | hash(token id)                        "hash": K distinct experts fixed per token id (`hash_expert_ids`)
  g_{t,k} = `Router.gates` of the chosen experts x routed_scaling_factor            (b never enters g)
  y_t     = sum_k g_k FFN_{e_k}(u_t)  or  sum_k FFN_{e_k}(g_k u_t)                    `Router.gate_at`

The bias b (moe.ffn.RoutingBias) steers selection only; aux-loss-free balancing moves it by the expert load
(`update_bias`, whatever the score function: it acts on the ranking, not on s; train.bias_update_rate, 0 for
routers trained without it). A hash-routed layer has nothing to steer: its load is fixed by the token ids, so its
bias is never moved (train/step.py) and its balance loss is 0. A group scores as the sum of its two best (r + b)
(DeepSeek-V3, `group_score="top2_sum"`) or as its best one (DeepSeek-V2's group_limited_greedy, `"max"`).

A zero expert (LongCat-Flash) is a router candidate i >= n_routed_experts whose output is its input times its gate:
it takes part in selection, the bias, the load and the balance loss like any candidate, and costs no compute
(moe/dispatch/ skips it). The router z-loss (ST-MoE) is `router_z_loss`; balance losses over other token sets
than a sequence are `balance_loss` over `BalanceRows`.

Adding a router is one `Router` entry (and the score function it names) plus its tests: `ModelConfig` validates
`model.router` against the table, the HF families name their router in it, the export check reads `exports_as`.
docs/routers.md tabulates them.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

# The ModelConfig fields every top-K router reads.
TOP_K_FIELDS = ("top_k", "n_group", "topk_group", "router_group_score", "norm_topk_prob", "routed_scaling_factor")
# ... and the fields of a router whose gates are always (or never) normalized, or that picks by token id.
FIXED_NORM_FIELDS = tuple(f for f in TOP_K_FIELDS if f != "norm_topk_prob")
HASH_FIELDS = ("top_k", "routed_scaling_factor")
# Fields any router reads beside its own: the candidates, the logit bias, per-layer K and the hash layers.
COMMON_FIELDS = ("n_zero_experts", "router_logit_bias", "layer_top_k", "n_hash_layers")


@dataclasses.dataclass(frozen=True)
class Router:
    name: str  # model.router
    score: str  # a key of SCORES: the logits -> affinity scores s
    selection: str  # "top_k": the K best (r + b) | "hash": the token id's fixed experts (no bias, nothing learned)
    ranks: str  # what top_k ranks: "scores" (s + b) or "logits" (z + b, where the family ranks raw logits)
    # "scores": the chosen experts' unbiased scores, normalized to sum 1 iff model.norm_topk_prob;
    # "normalized": always normalized; "raw": never; "softmax_logits": softmax over the chosen experts' logits.
    gates: str
    norm_floor: float  # normalized gates divide by max(sum, norm_floor), or by sum + 1e-20 when 0
    gate_at: str  # "output": sum_k g_k FFN_k(u) | "input": sum_k FFN_k(g_k u)
    selection_bias: bool  # a RoutingBias steers selection (aux-loss-free balancing moves it)
    reads: tuple[str, ...]  # the ModelConfig fields it reads (with COMMON_FIELDS)
    families: tuple[str, ...]  # the HF model types whose routers it reproduces
    exports_as: tuple[str, ...]  # the HF model types an export of a model with this router is exact in
    about: str


SCORES = {
    "sigmoid": jax.nn.sigmoid,
    "softmax": lambda z_TxE: jax.nn.softmax(z_TxE, axis=-1),
    "sqrt_softplus": lambda z_TxE: jnp.sqrt(jax.nn.softplus(z_TxE)),  # DeepSeek-V4
}
GROUP_SCORES = ("top2_sum", "max")

ROUTERS = {r.name: r for r in (
    Router("sigmoid", score="sigmoid", selection="top_k", ranks="scores", gates="scores", norm_floor=0.0,
           gate_at="output", selection_bias=True, reads=TOP_K_FIELDS,
           families=("deepseek_v3", "glm4_moe", "glm4_moe_lite", "dots1", "minimax_m2", "hy_v3"),
           exports_as=("glm4_moe", "deepseek_v3"),
           about="DeepSeek-V3: sigmoid affinities, top-K of score + bias (group-limited), normalized gates x "
                 "routed_scaling_factor"),
    # ERNIE 4.5 divides by max(sum, moe_norm_min = 1e-12); Mixtral and Qwen by the plain sum, DeepSeek-V2 by sum +
    # 1e-20: in fp32 all three are the same number whenever sum >= 1e-12 (1e-20 is below half an ulp there), which
    # always holds without a bias (sum >= K/E). Only a bias can pick experts whose probabilities sum below it.
    Router("softmax", score="softmax", selection="top_k", ranks="scores", gates="scores", norm_floor=1e-12,
           gate_at="output", selection_bias=True, reads=TOP_K_FIELDS,
           families=("deepseek_v2", "qwen2_moe", "qwen3_moe", "olmoe", "mixtral", "ernie4_5_moe", "qwen3_next",
                     "hunyuan_v1_moe", "longcat_flash", "mistral4"), exports_as=(),
           about="Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2 (greedy, or group-limited with router_group_score='max'): "
                 "softmax over all E experts, then top-K; ERNIE 4.5 with a selection bias; Qwen3-Next with "
                 "shared_expert_gate; Hunyuan with layer_top_k; LongCat-Flash with n_zero_experts"),
    Router("sqrt_softplus", score="sqrt_softplus", selection="top_k", ranks="scores", gates="normalized",
           norm_floor=0.0, gate_at="output", selection_bias=True, reads=FIXED_NORM_FIELDS,
           families=("deepseek_v4",), exports_as=(),
           about="DeepSeek-V4: sqrt(softplus) affinities, top-K of score + bias, gates always normalized x "
                 "routed_scaling_factor"),
    Router("topk_softmax", score="softmax", selection="top_k", ranks="logits", gates="softmax_logits",
           norm_floor=0.0, gate_at="output", selection_bias=True, reads=FIXED_NORM_FIELDS,
           families=("gpt_oss",), exports_as=(),
           about="gpt-oss: top-K of the raw logits (+ bias), gates = softmax over the K chosen logits (with "
                 "router_logit_bias: its router Linear's bias)"),
    Router("sigmoid_input", score="sigmoid", selection="top_k", ranks="logits", gates="raw", norm_floor=0.0,
           gate_at="input", selection_bias=True, reads=FIXED_NORM_FIELDS, families=("llama4",), exports_as=(),
           about="Llama 4: top-K of the raw logits (+ bias), gate sigmoid(logit) unnormalized, applied to the "
                 "expert's INPUT: sum_k FFN_k(g_k u)"),
    Router("hash", score="sqrt_softplus", selection="hash", ranks="scores", gates="normalized", norm_floor=0.0,
           gate_at="output", selection_bias=False, reads=HASH_FIELDS, families=("deepseek_v4",), exports_as=(),
           about="DeepSeek-V4's first layers: K experts fixed per token id, gates sqrt(softplus) of their logits, "
                 "normalized x routed_scaling_factor (the first model.n_hash_layers MoE layers of any router)"),
)}


@struct.dataclass
class BalanceRows:
    """Per row, what a balance loss over any set of rows is made of (`balance_loss`): over the row's valid tokens,
    the sum of the chosen-expert indicator / K (f's numerator), the sum of s_i / sum_j s_j (P's numerator), and the
    number of valid tokens. Summed over rows, they give the loss of those rows together."""

    chosen_BxE: jax.Array
    prob_BxE: jax.Array
    tokens_B: jax.Array


@struct.dataclass
class Routing:
    """One MoE layer's routing of a call (read by attribute; `routing["expert_ids"]` reads the same field)."""

    expert_ids: jax.Array  # [B, L, K] the chosen candidates (bias-steered: the experts that run; >= n_routed_experts:
    # zero experts)
    gates: jax.Array  # [B, L, K] their weights
    scores: jax.Array  # [B, L, E] affinity scores of every candidate
    load: jax.Array  # [E] valid tokens per candidate, every top-k choice counted
    balance_loss: jax.Array  # () the sequence-wise balance loss, unweighted (0 for a hash-routed layer)
    dropped_frac: jax.Array  # () fraction of valid token copies a capacity bound dropped (0: dropless)
    z_loss: jax.Array | None = None  # () the router z-loss, unweighted (`router_z_loss`)
    rows: BalanceRows | None = None  # per row: the balance loss of any scope (`balance_loss`)

    def __getitem__(self, name: str):
        return getattr(self, name)


def router_logits(u_TxD: jax.Array, router_DxE: jax.Array, logit_bias_E: jax.Array | None = None) -> jax.Array:
    """z = u . W (+ c), in fp32 whatever the compute dtype."""
    logits_TxE = jnp.dot(u_TxD.astype(jnp.float32), router_DxE.astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
    return logits_TxE if logit_bias_E is None else logits_TxE + logit_bias_E.astype(jnp.float32)


def affinity_scores(u_TxD: jax.Array, router_DxE: jax.Array, score: str = "sigmoid") -> jax.Array:
    """Affinities s_{t,i} = SCORES[score](u_t . e_i), computed in fp32 whatever the compute dtype."""
    return SCORES[score](router_logits(u_TxD, router_DxE))


def select_experts(scores_TxE, bias_E, top_k: int, n_group: int = 1, topk_group: int = 1,
                   group_score: str = "top2_sum"):
    """Top-K expert ids [T,K] by (score + bias), restricted to the best groups (node-limited routing). `scores`
    is whatever the router ranks (`Router.ranks`: scores or logits).

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


def _mix32(x):
    """murmur3's 32-bit finalizer: a bijection on uint32 that spreads every input bit over every output bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def hash_expert_ids(token_ids_T, n_experts: int, top_k: int, seed: int = 0):
    """The K distinct experts of each token id (DeepSeek-V4's `tid2eid[token]`, for a model trained from scratch):
    the K largest of E pseudo-random integers h(seed, token, e). A fixed table [vocab, K] (`hash_table`), the same
    on every platform, computed per call for the call's tokens: nothing is stored, learned or updated."""
    t_Tx1 = token_ids_T.astype(jnp.uint32)[:, None]
    e_1xE = jnp.arange(n_experts, dtype=jnp.uint32)[None, :]
    h_TxE = _mix32(_mix32(t_Tx1 ^ _mix32(jnp.uint32(seed) + jnp.uint32(0x9E3779B9))) + e_1xE * jnp.uint32(0x9E3779B9))
    return jax.lax.top_k((h_TxE >> 1).astype(jnp.int32), top_k)[1]


def hash_table(vocab_size: int, n_experts: int, top_k: int, seed: int = 0):
    """[vocab, K]: every token id's experts under `hash_expert_ids` (what a V4 checkpoint stores as tid2eid)."""
    return hash_expert_ids(jnp.arange(vocab_size), n_experts, top_k, seed)


def gate_weights(scores_TxE, ids_TxK, routed_scaling_factor: float = 1.0, normalize: bool = True,
                 norm_floor: float = 0.0):
    """Gates from the UNBIASED scores of the chosen experts; normalized ones divide by sum + 1e-20 (norm_floor 0)
    or max(sum, norm_floor), so they sum to routed_scaling_factor."""
    s_TxK = jnp.take_along_axis(scores_TxE, ids_TxK, axis=-1)
    if normalize:
        sum_Tx1 = s_TxK.sum(-1, keepdims=True)
        s_TxK = s_TxK / (jnp.maximum(sum_Tx1, norm_floor) if norm_floor else sum_Tx1 + 1e-20)
    return s_TxK * routed_scaling_factor


def softmax_gates(logits_TxE, ids_TxK, routed_scaling_factor: float = 1.0):
    """gpt-oss: softmax over the chosen experts' logits (= their softmax probabilities renormalized, exactly)."""
    return jax.nn.softmax(jnp.take_along_axis(logits_TxE, ids_TxK, axis=-1), axis=-1) * routed_scaling_factor


def route_logits(u_TxD, router_DxE, bias_E, *, top_k, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                 normalize=True, router="sigmoid", group_score="top2_sum", logit_bias_E=None, token_ids_T=None,
                 hash_seed=0):
    """logits [T,E], scores [T,E], chosen ids [T,K], gates [T,K] for a flat batch of tokens, by the
    `ROUTERS[router]` entry (a hash router needs the tokens' ids)."""
    r = ROUTERS[router]
    logits_TxE = router_logits(u_TxD, router_DxE, logit_bias_E)
    scores_TxE = SCORES[r.score](logits_TxE)
    if r.selection == "hash":
        if token_ids_T is None:
            raise ValueError(f"router {router!r} routes by token id: pass the tokens' ids")
        ids_TxK = hash_expert_ids(token_ids_T, logits_TxE.shape[-1], top_k, hash_seed)
    else:
        bias_E = jax.lax.stop_gradient(bias_E) if r.selection_bias else jnp.zeros_like(bias_E)
        ranked_TxE = scores_TxE if r.ranks == "scores" else logits_TxE
        ids_TxK = select_experts(ranked_TxE, bias_E, top_k, n_group, topk_group, group_score)
    if r.gates == "softmax_logits":
        gates_TxK = softmax_gates(logits_TxE, ids_TxK, routed_scaling_factor)
    else:
        norm = {"scores": normalize, "normalized": True, "raw": False}[r.gates]
        gates_TxK = gate_weights(scores_TxE, ids_TxK, routed_scaling_factor, norm, r.norm_floor)
    return logits_TxE, scores_TxE, ids_TxK, gates_TxK


def route(u_TxD, router_DxE, bias_E, **kw):
    """scores [T,E], chosen ids [T,K], gates [T,K] (`route_logits` without the logits)."""
    return route_logits(u_TxD, router_DxE, bias_E, **kw)[1:]


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


def balance_rows(scores_BxLxE, ids_BxLxK, valid_BxL) -> BalanceRows:
    """Each row's `BalanceRows` (the counted selection is the bias-steered one, as in `sequence_balance_loss`)."""
    E, K = scores_BxLxE.shape[-1], ids_BxLxK.shape[-1]
    valid_BxL = valid_BxL.astype(jnp.float32)
    chosen_BxLxE = jax.nn.one_hot(ids_BxLxK, E, dtype=jnp.float32).sum(-2) * valid_BxL[..., None]
    probs_BxLxE = scores_BxLxE / scores_BxLxE.sum(-1, keepdims=True)
    return BalanceRows(chosen_BxLxE.sum(1) / K, (probs_BxLxE * valid_BxL[..., None]).sum(1), valid_BxL.sum(-1))


def balance_loss(rows: BalanceRows, n_groups: int):
    """sum_i f_i P_i over each of `n_groups` equal runs of consecutive rows (their tokens together), averaged over
    the runs that hold a valid token: n_groups = B is `sequence_balance_loss`, 1 the whole batch (Qwen's
    global-batch loss), the data-parallel shards each shard's own rows. Leading axes (MoE layers) are kept.

    f_i = E / (K T) * #{t : i chosen for t},  P_i = 1/T sum_t s_{i,t} / sum_j s_{j,t}  (T valid tokens of the run).
    """
    *lead, B, E = rows.chosen_BxE.shape
    per = lambda a: a.reshape(*lead, n_groups, B // n_groups, *a.shape[len(lead) + 1:]).sum(len(lead) + 1)
    chosen_GxE, prob_GxE, n_G = per(rows.chosen_BxE), per(rows.prob_BxE), per(rows.tokens_B)
    denom_Gx1 = jnp.maximum(n_G, 1.0)[..., None]
    loss_G = (E * chosen_GxE / denom_Gx1 * (prob_GxE / denom_Gx1)).sum(-1)
    has_G = (n_G > 0).astype(jnp.float32)
    return (loss_G * has_G).sum(-1) / jnp.maximum(has_G.sum(-1), 1.0)


def router_z_loss(logits_TxE, valid_T=None):
    """ST-MoE's router z-loss: mean over the valid tokens of logsumexp(z_t)^2 (fp32). Multiply by its weight
    (train.router_z_loss_weight) outside."""
    lse_T = jax.nn.logsumexp(logits_TxE.astype(jnp.float32), axis=-1)
    w_T = jnp.ones_like(lse_T) if valid_T is None else valid_T.astype(jnp.float32)
    return (w_T * lse_T * lse_T).sum() / jnp.maximum(w_T.sum(), 1.0)


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
