"""Generation from a loaded model: the continuation of a prompt (KV-cache decoding a chunk at a time, so Ctrl-C
stops it between chunks), greedy speculative decoding with the MTP draft timed against plain greedy decoding, and
the checks before either starts. `python -m train.generate` (train/generate.py) is the command.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from moe import Execution
from moe.accounting import kv_cache_bytes_per_token
from moe.decoding.generate import check_decodable as decodable
from moe.decoding.generate import generate, generate_chunks
from moe.decoding.speculative import speculative_generate
from plumbing.errors import UserError
from train.data.tokenizer import EOS_ID
from train.preflight import device_memory_bytes

# How generation runs, whatever the run trained with: fp32 and dropless (KV-cache decoding steps one token at a
# time, and a dropping dispatch would make a row's continuation depend on the rest of the batch).
GENERATION = Execution()


def check_cache_fits(model, total_tokens: int) -> None:
    """The KV cache holds every layer's keys and values (or MLA's latents) for every slot: refuse one that cannot
    fit."""
    need = kv_cache_bytes_per_token(model.cfg, GENERATION.dtype) * total_tokens
    have = device_memory_bytes(jax.devices()[0])
    if have is not None and need > have:
        raise UserError(f"a KV cache for {total_tokens:,} tokens needs {need / 2**30:.1f} GiB but the device has "
                        f"{have / 2**30:.1f} GiB; lower --max_new_tokens")


def check_decodable(model) -> None:
    """KV-cache decoding appends one token at a time, which only a causal or prefix-style mask allows."""
    try:
        decodable(model)
    except ValueError as e:
        raise UserError(f"this model cannot generate: {e}") from None


def continue_ids(model, prompt_ids, *, max_new_tokens=64, temperature=0.0, top_p=1.0, seed=0) -> list[int]:
    """New token ids after `prompt_ids`, cut before the first EOS (which is not returned). Decoded a chunk at a time
    (one compiled call each), stopping early at EOS; Ctrl-C between chunks raises Interrupted with the tokens so far."""
    new = []
    chunks = generate_chunks(model, jnp.asarray([prompt_ids], jnp.int32), jax.random.key(seed),
                             max_new_tokens=max_new_tokens, temperature=float(temperature), top_p=float(top_p),
                             execution=GENERATION)
    try:
        for chunk in chunks:
            new += np.asarray(chunk)[0].tolist()
            if EOS_ID in new:
                break
    except KeyboardInterrupt:
        raise Interrupted(new[:new.index(EOS_ID)] if EOS_ID in new else new) from None
    return new[:new.index(EOS_ID)] if EOS_ID in new else new


class Interrupted(Exception):
    """Ctrl-C during generation, with the token ids generated before it."""

    def __init__(self, ids: list[int]):
        super().__init__(f"interrupted after {len(ids)} tokens")
        self.ids = ids


def _timed_pair(f, g, rounds: int = 3) -> tuple:
    """(f's result, g's result, f's seconds, g's seconds): each compiled and run once, then timed `rounds` times in
    turn (the median), so load from other processes hits both alike."""
    out_f, out_g = jax.block_until_ready(f()), jax.block_until_ready(g())
    times = [[], []]
    for _ in range(rounds):
        for fn, t in ((f, times[0]), (g, times[1])):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            t.append(time.perf_counter() - t0)
    return out_f, out_g, sorted(times[0])[rounds // 2], sorted(times[1])[rounds // 2]


def speculative_ids(model, prompt_ids, max_new_tokens: int) -> tuple[list[int], str]:
    """(new ids cut before the first EOS, a one-line report): greedy speculative decoding with the MTP draft, timed
    against plain greedy decoding of the same tokens, whose output must be identical."""
    if not model.cfg.mtp_depth:
        raise UserError("--speculative mtp drafts with the model's multi-token prediction module, and this model has "
                        "none: train with model.mtp_depth >= 1, or for an HF export written with --mtp drop, export "
                        "again with --mtp keep")
    if len(prompt_ids) < 2:
        raise UserError("--speculative mtp needs a prompt of at least 2 tokens")
    prompt = jnp.asarray([prompt_ids], jnp.int32)
    (spec, drafts, accepted), plain, t_spec, t_plain = _timed_pair(
        lambda: speculative_generate(model, prompt, max_new_tokens=max_new_tokens, execution=GENERATION),
        lambda: generate(model, prompt, jax.random.key(0), max_new_tokens=max_new_tokens, temperature=0.0,
                         execution=GENERATION))
    spec, plain = np.asarray(spec)[0].tolist(), np.asarray(plain)[0].tolist()
    if spec != plain:
        first = next(i for i, (a, b) in enumerate(zip(spec, plain)) if a != b)
        raise RuntimeError(f"speculative decoding diverged from greedy decoding at new token {first}")
    drafts, accepted = int(drafts), int(accepted)
    report = (f"speculative (mtp): {accepted} of {drafts} drafts accepted ({accepted / max(drafts, 1):.1%}), "
              f"{drafts} main-model calls for {max_new_tokens} tokens; {max_new_tokens / t_spec:,.0f} tokens/s vs "
              f"{max_new_tokens / t_plain:,.0f} plain greedy (x{t_plain / t_spec:.2f}); output identical")
    # A speculative step (the MTP block, then the main model on 2 tokens) yields 1 + (accepted) tokens; a plain step
    # yields 1. It pays once the acceptance rate exceeds (speculative step time / plain step time) - 1.
    break_even = (t_spec / max(drafts, 1)) / (t_plain / max_new_tokens) - 1
    if t_spec > t_plain:
        pays = (f"it pays only above {break_even:.0%} acceptance" if break_even < 1 else
                "it cannot pay here, even with every draft accepted")
        report += (f"; slower here: a speculative step costs {break_even + 1:.2f} plain steps, so {pays} "
                   "(docs/mtp.md: where a main-model call is bound by reading its weights, as for large models on "
                   "a GPU, a 2-token call costs about what a 1-token call does)")
    return (spec[:spec.index(EOS_ID)] if EOS_ID in spec else spec), report
