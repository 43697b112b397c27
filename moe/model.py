"""The decoder-only Transformer: embed -> n_layers x [pre-norm attention, pre-norm FFN] -> norm -> LM head.

Key: B batch, L length, S key slots, D model, V vocab, E routed experts, K top-k, M MoE layers.
The first `first_k_dense` blocks use a dense SwiGLU, the rest the DeepSeek-V3 MoE (cfg.is_moe_layer: other
families may interleave dense layers, see moe_layer_step / dense_layers).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from moe import kernels, layer_scan
from moe.config import ModelConfig
from moe.execution import Execution
from moe.layers import MLP, Attention, RMSNorm, param
from moe.lm_loss import cross_entropy, logits, weighted_cross_entropy
from moe.masks import attention_mask
from moe.mla import MLA
from moe.moe_layer import MoE, RoutingBias
from moe.mtp import MTPModule, mtp_forward

DEFAULT_EXECUTION = Execution()


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = MLA(cfg, rngs) if cfg.attention == "mla" else Attention(cfg, rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.is_moe = cfg.is_moe_layer(layer)
        self.ffn = MoE(cfg, rngs) if self.is_moe else MLP(cfg.d_model, cfg.d_ff, cfg, rngs)

    def attend(self, x_BxLxD, positions_BxL, mask, ex, cache=None, cache_index=None, return_probs=False,
               causal=False):
        """The attention branch, attn(norm(x)), before the residual add: (h, new_cache, probs). causal: the mask
        hides every later key (moe.layers.Attention; moe.mla.MLA with attention="mla")."""
        return self.attn(self.attn_norm(x_BxLxD), positions_BxL, mask, ex, cache, cache_index, return_probs,
                         causal)

    def feed_forward(self, x_BxLxD, valid_BxL, ex):
        """The FFN branch, ffn(norm(x)), before the residual add: (h, routing or None for a dense layer)."""
        if self.is_moe:
            return self.ffn(self.ffn_norm(x_BxLxD), valid_BxL, ex)
        return self.ffn(self.ffn_norm(x_BxLxD), ex), None

    def __call__(self, x_BxLxD, positions_BxL, mask, valid_BxL, ex, cache=None, cache_index=None,
                 return_probs=False, causal=False):
        h, new_cache, probs = self.attend(x_BxLxD, positions_BxL, mask, ex, cache, cache_index, return_probs,
                                          causal)
        x_BxLxD = x_BxLxD + h
        h, routing = self.feed_forward(x_BxLxD, valid_BxL, ex)
        x_BxLxD = ex.constrain(x_BxLxD + h, ("batch", "length", "act_embed"))
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
            if cfg.mtp_depth:  # after the main model's parameters: its random init is the same with or without
                self.mtp = nnx.List([MTPModule(cfg, Block(cfg, cfg.n_layers + k, rngs), rngs)
                                     for k in range(cfg.mtp_depth)])
        self.cfg = cfg

    def __call__(self, tokens_BxL, *, execution: Execution = DEFAULT_EXECUTION, **options):
        """Logits [B,L,V] (fp32) and the aux dict of `trunk` (its options and aux keys)."""
        x_BxLxD, aux = self.trunk(tokens_BxL, execution=execution, **options)
        return self.unembed(x_BxLxD, execution), aux

    def token_losses(self, tokens_BxL, targets_BxL, *, execution: Execution = DEFAULT_EXECUTION,
                     loss_weights_BxL=None, mtp: bool = False, **options):
        """Next-token cross-entropy [B,L] (fp32) against targets and `trunk`'s aux dict, without ever holding all
        [B,L,V] logits: the LM head runs in execution.loss_chunks sequence chunks (moe/lm_loss.py).

        loss_weights_BxL given (training): aux["objective"] = sum(weights * ce), its gradient computed in the
        forward pass (lm_loss.weighted_cross_entropy), and the returned ce carries values only, no gradient.

        mtp (with model.mtp_depth > 0): also the multi-token prediction modules (moe/mtp.py): aux gets mtp_ce,
        mtp_weights (and mtp_objective when fused); their MoE blocks' loads follow the main model's in
        aux["expert_load"] and aux["dropped_frac"] (rows: cfg.train_load_layer_ids), their balance losses add to
        aux["balance_loss"].
        """
        x_BxLxD, aux = self.trunk(tokens_BxL, execution=execution, **options)
        h_BxLxD = self.final_norm(x_BxLxD)
        args = (h_BxLxD, self.head(), targets_BxL)
        if loss_weights_BxL is None:
            ce_BxL = cross_entropy(*args, execution.loss_chunks, execution.constrain)
        else:
            aux["objective"], ce_BxL = weighted_cross_entropy(*args, loss_weights_BxL, execution.loss_chunks,
                                                              execution.constrain)
        if mtp and self.cfg.mtp_depth:
            out = self._mtp(h_BxLxD, tokens_BxL, targets_BxL, loss_weights_BxL, execution, **options)
            routing = out.pop("mtp_routing")
            aux.update(out)
            if routing:
                aux["balance_loss"] = aux["balance_loss"] + sum(r["balance_loss"] for r in routing)
                aux["expert_load"] = jnp.concatenate([aux["expert_load"], jnp.stack([r["load"] for r in routing])])
                aux["dropped_frac"] = jnp.concatenate([aux["dropped_frac"],
                                                       jnp.stack([r["dropped_frac"] for r in routing])])
        return ce_BxL, aux

    def _mtp(self, h_BxLxD, tokens_BxL, targets_BxL, loss_weights_BxL, execution, *, positions_BxL=None,
             segment_ids_BxL=None, prefix_len_B=None):
        ex = execution.resolved()
        positions_BxL, mask, valid_BxL = self.attention_inputs(
            tokens_BxL, positions_BxL=positions_BxL, segment_ids_BxL=segment_ids_BxL, prefix_len_B=prefix_len_B)

        def call(block, x_BxLxD, valid):
            return block(x_BxLxD, positions_BxL, mask, valid, ex, None, None, False, True)

        def call_block(block, x_BxLxD, valid):
            f = _rematerialized(lambda b, x, _: call(b, x, valid), ex.remat_policy) if ex.remat else \
                lambda b, x, _: call(b, x, valid)
            x_BxLxD, _, _, routing = f(block, x_BxLxD, None)
            return x_BxLxD, routing

        fused = loss_weights_BxL is not None
        weights = loss_weights_BxL if fused else jnp.ones(targets_BxL.shape, jnp.float32)
        return mtp_forward(self, h_BxLxD, targets_BxL, weights, segment_ids_BxL, valid_BxL, ex, fused, call_block)

    def trunk(self, tokens_BxL, *, execution: Execution = DEFAULT_EXECUTION, positions_BxL=None,
              segment_ids_BxL=None, prefix_len_B=None, cache=None, cache_index=None, return_routing=False,
              return_attention=False, return_hidden=False):
        """Everything before the final norm and LM head: the residual stream [B,L,D] and an aux dict:

          balance_loss  sum over MoE layers of the sequence-wise balance loss, unweighted (the training loss
                        multiplies it by train.balance_loss_weight)
          expert_load   [M, E] valid tokens per routed expert, every top-k choice counted
          dropped_frac  [M] fraction of valid token copies dropped by a capacity bound (0 for dropless)
          routing       (return_routing) per MoE layer: expert_ids [B,L,K], gates [B,L,K], scores [B,L,E],
                        load [E], balance_loss, dropped_frac
          attention     (return_attention) per layer: probabilities [B,H,L,S] (forces the einsum attention)
          hidden        (return_hidden) the residual stream [B,L,D]: the embedding, then after every block
          cache         (cache given) the updated KV cache, see moe/decode.py

        `execution` says how to run (dispatch, kernels, dtype, remat, mesh; moe/execution.py), never what is
        computed. segment_ids (packed rows): tokens attend only within their segment; segment 0 is padding and is
        left out of the expert load and balance loss. prefix_len [B]: the prefix of each row, for prefix/mixed
        masks. With a cache, this call's tokens occupy slots [cache_index, cache_index + L).
        """
        ex = execution.resolved()
        positions_BxL, mask, valid_BxL = self.attention_inputs(
            tokens_BxL, positions_BxL=positions_BxL, segment_ids_BxL=segment_ids_BxL, prefix_len_B=prefix_len_B,
            cache=cache, cache_index=cache_index)
        x_BxLxD = self.embed_tokens(tokens_BxL, ex)
        new_cache, probs, routing, hidden = [], [], [], [x_BxLxD]
        causal = self.cfg.mask == "causal"  # attention_inputs built a causal mask: kernels may skip later keys

        def call(block, x_BxLxD, layer_cache):
            return block(x_BxLxD, positions_BxL, mask, valid_BxL, ex, layer_cache, cache_index, return_attention,
                         causal)

        if ex.remat:
            call = _rematerialized(call, ex.remat_policy)
        for start, stop in self._runs(ex, cache):
            if stop - start > 1:
                x_BxLxD, outs = layer_scan.scan_blocks(call, self.blocks[start:stop], x_BxLxD, return_hidden)
            else:
                x_BxLxD, *out = call(self.blocks[start], x_BxLxD, None if cache is None else cache[start])
                outs = [(*out, x_BxLxD)]
            for c, p, r, h in outs:
                new_cache.append(c)
                probs.append(p)
                hidden.append(h)
                if r is not None:
                    routing.append(r)

        E = self.cfg.n_routed_experts
        aux = {
            "balance_loss": sum((r["balance_loss"] for r in routing), jnp.float32(0)),
            "expert_load": jnp.stack([r["load"] for r in routing]) if routing else jnp.zeros((0, E)),
            "dropped_frac": jnp.stack([r["dropped_frac"] for r in routing]) if routing else jnp.zeros((0,)),
        }
        if return_routing:
            aux["routing"] = routing
        if return_attention:
            aux["attention"] = probs
        if return_hidden:
            aux["hidden"] = hidden
        if cache is not None:
            aux["cache"] = new_cache
        return x_BxLxD, aux

    def _runs(self, ex: Execution, cache) -> list[tuple[int, int]]:
        """[start, stop) block ranges run together: runs of equal blocks with execution.scan_layers and no
        cache (moe/layer_scan.py), else one block each."""
        if ex.scan_layers and cache is None:
            return layer_scan.runs_of_equal_blocks(self.blocks)
        return [(i, i + 1) for i in range(len(self.blocks))]

    def attention_inputs(self, tokens_BxL, *, positions_BxL=None, segment_ids_BxL=None, prefix_len_B=None,
                         cache=None, cache_index=None):
        """(positions [B,L], attention mask [B,1|H,L,S], valid [B,L]) for a call: what every block shares."""
        cfg = self.cfg
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
            return positions_BxL, mask, valid_BxL
        if segment_ids_BxL is not None:
            # The cache does not record the segment of the slots written earlier, so it cannot mask across
            # segments: decode one sequence per row.
            raise ValueError("segment_ids (packed rows) cannot be used with a KV cache; decode one sequence per row")
        S = jax.tree.leaves(cache[0])[0].shape[1]  # every cache array is [B, S, ...]
        k_idx_BxS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        mask = attention_mask(cfg.mask, q_idx_BxL, k_idx_BxS, n_heads=cfg.n_heads, prefix_len_B=prefix_len_B,
                              k_valid_BxK=k_idx_BxS < offset + L)
        return positions_BxL, mask, valid_BxL

    def embed_tokens(self, tokens_BxL, ex: Execution = DEFAULT_EXECUTION):
        x_BxLxD = jnp.take(self.embed[...], tokens_BxL, axis=0).astype(jnp.dtype(ex.dtype))
        return ex.constrain(x_BxLxD, ("batch", "length", "act_embed"))

    def head(self):
        """The LM head [D, V]: the embedding's transpose when tied."""
        return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]

    def unembed(self, x_BxLxD, ex: Execution = DEFAULT_EXECUTION):
        """Final norm + LM head: logits [B,L,V] in fp32."""
        B, L, D = x_BxLxD.shape
        logits_BxLxV = logits(self.final_norm(x_BxLxD).reshape(B * L, D), self.head()).reshape(B, L, -1)
        return ex.constrain(logits_BxLxV, ("batch", "length", "act_vocab"))


def routing_biases(model: Transformer) -> list[jax.Array]:
    """The routing bias of every MoE layer, in layer order."""
    return [b.ffn.bias[...] for b in model.blocks if b.is_moe]


def set_routing_biases(model: Transformer, biases) -> None:
    for block, b in zip((b for b in model.blocks if b.is_moe), biases, strict=True):
        block.ffn.bias.set_value(b)


# jax.checkpoint's policy per execution.remat_policy (None: save nothing, jax.checkpoint's default).
REMAT_SAVES = {"full": None, "save_moe": jax.checkpoint_policies.save_only_these_names(kernels.SAVED)}


def _rematerialized(call, policy: str = "full"):
    """`call(block, x, layer_cache)` recomputed in the backward pass: jax.checkpoint over the block's state,
    keeping what `policy` names (moe/execution.py, REMAT_POLICIES).

    Not `nnx.remat`: newer Flax (0.12.9+, the GPU machine's) refuses to merge a traced state back into the
    block's own variables inside it ("Cannot mutate RoutingBias from a different trace level"). A block's
    forward pass mutates nothing, so a fresh copy merged from its state inside the checkpoint computes the same.
    """

    def rematerialized(block, x_BxLxD, layer_cache):
        graphdef, state = nnx.split(block)
        pure = lambda state, x, c: call(nnx.merge(graphdef, state), x, c)
        return jax.checkpoint(pure, policy=REMAT_SAVES[policy])(state, x_BxLxD, layer_cache)

    return rematerialized


def split_model(model: Transformer):
    """(graphdef, params, routing biases): what the train state and checkpoints hold."""
    graphdef, params, bias = nnx.split(model, nnx.Param, RoutingBias)
    return graphdef, params, bias


def merge_model(graphdef, params, bias) -> Transformer:
    return nnx.merge(graphdef, params, bias)


def abstract_model(mcfg, build=Transformer) -> Transformer:
    """The model of `mcfg` as shapes and dtypes only (nothing allocated): what a checkpoint restores into."""
    return nnx.eval_shape(lambda: build(mcfg, nnx.Rngs(0)))
