"""Gated DeltaNet: the recurrent token mixer of Qwen3-Next's linear_attention layers (model.linear_layers), in the
attention's place in a block, as transformers 5.25's Qwen3NextGatedDeltaNet computes it.

Key: B batch, L length, D model, Hk key heads, Hv value heads (r = Hv / Hk per key head), Dk key dims, Dv value
dims, C conv channels (2 Hk Dk + Hv Dv), K conv taps.

  projections  x W_qkvz per key head g: [q_g (Dk) | k_g (Dk) | v of value heads g r .. g r + r - 1 (r Dv) | z of
               the same (r Dv)]; x W_ba per key head: [b of its r value heads | a of them]
  conv         y_t = silu(sum_i w[:, i] x_{t-K+1+i}) over the channels [q | k | v] (depthwise, causal, zero history)
  gates        beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias) (the log decay, <= 0, fp32)
  kernel       q, k l2-normed (eps 1e-6), q x Dk^-1/2; value head j reads key head j // r; per value head a state
               S [Dk, Dv] (fp32):  S = exp(g_t) S;  S += k_t (beta_t (v_t - k_t^T S))^T;  o_t = S^T q_t
  output       RMSNorm of o over Dv with a plain weight, x silu(z) (fp32), then W_o

`delta_rule` is the plain recurrence (a lax.scan over tokens): the reference, and what a one-token decoding step
and execution.attention_impl "einsum" run; every other call runs `delta_rule_chunked` (64-token chunks, the WY
form transformers uses for multi-token calls), the same function up to fp32 rounding. A decoding cache per layer holds the last K - 1 conv inputs and the state (`init_cache`), so a continuation from it
equals the whole sequence at once. Packed rows (segment ids) restart the state and the conv at each segment;
padding (segment 0) enters as zeros, as HF's apply_mask_to_padding_states does.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from moe.nn import matmul_rows, param
from plumbing.errors import UserError

L2_EPS = 1e-6  # transformers' l2norm in the kernel, whatever rms_norm_eps is
CHUNK = 64  # tokens per chunk of delta_rule_chunked (transformers' chunk_size)


def is_recurrent_cache(cache) -> bool:
    """A Gated DeltaNet layer's decoding cache (no key slots), not an attention layer's."""
    return isinstance(cache, dict) and "recurrent_state" in cache


def init_cache(cfg, batch: int, dtype) -> dict:
    """One Gated DeltaNet layer's cache: the last K - 1 conv inputs [B, K-1, C] (compute dtype) and the state
    [B, Hv, Dk, Dv] (fp32, as HF keeps it)."""
    C = 2 * cfg.gdn_key_heads * cfg.gdn_key_dim + cfg.gdn_value_heads * cfg.gdn_value_dim
    return {"conv_state": jnp.zeros((batch, cfg.gdn_conv_kernel - 1, C), dtype),
            "recurrent_state": jnp.zeros((batch, cfg.gdn_value_heads, cfg.gdn_key_dim, cfg.gdn_value_dim),
                                         jnp.float32)}


def l2norm(x, eps: float = L2_EPS):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def delta_rule(q_BxLxHxK, k_BxLxHxK, v_BxLxHxV, beta_BxLxH, decay_BxLxH, state_BxHxKxV):
    """The gated delta rule token by token (fp32): (o [B, L, H, Dv], final state [B, H, Dk, Dv]). decay = exp(g)
    (0 restarts the state). q and k already normed and q scaled."""

    def step(S, inputs):
        q, k, v, beta, decay = inputs
        S = S * decay[..., None, None]
        kv_mem_BxHxV = jnp.einsum("bhk,bhkv->bhv", k, S)
        delta_BxHxV = beta[..., None] * (v - kv_mem_BxHxV)
        S = S + jnp.einsum("bhk,bhv->bhkv", k, delta_BxHxV)
        return S, jnp.einsum("bhk,bhkv->bhv", q, S)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q_BxLxHxK, k_BxLxHxK, v_BxLxHxV, beta_BxLxH, decay_BxLxH))
    state, o_LxBxHxV = jax.lax.scan(step, state_BxHxKxV, xs)
    return jnp.moveaxis(o_LxBxHxV, 0, 1), state


def delta_rule_chunked(q_BxLxHxK, k_BxLxHxK, v_BxLxHxV, beta_BxLxH, g_BxLxH, state_BxHxKxV, start_BxL=None,
                       chunk: int = CHUNK):
    """`delta_rule` by chunks of `chunk` tokens (the WY form transformers' torch_chunk_gated_delta_rule uses): the
    same function up to fp32 rounding, the sequential work L / chunk steps of matmuls instead of L rank-1 updates.
    g is the log decay (<= 0); start [B, L] marks tokens whose decay is 0 (a segment's first: the state restarts).

    Within a chunk, with G = cumsum(g) and S0 the state before it, the recurrence unrolls to
      U = (I + A)^-1 (v beta - (k beta exp(G)) S0),   A[t, j] = beta_t (k_t . k_j) exp(G_t - G_j), j < t
      o_t = exp(G_t) S0^T q_t + sum_{j <= t} exp(G_t - G_j) (q_t . k_j) U_j
      S_C = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j U_j^T
    and a restart between j and t zeroes the factor exp(G_t - G_j) (between the chunk's start and t: exp(G_t)).
    """
    B, L, H, Dk = k_BxLxHxK.shape
    n = -(-L // chunk)
    pad = n * chunk - L  # zero tokens after the end: no write (beta 0), no decay (g 0)

    def chunks(x):  # [B, L, H, ...] -> [B, N, H, C, ...]
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        x = x.reshape(B, n, chunk, *x.shape[2:])
        return jnp.moveaxis(x, 2, 3)

    q, k, v, beta, g = map(chunks, (q_BxLxHxK, k_BxLxHxK, v_BxLxHxV, beta_BxLxH, g_BxLxH))  # [B, N, H, C, ...]
    starts = jnp.zeros((B, L), jnp.int32) if start_BxL is None else start_BxL.astype(jnp.int32)
    seg_BxNxC = jnp.cumsum(jnp.pad(starts, ((0, 0), (0, pad))).reshape(B, n, chunk), axis=-1)  # restarts so far
    seg = seg_BxNxC[:, :, None]  # [B, N, 1, C]
    G = jnp.cumsum(g, axis=-1)  # [B, N, H, C]
    causal_CxC = jnp.tril(jnp.ones((chunk, chunk), bool))
    keep = causal_CxC & (seg[..., :, None] == seg[..., None, :])  # [B, N, 1, C, C]: no restart in (j, t]
    Gdiff = G[..., :, None] - G[..., None, :]
    decay_CxC = jnp.where(keep, jnp.exp(jnp.where(keep, Gdiff, 0.0)), 0.0)  # exp(G_t - G_j), 0 across a restart
    from_state = jnp.where(seg == 0, jnp.exp(G), 0.0)  # [B, N, H, C]: exp(G_t), 0 after a restart in the chunk
    kb = k * beta[..., None]
    A = jnp.einsum("bnhtk,bnhjk->bnhtj", kb, k) * decay_CxC * ~jnp.eye(chunk, dtype=bool)
    eye = jnp.eye(chunk, dtype=jnp.float32)
    solve = lambda x: jax.scipy.linalg.solve_triangular(eye + A, x, lower=True, unit_diagonal=True)
    U0 = solve(v * beta[..., None])  # [B, N, H, C, Dv]
    W = solve(kb * from_state[..., None])  # [B, N, H, C, Dk]
    qk = jnp.einsum("bnhtk,bnhjk->bnhtj", q, k) * decay_CxC
    q_state = q * from_state[..., None]
    last = decay_CxC[..., -1, :]  # [B, N, H, C]: exp(G_C - G_j), 0 across a restart
    k_last = k * last[..., None]
    carry = from_state[..., -1]  # [B, N, H]

    def step(S, xs):
        U0, W, qk, q_state, k_last, carry = xs
        U = U0 - jnp.einsum("bhck,bhkv->bhcv", W, S)
        o = jnp.einsum("bhck,bhkv->bhcv", q_state, S) + jnp.einsum("bhcj,bhjv->bhcv", qk, U)
        S = carry[..., None, None] * S + jnp.einsum("bhck,bhcv->bhkv", k_last, U)
        return S, o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (U0, W, qk, q_state, k_last, carry))
    state, o_NxBxHxCxV = jax.lax.scan(step, state_BxHxKxV, xs)
    o_BxLxHxV = jnp.moveaxis(o_NxBxHxCxV, 0, 1).swapaxes(2, 3).reshape(B, n * chunk, H, -1)
    return o_BxLxHxV[:, :L], state


def causal_conv(x_BxLxC, w_CxK, history_BxKm1xC, seg_BxL=None):
    """silu of the depthwise causal conv of x after `history` (the K - 1 inputs before it): (y [B, L, C], the last
    K - 1 inputs). With segment ids a tap reads only its own segment's inputs."""
    K, L = w_CxK.shape[1], x_BxLxC.shape[1]
    xpad_BxTxC = jnp.concatenate([history_BxKm1xC.astype(x_BxLxC.dtype), x_BxLxC], axis=1)
    w = w_CxK.astype(x_BxLxC.dtype)
    if seg_BxL is not None:
        seg_pad = jnp.concatenate([jnp.full((seg_BxL.shape[0], K - 1), -1, seg_BxL.dtype), seg_BxL], axis=1)
    y_BxLxC = 0
    for i in range(K):  # tap i reads position t - (K - 1 - i)
        tap = xpad_BxTxC[:, i:i + L]
        if seg_BxL is not None:
            tap = tap * (seg_pad[:, i:i + L] == seg_BxL)[..., None].astype(tap.dtype)
        y_BxLxC = y_BxLxC + w[:, i] * tap
    return jax.nn.silu(y_BxLxC), xpad_BxTxC[:, L:]


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        D, Hk, Hv, Dk, Dv = cfg.d_model, cfg.gdn_key_heads, cfg.gdn_value_heads, cfg.gdn_key_dim, cfg.gdn_value_dim
        r = Hv // Hk
        self.w_qkvz = param(rngs, (D, Hk, 2 * Dk + 2 * r * Dv), ("embed", None, None), cfg.init_std)
        self.w_ba = param(rngs, (D, Hk, 2 * r), ("embed", None, None), cfg.init_std)
        C = 2 * Hk * Dk + Hv * Dv
        self.conv = param(rngs, (C, cfg.gdn_conv_kernel), (None, None), cfg.gdn_conv_kernel ** -0.5)
        self.dt_bias = nnx.Param(jnp.ones((Hv,), jnp.float32), out_sharding=(None,))
        # HF's init: A ~ U(0, 16), stored as log A (decay rates spread over the heads)
        A = jax.random.uniform(rngs.params(), (Hv,), jnp.float32, 1.0, 16.0)
        self.A_log = nnx.Param(jnp.log(A), out_sharding=(None,))
        self.out_norm = nnx.Param(jnp.ones((Dv,), jnp.float32), out_sharding=("norm",))
        self.wo = param(rngs, (Hv, Dv, D), (None, None, "embed"), cfg.out_init_std)
        self.cfg = cfg

    def __call__(self, x_BxLxD, inputs, ex, *, cache=None, return_probs: bool = False):
        """(out [B, L, D], the updated cache or None, None): the Attention interface (moe/attention.py)."""
        if return_probs:
            raise UserError("a Gated DeltaNet layer (model.linear_layers) has no attention probabilities; inspect "
                            "the attention layers of a model without linear_layers")
        cfg, dt = self.cfg, x_BxLxD.dtype
        B, L, _ = x_BxLxD.shape
        Hk, Hv, Dk, Dv = cfg.gdn_key_heads, cfg.gdn_value_heads, cfg.gdn_key_dim, cfg.gdn_value_dim
        r = Hv // Hk
        seg_BxL = inputs.segment_ids_BxL
        if seg_BxL is not None:  # padding enters as zeros (HF's apply_mask_to_padding_states)
            x_BxLxD = jnp.where((seg_BxL > 0)[..., None], x_BxLxD, 0).astype(dt)
        qkvz_BxLxHkxE = matmul_rows(x_BxLxD, self.w_qkvz[...].astype(dt))
        q, k, v, z = jnp.split(qkvz_BxLxHkxE, [Dk, 2 * Dk, 2 * Dk + r * Dv], axis=-1)
        ba_BxLxHkx2r = matmul_rows(x_BxLxD, self.w_ba[...].astype(dt))
        b_BxLxHv = ba_BxLxHkx2r[..., :r].reshape(B, L, Hv)
        a_BxLxHv = ba_BxLxHkx2r[..., r:].reshape(B, L, Hv)
        mixed_BxLxC = jnp.concatenate([q.reshape(B, L, -1), k.reshape(B, L, -1), v.reshape(B, L, -1)], axis=-1)
        fresh = cache is None
        state = init_cache(cfg, B, dt) if fresh else cache
        y_BxLxC, conv_state = causal_conv(mixed_BxLxC, self.conv[...], state["conv_state"], seg_BxL)
        q_BxLxHkxK = y_BxLxC[..., :Hk * Dk].reshape(B, L, Hk, Dk).astype(jnp.float32)
        k_BxLxHkxK = y_BxLxC[..., Hk * Dk:2 * Hk * Dk].reshape(B, L, Hk, Dk).astype(jnp.float32)
        v_BxLxHvxV = y_BxLxC[..., 2 * Hk * Dk:].reshape(B, L, Hv, Dv).astype(jnp.float32)
        # value head j reads key head j // r
        q_BxLxHvxK = jnp.repeat(l2norm(q_BxLxHkxK) * Dk ** -0.5, r, axis=2)
        k_BxLxHvxK = jnp.repeat(l2norm(k_BxLxHkxK), r, axis=2)
        beta_BxLxHv = jax.nn.sigmoid(b_BxLxHv).astype(jnp.float32)
        g_BxLxHv = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a_BxLxHv.astype(jnp.float32) + self.dt_bias[...])
        start_BxL = None
        if seg_BxL is not None:  # a segment starts from a zero state
            start_BxL = seg_BxL != jnp.concatenate([seg_BxL[:, :1], seg_BxL[:, :-1]], axis=1)
        if L == 1 or ex.attention_impl == "einsum":  # a decoding step, or the reference kernels asked for
            decay_BxLxHv = jnp.exp(g_BxLxHv)
            if start_BxL is not None:
                decay_BxLxHv = jnp.where(start_BxL[..., None], 0.0, decay_BxLxHv)
            o_BxLxHvxV, S = delta_rule(q_BxLxHvxK, k_BxLxHvxK, v_BxLxHvxV, beta_BxLxHv, decay_BxLxHv,
                                       state["recurrent_state"])
        else:
            o_BxLxHvxV, S = delta_rule_chunked(q_BxLxHvxK, k_BxLxHvxK, v_BxLxHvxV, beta_BxLxHv, g_BxLxHv,
                                               state["recurrent_state"], start_BxL)
        out_BxLxD = matmul_rows(self._gated_norm(o_BxLxHvxV.astype(dt), z.reshape(B, L, Hv, Dv)),
                                self.wo[...].astype(dt), contract=2)
        new_cache = None if fresh else {"conv_state": conv_state.astype(cache["conv_state"].dtype),
                                        "recurrent_state": S}
        return out_BxLxD, new_cache, None

    def _gated_norm(self, o_BxLxHxV, z_BxLxHxV):
        """HF's Qwen3NextRMSNormGated: normalize in fp32, scale in the compute dtype, x silu(z) in fp32."""
        dt = o_BxLxHxV.dtype
        o32 = o_BxLxHxV.astype(jnp.float32)
        o32 = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + self.cfg.norm_eps)
        h = self.out_norm[...].astype(dt) * o32.astype(dt)
        return (h.astype(jnp.float32) * jax.nn.silu(z_BxLxHxV.astype(jnp.float32))).astype(dt)
