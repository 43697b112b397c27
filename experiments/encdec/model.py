"""A small encoder-decoder built from the decoder-only model's own blocks: the baseline the
"why decoder-only" arguments compare against.

  encoder  Blocks (moe.model.Block: attention + dense/MoE FFN) with a bidirectional mask over the source
  decoder  DecoderBlocks: causal self-attention, cross-attention to the encoder output, dense/MoE FFN
Source and target share one embedding table and the LM head is the decoder-only model's. RoPE in self-attention
(both stacks); cross-attention has no positions (as in T5). Segment id 0 marks padding on either side: padded
source tokens are never attended to.

Key: B batch, S source length, T target length, D model, H heads, N kv heads, G = H / N, Dh head dim, V vocab.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from moe.attention import Attention, BlockInputs, attention_mask
from moe.dispatch.execution import Execution
from moe.ffn import MLP, MoE
from moe.model import DEFAULT_EXECUTION, Aux, Block, routing_stats
from moe.nn import RMSNorm, matmul_rows, param


class CrossAttention(nnx.Module):
    """Queries from the decoder, keys and values from the encoder output (grouped-query, fp32 softmax)."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        D, H, N, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = param(rngs, (D, H, Dh), ("embed", "heads", "head_dim"), cfg.init_std)
        self.wk = param(rngs, (D, N, Dh), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        self.wv = param(rngs, (D, N, Dh), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        self.wo = param(rngs, (H, Dh, D), ("heads", "head_dim", "embed"), cfg.out_init_std)
        self.cfg = cfg

    def __call__(self, x_BxTxD, mem_BxSxD, mask_Bx1xTxS):
        cfg, dt = self.cfg, x_BxTxD.dtype
        B, T, _ = x_BxTxD.shape
        H, N, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_BxTxNxGxDh = matmul_rows(x_BxTxD, self.wq[...].astype(dt)).reshape(B, T, N, H // N, Dh)
        k_BxSxNxDh = matmul_rows(mem_BxSxD, self.wk[...].astype(dt))
        v_BxSxNxDh = matmul_rows(mem_BxSxD, self.wv[...].astype(dt))
        logits = jnp.einsum("btngk,bsnk->bngts", q_BxTxNxGxDh, k_BxSxNxDh,
                            preferred_element_type=jnp.float32) * Dh**-0.5
        logits = jnp.where(mask_Bx1xTxS[:, :, None], logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bngts,bsnk->btngk", probs.astype(dt), v_BxSxNxDh).reshape(B, T, H, Dh)
        return matmul_rows(out, self.wo[...].astype(dt), contract=2)


class DecoderBlock(nnx.Module):
    def __init__(self, cfg, layer: int, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, rngs)
        self.cross_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.cross = CrossAttention(cfg, rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.is_moe = cfg.is_moe_layer(layer)
        self.ffn = MoE(cfg, rngs) if self.is_moe else MLP(cfg.d_model, cfg.d_ff, cfg, rngs)

    def __call__(self, x_BxTxD, positions_BxT, self_mask, mem_BxSxD, cross_mask, valid_BxT, ex: Execution):
        # self_mask is causal (EncoderDecoder builds it so): the kernels may skip later keys.
        inputs = BlockInputs(positions_BxT, self_mask, valid_BxT, causal=True)
        x_BxTxD = x_BxTxD + self.attn(self.attn_norm(x_BxTxD), inputs, ex)[0]
        x_BxTxD = x_BxTxD + self.cross(self.cross_norm(x_BxTxD), mem_BxSxD, cross_mask)
        if self.is_moe:
            h, routing = self.ffn(self.ffn_norm(x_BxTxD), valid_BxT, ex)
        else:
            h, routing = self.ffn(self.ffn_norm(x_BxTxD), ex), None
        return x_BxTxD + h, routing


class EncoderDecoder(nnx.Module):
    """`cfg` as for moe.Transformer (cfg.mask is ignored: the encoder is bidirectional, the decoder causal);
    cfg.n_layers decoder layers and `n_encoder_layers` (default cfg.n_layers) encoder layers."""

    def __init__(self, cfg, rngs: nnx.Rngs, n_encoder_layers: int | None = None):
        n_enc = cfg.n_layers if n_encoder_layers is None else n_encoder_layers
        enc_cfg = dataclasses.replace(cfg, n_layers=n_enc, mask="bidirectional")
        cfg = dataclasses.replace(cfg, mask="causal")
        with nnx.use_eager_sharding(False):  # as moe.Transformer: build unsharded
            self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std)
            self.encoder = nnx.List([Block(enc_cfg, i, rngs) for i in range(n_enc)])
            self.enc_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.decoder = nnx.List([DecoderBlock(cfg, i, rngs) for i in range(cfg.n_layers)])
            self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std)
        self.cfg = cfg

    def encode(self, src_BxS, src_segment_ids_BxS=None, execution: Execution = DEFAULT_EXECUTION):
        """Encoder output [B,S,D] and its MoE routing."""
        ex = execution
        dt = jnp.dtype(ex.dtype)
        B, S = src_BxS.shape
        idx = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        seg = jnp.ones((B, S), jnp.int32) if src_segment_ids_BxS is None else src_segment_ids_BxS
        mask = attention_mask("bidirectional", idx, idx, n_heads=self.cfg.n_heads, q_seg_BxQ=seg, k_seg_BxK=seg)
        x = jnp.take(self.embed[...], src_BxS, axis=0).astype(dt)
        routing = []
        for block in self.encoder:
            out = block(x, BlockInputs(idx, mask, seg > 0), ex)
            x = out.x
            routing += [out.routing] if out.routing is not None else []
        return self.enc_norm(x), routing

    def __call__(self, src_BxS, tgt_BxT, *, src_segment_ids_BxS=None, tgt_segment_ids_BxT=None,
                 execution: Execution = DEFAULT_EXECUTION):
        """Logits [B,T,V] (fp32) for the next target token at every target position, and an Aux as
        moe.Transformer's (balance_loss unweighted; expert_load and dropped_frac over the decoder's then the
        encoder's MoE layers)."""
        ex = execution
        cfg, dt = self.cfg, jnp.dtype(ex.dtype)
        B, T = tgt_BxT.shape
        S = src_BxS.shape[1]
        mem, enc_routing = self.encode(src_BxS, src_segment_ids_BxS, ex)
        routing = []
        tseg = jnp.ones((B, T), jnp.int32) if tgt_segment_ids_BxT is None else tgt_segment_ids_BxT
        sseg = jnp.ones((B, S), jnp.int32) if src_segment_ids_BxS is None else src_segment_ids_BxS
        idx = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        self_mask = attention_mask("causal", idx, idx, n_heads=cfg.n_heads, q_seg_BxQ=tseg, k_seg_BxK=tseg)
        cross_mask = (tseg[:, None, :, None] > 0) & (sseg[:, None, None, :] > 0)
        x = jnp.take(self.embed[...], tgt_BxT, axis=0).astype(dt)
        for block in self.decoder:
            x, r = block(x, idx, self_mask, mem, cross_mask, tseg > 0, ex)
            routing += [r] if r is not None else []
        logits = jnp.einsum("btd,dv->btv", self.final_norm(x), self.lm_head[...].astype(dt),
                            preferred_element_type=jnp.float32)
        # Decoder layers first: the order of the model's RoutingBias leaves (nnx orders attributes by name), which
        # the train step pairs with these rows to update each layer's bias from its own load.
        routing += enc_routing
        return logits, Aux(**routing_stats(routing, cfg.n_routed_experts))


def n_params(model) -> int:
    """Every parameter of a model (embedding and head included)."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
