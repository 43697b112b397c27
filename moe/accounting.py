"""Parameter, FLOP and KV-cache accounting (for reports, MFU and memory checks).

Active parameters count what one token goes through. With zero experts (model.n_zero_experts = Z) how many real
experts a token runs varies by token; the active counts are the EXPECTATION under uniform routing over the E + Z
candidates (each of a layer's K choices is a real expert with probability E / (E + Z): the load that aux-loss-free
balancing of every candidate drives to), rounded to an integer. A zero expert costs nothing (no FLOPs). Per-layer
top-k (model.layer_top_k) counts each layer's own K; the router (its logit bias too) is active for every token,
hash-routed layers included (their gates read it).
"""

import jax.numpy as jnp

from moe.config import ModelConfig


def attention_params(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters of one attention layer, of them the matmul weights): GQA's q/k/v/o with their options, or
    MLA's projections and latent norms (moe/mla.py)."""
    D, H = cfg.d_model, cfg.n_heads
    if cfg.attention == "mla":
        Q, R, Dn, Dr, Dv = (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim)
        query = D * Q + Q * H * (Dn + Dr) if Q else D * H * (Dn + Dr)
        matmul = query + D * (R + Dr) + R * H * (Dn + Dv) + H * Dv * D
        return matmul + Q + R, matmul  # + the q and kv latent norms
    N, Dh = cfg.n_kv_heads, cfg.head_dim
    matmul = D * Dh * (2 * H + 2 * N) + cfg.attn_output_gate * D * H * Dh  # the gate: q_proj twice as wide
    attn = matmul + cfg.qkv_bias * Dh * ((1 + cfg.attn_output_gate) * H + 2 * N) + cfg.attn_out_bias * D
    attn += {"none": 0, "head": 2 * Dh, "full": (H + N) * Dh, "weightless": 0}[cfg.qk_norm] + cfg.attn_sinks * H
    return attn, matmul


def gdn_params(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters of one Gated DeltaNet layer, of them the matmul weights) (moe/gdn.py): the qkvz and ba
    projections, the conv taps, dt_bias, A_log, the output norm and W_o."""
    D, Hk, Hv, Dk, Dv = cfg.d_model, cfg.gdn_key_heads, cfg.gdn_value_heads, cfg.gdn_key_dim, cfg.gdn_value_dim
    matmul = D * (2 * Hk * Dk + 2 * Hv * Dv) + D * 2 * Hv + Hv * Dv * D
    return matmul + (2 * Hk * Dk + Hv * Dv) * cfg.gdn_conv_kernel + 2 * Hv + Dv, matmul


def mixer_params(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """attention_params, or gdn_params for a layer of model.linear_layers."""
    return gdn_params(cfg) if layer in cfg.linear_layer_ids else attention_params(cfg)


def _ffn_params(cfg: ModelConfig, layer: int) -> tuple[int, int, int]:
    """(parameters, of them active per token, matmul weights active per token) of layer `layer`'s FFN (layer >=
    n_layers: an MTP module's block)."""
    D = cfg.d_model
    if not cfg.is_moe_layer(layer):
        return (3 * D * cfg.d_ff,) * 3
    expert, router = 3 * D * cfg.moe_d_ff, D * cfg.n_candidates
    shared = 3 * D * cfg.shared_width + cfg.shared_expert_gate * D
    logit_bias = cfg.router_logit_bias * cfg.n_candidates
    routed = round(cfg.moe_top_k(layer) * expert * cfg.n_routed_experts / cfg.n_candidates)  # = K x expert, Z = 0
    active = router + shared + routed
    total = router + shared + cfg.n_routed_experts * expert
    bias = cfg.expert_bias * (2 * cfg.moe_d_ff + D)  # gpt-oss: per expert, beside its matmul weights
    return (total + logit_bias + cfg.n_routed_experts * bias, active + logit_bias + cfg.moe_top_k(layer) * bias,
            active - cfg.shared_expert_gate * D)


def _blocks(cfg: ModelConfig) -> range:
    """Every Block: the main model's layers, then the MTP modules' (layer n_layers + k - 1)."""
    return range(cfg.n_layers + cfg.mtp_depth)


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """total: every parameter; active: parameters one token touches (embedding row excluded from neither). An MTP
    module adds its block, eh_proj [2D, D] and three norms (it shares the embedding and head)."""
    D, V = cfg.d_model, cfg.vocab_size
    norms = 2 * D
    embed = V * D * (1 if cfg.tie_embeddings else 2) + D  # + final norm
    total = active = embed + cfg.mtp_depth * (2 * D * D + 3 * D)
    for i in _blocks(cfg):
        ffn_total, ffn_active, _ = _ffn_params(cfg, i)
        attn = mixer_params(cfg, i)[0]
        total += attn + norms + ffn_total
        active += attn + norms + ffn_active
    if cfg.dual_sublayers:  # LongCat-Flash: a second attention, two more norms and two dense SwiGLUs per layer
        extra = cfg.n_layers * (attention_params(cfg)[0] + norms + 2 * 3 * D * cfg.d_ff)
        total, active = total + extra, active + extra
    return {"total": total, "active": active}


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights in matmuls one token goes through (no embedding lookup, no norms, no routing bias); an MTP module's
    block, eh_proj and the shared head once more per depth."""
    D = cfg.d_model
    blocks = sum(mixer_params(cfg, i)[1] + _ffn_params(cfg, i)[2] for i in _blocks(cfg))
    blocks += cfg.dual_sublayers * cfg.n_layers * (attention_params(cfg)[1] + 3 * D * cfg.d_ff * 2)  # LongCat-Flash's second sublayer
    return blocks + (1 + cfg.mtp_depth) * D * cfg.vocab_size + cfg.mtp_depth * 2 * D * D


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 x active matmul params + attention (QK^T and PV: 2 flops x L x H x (Dqk + Dv), x3 for fwd+bwd).

    The attention term counts the full L x L square (as PaLM's MFU does), not the causal half. MLA trains in the
    expanded form (per-head keys of qk_nope_head_dim + qk_rope_head_dim, values of v_head_dim; moe/mla.py).
    """
    n = len(_blocks(cfg)) - len(cfg.linear_layer_ids)  # Gated DeltaNet layers: below
    if cfg.attention == "mla":
        attention = 6 * n * seq_len * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    else:
        attention = 6 * 2 * n * seq_len * cfg.n_heads * cfg.head_dim
    # Gated DeltaNet, per token and value head: decay, k^T S, the rank-1 write and q^T S, ~4 [Dk, Dv] passes of 2
    # flops each (x3 for fwd+bwd), whatever the length
    recurrent = 6 * 4 * len(cfg.linear_layer_ids) * cfg.gdn_value_heads * cfg.gdn_key_dim * cfg.gdn_value_dim
    return 6 * matmul_params_per_token(cfg) + attention + recurrent


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype: str = "float32") -> int:
    """Bytes one token adds to the decoding cache over all layers (moe.decoding.generate.init_cache): keys and values of the
    kv heads (gqa), or the kv latent and the shared roped key (mla)."""
    per_layer = (cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.attention == "mla"
                 else 2 * cfg.n_kv_heads * cfg.head_dim)
    n = cfg.n_layers - len(cfg.linear_layer_ids)  # a Gated DeltaNet layer's state does not grow
    return n * (1 + cfg.dual_sublayers) * per_layer * jnp.dtype(dtype).itemsize
