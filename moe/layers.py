"""Building blocks: RMSNorm, rotary embedding, (grouped-query) attention with a KV cache, SwiGLU MLP.

Key: B batch, L query length, S key length (= L, or cache slots), D model, H heads, G query heads per kv head,
N kv heads, Dh head dim, F ffn width. Params are fp32; matmuls run in `dtype`; softmax and norms in fp32.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from moe import platform
from moe.execution import Execution


def param(rngs: nnx.Rngs, shape, names, std: float) -> nnx.Param:
    """An fp32 parameter drawn from N(0, std^2), carrying logical axis names for sharding."""
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), out_sharding=names)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), out_sharding=("norm",))
        self.eps = eps

    def __call__(self, x):
        # Normalize in fp32, then scale in the input dtype (as HF does, so exports match exactly).
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * x32.astype(x.dtype)


def matmul_rows(x, w, contract: int = 1):
    """x [..., *C] @ w [*C, *O] -> [..., *O] as one 2-D matmul over all leading rows (C: the last `contract` dims
    of x, the first of w). XLA:CPU runs the backward of the equivalent 3-D einsum ("bld,dhk->blhk": the weight's
    gradient contracted over b and l) ~1.4x slower; the same math on every backend."""
    lead, inner = x.shape[:x.ndim - contract], w.shape[:contract]
    rows_NxC = x.reshape(-1, math.prod(inner))
    return (rows_NxC @ w.reshape(math.prod(inner), -1)).reshape(*lead, *w.shape[contract:])


def rope(x_BxLxHxDh, positions_BxL, theta: float, rot_dim: int | None = None):
    """Rotate-half (GPT-NeoX) rotary embedding, computed in fp32.

    Each pair (x1[i], x2[i]) = (x[i], x[i + R/2]) turns by the angle position * theta^(-2i/R). Written per half
    (no concatenated [-x2, x1] copy and no duplicated angle table: a few percent of the CPU train step).
    rot_dim < Dh (partial rotary, GLM-4.5): only the leading rot_dim dims rotate, with frequencies
    theta^(-2i/rot_dim) and rotate-half within them (as HF's Glm4Moe); the rest pass through unchanged.
    """
    Dh = x_BxLxHxDh.shape[-1]
    R = Dh if rot_dim is None else rot_dim
    inv_freq_F = 1.0 / (theta ** (jnp.arange(0, R, 2, dtype=jnp.float32) / R))
    angles_BxLx1xF = (positions_BxL[..., None].astype(jnp.float32) * inv_freq_F)[:, :, None, :]
    cos, sin = jnp.cos(angles_BxLx1xF), jnp.sin(angles_BxLx1xF)
    x = x_BxLxHxDh.astype(jnp.float32)
    x1, x2, x_pass = x[..., :R // 2], x[..., R // 2:R], x[..., R:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x_pass], -1)
    return out.astype(x_BxLxHxDh.dtype)


def chunk_count(L: int, chunks: int) -> int:
    """The largest divisor of L that is at most `chunks` (>= 1): equal chunks for any sequence length."""
    return max(d for d in range(1, max(1, min(chunks, L)) + 1) if L % d == 0)


def causal_blocks(L: int, max_blocks: int = 4, min_rows: int = 32) -> int:
    """Query blocks of the `blockwise` attention: the most equal blocks (<= max_blocks) of >= min_rows rows each.
    n blocks do (n + 1) / 2n of the full [L, L] work; fewer, larger blocks keep XLA's batched matmuls efficient."""
    return chunk_count(L, min(max_blocks, L // min_rows))


def softmax_attention(q_BxLxNxGxDh, k_BxSxNxDh, v_BxSxNxDh, mask_BxHxLxS, return_probs: bool = False):
    """softmax(q k^T / sqrt(Dh), masked) v with fp32 logits and softmax: (out [B,L,N,G,Dh], probs [B,N,G,L,S] if
    return_probs else None).

    Without probabilities the softmax's division is applied to the output ([.., Dh] per query) instead of the
    probabilities ([.., S] per query): exp(logits - max) v / sum(exp(logits - max)), the same function up to
    rounding, and its backward pass has no [.., S]-sized division either (a few percent of the CPU train
    step).
    """
    B, L, N, G, Dh = q_BxLxNxGxDh.shape
    logits = jnp.einsum("blngk,bsnk->bngls", q_BxLxNxGxDh, k_BxSxNxDh,
                        preferred_element_type=jnp.float32) * Dh**-0.5
    S = logits.shape[-1]
    mask_BxNxGxLxS = jnp.broadcast_to(mask_BxHxLxS, (B, mask_BxHxLxS.shape[1], L, S))
    if mask_BxNxGxLxS.shape[1] == 1:
        mask_BxNxGxLxS = mask_BxNxGxLxS[:, :, None]
    else:
        mask_BxNxGxLxS = mask_BxNxGxLxS.reshape(B, N, G, L, S)
    logits = jnp.where(mask_BxNxGxLxS, logits, jnp.finfo(jnp.float32).min)
    dt = q_BxLxNxGxDh.dtype
    if return_probs:
        probs = jax.nn.softmax(logits, axis=-1)  # fp32 softmax
        return jnp.einsum("bngls,bsnk->blngk", probs.astype(dt), v_BxSxNxDh), probs
    # the max only keeps exp in range: it cancels in the ratio, so no gradient flows through it
    unnormalized = jnp.exp(logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True)))
    denom_BxLxNxGx1 = jnp.moveaxis(unnormalized.sum(-1), -1, 1)[..., None]
    out = jnp.einsum("bngls,bsnk->blngk", unnormalized.astype(dt), v_BxSxNxDh, preferred_element_type=jnp.float32)
    return (out / denom_BxLxNxGx1).astype(dt), None


class Attention(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        D, H, N, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = param(rngs, (D, H, Dh), ("embed", "heads", "head_dim"), cfg.init_std)
        self.wk = param(rngs, (D, N, Dh), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        self.wv = param(rngs, (D, N, Dh), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        self.wo = param(rngs, (H, Dh, D), ("heads", "head_dim", "embed"), cfg.out_init_std)
        # Options of other MoE families (off by default; see moe/config.py).
        if cfg.qkv_bias:
            self.bq = nnx.Param(jnp.zeros((H, Dh), jnp.float32), out_sharding=("heads", "head_dim"))
            self.bk = nnx.Param(jnp.zeros((N, Dh), jnp.float32), out_sharding=("kv_heads", "head_dim"))
            self.bv = nnx.Param(jnp.zeros((N, Dh), jnp.float32), out_sharding=("kv_heads", "head_dim"))
        if cfg.attn_out_bias:
            self.bo = nnx.Param(jnp.zeros((D,), jnp.float32), out_sharding=("embed",))
        if cfg.qk_norm != "none":
            q_dim, k_dim = (Dh, Dh) if cfg.qk_norm == "head" else (H * Dh, N * Dh)
            self.q_norm = RMSNorm(q_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(k_dim, cfg.norm_eps)
        self.cfg = cfg

    def _qk_norm(self, norm, x_BxLxHxDh):
        if self.cfg.qk_norm == "head":
            return norm(x_BxLxHxDh)
        B, L, H, Dh = x_BxLxHxDh.shape  # "full": one RMSNorm over all heads together (OLMoE)
        return norm(x_BxLxHxDh.reshape(B, L, H * Dh)).reshape(B, L, H, Dh)

    def __call__(self, x_BxLxD, positions_BxL, mask_BxHxLxS, ex: Execution, cache=None, cache_index=None,
                 return_probs=False, causal=False):
        """Returns (out_BxLxD, new_cache or None, probs_BxHxLxS or None).

        causal: the caller's promise that the mask hides every key after its query (a causal mask, with or
        without segments), so the kernels may skip those keys without reading the mask; False (the default) is
        right for any mask.

        With `cache` ({"k","v": [B,S,N,Dh]}), this call's keys/values are written at slots
        [cache_index, cache_index + L) and queries attend over all S slots (the mask hides unwritten ones).

        `ex.attention_impl` "xla" / "cudnn" hands the no-cache, no-probabilities call (training, evaluation) to
        `jax.nn.dot_product_attention` with that implementation: cuDNN's fused flash attention on NVIDIA GPUs,
        with no fp32 [B,H,L,S] logits or probabilities in memory. For a causal call it also passes is_causal,
        so the kernel skips blocks above the diagonal; the boolean mask (segments, prefix) still applies, and
        cuDNN takes it as an additive bias of the mask's shape ([B,1,L,S], or [B,H,L,S] for `mixed`). The
        einsum path below is the reference it is tested against, and the path for the KV cache and for
        attention probabilities. "blockwise" (the default) runs the einsum path a block of queries at a time in a
        causal call, each block against the keys up to its last row only (`causal_blocks`): no
        logits above the diagonal's blocks are computed, the same function up to rounding.
        """
        cfg, dt = self.cfg, x_BxLxD.dtype
        q_BxLxHxDh = matmul_rows(x_BxLxD, self.wq[...].astype(dt))
        k_BxLxNxDh = matmul_rows(x_BxLxD, self.wk[...].astype(dt))
        v_BxLxNxDh = matmul_rows(x_BxLxD, self.wv[...].astype(dt))
        if cfg.qkv_bias:
            q_BxLxHxDh = q_BxLxHxDh + self.bq[...].astype(dt)
            k_BxLxNxDh = k_BxLxNxDh + self.bk[...].astype(dt)
            v_BxLxNxDh = v_BxLxNxDh + self.bv[...].astype(dt)
        if cfg.qk_norm != "none":
            q_BxLxHxDh = self._qk_norm(self.q_norm, q_BxLxHxDh)
            k_BxLxNxDh = self._qk_norm(self.k_norm, k_BxLxNxDh)
        if cfg.rope:
            q_BxLxHxDh = rope(q_BxLxHxDh, positions_BxL, cfg.rope_theta, cfg.rope_dim)
            k_BxLxNxDh = rope(k_BxLxNxDh, positions_BxL, cfg.rope_theta, cfg.rope_dim)
        # q, k and v sharded alike (heads over tensor): cuDNN's partitioner requires identical shardings.
        q_BxLxHxDh = ex.constrain(q_BxLxHxDh, ("batch", "length", "act_heads", None))
        k_BxLxNxDh = ex.constrain(k_BxLxNxDh, ("batch", "length", "act_heads", None))
        v_BxLxNxDh = ex.constrain(v_BxLxNxDh, ("batch", "length", "act_heads", None))
        new_cache = None
        if cache is not None:
            at = (0, cache_index, 0, 0)
            k_all = jax.lax.dynamic_update_slice(cache["k"], k_BxLxNxDh.astype(cache["k"].dtype), at)
            v_all = jax.lax.dynamic_update_slice(cache["v"], v_BxLxNxDh.astype(cache["v"].dtype), at)
            new_cache = {"k": k_all, "v": v_all}
            k_BxSxNxDh, v_BxSxNxDh = k_all.astype(dt), v_all.astype(dt)
        else:
            k_BxSxNxDh, v_BxSxNxDh = k_BxLxNxDh, v_BxLxNxDh

        if ex.attention_impl in ("xla", "cudnn") and cache is None and not return_probs:
            out_BxLxHxDh = jax.nn.dot_product_attention(
                q_BxLxHxDh, k_BxSxNxDh, v_BxSxNxDh, mask=mask_BxHxLxS, is_causal=causal,
                implementation=platform.attention_impl(ex.attention_impl, ex.platform or None))
            out_BxLxD = matmul_rows(out_BxLxHxDh, self.wo[...].astype(dt), contract=2)
            return self._out_bias(out_BxLxD), None, None

        B, L, H, Dh = q_BxLxHxDh.shape
        N = cfg.n_kv_heads
        q_BxLxNxGxDh = q_BxLxHxDh.reshape(B, L, N, H // N, Dh)  # query head h uses kv head h // G
        blockwise = ex.attention_impl == "blockwise" and causal and cache is None and not return_probs
        n = causal_blocks(L) if blockwise else 1
        if n == 1:
            out_BxLxNxGxDh, probs = softmax_attention(q_BxLxNxGxDh, k_BxSxNxDh, v_BxSxNxDh, mask_BxHxLxS,
                                                      return_probs)
        else:
            # A causal mask hides every key after a query: block i of C queries needs only keys [0, (i+1) C).
            C = L // n
            out_BxLxNxGxDh = jnp.concatenate([
                softmax_attention(q_BxLxNxGxDh[:, i * C:(i + 1) * C], k_BxSxNxDh[:, :(i + 1) * C],
                                  v_BxSxNxDh[:, :(i + 1) * C], mask_BxHxLxS[:, :, i * C:(i + 1) * C, :(i + 1) * C])[0]
                for i in range(n)], axis=1)
        out_BxLxD = matmul_rows(out_BxLxNxGxDh.reshape(B, L, H, Dh), self.wo[...].astype(dt), contract=2)
        probs_BxHxLxS = probs.reshape(B, H, L, -1) if return_probs else None
        return self._out_bias(out_BxLxD), new_cache, probs_BxHxLxS

    def _out_bias(self, out_BxLxD):
        return out_BxLxD + self.bo[...].astype(out_BxLxD.dtype) if self.cfg.attn_out_bias else out_BxLxD


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
