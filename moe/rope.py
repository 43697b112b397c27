"""Rotary position embedding: the frequencies (plain, or YaRN-scaled) and the rotation (rotate-half, or DeepSeek's
interleaved pairs).

Key: B batch, L length, H heads, Dh head dim, R rotated dims, F = R / 2 frequencies.

YaRN (`model.rope_scaling_factor` > 1) mirrors transformers' `_compute_yarn_parameters` (truncated correction
range, `attention_factor` from mscale / mscale_all_dim) and DeepSeek's softmax-scale correction
(`yarn_apply_mscale`), so imported checkpoints reproduce HF's numbers.
"""

import math

import jax
import jax.numpy as jnp


def rope(x_BxLxHxDh, positions_BxL, theta: float, rot_dim: int | None = None, *, inv_freq_F=None,
         scale: float = 1.0, interleave: bool = False):
    """Rotary embedding, computed in fp32.

    Each pair (x1[i], x2[i]) turns by the angle position * inv_freq[i] (default theta^(-2i/R)); rotate-half pairs
    (x[i], x[i + R/2]) (GPT-NeoX), interleave pairs (x[2i], x[2i+1]) (DeepSeek checkpoints). Written per half (no
    concatenated [-x2, x1] copy and no duplicated angle table). rot_dim < Dh (partial rotary, GLM-4.5): only the
    leading rot_dim dims rotate, the rest pass through unchanged. `scale` multiplies cos and sin (YaRN's
    attention_factor).

    interleave returns the rotated pairs as [x1' | x2'] (evens then odds), as HF's
    apply_rotary_pos_emb_interleave does: a fixed permutation applied to queries and keys alike, so every q.k
    equals that of the rotation in place.
    """
    Dh = x_BxLxHxDh.shape[-1]
    R = Dh if rot_dim is None else rot_dim
    if inv_freq_F is None:
        inv_freq_F = 1.0 / (theta ** (jnp.arange(0, R, 2, dtype=jnp.float32) / R))
    angles_BxLx1xF = (positions_BxL[..., None].astype(jnp.float32) * inv_freq_F)[:, :, None, :]
    cos, sin = jnp.cos(angles_BxLx1xF), jnp.sin(angles_BxLx1xF)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x = x_BxLxHxDh.astype(jnp.float32)
    if interleave:
        x1, x2 = x[..., 0:R:2], x[..., 1:R:2]
    else:
        x1, x2 = x[..., :R // 2], x[..., R // 2:R]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., R:]], -1)
    return out.astype(x_BxLxHxDh.dtype)


def rotate(cfg, x_BxLxHxDh, positions_BxL, rot_dim: int):
    """`rope` as `cfg` asks: its theta, YaRN scaling and pair layout (rope_interleave)."""
    if cfg.rope_scaling_factor == 1.0:  # plain RoPE: the exact program of the unscaled model
        return rope(x_BxLxHxDh, positions_BxL, cfg.rope_theta, rot_dim, interleave=cfg.rope_interleave)
    return rope(x_BxLxHxDh, positions_BxL, cfg.rope_theta, rot_dim, inv_freq_F=yarn_inv_frequencies(cfg, rot_dim),
                scale=yarn_attention_factor(cfg), interleave=cfg.rope_interleave)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(cfg) -> float:
    """What YaRN multiplies cos and sin by (HF's attention_factor when config.json does not give one)."""
    f = cfg.rope_scaling_factor
    if cfg.yarn_mscale and cfg.yarn_mscale_all_dim:
        return float(yarn_mscale(f, cfg.yarn_mscale) / yarn_mscale(f, cfg.yarn_mscale_all_dim))
    return yarn_mscale(f)


def softmax_scale(cfg, head_dim: int) -> float:
    """The logits' scale 1/sqrt(head_dim), times DeepSeek's YaRN correction mscale(factor, mscale_all_dim)^2 (MLA
    only: HF's other families with YaRN keep 1/sqrt(head_dim))."""
    scale = head_dim ** (-0.5)
    if cfg.attention == "mla" and cfg.rope_scaling_factor != 1.0 and cfg.yarn_mscale_all_dim:
        m = yarn_mscale(cfg.rope_scaling_factor, cfg.yarn_mscale_all_dim)
        scale = scale * m * m
    return scale


def yarn_inv_frequencies(cfg, R: int) -> jax.Array:
    """YaRN's [F] inverse frequencies: the original ones for the fast dims (> beta_fast rotations over the original
    context), divided by `factor` for the slow ones (< beta_slow rotations), a linear ramp between (fp32, as HF)."""
    f, theta, original = cfg.rope_scaling_factor, cfg.rope_theta, cfg.rope_original_max_position

    def correction_dim(rotations):
        return (R * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(cfg.yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.yarn_beta_slow)), R - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp_F = jnp.clip((jnp.arange(R // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    pos_freqs_F = theta ** (jnp.arange(0, R, 2, dtype=jnp.float32) / R)
    extrapolation_F = 1 - ramp_F  # weight of the original frequency
    return (1.0 / (f * pos_freqs_F)) * (1 - extrapolation_F) + (1.0 / pos_freqs_F) * extrapolation_F
