"""Attention masks by mode, in terms of absolute slot indices (row index in training, cache slot in decoding).

  causal         key k visible to query q iff k <= q                                     (GPT)
  prefix         causal, plus bidirectional inside the prefix: k < P and q < P          (prefix-LM / UniLM)
  bidirectional  every key visible
  mixed          inside the prefix, the first half of the heads see k <= q (lower-triangular) and the second
                 half q <= k < P (upper-triangular), so each head's matrix stays triangular (full rank) while
                 the layer sees both directions; queries after the prefix are causal in every head.

Segment ids keep attention inside one document of a packed row; `k_valid` hides unwritten cache slots.
Returns bool [B, 1, Q, K] (or [B, H, Q, K] for `mixed`).
"""

import jax.numpy as jnp


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
