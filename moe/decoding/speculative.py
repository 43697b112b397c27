"""Greedy speculative decoding with the multi-token prediction module as the draft (model.mtp_depth >= 1).

Key: T token slots, D model, V vocab. One sequence (batch 1): rows would accept different numbers of drafts.

Every step drafts one token with MTP module 1 and verifies it with one main-model call on two tokens:

    committed s_0 .. s_{n-1}; the main cache holds positions [0, n-1), h[i] the main model's final-normed hidden
    state at position i (what the MTP module reads), the MTP block's cache positions [0, n-3).
    1. draft   MTP module 1 at positions [n-3, n-2] on (s_{n-2}, h[n-3]), (s_{n-1}, h[n-2]): its prediction at n-2
               is the draft d for s_n (slot n-3 is rewritten with the values it already held).
    2. verify  the main model at positions [n-1, n] on (s_{n-1}, d): g0 = argmax at n-1 is s_n; if g0 == d, the
               argmax at n is s_{n+1} too (two tokens for one main call), else only g0 is kept and slot n of the
               main cache, written for d, is overwritten by the next step.

The output is exactly plain greedy decoding's (`moe.decoding.generate.generate(temperature=0)`): every committed token is the
main model's argmax given the committed tokens before it (tests/test_speculative.py). Later MTP modules (depth >= 2)
are not used as drafts.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from moe.decoding.generate import init_cache, layer_cache
from moe.dispatch.execution import Execution
from moe.lm_loss import logits as head_logits
from moe.model import DEFAULT_EXECUTION, Transformer


def _main(model, tokens_1xL, index, cache, ex):
    """(logits [1, L, V], final-normed hidden [1, L, D], cache) of the main model on L tokens at slots index.."""
    L = tokens_1xL.shape[1]
    positions = index + jnp.arange(L, dtype=jnp.int32)[None]
    x, aux = model.forward(tokens_1xL, execution=ex, positions_BxL=positions, cache=cache, cache_index=index)
    return model.unembed(x, ex), model.final_norm(x), aux.cache


def _draft(model, tokens_1xL, h_1xLxD, index, cache, ex):
    """(logits [1, L, V], cache) of MTP module 1 on L (token, hidden) pairs at slots index..: the token is the one
    after the hidden state's position, the logits predict the token after that."""
    module, ex = model.mtp[0], ex.resolved()  # as Transformer.forward resolves it for its own blocks
    L = tokens_1xL.shape[1]
    positions = index + jnp.arange(L, dtype=jnp.int32)[None]
    inputs = model.block_inputs(tokens_1xL, positions_BxL=positions, cache=[cache], cache_index=index)
    x = module.combine(model.embed_tokens(tokens_1xL, ex), h_1xLxD)
    out = module.block(x, inputs, ex, cache=cache)
    cache, h = out.cache, module.head_norm(out.x)
    return head_logits(h.reshape(L, -1), model.head()).reshape(1, L, -1), cache


@functools.partial(nnx.jit, static_argnames=("max_new_tokens", "execution"))
def speculative_generate(model: Transformer, prompt_1xP, *, max_new_tokens: int,
                         execution: Execution = DEFAULT_EXECUTION):
    """Greedy continuation [1, max_new_tokens] of a prompt of P >= 2 tokens, and the numbers of drafts made and
    accepted."""
    if not model.cfg.mtp_depth:
        raise ValueError("speculative decoding drafts with the MTP module: model.mtp_depth must be >= 1")
    B, P = prompt_1xP.shape
    if B != 1 or P < 2:
        raise ValueError(f"speculative decoding takes one prompt of at least 2 tokens, got shape {(B, P)}")
    ex = execution.for_decoding()
    T = P + max_new_tokens + 2  # a last accepted step may commit one token past the end
    cfg, dt = model.cfg, execution.dtype
    main_cache = init_cache(cfg, 1, T, dt)
    mtp_cache = layer_cache(cfg, 1, T, dt)
    logits, h, main_cache = _main(model, prompt_1xP, 0, main_cache, ex)
    seq = jnp.zeros((1, T), jnp.int32).at[:, :P].set(prompt_1xP).at[:, P].set(jnp.argmax(logits[:, -1], -1))
    hid = jnp.zeros((1, T, cfg.d_model), h.dtype).at[:, :P].set(h)
    # the MTP cache's slots [0, P-1): (s_{i+1}, h[i]) for i < P - 1
    _, mtp_cache = _draft(model, prompt_1xP[:, 1:], h[:, :-1], 0, mtp_cache, ex)

    def step(carry):
        seq, hid, n, main_cache, mtp_cache, drafts, accepted = carry
        pair = jax.lax.dynamic_slice_in_dim(seq, n - 2, 2, axis=1)  # s_{n-2}, s_{n-1}
        logits, mtp_cache = _draft(model, pair, jax.lax.dynamic_slice_in_dim(hid, n - 3, 2, axis=1), n - 3,
                                   mtp_cache, ex)
        d = jnp.argmax(logits[:, 1], -1).astype(jnp.int32)
        verify = jnp.concatenate([pair[:, 1:], d[:, None]], axis=1)  # s_{n-1}, d
        logits, h, main_cache = _main(model, verify, n - 1, main_cache, ex)
        g = jnp.argmax(logits, -1).astype(jnp.int32)  # [1, 2]: s_n, and s_{n+1} if d == s_n
        ok = g[0, 0] == d[0]
        seq = jax.lax.dynamic_update_slice_in_dim(seq, g[:, :1], n, axis=1)
        seq = jnp.where(ok, jax.lax.dynamic_update_slice_in_dim(seq, g[:, 1:], n + 1, axis=1), seq)
        hid = jax.lax.dynamic_update_slice_in_dim(hid, h, n - 1, axis=1)
        return seq, hid, n + 1 + ok, main_cache, mtp_cache, drafts + 1, accepted + ok

    start = (seq, hid, jnp.int32(P + 1), main_cache, mtp_cache, jnp.int32(0), jnp.int32(0))
    seq, _, _, _, _, drafts, accepted = jax.lax.while_loop(lambda c: c[2] < P + max_new_tokens, step, start)
    return seq[:, P:P + max_new_tokens], drafts, accepted
