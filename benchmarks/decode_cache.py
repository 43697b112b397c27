"""Decoding speed and KV-cache memory at long context: GQA against MLA, absorbed and naive.

    python -m benchmarks.decode_cache [--contexts 1024,4096,16384] [--new_tokens 32] [--batch 1] [--steps 3]
        [--preset cpu|gpu|tiny]

Models: cpu / tiny, configs/default.py's (GQA, 2 kv heads of 48) and configs/deepseek_mini.py's (MLA, kv latent 64
+ roped key 16) at the same width, depth and experts, the MTP module left out (decoding never runs it); gpu, the
same two at configs/gpu_1b.py's width. Each row times `new_tokens` one-token decode steps (moe.decoding.generate.step, one
jitted loop) after a context of C tokens already in the cache: the cache is filled with random numbers instead of a
prefill, since a step's cost depends on the slots it attends to, not their values. MLA decodes in the absorbed
form (the key up-projection folded into the query, the value one into the output) or, with
execution.attention_impl="einsum", the naive one (keys and values rebuilt per head from the latent at every step).
Cache bytes: moe.accounting.kv_cache_bytes_per_token x (C + new_tokens) x batch.
"""

import argparse
import importlib
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.common import describe, table, time_fn
from moe import Execution, ModelConfig, Transformer, decoding
from moe.accounting import kv_cache_bytes_per_token

MODELS = {"cpu": ("configs.default", "configs.deepseek_mini"), "tiny": ("configs.tiny", None),
          "gpu": ("configs.gpu_1b", None)}
TINY_MLA = dict(attention="mla", q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16)


def model_configs(preset: str) -> dict[str, ModelConfig]:
    """{"gqa": ..., "mla": ...} for the preset: the MLA model is deepseek_mini's attention on the GQA model's stack
    where no MLA config of that size exists (tiny, gpu: query latent none, kv latent d/3, 32 + 16 dims per head)."""
    gqa_mod, mla_mod = MODELS[preset]
    gqa = dict(importlib.import_module(gqa_mod).get_config().model)
    if mla_mod:
        mla = dict(importlib.import_module(mla_mod).get_config().model)
    else:
        d = gqa["d_model"]
        mla = dict(gqa, **(TINY_MLA if preset == "tiny" else dict(
            attention="mla", q_lora_rank=0, kv_lora_rank=d // 3 // 16 * 16, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=gqa["head_dim"])))
    mla["mtp_depth"] = 0
    return {"gqa": ModelConfig(**gqa), "mla": ModelConfig(**mla)}


def random_cache(cfg, batch: int, slots: int, dtype: str, seed: int = 0):
    cache = decoding.init_cache(cfg, batch, slots, dtype)
    keys = iter(jax.random.split(jax.random.key(seed), 2 * len(cache)))
    return [{k: jax.random.normal(next(keys), v.shape, v.dtype) for k, v in layer.items()} for layer in cache]


def decode_fn(graphdef, start: int, n: int, ex: Execution):
    """A jitted (state, token [B, 1], cache) -> last logits: n greedy one-token steps from slot `start`."""

    @jax.jit
    def run(state, token, cache):
        model = nnx.merge(graphdef, state)

        def body(i, carry):
            token, cache, _ = carry
            logits, cache = decoding.step(model, token, start + i, cache, execution=ex)
            return jnp.argmax(logits, -1)[:, None].astype(jnp.int32), cache, logits

        B = token.shape[0]
        _, _, logits = jax.lax.fori_loop(0, n, body, (token, cache, jnp.zeros((B, model.cfg.vocab_size))))
        return logits

    return run


def rows(preset: str, contexts, new_tokens: int, batch: int, steps: int, dtype: str, on_row=None) -> list[dict]:
    """One row per (context, attention, decode form), shortest context first and GQA beside MLA at each, so a run
    cut off by a time limit has compared both at the contexts it reached; on_row(row) sees each as it lands."""
    models = [(name, cfg, nnx.split(Transformer(cfg, nnx.Rngs(0))))
              for name, cfg in model_configs(preset).items()]
    out = []
    for C in contexts:
        for name, cfg, (graphdef, state) in models:
            for form in ("absorbed", "naive") if cfg.attention == "mla" else ("-",):
                ex = Execution(dtype=dtype, attention_impl="einsum" if form == "naive" else "blockwise")
                cache = random_cache(cfg, batch, C + new_tokens, dtype)
                fn = decode_fn(graphdef, C, new_tokens, ex)
                token = jnp.ones((batch, 1), jnp.int32)
                seconds = time_fn(fn, state, token, cache, steps=steps)
                out.append({"attention": name, "decode": form, "context": C,
                            "cache MiB": kv_cache_bytes_per_token(cfg, dtype) * (C + new_tokens) * batch / 2**20,
                            "cache bytes / token": kv_cache_bytes_per_token(cfg, dtype),
                            "tokens/s": batch * new_tokens / seconds, "ms / step": 1e3 * seconds / new_tokens})
                if on_row:
                    on_row(out[-1])
    return out


def print_row(row: dict) -> None:
    """`on_row` for a console: each row as a one-line table, flushed, so a run cut off keeps what it measured."""
    print(table([row]), flush=True)


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_cache", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu", choices=list(MODELS))
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    return p.parse_args(argv)


def main(argv=None):
    a = parse(sys.argv[1:] if argv is None else argv)
    contexts = [int(x) for x in a.contexts.split(",")]
    print(describe())
    print(f"preset {a.preset}, {a.new_tokens} decode steps after each context, batch {a.batch}, {a.dtype}")
    result = rows(a.preset, contexts, a.new_tokens, a.batch, a.steps, a.dtype, on_row=print_row)
    print(table(result))
    return result


if __name__ == "__main__":
    main()
