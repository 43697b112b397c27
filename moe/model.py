"""The decoder-only Transformer: embed -> n_layers x [pre-norm attention, pre-norm FFN] -> norm -> LM head.

Key: B batch, L length, S key slots, D model, V vocab, E routed experts, K top-k, M MoE layers.
The first `first_k_dense` blocks use a dense SwiGLU, the rest the DeepSeek-V3 MoE (cfg.is_moe_layer: other
families may interleave dense layers, see moe_layer_step / dense_layers).

A block takes the residual stream and the call's `BlockInputs` (positions, mask, valid tokens, token ids) and returns a
`BlockOutput`; the model's `forward` (training, evaluation, decoding with a KV cache) keeps of it the statistics the
loss needs (`Aux`). What analysis looks at (every layer's routing, attention maps, the residual stream after every
block) is the `inspect` path over the same blocks.

Consecutive blocks of the same structure can run as one `jax.lax.scan` over their stacked states
(`execution.scan_layers`): the compiled program holds one copy of such a block instead of one per layer (the
unrolled program, and XLA's passes and code generation with it, grows with the depth; configs/gpu_1b.py's step
optimizes to 1,373 dots unrolled and 127 scanned). The parameters stay one module per layer (checkpoints, export
and analysis see the same tree); the scan stacks their states inside the traced function, a stacked copy of the
scanned layers' parameters per call. On CPU the default config's step runs ~8% slower scanned, so it is off by
default. With a KV cache the blocks run unrolled (decoding compiles small programs anyway).
"""

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx, struct

from moe.attention import Attention, BlockInputs, attention_mask, chunk_mask, window_mask
from moe.config import ModelConfig
from moe.dispatch import kernels
from moe.dispatch.execution import Execution
from moe.ffn import MLP, MoE, RoutingBias
from moe.gdn import GatedDeltaNet, is_recurrent_cache
from moe.lm_loss import cross_entropy, logits, weighted_cross_entropy
from moe.mla import MLA
from moe.mtp import MTPModule, MTPOutput, mtp_forward
from moe.nn import RMSNorm, param
from moe.router import BalanceRows, Routing
from plumbing.errors import UserError

DEFAULT_EXECUTION = Execution()


class BlockOutput(NamedTuple):
    x: jax.Array  # [B, L, D] the residual stream after the block
    routing: Routing | None  # the MoE layer's routing (None: a dense FFN)
    cache: dict | None = None  # the layer's KV cache with this call's keys and values written (decoding)
    probs: jax.Array | None = None  # [B, H, L, S] attention probabilities (asked with attention_probs=True)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_offset)
        if layer in cfg.linear_layer_ids:  # Qwen3-Next: a recurrent token mixer in the attention's place
            self.attn = GatedDeltaNet(cfg, rngs)
        else:
            self.attn = MLA(cfg, rngs) if cfg.attention == "mla" else Attention(cfg, rngs, layer)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_offset)
        self.is_moe = cfg.is_moe_layer(layer)
        self.ffn = MoE(cfg, rngs, layer) if self.is_moe else MLP(cfg.d_model, cfg.d_ff, cfg, rngs)

    def __call__(self, x_BxLxD, inputs: BlockInputs, ex: Execution, *, cache=None,
                 attention_probs: bool = False) -> BlockOutput:
        h_BxLxD, cache, probs = self.attend(x_BxLxD, inputs, ex, cache=cache, attention_probs=attention_probs)
        x_BxLxD = x_BxLxD + h_BxLxD
        h_BxLxD, routing = self.feed_forward(x_BxLxD, inputs.valid_BxL, ex, inputs.token_ids_BxL)
        x_BxLxD = ex.constrain(x_BxLxD + h_BxLxD, ("batch", "length", "act_embed"))
        return BlockOutput(x_BxLxD, routing, cache, probs)

    def attend(self, x_BxLxD, inputs: BlockInputs, ex: Execution, *, cache=None, attention_probs: bool = False):
        """The attention branch attn(norm(x)), before the residual add: (h, cache or None, probs or None)."""
        return self.attn(self.attn_norm(x_BxLxD), inputs, ex, cache=cache, return_probs=attention_probs)

    def feed_forward(self, x_BxLxD, valid_BxL, ex: Execution, token_ids_BxL=None):
        """The FFN branch ffn(norm(x)), before the residual add: (h, Routing or None for a dense layer). A
        hash-routed MoE layer needs the tokens' ids."""
        if self.is_moe:
            return self.ffn(self.ffn_norm(x_BxLxD), valid_BxL, ex, token_ids_BxL)
        return self.ffn(self.ffn_norm(x_BxLxD), ex), None


class DualBlock(nnx.Module):
    """LongCat-Flash's layer (model.dual_sublayers): two pre-norm (attention, dense SwiGLU) sublayers, and a MoE on
    the first SwiGLU's normed input whose output joins the residual after the second. Its cache is a pair."""

    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        attn = lambda: MLA(cfg, rngs) if cfg.attention == "mla" else Attention(cfg, rngs, layer)
        self.attn_norm = nnx.List([RMSNorm(cfg.d_model, cfg.norm_eps) for _ in range(2)])
        self.attn = nnx.List([attn(), attn()])
        self.ffn_norm = nnx.List([RMSNorm(cfg.d_model, cfg.norm_eps) for _ in range(2)])
        self.mlp = nnx.List([MLP(cfg.d_model, cfg.d_ff, cfg, rngs) for _ in range(2)])
        self.ffn = MoE(cfg, rngs, layer)
        self.is_moe = True

    def __call__(self, x_BxLxD, inputs: BlockInputs, ex: Execution, *, cache=None,
                 attention_probs: bool = False) -> BlockOutput:
        if attention_probs:
            raise ValueError("attention probabilities of a dual-sublayer layer (LongCat-Flash) are not implemented")
        caches = [None, None] if cache is None else list(cache)
        for j in range(2):
            h_BxLxD, caches[j], _ = self.attn[j](self.attn_norm[j](x_BxLxD), inputs, ex, cache=caches[j])
            x_BxLxD = x_BxLxD + h_BxLxD
            u_BxLxD = self.ffn_norm[j](x_BxLxD)
            if j == 0:
                moe_BxLxD, routing = self.ffn(u_BxLxD, inputs.valid_BxL, ex, inputs.token_ids_BxL)
            x_BxLxD = x_BxLxD + self.mlp[j](u_BxLxD, ex)
        x_BxLxD = ex.constrain(x_BxLxD + moe_BxLxD, ("batch", "length", "act_embed"))
        return BlockOutput(x_BxLxD, routing, None if cache is None else caches)

    def attend(self, *_, **__):
        raise UserError("this analysis reads one attention and one FFN branch per layer; LongCat-Flash's layers "
                        "(model.dual_sublayers) have two of each: not implemented (analysis.routing works)")

    feed_forward = attend


@struct.dataclass
class Aux:
    """What a forward call returns beside its output, one field per quantity (read by attribute; `aux["name"]`
    reads a field that is set, as the dict this replaced did)."""

    balance_loss: jax.Array  # () sum over MoE layers of the sequence-wise balance loss, unweighted
    expert_load: jax.Array  # [M, E] valid tokens per router candidate (routed, then zero experts), every top-k choice
    dropped_frac: jax.Array  # [M] fraction of valid token copies dropped by a capacity bound (0 for dropless)
    z_loss: jax.Array | None = None  # () sum over MoE layers of the router z-loss, unweighted
    balance_rows: BalanceRows | None = None  # [M, B, ...] per layer and row: a balance loss of any scope
    objective: jax.Array | None = None  # token_losses with loss weights: sum(weights * ce), differentiable
    mtp: MTPOutput | None = None  # token_losses(mtp=True): the multi-token prediction modules' losses
    cache: list | None = None  # a call with a KV cache: the updated cache (moe/decoding/)
    routing: list[Routing] | None = None  # inspection (Transformer.inspect): each MoE layer's Routing
    attention: list | None = None  # inspection: each layer's attention probabilities [B, H, L, S]
    hidden: list | None = None  # inspection: the residual stream [B, L, D], embedding first, then every block's

    def __getitem__(self, name: str):
        value = getattr(self, name, None)
        if value is None:
            raise KeyError(name)
        return value

    def __contains__(self, name: str) -> bool:
        return getattr(self, name, None) is not None


def routing_stats(routing: list[Routing], n_experts: int) -> dict:
    """The Aux fields the loss and the training loop read, from the MoE layers' routing in layer order."""
    return dict(balance_loss=sum((r.balance_loss for r in routing), jnp.float32(0)),
                expert_load=jnp.stack([r.load for r in routing]) if routing else jnp.zeros((0, n_experts)),
                dropped_frac=jnp.stack([r.dropped_frac for r in routing]) if routing else jnp.zeros((0,)),
                z_loss=sum((r.z_loss for r in routing), jnp.float32(0)),
                balance_rows=jax.tree.map(lambda *a: jnp.stack(a), *[r.rows for r in routing]) if routing else None)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        # Build unsharded; training maps the logical `out_sharding` metadata onto its mesh (moe/sharding.py).
        with nnx.use_eager_sharding(False):
            self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std)
            layer = DualBlock if cfg.dual_sublayers else Block
            self.blocks = nnx.List([layer(cfg, i, rngs) for i in range(cfg.n_layers)])
            self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_offset)
            if not cfg.tie_embeddings:
                self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std)
            if cfg.mtp_depth:  # after the main model's parameters: its random init is the same with or without
                self.mtp = nnx.List([MTPModule(cfg, Block(cfg, cfg.n_layers + k, rngs), rngs)
                                     for k in range(cfg.mtp_depth)])
        self.cfg = cfg

    def __call__(self, tokens_BxL, *, execution: Execution = DEFAULT_EXECUTION, return_routing: bool = False,
                 return_attention: bool = False, return_hidden: bool = False, **inputs):
        """Logits [B,L,V] (fp32) and the call's Aux. `inputs`: forward's (positions_BxL, segment_ids_BxL,
        prefix_len_B, cache, cache_index). Any of return_routing / return_attention / return_hidden runs the
        inspection path (`inspect`) instead."""
        if return_routing or return_attention or return_hidden:
            return self.inspect(tokens_BxL, execution=execution, attention=return_attention, hidden=return_hidden,
                                **inputs)
        x_BxLxD, aux = self.forward(tokens_BxL, execution=execution, **inputs)
        return self.unembed(x_BxLxD, execution), aux

    def inspect(self, tokens_BxL, *, execution: Execution = DEFAULT_EXECUTION, attention: bool = False,
                hidden: bool = False, positions_BxL=None, segment_ids_BxL=None, prefix_len_B=None):
        """The inspection path, for analysis: logits [B,L,V] and an Aux that also holds every MoE layer's Routing
        (aux.routing), with `attention` every layer's attention probabilities [B,H,L,S] (aux.attention; they need
        the einsum kernel, whatever execution.attention_impl says) and with `hidden` the residual stream before
        and after every block (aux.hidden: n_layers + 1 arrays [B,L,D]). The same blocks and numbers as
        `forward` (scan and remat included)."""
        ex = execution.resolved()
        inputs = self.block_inputs(tokens_BxL, positions_BxL=positions_BxL, segment_ids_BxL=segment_ids_BxL,
                                   prefix_len_B=prefix_len_B)
        x0_BxLxD = self.embed_tokens(tokens_BxL, ex)
        x_BxLxD, outs = self.run_blocks(x0_BxLxD, inputs, ex, attention_probs=attention, keep_hidden=hidden)
        routing = [o.routing for o in outs if o.routing is not None]
        aux = Aux(**routing_stats(routing, self.cfg.n_candidates), routing=routing,
                  attention=[o.probs for o in outs] if attention else None,
                  hidden=[x0_BxLxD] + [o.x for o in outs] if hidden else None)
        return self.unembed(x_BxLxD, execution), aux

    def forward(self, tokens_BxL, *, execution: Execution = DEFAULT_EXECUTION, positions_BxL=None,
                segment_ids_BxL=None, prefix_len_B=None, cache=None, cache_index=None):
        """Everything before the final norm and LM head: the residual stream [B,L,D] and the call's Aux.

        `execution` says how to run (dispatch, kernels, dtype, remat, mesh; moe/dispatch/execution.py), never what
        is computed. segment_ids (packed rows): tokens attend only within their segment; segment 0 is padding and
        is left out of the expert load and balance loss. prefix_len [B]: the prefix of each row, for prefix/mixed
        masks. With a KV cache (moe/decoding/), this call's tokens occupy slots [cache_index, cache_index + L) and
        aux.cache is the updated cache.
        """
        ex = execution.resolved()
        inputs = self.block_inputs(tokens_BxL, positions_BxL=positions_BxL, segment_ids_BxL=segment_ids_BxL,
                                   prefix_len_B=prefix_len_B, cache=cache, cache_index=cache_index)
        x_BxLxD = self.embed_tokens(tokens_BxL, ex)
        if cache is None:
            x_BxLxD, outs = self.run_blocks(x_BxLxD, inputs, ex)
        else:
            outs = []
            for block, layer_cache in zip(self.blocks, cache, strict=True):
                outs.append(block(x_BxLxD, inputs, ex, cache=layer_cache))
                x_BxLxD = outs[-1].x
        routing = [o.routing for o in outs if o.routing is not None]
        return x_BxLxD, Aux(**routing_stats(routing, self.cfg.n_candidates),
                            cache=None if cache is None else [o.cache for o in outs])

    def run_blocks(self, x_BxLxD, inputs: BlockInputs, ex: Execution, *, attention_probs: bool = False,
                   keep_hidden: bool = False) -> tuple[jax.Array, list[BlockOutput]]:
        """Every block on x: (x after the last block, each block's BlockOutput). Runs of equal blocks run as one
        scan with execution.scan_layers (their outputs' x only with keep_hidden), each block rematerialized with
        execution.remat. `ex` is resolved."""

        def call(block, x_BxLxD):
            return block(x_BxLxD, inputs, ex, attention_probs=attention_probs)

        if ex.remat:
            call = _rematerialized(call, ex.remat_policy)
        outs = []
        runs = runs_of_equal_blocks(self.blocks) if ex.scan_layers else [(i, i + 1) for i in range(len(self.blocks))]
        for start, stop in runs:
            if stop - start > 1:
                x_BxLxD, run = scan_blocks(call, self.blocks[start:stop], x_BxLxD, keep_hidden)
            else:
                run = [call(self.blocks[start], x_BxLxD)]
                x_BxLxD = run[0].x
            outs += run
        return x_BxLxD, outs

    def token_losses(self, tokens_BxL, targets_BxL, *, execution: Execution = DEFAULT_EXECUTION,
                     loss_weights_BxL=None, mtp: bool = False, **inputs):
        """Next-token cross-entropy [B,L] (fp32) against targets and the call's Aux, without ever holding all
        [B,L,V] logits: the LM head runs in execution.loss_chunks sequence chunks (moe/lm_loss.py).

        loss_weights_BxL given (training): aux.objective = sum(weights * ce), its gradient computed in the forward
        pass (lm_loss.weighted_cross_entropy), and the returned ce carries values only, no gradient.

        mtp (with model.mtp_depth > 0): also the multi-token prediction modules (moe/mtp.py) into aux.mtp; their
        MoE blocks' loads follow the main model's in aux.expert_load and aux.dropped_frac (rows:
        cfg.train_load_layer_ids), their balance losses add to aux.balance_loss.
        """
        x_BxLxD, aux = self.forward(tokens_BxL, execution=execution, **inputs)
        h_BxLxD = self.final_norm(x_BxLxD)
        args = (h_BxLxD, self.head(), targets_BxL)
        if loss_weights_BxL is None:
            ce_BxL = cross_entropy(*args, execution.loss_chunks, execution.constrain)
        else:
            objective, ce_BxL = weighted_cross_entropy(*args, loss_weights_BxL, execution.loss_chunks,
                                                       execution.constrain)
            aux = aux.replace(objective=objective)
        if mtp and self.cfg.mtp_depth:
            out = self._mtp(h_BxLxD, tokens_BxL, targets_BxL, loss_weights_BxL, execution, **inputs)
            stats = routing_stats(out.routing, self.cfg.n_candidates)
            rows = [r for r in (aux.balance_rows, stats["balance_rows"]) if r is not None]
            aux = aux.replace(mtp=out, balance_loss=aux.balance_loss + stats["balance_loss"],
                              expert_load=jnp.concatenate([aux.expert_load, stats["expert_load"]]),
                              dropped_frac=jnp.concatenate([aux.dropped_frac, stats["dropped_frac"]]),
                              z_loss=aux.z_loss + stats["z_loss"],
                              balance_rows=jax.tree.map(lambda *a: jnp.concatenate(a), *rows) if rows else None)
        return ce_BxL, aux

    def _mtp(self, h_BxLxD, tokens_BxL, targets_BxL, loss_weights_BxL, execution, *, positions_BxL=None,
             segment_ids_BxL=None, prefix_len_B=None) -> MTPOutput:
        ex = execution.resolved()
        inputs = self.block_inputs(tokens_BxL, positions_BxL=positions_BxL, segment_ids_BxL=segment_ids_BxL,
                                   prefix_len_B=prefix_len_B)

        def call_block(block, x_BxLxD, valid_BxL):
            call = lambda b, x: b(x, inputs.replace(valid_BxL=valid_BxL), ex)
            if ex.remat:
                call = _rematerialized(call, ex.remat_policy)
            out = call(block, x_BxLxD)
            return out.x, out.routing

        fused = loss_weights_BxL is not None
        weights = loss_weights_BxL if fused else jnp.ones(targets_BxL.shape, jnp.float32)
        return mtp_forward(self, h_BxLxD, targets_BxL, weights, segment_ids_BxL, inputs.valid_BxL, ex, fused,
                           call_block)

    def block_inputs(self, tokens_BxL, *, positions_BxL=None, segment_ids_BxL=None, prefix_len_B=None,
                     cache=None, cache_index=None) -> BlockInputs:
        """What every block of a call shares: positions [B,L], the attention mask [B,1|H,L,S], valid tokens, the
        tokens' ids (hash routing)."""
        cfg = self.cfg
        B, L = tokens_BxL.shape
        S = L if cache is None else cache_slots(cache, L)
        check_keys(cfg, S, cache is not None)
        offset = 0 if cache is None else cache_index
        q_idx_BxL = jnp.broadcast_to(offset + jnp.arange(L, dtype=jnp.int32), (B, L))
        if positions_BxL is None:
            positions_BxL = q_idx_BxL
        valid_BxL = jnp.ones((B, L), bool) if segment_ids_BxL is None else segment_ids_BxL > 0
        if cache is None:
            mask = attention_mask(cfg.mask, q_idx_BxL, q_idx_BxL, n_heads=cfg.n_heads,
                                  prefix_len_B=prefix_len_B, q_seg_BxQ=segment_ids_BxL,
                                  k_seg_BxK=segment_ids_BxL)
            # a causal mask hides every later key: kernels may skip them
            return BlockInputs(positions_BxL, mask, valid_BxL, causal=cfg.mask == "causal", token_ids_BxL=tokens_BxL,
                               segment_ids_BxL=segment_ids_BxL,
                               chunked_mask=self._chunked(mask, q_idx_BxL, q_idx_BxL),
                               sliding_mask=self._sliding(mask, q_idx_BxL, q_idx_BxL))
        if segment_ids_BxL is not None:
            # The cache does not record the segment of the slots written earlier, so it cannot mask across
            # segments: decode one sequence per row.
            raise ValueError("segment_ids (packed rows) cannot be used with a KV cache; decode one sequence per row")
        k_idx_BxS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        mask = attention_mask(cfg.mask, q_idx_BxL, k_idx_BxS, n_heads=cfg.n_heads, prefix_len_B=prefix_len_B,
                              k_valid_BxK=k_idx_BxS < offset + L)
        return BlockInputs(positions_BxL, mask, valid_BxL, causal=cfg.mask == "causal", cache_index=cache_index,
                           token_ids_BxL=tokens_BxL, chunked_mask=self._chunked(mask, q_idx_BxL, k_idx_BxS),
                           sliding_mask=self._sliding(mask, q_idx_BxL, k_idx_BxS))

    def _sliding(self, mask, q_idx_BxQ, k_idx_BxK):
        """The mask of the sliding-window layers (model.sliding_window), or None."""
        if not self.cfg.sliding_window:
            return None
        return mask & window_mask(self.cfg.sliding_window, q_idx_BxQ, k_idx_BxK)

    def _chunked(self, mask, q_idx_BxQ, k_idx_BxK):
        """The mask of the chunked layers (model.attention_chunk), or None."""
        if not self.cfg.attention_chunk:
            return None
        return mask & chunk_mask(self.cfg.attention_chunk, q_idx_BxQ, k_idx_BxK)

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


def cache_slots(cache, L: int) -> int:
    """S, the slots of a KV cache (every attention cache array is [B, S, ...]); a Gated DeltaNet layer's recurrent
    cache has no slots (moe/gdn.py). A cache of recurrent layers only: L (the mask then concerns no layer)."""
    return next((jax.tree.leaves(c)[0].shape[1] for c in cache if not is_recurrent_cache(c)), L)


def check_keys(cfg: ModelConfig, n_keys: int, cached: bool) -> None:
    """A call whose queries may see more than cfg.max_keys keys (L tokens, or a cache of S slots) is refused."""
    if cfg.max_keys and n_keys > cfg.max_keys:
        what = f"a KV cache of {n_keys} slots" if cached else f"{n_keys} tokens per row"
        raise UserError(f"{what} exceed model.max_keys={cfg.max_keys}: past it a query of this model (DeepSeek-V3.2 "
                        "/ GLM-5's index_topk) attends to a sparse subset of keys, which is not implemented; use "
                        f"sequences of at most {cfg.max_keys} tokens")


def runs_of_equal_blocks(blocks) -> list[tuple[int, int]]:
    """[start, stop) of each maximal run of consecutive blocks with one graph structure (the first dense
    blocks, then the MoE blocks, for DeepSeek-V3's layout; interleaved families give runs of one)."""
    runs, start = [], 0
    for _, run in itertools.groupby(blocks, key=nnx.graphdef):
        stop = start + len(list(run))
        runs.append((start, stop))
        start = stop
    return runs


def scan_blocks(call, blocks, x_BxLxD, keep_hidden: bool = False) -> tuple[jax.Array, list[BlockOutput]]:
    """`call(block, x) -> BlockOutput` over `blocks` (one structure) as one scan: the final x and, per block in
    order, its BlockOutput (whose x is None unless keep_hidden)."""
    graphdef = nnx.graphdef(blocks[0])
    # Every leaf with a leading layer axis [n_blocks, ...]; the scan hands the body one layer's slice.
    state_by_layer = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(nnx.state(b) for b in blocks))

    def body(x_BxLxD, state):
        out = call(nnx.merge(graphdef, state), x_BxLxD)
        return out.x, out._replace(x=out.x if keep_hidden else None)

    x_BxLxD, outs = jax.lax.scan(body, x_BxLxD, state_by_layer)
    return x_BxLxD, [jax.tree.map(lambda a, i=i: a[i], outs) for i in range(len(blocks))]


# jax.checkpoint's policy per execution.remat_policy (None: save nothing, jax.checkpoint's default).
REMAT_SAVES = {"full": None, "save_moe": jax.checkpoint_policies.save_only_these_names(kernels.SAVED)}


def _rematerialized(call, policy: str = "full"):
    """`call(block, x)` recomputed in the backward pass: jax.checkpoint over the block's state, keeping what
    `policy` names (moe/dispatch/execution.py, REMAT_POLICIES).

    Not `nnx.remat`: newer Flax (0.12.9+, the GPU machine's) refuses to merge a traced state back into the
    block's own variables inside it ("Cannot mutate RoutingBias from a different trace level"). A block's
    forward pass mutates nothing, so a fresh copy merged from its state inside the checkpoint computes the same.
    """

    def rematerialized(block, x_BxLxD):
        graphdef, state = nnx.split(block)
        pure = lambda state, x: call(nnx.merge(graphdef, state), x)
        return jax.checkpoint(pure, policy=REMAT_SAVES[policy])(state, x_BxLxD)

    return rematerialized


def routing_biases(model: Transformer) -> list[jax.Array]:
    """The routing bias of every MoE layer, in layer order."""
    return [b.ffn.bias[...] for b in model.blocks if b.is_moe]


def set_routing_biases(model: Transformer, biases) -> None:
    for block, b in zip((b for b in model.blocks if b.is_moe), biases, strict=True):
        block.ffn.bias.set_value(b)


def split_model(model: Transformer):
    """(graphdef, params, routing biases): what the train state and checkpoints hold."""
    graphdef, params, bias = nnx.split(model, nnx.Param, RoutingBias)
    return graphdef, params, bias


def merge_model(graphdef, params, bias) -> Transformer:
    return nnx.merge(graphdef, params, bias)


def abstract_model(mcfg, build=Transformer) -> Transformer:
    """The model of `mcfg` as shapes and dtypes only (nothing allocated): what a checkpoint restores into."""
    return nnx.eval_shape(lambda: build(mcfg, nnx.Rngs(0)))
