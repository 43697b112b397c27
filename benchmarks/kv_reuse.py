"""KV-cache reuse over a multi-turn dialogue: what a causal decoder saves.

    python -m benchmarks.kv_reuse [--preset cpu] [--turns 4] [--user_tokens 48] [--reply_tokens 16] [--steps 3]

A dialogue of `turns` turns, each a user message of `user_tokens` tokens followed by a reply of `reply_tokens`.
Before the reply of turn i the model must read the new user message (time to first token, TTFT):
  causal, reuse      prefill only the new message at the slots after the cached history (decoding.prefill start=)
  causal, recompute  prefill the whole history from slot 0 (what a server without a cache does)
  prefix / mixed     must recompute: their prompt is one bidirectional prefix, so a longer prompt changes the
                     keys and values of every earlier slot (decoding.prefill refuses start > 0 for them)
The replies' own decoding (one token per step, the same for every mask) is not timed. FLOPs are counted, not
measured: 2 x matmul weights per processed token (moe.accounting) + 4 x n_layers x heads x head_dim per attended
(query, key) pair, with exactly the pairs each mask attends to.
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import describe, preset, table, time_fn
from moe import ModelConfig, Transformer, decoding
from moe.accounting import matmul_params_per_token
from train import host_memory

ARMS = (("causal", "reuse"), ("causal", "recompute"), ("prefix", "recompute"), ("mixed", "recompute"))


def attended_pairs(mask: str, start: int, n_new: int) -> int:
    """(query, key) pairs attended when n_new tokens are processed at slots [start, start + n_new) over a cache
    holding slots [0, start). prefix / mixed: the processed tokens are the whole prompt (start must be 0), one
    bidirectional prefix (mixed: half the heads see k <= q, half q <= k, the same count as causal per head pair)."""
    if mask == "prefix":
        assert start == 0
        return n_new * n_new
    q = np.arange(start, start + n_new)
    return int(np.sum(q + 1))  # causal; mixed: lower- and upper-triangular heads attend as many pairs each


def prefill_flops(cfg, mask: str, start: int, n_new: int) -> float:
    per_pair = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim  # QK^T and PV, 2 flops per multiply-add
    return 2.0 * matmul_params_per_token(cfg) * n_new + per_pair * attended_pairs(mask, start, n_new)


def schedule(mode: str, turn: int, user: int, reply: int) -> tuple[int, int]:
    """(start slot, tokens to prefill) before the reply of `turn` (0-based)."""
    history = turn * (user + reply)
    return (history, user) if mode == "reuse" else (0, history + user)


def _prefill_fn(graphdef, start: int):
    @jax.jit
    def fn(state, prompt, cache):
        model = nnx.merge(graphdef, state)
        logits, cache = decoding.prefill(model, prompt, cache, start=start)
        return logits[:, -1], cache

    return fn


def run(model_kwargs: dict, turns: int, user: int, reply: int, steps: int, batch: int = 1) -> list[dict]:
    rows = []
    max_len = turns * (user + reply)
    rng = np.random.default_rng(0)
    for mask, mode in ARMS:
        cfg = ModelConfig(**{**model_kwargs, "mask": mask})
        graphdef, state = nnx.split(Transformer(cfg, nnx.Rngs(0)))
        for t in range(turns):
            start, n = schedule(mode, t, user, reply)
            prompt = jnp.asarray(rng.integers(3, cfg.vocab_size, (batch, n)), jnp.int32)
            cache = decoding.init_cache(cfg, batch, max_len)
            fn = _prefill_fn(graphdef, start)
            seconds = time_fn(fn, state, prompt, cache, steps=steps)
            rows.append({"mask": mask, "mode": mode, "turn": t + 1, "history": t * (user + reply),
                         "prefilled": n, "gflops": prefill_flops(cfg, mask, start, n) / 1e9,
                         "ttft_ms": seconds * 1e3})
    return rows


def totals(rows) -> list[dict]:
    out = []
    for mask, mode in ARMS:
        rs = [r for r in rows if r["mask"] == mask and r["mode"] == mode]
        out.append({"mask": mask, "mode": mode, "tokens prefilled": sum(r["prefilled"] for r in rs),
                    "total gflops": sum(r["gflops"] for r in rs), "total ttft_ms": sum(r["ttft_ms"] for r in rs),
                    "last-turn ttft_ms": rs[-1]["ttft_ms"]})
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_reuse", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user_tokens", type=int, default=48)
    p.add_argument("--reply_tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="timed calls per point (median)")
    args = p.parse_args(argv)
    host_memory.keep_freed_memory()  # as `python -m train` runs (train/host_memory.py)
    if min(args.turns, args.user_tokens, args.steps) < 1 or args.reply_tokens < 0:
        p.exit(2, "error: --turns, --user_tokens and --steps must be positive, --reply_tokens >= 0\n")
    model = dict(preset(args.preset)["model"])
    rows = run(model, args.turns, args.user_tokens, args.reply_tokens, args.steps)
    print(describe())
    print(f"dialogue: {args.turns} turns x ({args.user_tokens} user + {args.reply_tokens} reply) tokens, batch 1\n")
    print(table(rows))
    print()
    print(table(totals(rows)))


if __name__ == "__main__":
    main()
