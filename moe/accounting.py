"""Parameter and FLOP accounting (for reports and MFU)."""

from moe.config import ModelConfig


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """total: every parameter; active: parameters one token touches (embedding row excluded from neither)."""
    D, V = cfg.d_model, cfg.vocab_size
    H, N, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    attn = D * Dh * (2 * H + 2 * N) + cfg.qkv_bias * Dh * (H + 2 * N) + cfg.attn_out_bias * D
    attn += {"none": 0, "head": 2 * Dh, "full": (H + N) * Dh}[cfg.qk_norm]
    norms = 2 * D
    dense_ffn = 3 * D * cfg.d_ff
    expert = 3 * D * cfg.moe_d_ff
    router = D * cfg.n_routed_experts
    shared = 3 * D * cfg.shared_width + cfg.shared_expert_gate * D
    embed = V * D * (1 if cfg.tie_embeddings else 2) + D  # + final norm
    n_moe = cfg.n_moe_layers
    n_dense = cfg.n_layers - n_moe
    total = embed + cfg.n_layers * (attn + norms) + n_dense * dense_ffn + n_moe * (
        router + shared + cfg.n_routed_experts * expert)
    active = embed + cfg.n_layers * (attn + norms) + n_dense * dense_ffn + n_moe * (
        router + shared + cfg.top_k * expert)
    return {"total": total, "active": active}


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights in matmuls one token goes through (no embedding lookup, no norms, no routing bias)."""
    D = cfg.d_model
    attn = D * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    expert = 3 * D * cfg.moe_d_ff
    moe = D * cfg.n_routed_experts + cfg.top_k * expert + 3 * D * cfg.shared_width
    n_dense = cfg.n_layers - cfg.n_moe_layers
    return cfg.n_layers * attn + n_dense * 3 * D * cfg.d_ff + cfg.n_moe_layers * moe + D * cfg.vocab_size


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 x active matmul params + attention (QK^T and PV: 2 matmuls x 2 flops x L x H x Dh, x3 for fwd+bwd).

    The attention term counts the full L x L square (as PaLM's MFU does), not the causal half.
    """
    attention = 6 * 2 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
    return 6 * matmul_params_per_token(cfg) + attention
