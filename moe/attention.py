"""Attention: masks, rotary position embedding, the attention kernels and grouped-query attention with a KV cache.
Multi-head latent attention (moe/mla.py) shares the masks, RoPE and kernels.

Key: B batch, L query length, S key length (= L, or cache slots), D model, H heads, G query heads per kv head,
N kv heads, Dh head dim, R rotated dims, F = R / 2 frequencies. Matmuls run in the activations' dtype; logits,
softmax and RoPE in fp32.

Masks, in terms of absolute slot indices (row index in training, cache slot in decoding):

  causal         key k visible to query q iff k <= q                                     (GPT)
  prefix         causal, plus bidirectional inside the prefix: k < P and q < P          (prefix-LM / UniLM)
  bidirectional  every key visible
  mixed          inside the prefix, the first half of the heads see k <= q (lower-triangular) and the second
                 half q <= k < P (upper-triangular), so each head's matrix stays triangular (full rank) while
                 the layer sees both directions; queries after the prefix are causal in every head.

Segment ids keep attention inside one document of a packed row; `k_valid` hides unwritten cache slots.

RoPE: the frequencies (plain, or YaRN-scaled) and the rotation (rotate-half, or DeepSeek's interleaved pairs).
YaRN (`model.rope_scaling_factor` > 1) mirrors transformers' `_compute_yarn_parameters` (truncated correction
range, `attention_factor` from mscale / mscale_all_dim) and DeepSeek's softmax-scale correction
(`yarn_apply_mscale`), so imported checkpoints reproduce HF's numbers.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx, struct

from moe.dispatch import platform
from moe.dispatch.execution import Execution
from moe.nn import RMSNorm, chunk_count, matmul_rows, param


@struct.dataclass
class BlockInputs:
    """What every block of one forward call shares (moe.model.Transformer.block_inputs builds it)."""

    positions_BxL: jax.Array  # each token's position (RoPE)
    mask: jax.Array  # [B, 1|H, L, S] bool: which keys each query sees (`attention_mask`)
    valid_BxL: jax.Array  # tokens that count in the expert load and balance loss (not padding)
    # The mask hides every key after its query (a causal mask, with or without segments): kernels may skip those
    # keys without reading the mask. False is right for any mask.
    causal: bool = struct.field(pytree_node=False, default=False)
    cache_index: jax.Array | int | None = None  # with a KV cache: this call's tokens occupy slots [i, i + L)
    # With model.attention_chunk: `mask` and each query's keys in its own chunk only (the RoPE layers' mask).
    chunked_mask: jax.Array | None = None
    # With model.sliding_window: `mask` and each query's last sliding_window keys only (the sliding layers' mask).
    sliding_mask: jax.Array | None = None
    # The tokens' ids [B, L]: what a hash-routed MoE layer routes by (DeepSeek-V4). An MTP module's blocks get the
    # main call's (t_i at position i). None: no layer may route by hash.
    token_ids_BxL: jax.Array | None = None
    # Packed rows' segment ids [B, L] (0: padding), for the recurrent mixers (moe/gdn.py) that must not carry state
    # across documents; None: one sequence per row.
    segment_ids_BxL: jax.Array | None = None


# Masks.

def attention_mask(mode, q_idx_BxQ, k_idx_BxK, *, n_heads, prefix_len_B=None, q_seg_BxQ=None,
                   k_seg_BxK=None, k_valid_BxK=None):
    q = q_idx_BxQ[:, None, :, None]
    k = k_idx_BxK[:, None, None, :]
    causal = k <= q
    if mode in ("prefix", "mixed"):
        if prefix_len_B is None:
            raise ValueError(f"mask mode {mode!r} needs prefix_len (the length of each row's prefix)")
        P = prefix_len_B[:, None, None, None]
    if mode == "causal":
        mask = causal
    elif mode == "bidirectional":
        mask = jnp.ones_like(causal)
    elif mode == "prefix":
        mask = causal | ((k < P) & (q < P))
    elif mode == "mixed":
        in_prefix = q < P
        upper = (k >= q) & (k < P)
        half = jnp.arange(n_heads)[None, :, None, None] >= n_heads // 2
        mask = jnp.where(in_prefix & half, upper, causal)
    else:
        raise ValueError(f"unknown mask mode {mode!r}")
    if q_seg_BxQ is not None:
        mask = mask & (q_seg_BxQ[:, None, :, None] == k_seg_BxK[:, None, None, :])
    if k_valid_BxK is not None:
        mask = mask & k_valid_BxK[:, None, None, :]
    return mask


# Rotary position embedding.

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
    if cfg.rope_scaling == "llama3":
        return rope(x_BxLxHxDh, positions_BxL, cfg.rope_theta, rot_dim,
                    inv_freq_F=llama3_inv_frequencies(cfg, rot_dim), interleave=cfg.rope_interleave)
    return rope(x_BxLxHxDh, positions_BxL, cfg.rope_theta, rot_dim, inv_freq_F=yarn_inv_frequencies(cfg, rot_dim),
                scale=yarn_attention_factor(cfg), interleave=cfg.rope_interleave)


def query_scale(cfg, positions_BxL):
    """Llama 4's query scale [B, L] (fp32), 1 + beta * ln(1 + floor((position + offset) / period)), or None when
    off: 1 below the first period, growing in steps after (Mistral Small 4 scales its whole MLA query by it after
    RoPE, Llama 4 the query of its NoPE layers)."""
    if not cfg.query_scale_beta:
        return None
    steps_BxL = jnp.floor((positions_BxL.astype(jnp.float32) + cfg.query_scale_offset) / cfg.query_scale_period)
    return 1.0 + cfg.query_scale_beta * jnp.log1p(steps_BxL)


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
    if cfg.attention == "mla" and cfg.rope_scaling_factor != 1.0 and cfg.yarn_mscale_all_dim:  # (YaRN: mla)
        m = yarn_mscale(cfg.rope_scaling_factor, cfg.yarn_mscale_all_dim)
        scale = scale * m * m
    return scale


def llama3_inv_frequencies(cfg, R: int) -> jax.Array:
    """Llama 3.1's [F] inverse frequencies (transformers' _compute_llama3_parameters, fp32): wavelengths longer than
    original / low_freq_factor divided by `factor`, shorter than original / high_freq_factor kept, a smooth ramp
    between."""
    f, original = cfg.rope_scaling_factor, cfg.rope_original_max_position
    low, high = cfg.llama3_low_freq_factor, cfg.llama3_high_freq_factor
    inv_F = 1.0 / (cfg.rope_theta ** (jnp.arange(0, R, 2, dtype=jnp.float32) / R))
    wavelen_F = 2 * math.pi / inv_F
    scaled_F = jnp.where(wavelen_F > original / low, inv_F / f, inv_F)
    smooth_F = (original / wavelen_F - low) / (high - low)
    medium_F = ~(wavelen_F < original / high) & ~(wavelen_F > original / low)
    return jnp.where(medium_F, (1 - smooth_F) * scaled_F / f + smooth_F * scaled_F, scaled_F)


def yarn_inv_frequencies(cfg, R: int) -> jax.Array:
    """YaRN's [F] inverse frequencies: the original ones for the fast dims (> beta_fast rotations over the original
    context), divided by `factor` for the slow ones (< beta_slow rotations), a linear ramp between (fp32, as HF)."""
    f, theta, original = cfg.rope_scaling_factor, cfg.rope_theta, cfg.rope_original_max_position

    def correction_dim(rotations):
        return (R * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(cfg.yarn_beta_fast), correction_dim(cfg.yarn_beta_slow)
    if getattr(cfg, "yarn_truncate", True):  # whole dims (transformers' default; gpt-oss sets truncate false)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp_F = jnp.clip((jnp.arange(R // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    pos_freqs_F = theta ** (jnp.arange(0, R, 2, dtype=jnp.float32) / R)
    extrapolation_F = 1 - ramp_F  # weight of the original frequency
    return (1.0 / (f * pos_freqs_F)) * (1 - extrapolation_F) + (1.0 / pos_freqs_F) * extrapolation_F


# The kernels, and grouped-query attention.

def causal_blocks(L: int, max_blocks: int = 4, min_rows: int = 32) -> int:
    """Query blocks of the `blockwise` attention: the most equal blocks (<= max_blocks) of >= min_rows rows each.
    n blocks do (n + 1) / 2n of the full [L, L] work; fewer, larger blocks keep XLA's batched matmuls efficient."""
    return chunk_count(L, min(max_blocks, L // min_rows))


def softmax_attention(q_BxLxNxGxDh, k_BxSxNxDh, v_BxSxNxDh, mask_BxHxLxS, return_probs: bool = False,
                      scale: float | None = None, sinks_NxG=None):
    """softmax(q k^T * scale, masked) v with fp32 logits and softmax: (out [B,L,N,G,Dv], probs [B,N,G,L,S] if
    return_probs else None). scale None: 1/sqrt(Dh). Values may be Dv wide, Dv != Dh (MLA). sinks [N, G] (gpt-oss):
    one more logit per head in every denominator, unscaled and with no value (the probabilities sum below 1).

    Without probabilities the softmax's division is applied to the output ([.., Dh] per query) instead of the
    probabilities ([.., S] per query): exp(logits - max) v / sum(exp(logits - max)), the same function up to
    rounding, and its backward pass has no [.., S]-sized division either (a few percent of the CPU train
    step).
    """
    B, L, N, G, Dh = q_BxLxNxGxDh.shape
    logits = jnp.einsum("blngk,bsnk->bngls", q_BxLxNxGxDh, k_BxSxNxDh,
                        preferred_element_type=jnp.float32) * (Dh**-0.5 if scale is None else scale)
    S = logits.shape[-1]
    mask_BxNxGxLxS = jnp.broadcast_to(mask_BxHxLxS, (B, mask_BxHxLxS.shape[1], L, S))
    if mask_BxNxGxLxS.shape[1] == 1:
        mask_BxNxGxLxS = mask_BxNxGxLxS[:, :, None]
    else:
        mask_BxNxGxLxS = mask_BxNxGxLxS.reshape(B, N, G, L, S)
    logits = jnp.where(mask_BxNxGxLxS, logits, jnp.finfo(jnp.float32).min)
    dt = q_BxLxNxGxDh.dtype
    if sinks_NxG is not None:
        return _with_sinks(logits, v_BxSxNxDh, sinks_NxG.astype(jnp.float32), return_probs, dt)
    if return_probs:
        probs = jax.nn.softmax(logits, axis=-1)  # fp32 softmax
        return jnp.einsum("bngls,bsnk->blngk", probs.astype(dt), v_BxSxNxDh), probs
    # the max only keeps exp in range: it cancels in the ratio, so no gradient flows through it
    unnormalized = jnp.exp(logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True)))
    denom_BxLxNxGx1 = jnp.moveaxis(unnormalized.sum(-1), -1, 1)[..., None]
    out = jnp.einsum("bngls,bsnk->blngk", unnormalized.astype(dt), v_BxSxNxDh, preferred_element_type=jnp.float32)
    return (out / denom_BxLxNxGx1).astype(dt), None


def _with_sinks(logits_BxNxGxLxS, v_BxSxNxDv, sinks_NxG, return_probs, dt):
    """The plain softmax over [logits | sink] with the sink's column dropped (gpt-oss's eager attention), fp32."""
    sink_1xNxGx1x1 = sinks_NxG[None, :, :, None, None]
    top = jax.lax.stop_gradient(jnp.maximum(logits_BxNxGxLxS.max(-1, keepdims=True), sink_1xNxGx1x1))
    unnormalized = jnp.exp(logits_BxNxGxLxS - top)
    probs = unnormalized / (unnormalized.sum(-1, keepdims=True) + jnp.exp(sink_1xNxGx1x1 - top))
    out = jnp.einsum("bngls,bsnk->blngk", probs.astype(dt), v_BxSxNxDv)
    return out, probs if return_probs else None


def attention(q_BxLxHxDk, k_BxSxNxDk, v_BxSxNxDv, mask_BxHxLxS, ex: Execution, *, causal: bool, cached: bool,
              return_probs: bool, scale: float | None = None, sinks_H=None):
    """softmax(q k^T * scale, masked) v by `ex.attention_impl`: (out [B,L,H,Dv], probs [B,H,L,S] or None). Query
    head h reads kv head h // (H / N). scale None: 1/sqrt(Dk).

    "xla" / "cudnn" hand the call to `jax.nn.dot_product_attention` unless it reads a cache (`cached`) or returns
    probabilities; keys narrower or wider than values (MLA) are zero-padded to one width there, which changes no
    q.k and no kept output column. "blockwise" runs the einsum path a block of queries at a time in a causal
    call, each block against the keys up to its last row only (`causal_blocks`). "einsum" is the reference.
    causal: the caller's promise that the mask hides every key after its query. sinks [H] (gpt-oss): the einsum
    and blockwise paths only.
    """
    Dk, Dv = q_BxLxHxDk.shape[-1], v_BxSxNxDv.shape[-1]
    if ex.attention_impl in ("xla", "cudnn") and not cached and not return_probs and sinks_H is None:
        impl = platform.attention_impl(ex.attention_impl, ex.platform or None)
        if Dk == Dv:
            return jax.nn.dot_product_attention(q_BxLxHxDk, k_BxSxNxDk, v_BxSxNxDv, scale=scale, mask=mask_BxHxLxS,
                                                is_causal=causal, implementation=impl), None
        pad = lambda x: jnp.pad(x, ((0, 0),) * 3 + ((0, max(Dk, Dv) - x.shape[-1]),))
        out = jax.nn.dot_product_attention(pad(q_BxLxHxDk), pad(k_BxSxNxDk), pad(v_BxSxNxDv),
                                           scale=Dk**-0.5 if scale is None else scale, mask=mask_BxHxLxS,
                                           is_causal=causal, implementation=impl)
        return out[..., :Dv], None
    B, L, H, _ = q_BxLxHxDk.shape
    N = k_BxSxNxDk.shape[2]
    q_BxLxNxGxDk = q_BxLxHxDk.reshape(B, L, N, H // N, Dk)  # query head h uses kv head h // G
    sinks_NxG = None if sinks_H is None else sinks_H.reshape(N, H // N)
    blockwise = ex.attention_impl == "blockwise" and causal and not cached and not return_probs
    n = causal_blocks(L) if blockwise else 1
    if n == 1:
        out_BxLxNxGxDv, probs = softmax_attention(q_BxLxNxGxDk, k_BxSxNxDk, v_BxSxNxDv, mask_BxHxLxS, return_probs,
                                                  scale, sinks_NxG)
    else:
        # A causal mask hides every key after a query: block i of C queries needs only keys [0, (i+1) C).
        C = L // n
        out_BxLxNxGxDv = jnp.concatenate([
            softmax_attention(q_BxLxNxGxDk[:, i * C:(i + 1) * C], k_BxSxNxDk[:, :(i + 1) * C],
                              v_BxSxNxDv[:, :(i + 1) * C], mask_BxHxLxS[:, :, i * C:(i + 1) * C, :(i + 1) * C],
                              scale=scale, sinks_NxG=sinks_NxG)[0]
            for i in range(n)], axis=1)
    probs_BxHxLxS = probs.reshape(B, H, L, -1) if return_probs else None
    return out_BxLxNxGxDv.reshape(B, L, H, Dv), probs_BxHxLxS


def window_mask(window: int, q_idx_BxQ, k_idx_BxK):
    """[B, 1, Q, K]: key k among query q's last `window` positions, q's own included (k > q - window); AND it with
    the causal mask (gpt-oss's sliding layers)."""
    return k_idx_BxK[:, None, None, :] > q_idx_BxQ[:, None, :, None] - window


def chunk_mask(chunk: int, q_idx_BxQ, k_idx_BxK):
    """[B, 1, Q, K]: key k in query q's chunk of `chunk` positions (Llama 4's chunked attention, chunks aligned to
    slot 0); AND it with the causal mask."""
    return (q_idx_BxQ[:, None, :, None] // chunk) == (k_idx_BxK[:, None, None, :] // chunk)


class WeightlessRMSNorm(nnx.Module):
    """x / rms(x) over the last axis (fp32), no scale: Llama 4's q/k norm."""

    def __init__(self, eps: float):
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs, layer: int | None = None):
        """The attention of model layer `layer` (None: the default layer; model.nope_layers differ)."""
        D, H, N, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # With attn_output_gate each head's query columns are [q | gate] (Qwen3-Next's q_proj, per head).
        Dq = 2 * Dh if cfg.attn_output_gate else Dh
        self.wq = param(rngs, (D, H, Dq), ("embed", "heads", "head_dim"), cfg.init_std)
        self.wk = param(rngs, (D, N, Dh), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        self.wv = param(rngs, (D, N, Dh), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        self.wo = param(rngs, (H, Dh, D), ("heads", "head_dim", "embed"), cfg.out_init_std)
        # Options of other MoE families (off by default; see moe/config.py).
        if cfg.qkv_bias:
            self.bq = nnx.Param(jnp.zeros((H, Dq), jnp.float32), out_sharding=("heads", "head_dim"))
            self.bk = nnx.Param(jnp.zeros((N, Dh), jnp.float32), out_sharding=("kv_heads", "head_dim"))
            self.bv = nnx.Param(jnp.zeros((N, Dh), jnp.float32), out_sharding=("kv_heads", "head_dim"))
        if cfg.attn_out_bias:
            self.bo = nnx.Param(jnp.zeros((D,), jnp.float32), out_sharding=("embed",))
        # static per layer: a NoPE layer (Llama 4) has no RoPE, no q/k norm and no chunking, and scales its query
        self.use_rope = cfg.uses_rope(layer)
        self.norm_qk = cfg.qk_norm != "none" and layer not in cfg.nope_layer_ids
        if cfg.qk_norm in ("head", "full") and self.norm_qk:
            q_dim, k_dim = (Dh, Dh) if cfg.qk_norm == "head" else (H * Dh, N * Dh)
            self.q_norm = RMSNorm(q_dim, cfg.norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(k_dim, cfg.norm_eps, cfg.norm_offset)
        elif self.norm_qk:
            self.q_norm = self.k_norm = WeightlessRMSNorm(cfg.norm_eps)
        self.scale_query = bool(cfg.query_scale_beta) and not self.use_rope
        self.chunked = bool(cfg.attention_chunk) and self.use_rope
        self.sliding = layer in cfg.sliding_layer_ids
        if cfg.attn_sinks:  # gpt-oss: one logit per query head
            self.sinks = nnx.Param(jnp.zeros((H,), jnp.float32), out_sharding=("heads",))
        self.cfg = cfg

    def _qk_norm(self, norm, x_BxLxHxDh):
        if self.cfg.qk_norm in ("head", "weightless"):
            return norm(x_BxLxHxDh)
        B, L, H, Dh = x_BxLxHxDh.shape  # "full": one RMSNorm over all heads together (OLMoE)
        return norm(x_BxLxHxDh.reshape(B, L, H * Dh)).reshape(B, L, H, Dh)

    def __call__(self, x_BxLxD, inputs: BlockInputs, ex: Execution, *, cache=None, return_probs: bool = False):
        """Returns (out_BxLxD, new_cache or None, probs_BxHxLxS or None).

        With `cache` ({"k","v": [B,S,N,Dh]}), this call's keys/values are written at slots
        [inputs.cache_index, inputs.cache_index + L) and queries attend over all S slots (the mask hides unwritten
        ones).

        `ex.attention_impl` picks the kernel (`attention` above): "xla" / "cudnn" hand the no-cache,
        no-probabilities call (training, evaluation) to `jax.nn.dot_product_attention` (cuDNN's fused flash
        attention on NVIDIA GPUs, no fp32 [B,H,L,S] logits in memory; for a causal call it also passes is_causal,
        and the boolean mask still applies, as an additive bias of the mask's shape). The einsum path is the
        reference, and the path for the KV cache and for attention probabilities; "blockwise" (the default) runs
        it a block of queries at a time in a causal call, the same function up to rounding.
        """
        cfg, dt = self.cfg, x_BxLxD.dtype
        positions_BxL = inputs.positions_BxL
        q_BxLxHxDh = matmul_rows(x_BxLxD, self.wq[...].astype(dt))
        k_BxLxNxDh = matmul_rows(x_BxLxD, self.wk[...].astype(dt))
        v_BxLxNxDh = matmul_rows(x_BxLxD, self.wv[...].astype(dt))
        if cfg.qkv_bias:
            q_BxLxHxDh = q_BxLxHxDh + self.bq[...].astype(dt)
            k_BxLxNxDh = k_BxLxNxDh + self.bk[...].astype(dt)
            v_BxLxNxDh = v_BxLxNxDh + self.bv[...].astype(dt)
        if cfg.attn_output_gate:
            q_BxLxHxDh, gate_BxLxHxDh = jnp.split(q_BxLxHxDh, 2, axis=-1)
        if self.norm_qk and not cfg.qk_norm_after_rope:
            q_BxLxHxDh = self._qk_norm(self.q_norm, q_BxLxHxDh)
            k_BxLxNxDh = self._qk_norm(self.k_norm, k_BxLxNxDh)
        if self.use_rope:
            q_BxLxHxDh = rotate(cfg, q_BxLxHxDh, positions_BxL, cfg.rope_dim)
            k_BxLxNxDh = rotate(cfg, k_BxLxNxDh, positions_BxL, cfg.rope_dim)
        if self.norm_qk and cfg.qk_norm_after_rope:  # Hunyuan, Llama 4: the rotated q and k are normed (k cached so)
            q_BxLxHxDh = self._qk_norm(self.q_norm, q_BxLxHxDh)
            k_BxLxNxDh = self._qk_norm(self.k_norm, k_BxLxNxDh)
        if self.scale_query:  # Llama 4's NoPE layers: attention temperature by position
            q_BxLxHxDh = q_BxLxHxDh * query_scale(cfg, positions_BxL)[:, :, None, None].astype(q_BxLxHxDh.dtype)
        # q, k and v sharded alike (heads over tensor): cuDNN's partitioner requires identical shardings.
        q_BxLxHxDh = ex.constrain(q_BxLxHxDh, ("batch", "length", "act_heads", None))
        k_BxLxNxDh = ex.constrain(k_BxLxNxDh, ("batch", "length", "act_heads", None))
        v_BxLxNxDh = ex.constrain(v_BxLxNxDh, ("batch", "length", "act_heads", None))
        new_cache = None
        if cache is not None:
            at = (0, inputs.cache_index, 0, 0)
            k_all = jax.lax.dynamic_update_slice(cache["k"], k_BxLxNxDh.astype(cache["k"].dtype), at)
            v_all = jax.lax.dynamic_update_slice(cache["v"], v_BxLxNxDh.astype(cache["v"].dtype), at)
            new_cache = {"k": k_all, "v": v_all}
            k_BxSxNxDh, v_BxSxNxDh = k_all.astype(dt), v_all.astype(dt)
        else:
            k_BxSxNxDh, v_BxSxNxDh = k_BxLxNxDh, v_BxLxNxDh
        mask = inputs.chunked_mask if self.chunked else inputs.sliding_mask if self.sliding else inputs.mask
        out_BxLxHxDh, probs_BxHxLxS = attention(q_BxLxHxDh, k_BxSxNxDh, v_BxSxNxDh, mask, ex,
                                                causal=inputs.causal, cached=cache is not None,
                                                return_probs=return_probs,
                                                sinks_H=self.sinks[...] if cfg.attn_sinks else None)
        if cfg.attn_output_gate:
            out_BxLxHxDh = out_BxLxHxDh * jax.nn.sigmoid(gate_BxLxHxDh)
        out_BxLxD = matmul_rows(out_BxLxHxDh, self.wo[...].astype(dt), contract=2)
        return self._out_bias(out_BxLxD), new_cache, probs_BxHxLxS

    def _out_bias(self, out_BxLxD):
        return out_BxLxD + self.bo[...].astype(out_BxLxD.dtype) if self.cfg.attn_out_bias else out_BxLxD
