"""Building blocks: RMSNorm, the attention kernels (`attention`, shared with moe/mla.py), (grouped-query) attention
with a KV cache, SwiGLU MLP. Rotary embedding: moe/rope.py.

Key: B batch, L query length, S key length (= L, or cache slots), D model, H heads, G query heads per kv head,
N kv heads, Dh head dim, F ffn width. Params are fp32; matmuls run in `dtype`; softmax and norms in fp32.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from moe import platform
from moe.execution import Execution
from moe.rope import rope, rotate  # noqa: F401 (rope: imported from here by callers)


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


def chunk_count(L: int, chunks: int) -> int:
    """The largest divisor of L that is at most `chunks` (>= 1): equal chunks for any sequence length."""
    return max(d for d in range(1, max(1, min(chunks, L)) + 1) if L % d == 0)


def causal_blocks(L: int, max_blocks: int = 4, min_rows: int = 32) -> int:
    """Query blocks of the `blockwise` attention: the most equal blocks (<= max_blocks) of >= min_rows rows each.
    n blocks do (n + 1) / 2n of the full [L, L] work; fewer, larger blocks keep XLA's batched matmuls efficient."""
    return chunk_count(L, min(max_blocks, L // min_rows))


def softmax_attention(q_BxLxNxGxDh, k_BxSxNxDh, v_BxSxNxDh, mask_BxHxLxS, return_probs: bool = False,
                      scale: float | None = None):
    """softmax(q k^T * scale, masked) v with fp32 logits and softmax: (out [B,L,N,G,Dv], probs [B,N,G,L,S] if
    return_probs else None). scale None: 1/sqrt(Dh). Values may be Dv wide, Dv != Dh (MLA).

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
    if return_probs:
        probs = jax.nn.softmax(logits, axis=-1)  # fp32 softmax
        return jnp.einsum("bngls,bsnk->blngk", probs.astype(dt), v_BxSxNxDh), probs
    # the max only keeps exp in range: it cancels in the ratio, so no gradient flows through it
    unnormalized = jnp.exp(logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True)))
    denom_BxLxNxGx1 = jnp.moveaxis(unnormalized.sum(-1), -1, 1)[..., None]
    out = jnp.einsum("bngls,bsnk->blngk", unnormalized.astype(dt), v_BxSxNxDh, preferred_element_type=jnp.float32)
    return (out / denom_BxLxNxGx1).astype(dt), None


def attention(q_BxLxHxDk, k_BxSxNxDk, v_BxSxNxDv, mask_BxHxLxS, ex: Execution, *, causal: bool, cached: bool,
              return_probs: bool, scale: float | None = None):
    """softmax(q k^T * scale, masked) v by `ex.attention_impl`: (out [B,L,H,Dv], probs [B,H,L,S] or None). Query
    head h reads kv head h // (H / N). scale None: 1/sqrt(Dk).

    "xla" / "cudnn" hand the call to `jax.nn.dot_product_attention` unless it reads a cache (`cached`) or returns
    probabilities; keys narrower or wider than values (MLA) are zero-padded to one width there, which changes no
    q.k and no kept output column. "blockwise" runs the einsum path a block of queries at a time in a causal
    call, each block against the keys up to its last row only (`causal_blocks`). "einsum" is the reference.
    causal: the caller's promise that the mask hides every key after its query.
    """
    Dk, Dv = q_BxLxHxDk.shape[-1], v_BxSxNxDv.shape[-1]
    if ex.attention_impl in ("xla", "cudnn") and not cached and not return_probs:
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
    blockwise = ex.attention_impl == "blockwise" and causal and not cached and not return_probs
    n = causal_blocks(L) if blockwise else 1
    if n == 1:
        out_BxLxNxGxDv, probs = softmax_attention(q_BxLxNxGxDk, k_BxSxNxDk, v_BxSxNxDv, mask_BxHxLxS, return_probs,
                                                  scale)
    else:
        # A causal mask hides every key after a query: block i of C queries needs only keys [0, (i+1) C).
        C = L // n
        out_BxLxNxGxDv = jnp.concatenate([
            softmax_attention(q_BxLxNxGxDk[:, i * C:(i + 1) * C], k_BxSxNxDk[:, :(i + 1) * C],
                              v_BxSxNxDv[:, :(i + 1) * C], mask_BxHxLxS[:, :, i * C:(i + 1) * C, :(i + 1) * C],
                              scale=scale)[0]
            for i in range(n)], axis=1)
    probs_BxHxLxS = probs.reshape(B, H, L, -1) if return_probs else None
    return out_BxLxNxGxDv.reshape(B, L, H, Dv), probs_BxHxLxS


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

        `ex.attention_impl` picks the kernel (`attention` above): "xla" / "cudnn" hand the no-cache,
        no-probabilities call (training, evaluation) to `jax.nn.dot_product_attention` (cuDNN's fused flash
        attention on NVIDIA GPUs, no fp32 [B,H,L,S] logits in memory; for a causal call it also passes is_causal,
        and the boolean mask still applies, as an additive bias of the mask's shape). The einsum path is the
        reference, and the path for the KV cache and for attention probabilities; "blockwise" (the default) runs
        it a block of queries at a time in a causal call, the same function up to rounding.
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
            q_BxLxHxDh = rotate(cfg, q_BxLxHxDh, positions_BxL, cfg.rope_dim)
            k_BxLxNxDh = rotate(cfg, k_BxLxNxDh, positions_BxL, cfg.rope_dim)
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
        out_BxLxHxDh, probs_BxHxLxS = attention(q_BxLxHxDh, k_BxSxNxDh, v_BxSxNxDh, mask_BxHxLxS, ex, causal=causal,
                                                cached=cache is not None, return_probs=return_probs)
        out_BxLxD = matmul_rows(out_BxLxHxDh, self.wo[...].astype(dt), contract=2)
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
