"""KV-cache incremental decoding: prefill the prompt once, then one token per step.

The cache is a list (one per layer) of {"k", "v": [B, S, N, Dh]} in the compute dtype; for multi-head latent
attention (model.attention="mla") of {"latent": [B, S, R], "k_rope": [B, S, Dr]} (`init_cache`), decoded in the
absorbed form (moe/mla.py; execution.attention_impl="einsum" runs the naive reference). Logits at every position
equal the full-sequence forward (tests/test_decode.py, tests/test_mla_decode.py). In prefix mode the whole prompt is the prefix: it is
processed bidirectionally once, then generation is causal. Every function takes the Execution to run with;
decoding uses `execution.for_decoding()` (dropless: a one-token step must not depend on the rest of the batch).
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from moe import gdn
from moe.dispatch.execution import Execution
from moe.model import DEFAULT_EXECUTION, Transformer


def init_cache(cfg, batch: int, max_len: int, dtype: str = "float32"):
    """One dict per layer: {"k", "v": [B,S,N,Dh]} (gqa), or {"latent": [B,S,R], "k_rope": [B,S,Dr]} (mla: the
    normalized kv latent and the roped shared key, moe/mla.py), or a Gated DeltaNet layer's fixed-size state
    (moe/gdn.py); moe.accounting.kv_cache_bytes_per_token counts what grows per token.
    A dual-sublayer layer (LongCat-Flash) holds a pair of them."""
    if cfg.dual_sublayers:
        return [[layer_cache(cfg, batch, max_len, dtype) for _ in range(2)] for _ in range(cfg.n_layers)]
    return [layer_cache(cfg, batch, max_len, dtype, i) for i in range(cfg.n_layers)]


def layer_cache(cfg, batch: int, max_len: int, dtype: str = "float32", layer: int | None = None) -> dict:
    """Layer `layer`'s cache (init_cache's entry; None: an attention layer, also an MTP module's block,
    moe/decoding/speculative.py). A Gated DeltaNet layer (model.linear_layers) holds its conv inputs and recurrent
    state instead, whatever max_len (moe/gdn.py)."""
    dt = jnp.dtype(dtype)
    if layer in cfg.linear_layer_ids:
        return gdn.init_cache(cfg, batch, dt)
    if cfg.attention == "mla":
        return {"latent": jnp.zeros((batch, max_len, cfg.kv_lora_rank), dt),
                "k_rope": jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dt)}
    shape = (batch, max_len, cfg.n_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt)}


def check_decodable(model) -> None:
    """Decoding appends one token at a time, each attending to what came before: a model whose mask lets every
    position see later ones (bidirectional) has no left-to-right distribution to sample from. ValueError."""
    if model.cfg.mask == "bidirectional":
        raise ValueError("model.mask 'bidirectional' cannot generate left to right (every position attends to later "
                         "ones); use a causal, prefix or mixed model")


def _prefix_len(model, prompt_BxP):
    B, P = prompt_BxP.shape
    return jnp.full((B,), P, jnp.int32) if model.cfg.mask in ("prefix", "mixed") else None


def prefill(model: Transformer, prompt_BxP, cache, start: int = 0, execution: Execution = DEFAULT_EXECUTION):
    """Run P tokens through the model at cache slots [start, start + P) (positions too), attending to the slots
    already written before `start`: a causal model continues a conversation without recomputing earlier turns.
    Returns (logits [B,P,V], cache).

    Prefix and mixed masks make the whole prompt a bidirectional prefix, so a longer prompt changes the keys and
    values of every earlier slot: they must prefill from slot 0 again (the recomputation a causal decoder saves).
    """
    if start and model.cfg.mask != "causal":
        raise ValueError(f"mask {model.cfg.mask!r} cannot extend a cached prompt (its prefix attends both ways, so "
                         "earlier slots change); prefill the whole prompt from start=0")
    logits, aux = model(prompt_BxP, execution=execution.for_decoding(), cache=cache, cache_index=start,
                        prefix_len_B=_prefix_len(model, prompt_BxP))
    return logits, aux.cache


def step(model: Transformer, token_Bx1, index, cache, prefix_len_B=None, execution: Execution = DEFAULT_EXECUTION):
    """One token at slot `index` (its position too). Returns (logits [B,V], cache)."""
    B = token_Bx1.shape[0]
    positions = jnp.full((B, 1), index, jnp.int32)
    logits, aux = model(token_Bx1, execution=execution.for_decoding(), positions_BxL=positions, cache=cache,
                        cache_index=index, prefix_len_B=prefix_len_B)
    return logits[:, 0], aux.cache


def sample(logits_BxV, rng, temperature: float, top_p: float):
    """Greedy when temperature == 0, else temperature + nucleus (top-p) sampling."""
    if temperature == 0.0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits_BxV = logits_BxV.astype(jnp.float32) / temperature
    if top_p < 1.0:
        sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
        probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
        # Keep the smallest set whose mass reaches top_p (the top token always stays).
        keep_BxV = (jnp.cumsum(probs_BxV, axis=-1) - probs_BxV) < top_p
        threshold_B = jnp.min(jnp.where(keep_BxV, sorted_BxV, jnp.inf), axis=-1)
        logits_BxV = jnp.where(logits_BxV >= threshold_B[:, None], logits_BxV, -jnp.inf)
    return jax.random.categorical(rng, logits_BxV, axis=-1).astype(jnp.int32)


@functools.partial(nnx.jit, static_argnames=("max_new_tokens", "temperature", "top_p", "execution"))
def generate(model: Transformer, prompt_BxP, rng, *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, execution: Execution = DEFAULT_EXECUTION):
    """Prompt [B,P] (same length for every row) -> new tokens [B, max_new_tokens]."""
    check_decodable(model)
    B, P = prompt_BxP.shape
    cache = init_cache(model.cfg, B, P + max_new_tokens, execution.dtype)
    logits_BxPxV, cache = prefill(model, prompt_BxP, cache, execution=execution)
    prefix_len_B = _prefix_len(model, prompt_BxP)
    rng, sub = jax.random.split(rng)
    first_B = sample(logits_BxPxV[:, -1], sub, temperature, top_p)
    out_BxN = jnp.zeros((B, max_new_tokens), jnp.int32).at[:, 0].set(first_B)

    def body(i, carry):
        out_BxN, cache, rng = carry
        logits_BxV, cache = step(model, jax.lax.dynamic_slice_in_dim(out_BxN, i - 1, 1, axis=1), P + i - 1, cache,
                                 prefix_len_B, execution)
        rng, sub = jax.random.split(rng)
        return out_BxN.at[:, i].set(sample(logits_BxV, sub, temperature, top_p)), cache, rng

    out_BxN, _, _ = jax.lax.fori_loop(1, max_new_tokens, body, (out_BxN, cache, rng))
    return out_BxN


@functools.partial(nnx.jit, static_argnames=("max_len", "temperature", "top_p", "execution"))
def _start(model, prompt_BxP, rng, *, max_len: int, temperature, top_p, execution):
    cache = init_cache(model.cfg, prompt_BxP.shape[0], max_len, execution.dtype)
    logits_BxPxV, cache = prefill(model, prompt_BxP, cache, execution=execution)
    rng, sub = jax.random.split(rng)
    return sample(logits_BxPxV[:, -1], sub, temperature, top_p), cache, rng


@functools.partial(nnx.jit, static_argnames=("n", "temperature", "top_p", "execution"))
def _advance(model, last_B, index, cache, rng, prefix_len_B, *, n: int, temperature, top_p, execution):
    """n more tokens after `last_B` (at slot index): (tokens [B, n], cache, rng), as `generate`'s loop makes them."""
    out_BxN = jnp.zeros((last_B.shape[0], n), jnp.int32)

    def body(i, carry):
        out_BxN, last_B, cache, rng = carry
        logits_BxV, cache = step(model, last_B[:, None], index + i, cache, prefix_len_B, execution)
        rng, sub = jax.random.split(rng)
        new_B = sample(logits_BxV, sub, temperature, top_p)
        return out_BxN.at[:, i].set(new_B), new_B, cache, rng

    out_BxN, _, cache, rng = jax.lax.fori_loop(0, n, body, (out_BxN, last_B, cache, rng))
    return out_BxN, cache, rng


def generate_chunks(model: Transformer, prompt_BxP, rng, *, max_new_tokens: int, chunk: int = 256,
                    temperature: float = 0.0, top_p: float = 1.0, execution: Execution = DEFAULT_EXECUTION):
    """`generate`'s tokens as they come: yields [B, n] arrays (the first token, then chunks of up to `chunk`), each
    one compiled call, so a caller can stop between them (Ctrl-C) without waiting for the whole continuation."""
    check_decodable(model)
    B, P = prompt_BxP.shape
    kw = dict(temperature=float(temperature), top_p=float(top_p), execution=execution)
    last_B, cache, rng = _start(model, prompt_BxP, rng, max_len=P + max_new_tokens, **kw)
    yield last_B[:, None]
    prefix_len_B, done = _prefix_len(model, prompt_BxP), 1
    while done < max_new_tokens:
        n = min(chunk, max_new_tokens - done)
        new_BxN, cache, rng = _advance(model, last_B, P + done - 1, cache, rng, prefix_len_B, n=n, **kw)
        yield new_BxN
        last_B, done = new_BxN[:, -1], done + n
