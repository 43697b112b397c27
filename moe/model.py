"""The decoder-only Transformer: embed -> n_layers x [pre-norm attention, pre-norm FFN] -> norm -> LM head.

Key: B batch, L length, S key slots, D model, V vocab, E routed experts, K top-k, M MoE layers.
The first `first_k_dense` blocks use a dense SwiGLU, the rest the DeepSeek-V3 MoE (cfg.is_moe_layer: other
families may interleave dense layers, see moe_layer_step / dense_layers).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from moe.config import ModelConfig
from moe.layers import MLP, Attention, RMSNorm, param
from moe.masks import attention_mask
from moe.moe_layer import MoE
from moe.sharding import constrain


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.is_moe = cfg.is_moe_layer(layer)
        self.ffn = MoE(cfg, rngs) if self.is_moe else MLP(cfg.d_model, cfg.d_ff, cfg, rngs)

    def __call__(self, x_BxLxD, positions_BxL, mask, valid_BxL, cache=None, cache_index=None,
                 return_probs=False):
        h, new_cache, probs = self.attn(self.attn_norm(x_BxLxD), positions_BxL, mask, cache, cache_index,
                                        return_probs)
        x_BxLxD = x_BxLxD + h
        if self.is_moe:
            h, routing = self.ffn(self.ffn_norm(x_BxLxD), valid_BxL)
        else:
            h, routing = self.ffn(self.ffn_norm(x_BxLxD)), None
        x_BxLxD = constrain(x_BxLxD + h, ("batch", "length", "act_embed"))
        return x_BxLxD, new_cache, probs, routing


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        # Build unsharded; training maps the logical `out_sharding` metadata onto its mesh (moe/sharding.py).
        with nnx.use_eager_sharding(False):
            self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std)
            self.blocks = nnx.List([Block(cfg, i, rngs) for i in range(cfg.n_layers)])
            self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            if not cfg.tie_embeddings:
                self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std)
        self.cfg = cfg

    def __call__(self, tokens_BxL, *, positions_BxL=None, segment_ids_BxL=None, prefix_len_B=None,
                 cache=None, cache_index=None, return_routing=False, return_attention=False):
        """Logits [B,L,V] (fp32) and an aux dict:

          balance_loss  alpha * sum over MoE layers of the sequence-wise balance loss (0 if alpha == 0)
          expert_load   [M, E] valid tokens per routed expert, every top-k choice counted
          dropped_frac  [M] fraction of valid token copies dropped by a capacity bound (0 for dropless)
          routing       (return_routing) per MoE layer: expert_ids [B,L,K], gates [B,L,K], scores [B,L,E],
                        load [E], balance_loss, dropped_frac
          attention     (return_attention) per layer: probabilities [B,H,L,S]
          cache         (cache given) the updated KV cache, see moe/decode.py

        segment_ids (packed rows): tokens attend only within their segment; segment 0 is padding and is left
        out of the expert load and balance loss. prefix_len [B]: the prefix of each row, for prefix/mixed masks.
        With a cache, this call's tokens occupy slots [cache_index, cache_index + L).
        """
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        B, L = tokens_BxL.shape
        offset = 0 if cache is None else cache_index
        q_idx_BxL = jnp.broadcast_to(offset + jnp.arange(L, dtype=jnp.int32), (B, L))
        if positions_BxL is None:
            positions_BxL = q_idx_BxL
        valid_BxL = jnp.ones((B, L), bool) if segment_ids_BxL is None else segment_ids_BxL > 0
        if cache is None:
            mask = attention_mask(cfg.mask, q_idx_BxL, q_idx_BxL, n_heads=cfg.n_heads,
                                  prefix_len_B=prefix_len_B, q_seg_BxQ=segment_ids_BxL,
                                  k_seg_BxK=segment_ids_BxL)
        else:
            S = cache[0]["k"].shape[1]
            k_idx_BxS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
            mask = attention_mask(cfg.mask, q_idx_BxL, k_idx_BxS, n_heads=cfg.n_heads,
                                  prefix_len_B=prefix_len_B, k_valid_BxK=k_idx_BxS < offset + L)

        x_BxLxD = jnp.take(self.embed.value, tokens_BxL, axis=0).astype(dt)
        x_BxLxD = constrain(x_BxLxD, ("batch", "length", "act_embed"))
        new_cache, probs, routing = [], [], []
        def call(block, x_BxLxD, layer_cache):
            return block(x_BxLxD, positions_BxL, mask, valid_BxL, layer_cache, cache_index, return_attention)

        if cfg.remat:
            call = nnx.remat(call)
        for i, block in enumerate(self.blocks):
            x_BxLxD, c, p, r = call(block, x_BxLxD, None if cache is None else cache[i])
            new_cache.append(c)
            probs.append(p)
            if r is not None:
                routing.append(r)

        x_BxLxD = self.final_norm(x_BxLxD)
        head_DxV = self.embed.value.T if cfg.tie_embeddings else self.lm_head.value
        # One 2-D matmul over all B*L rows: XLA:CPU runs the 3-D einsum's backward (weight gradient contracted
        # over b and l) ~3x slower (benchmarks/train_step.py); the same math on every backend.
        B, L, D = x_BxLxD.shape
        logits_BxLxV = jnp.dot(x_BxLxD.reshape(B * L, D), head_DxV.astype(dt),
                               preferred_element_type=jnp.float32).reshape(B, L, -1)
        logits_BxLxV = constrain(logits_BxLxV, ("batch", "length", "act_vocab"))

        E = cfg.n_routed_experts
        aux = {
            "balance_loss": cfg.balance_loss_weight * sum((r["balance_loss"] for r in routing), jnp.float32(0)),
            "expert_load": jnp.stack([r["load"] for r in routing]) if routing else jnp.zeros((0, E)),
            "dropped_frac": jnp.stack([r["dropped_frac"] for r in routing]) if routing else jnp.zeros((0,)),
        }
        if return_routing:
            aux["routing"] = routing
        if return_attention:
            aux["attention"] = probs
        if cache is not None:
            aux["cache"] = new_cache
        return logits_BxLxV, aux


def routing_biases(model: Transformer) -> list[jax.Array]:
    """The routing bias of every MoE layer, in layer order."""
    return [b.ffn.bias.value for b in model.blocks if b.is_moe]


def set_routing_biases(model: Transformer, biases) -> None:
    for block, b in zip((b for b in model.blocks if b.is_moe), biases, strict=True):
        block.ffn.bias.value = b
