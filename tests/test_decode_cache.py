"""benchmarks/decode_cache.py on toy shapes: a row per attention, decode form and context, the MLA cache smaller
per token by the stated ratio, and the decode loop the benchmark times equal to moe.decoding.generate.generate's tokens."""

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks import decode_cache
from moe import Execution, Transformer, decoding
from moe.accounting import kv_cache_bytes_per_token


def test_rows_cover_every_attention_form_and_context():
    seen = []
    rows = decode_cache.rows("tiny", [16, 32], new_tokens=2, batch=1, steps=1, dtype="float32", on_row=seen.append)
    assert [(r["attention"], r["decode"], r["context"]) for r in rows] == [  # each context's comparison in turn
        ("gqa", "-", 16), ("mla", "absorbed", 16), ("mla", "naive", 16), ("gqa", "-", 32), ("mla", "absorbed", 32),
        ("mla", "naive", 32)]
    assert seen == rows
    cfgs = decode_cache.model_configs("tiny")
    assert kv_cache_bytes_per_token(cfgs["mla"]) == 4 * cfgs["mla"].n_layers * (32 + 8)
    assert all(r["tokens/s"] > 0 for r in rows)
    assert rows[4]["cache MiB"] == kv_cache_bytes_per_token(cfgs["mla"]) * 34 / 2**20  # mla absorbed at 32


def test_cpu_models_are_the_default_and_deepseek_mini_without_mtp():
    cfgs = decode_cache.model_configs("cpu")
    assert cfgs["gqa"].attention == "gqa" and cfgs["mla"].attention == "mla" and cfgs["mla"].mtp_depth == 0
    assert cfgs["gqa"].d_model == cfgs["mla"].d_model and cfgs["gqa"].n_layers == cfgs["mla"].n_layers


def test_the_timed_loop_decodes_what_generate_decodes():
    cfg = decode_cache.model_configs("tiny")["mla"]
    model = Transformer(cfg, nnx.Rngs(0))
    prompt = jnp.asarray([[3, 5, 7, 11]], jnp.int32)
    want = decoding.generate(model, prompt, jax.random.key(0), max_new_tokens=4, temperature=0.0)
    graphdef, state = nnx.split(model)
    cache = decoding.init_cache(cfg, 1, 8)
    logits, cache = decoding.prefill(model, prompt, cache)
    first = jnp.argmax(logits[:, -1], -1)[:, None].astype(jnp.int32)
    last = decode_cache.decode_fn(graphdef, 4, 3, Execution())(state, first, cache)
    assert int(first[0, 0]) == int(want[0, 0]) and int(jnp.argmax(last, -1)[0]) == int(want[0, 3])
