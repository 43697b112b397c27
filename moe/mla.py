"""Multi-head latent attention (MLA; DeepSeek-V2 §2.1, DeepSeek-V3 §2.1) and its compressed KV cache.

Key: B batch, L query length, S key length (= L, or cache slots), D model, H heads, Q q_lora_rank, R kv_lora_rank,
Dn / Dr / Dv the per-head no-position / rotary / value dims, Dq = Dn + Dr.

  query    q = RMSNorm(x W_qa) W_qb (Q > 0) or x W_q, per head [q_nope (Dn) | q_rope (Dr)], RoPE on q_rope
  latent   [c (R) | k_rope (Dr)] = x W_kva; c = RMSNorm(c); k_rope roped, one key all heads share
  keys     per head [c W_uk (Dn) | k_rope]; values c W_uv (Dv); W_kvb = [W_uk | W_uv] per head
  scores   q.k * softmax_scale: 1/sqrt(Dq), times YaRN's mscale(factor, mscale_all_dim)^2 (moe/attention.py)
Both RMSNorms use model.latent_norm_eps (0: norm_eps); DeepSeek checkpoints need 1e-6 there (the HF importer sets it).

The cache holds c and the roped k_rope, R + Dr numbers per token and layer ({"latent": [B,S,R], "k_rope": [B,S,Dr]},
moe/decoding/generate.py). Two forms compute the same function:
  expanded  keys and values rebuilt per head from the latent, then `moe.attention.attention` with any
            attention_impl (blockwise, einsum, and xla / cudnn with keys and values zero-padded to one width).
            Training and every call without a cache; with a cache and attention_impl="einsum", the naive decode,
            the reference.
  absorbed  with a cache (decoding; any other attention_impl): W_uk folded into the query, q_nope W_uk^T
            [B,L,H,R], scored against the cached latent directly; the attention-weighted latents [B,L,H,R] go
            through W_uv, then W_o. No per-head key or value is ever built for the S cached slots.

Parameters and HF's DeepseekV3Attention / DeepseekV2Attention (torch Linear weights are [out, in]):
  wq    [D,H,Dq]    q_proj.weight.T.reshape(D, H, Dq)            (q_lora_rank 0)
  wq_a  [D,Q]       q_a_proj.weight.T                            (q_lora_rank > 0, with q_norm and wq_b)
  q_norm.scale      q_a_layernorm.weight
  wq_b  [Q,H,Dq]    q_b_proj.weight.T.reshape(Q, H, Dq)
  wkv_a [D,R+Dr]    kv_a_proj_with_mqa.weight.T
  kv_norm.scale     kv_a_layernorm.weight
  wkv_b [R,H,Dn+Dv] kv_b_proj.weight.T.reshape(R, H, Dn + Dv)
  wo    [H,Dv,D]    o_proj.weight.T.reshape(H, Dv, D)
Per head, the Dq query dims are [nope | rope] and the Dn + Dv kv_b dims [k_nope | v], as HF splits them. Config:
HF's rope_interleave (DeepSeek-V3 checkpoints: true) is model.rope_interleave; deepseek_v2 always interleaves
(its complex rotation) and the rotated pairs land in place there, in [evens | odds] here: only q.k is compared
(the same numbers), never the roped dims themselves. attention_bias=true is not supported (validate refuses the
biases with mla).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from moe.attention import BlockInputs, attention, query_scale, rotate, softmax_scale
from moe.dispatch.execution import Execution
from moe.nn import RMSNorm, matmul_rows, param


class MLA(nnx.Module):
    """Sharding: heads over tensor (wq / wq_b / wkv_b / wo), as GQA's. The down projections (wq_a, wkv_a) and the
    latents are replicated across tensor ranks: each rank computes the whole latent (D x (Q + R + Dr) per token,
    small beside the per-head projections) instead of gathering a latent sharded over tensor before every
    up projection. Along fsdp the down projections split on `embed` and the up projections on `latent_in`."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        D, H, Q, R = cfg.d_model, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank
        Dn, Dr, Dv, std = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.init_std
        eps = cfg.latent_norm_eps or cfg.norm_eps
        if Q:
            self.wq_a = param(rngs, (D, Q), ("embed", "latent"), std)
            self.q_norm = RMSNorm(Q, eps)
            self.wq_b = param(rngs, (Q, H, Dn + Dr), ("latent_in", "heads", "head_dim"), std)
        else:
            self.wq = param(rngs, (D, H, Dn + Dr), ("embed", "heads", "head_dim"), std)
        self.wkv_a = param(rngs, (D, R + Dr), ("embed", "latent"), std)
        self.kv_norm = RMSNorm(R, eps)
        self.wkv_b = param(rngs, (R, H, Dn + Dv), ("latent_in", "heads", "head_dim"), std)
        self.wo = param(rngs, (H, Dv, D), ("heads", "head_dim", "embed"), cfg.out_init_std)
        self.cfg = cfg
        self.scale = softmax_scale(cfg, Dn + Dr)
        # LongCat-Flash: the query and the normed latent (what the cache holds) scaled by sqrt(D / rank)
        self.q_scale = (D / Q) ** 0.5 if cfg.mla_lora_scale else 1.0
        self.kv_scale = (D / R) ** 0.5 if cfg.mla_lora_scale else 1.0

    def __call__(self, x_BxLxD, inputs: BlockInputs, ex: Execution, *, cache=None, return_probs: bool = False):
        """(out [B,L,D], new_cache or None, probs [B,H,L,S] or None): the signature of moe.attention.Attention.

        With `cache` ({"latent": [B,S,R], "k_rope": [B,S,Dr]}) this call's latents are written at slots
        [inputs.cache_index, inputs.cache_index + L) and queries attend over all S slots (the mask hides unwritten
        ones).
        """
        cfg, dt = self.cfg, x_BxLxD.dtype
        positions_BxL, mask_BxHxLxS, cache_index = inputs.positions_BxL, inputs.mask, inputs.cache_index
        Dn = cfg.qk_nope_head_dim
        q_BxLxHxDq = ex.constrain(self._query(x_BxLxD), ("batch", "length", "act_heads", None))
        q_nope_BxLxHxDn = q_BxLxHxDq[..., :Dn]
        q_rope_BxLxHxDr = rotate(cfg, q_BxLxHxDq[..., Dn:], positions_BxL, cfg.qk_rope_head_dim)
        scale_BxL = query_scale(cfg, positions_BxL)
        if scale_BxL is not None:  # the whole query, after RoPE (Mistral Small 4)
            scale_BxLx1x1 = scale_BxL[:, :, None, None].astype(q_BxLxHxDq.dtype)
            q_nope_BxLxHxDn, q_rope_BxLxHxDr = q_nope_BxLxHxDn * scale_BxLx1x1, q_rope_BxLxHxDr * scale_BxLx1x1
        c_BxLxR, k_rope_BxLxDr = self._latent(x_BxLxD, positions_BxL)
        c_BxLxR = ex.constrain(c_BxLxR, ("batch", "length", "latent"))
        k_rope_BxLxDr = ex.constrain(k_rope_BxLxDr, ("batch", "length", "latent"))
        c_BxSxR, k_rope_BxSxDr, new_cache = c_BxLxR, k_rope_BxLxDr, None
        if cache is not None:
            c_all = jax.lax.dynamic_update_slice(cache["latent"], c_BxLxR.astype(cache["latent"].dtype),
                                                 (0, cache_index, 0))
            k_all = jax.lax.dynamic_update_slice(cache["k_rope"], k_rope_BxLxDr.astype(cache["k_rope"].dtype),
                                                 (0, cache_index, 0))
            new_cache = {"latent": c_all, "k_rope": k_all}
            c_BxSxR, k_rope_BxSxDr = c_all.astype(dt), k_all.astype(dt)
        if cache is not None and ex.attention_impl != "einsum":
            out_BxLxHxDv, probs = self._absorbed(q_nope_BxLxHxDn, q_rope_BxLxHxDr, c_BxSxR, k_rope_BxSxDr,
                                                 mask_BxHxLxS, return_probs)
        else:
            out_BxLxHxDv, probs = self._expanded(q_nope_BxLxHxDn, q_rope_BxLxHxDr, c_BxSxR, k_rope_BxSxDr,
                                                 mask_BxHxLxS, ex, cache is not None, return_probs, inputs.causal)
        return matmul_rows(out_BxLxHxDv, self.wo[...].astype(dt), contract=2), new_cache, probs

    def _query(self, x_BxLxD):
        dt = x_BxLxD.dtype
        if self.cfg.q_lora_rank:
            cq_BxLxQ = self.q_norm(matmul_rows(x_BxLxD, self.wq_a[...].astype(dt)))
            q_BxLxHxDq = matmul_rows(cq_BxLxQ, self.wq_b[...].astype(dt))
            return q_BxLxHxDq * self.q_scale if self.q_scale != 1.0 else q_BxLxHxDq
        return matmul_rows(x_BxLxD, self.wq[...].astype(dt))

    def _latent(self, x_BxLxD, positions_BxL):
        """(normalized latent c [B,L,R], roped shared key [B,L,Dr]): what the cache holds."""
        R = self.cfg.kv_lora_rank
        kv_BxLxRr = matmul_rows(x_BxLxD, self.wkv_a[...].astype(x_BxLxD.dtype))
        k_rope_BxLx1xDr = rotate(self.cfg, kv_BxLxRr[:, :, None, R:], positions_BxL, self.cfg.qk_rope_head_dim)
        c_BxLxR = self.kv_norm(kv_BxLxRr[..., :R])
        return c_BxLxR * self.kv_scale if self.kv_scale != 1.0 else c_BxLxR, k_rope_BxLx1xDr[:, :, 0]

    def _expanded(self, q_nope_BxLxHxDn, q_rope_BxLxHxDr, c_BxSxR, k_rope_BxSxDr, mask, ex, cached, return_probs,
                  causal):
        """Per-head keys [c W_uk | k_rope] and values c W_uv, then ordinary attention over them."""
        Dn, dt = self.cfg.qk_nope_head_dim, c_BxSxR.dtype
        kv_BxSxHxDkv = matmul_rows(c_BxSxR, self.wkv_b[...].astype(dt))
        B, S, H, _ = kv_BxSxHxDkv.shape
        k_rope_BxSxHxDr = jnp.broadcast_to(k_rope_BxSxDr[:, :, None], (B, S, H, k_rope_BxSxDr.shape[-1]))
        q_BxLxHxDq = jnp.concatenate([q_nope_BxLxHxDn, q_rope_BxLxHxDr], -1)
        k_BxSxHxDq = jnp.concatenate([kv_BxSxHxDkv[..., :Dn], k_rope_BxSxHxDr], -1)
        names = ("batch", "length", "act_heads", None)
        q_BxLxHxDq, k_BxSxHxDq = ex.constrain(q_BxLxHxDq, names), ex.constrain(k_BxSxHxDq, names)
        v_BxSxHxDv = ex.constrain(kv_BxSxHxDkv[..., Dn:], names)
        return attention(q_BxLxHxDq, k_BxSxHxDq, v_BxSxHxDv, mask, ex, causal=causal, cached=cached,
                         return_probs=return_probs, scale=self.scale)

    def _absorbed(self, q_nope_BxLxHxDn, q_rope_BxLxHxDr, c_BxSxR, k_rope_BxSxDr, mask_BxHxLxS, return_probs):
        """Attention over the latent itself: q_nope.(c W_uk) = (q_nope W_uk^T).c, and sum_s p_s (c_s W_uv) =
        (sum_s p_s c_s) W_uv. fp32 logits and softmax, as the einsum reference."""
        Dn, dt = self.cfg.qk_nope_head_dim, c_BxSxR.dtype
        w_kvb_RxHxDkv = self.wkv_b[...].astype(dt)
        q_lat_BxLxHxR = jnp.einsum("blhn,rhn->blhr", q_nope_BxLxHxDn, w_kvb_RxHxDkv[..., :Dn])
        logits_BxHxLxS = (jnp.einsum("blhr,bsr->bhls", q_lat_BxLxHxR, c_BxSxR, preferred_element_type=jnp.float32)
                          + jnp.einsum("blhd,bsd->bhls", q_rope_BxLxHxDr, k_rope_BxSxDr,
                                       preferred_element_type=jnp.float32)) * self.scale
        logits_BxHxLxS = jnp.where(mask_BxHxLxS, logits_BxHxLxS, jnp.finfo(jnp.float32).min)
        probs_BxHxLxS = jax.nn.softmax(logits_BxHxLxS, axis=-1)
        o_lat_BxLxHxR = jnp.einsum("bhls,bsr->blhr", probs_BxHxLxS.astype(dt), c_BxSxR)
        out_BxLxHxDv = jnp.einsum("blhr,rhv->blhv", o_lat_BxLxHxR, w_kvb_RxHxDkv[..., Dn:])
        return out_BxLxHxDv, probs_BxHxLxS if return_probs else None
