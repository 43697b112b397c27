"""Peak host memory of the HuggingFace import (moe.hf.load_model) against the imported model's fp32 bytes.

    python -m benchmarks.hf_import_memory [--gb 1.0] [--dtype float32] [--shard_mb 100]
    # against the loader of another tree (e.g. `git archive HEAD | tar -x -C /tmp/moe_head`), same checkpoint:
    python -m benchmarks.hf_import_memory --src /tmp/moe_head,.
    # DeepSeek's block FP8 (e4m3 Linear weights + F32 scale_inv per 128 x 128 tile, BF16 elsewhere):
    python -m benchmarks.hf_import_memory --dtype float8
    # gpt-oss's MXFP4 experts (U8 blocks + E8M0 scales, BF16 elsewhere), a gpt_oss checkpoint of the same size:
    python -m benchmarks.hf_import_memory --dtype mxfp4

Writes a random glm4_moe checkpoint (moe.hf.write_hf_checkpoint of a freshly initialized moe.Transformer: d_model
1024, 16 routed experts of width 384 top-2 + 1 shared, one dense first layer, vocabulary 8192, as many layers as
reach --gb GB of fp32 parameters) as sharded safetensors in --dtype (float8: written in fp32, then every Linear
weight of every shard quantized as DeepSeek-V3 ships them, with its quantization_config; mxfp4: a random gpt_oss
checkpoint as the Hub ships gpt-oss, GPT_OSS_SHAPE, one shard per layer), then loads it once per
--src tree, each in a fresh subprocess: the growth of its resident memory (VmHWM, the high-water mark, minus VmRSS
after importing jax and moe.hf and starting the CPU backend) over the model's fp32 bytes is the ratio (1.0:
nothing but the model).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import host_cpu, table

SHAPE = dict(d_model=1024, n_heads=8, n_kv_heads=8, head_dim=128, d_ff=2816, first_k_dense=1, vocab_size=8192,
             n_routed_experts=16, n_shared_experts=1, top_k=2, moe_d_ff=384)

# Run in the subprocess with PYTHONPATH=<src>: argv[1] the checkpoint; prints one JSON line.
MEASURE = """
import json, sys, time
import jax
import numpy as np
from flax import nnx
from moe.hf import load_model

def kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))

jax.devices()  # the CPU backend started: its buffers are not the loader's
before = kib("VmRSS")
t0 = time.perf_counter()
model = load_model(sys.argv[1])
seconds = time.perf_counter() - t0
fp32 = sum(4 * np.size(x) for x in jax.tree.leaves(nnx.state(model)))
print(json.dumps(dict(rss_before=before * 1024, peak=kib("VmHWM") * 1024, fp32_bytes=fp32, seconds=seconds)))
"""


def model_config(gb: float):
    """SHAPE with as many layers as make `gb` GB (1e9 bytes) of fp32 parameters."""
    from moe import ModelConfig
    from moe.accounting import param_counts

    one, two = (param_counts(ModelConfig(**SHAPE, n_layers=n))["total"] for n in (2, 3))
    n_layers = max(2, 2 + round((gb * 1e9 / 4 - one) / (two - one)))
    return ModelConfig(**SHAPE, n_layers=n_layers)


def write_checkpoint(out: str, gb: float, dtype: str, shard_mb: int) -> None:
    if dtype == "mxfp4":
        return write_gpt_oss_mxfp4(out, gb)
    import jax
    from flax import nnx

    from moe import Transformer
    from moe.hf import write_hf_checkpoint
    from train.data.tokenizer import DEFAULT_TOKENIZER

    model = Transformer(model_config(gb), nnx.Rngs(0))
    jax.block_until_ready(nnx.state(model))
    stored = "float32" if dtype == "float8" else dtype
    write_hf_checkpoint(model, out, str(DEFAULT_TOKENIZER), stored, max_shard_bytes=shard_mb * 2**20)
    del model
    if dtype == "float8":
        to_block_fp8(out)


FP8_BLOCK = 128


def to_block_fp8(out: str) -> None:
    """Rewrite each shard of the HF directory `out` as DeepSeek-V3 ships FP8: every 2-D `*_proj.weight` as
    float8_e4m3fn with its `_scale_inv` (F32, amax / 448 per 128 x 128 tile), the rest BF16 (the router and its
    bias F32); the index and config.json (quantization_config) follow."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    index_path = Path(out) / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    shards = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    for shard in shards:
        tensors = load_file(os.path.join(out, shard))
        for name in list(tensors):
            w = tensors.pop(name)
            if name.endswith("_proj.weight") and w.ndim == 2:
                tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(w, FP8_BLOCK)
                if index:
                    index["weight_map"][name + "_scale_inv"] = shard
            else:
                tensors[name] = w if ".mlp.gate." in name else w.astype(ml_dtypes.bfloat16)
        save_file(tensors, os.path.join(out, shard), metadata={"format": "pt"})
        del tensors
    if index:
        index_path.write_text(json.dumps(index))
    config_path = Path(out) / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    config_path.write_text(json.dumps(config))


def quantize_blocks(w, block: int):
    """DeepSeek's weight_quant: per tile s = amax / 448, q = e4m3(w / s) (clipped: ml_dtypes makes overflow NaN)."""
    import ml_dtypes
    import numpy as np

    rows, cols = w.shape
    r, c = -(-rows // block), -(-cols // block)
    tiles = np.zeros((r * block, c * block), np.float32)
    tiles[:rows, :cols] = w
    tiles = tiles.reshape(r, block, c, block)
    s = np.abs(tiles).max(axis=(1, 3)) / 448
    s[s == 0] = 1.0
    q = np.clip(tiles / s[:, None, :, None], -448, 448).reshape(r * block, c * block)[:rows, :cols]
    return q.astype(ml_dtypes.float8_e4m3fn), s.astype(np.float32)


GPT_OSS_SHAPE = dict(hidden_size=1024, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
                     head_dim=128, num_local_experts=16, num_experts_per_tok=2, vocab_size=8192, sliding_window=128,
                     rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=4096)


def gpt_oss_params(c: dict, n_layers: int) -> int:
    """Parameters of a gpt_oss model of config `c` (GPT_OSS_SHAPE's keys) with n_layers layers (untied head)."""
    D, F, E, Dh = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], c["head_dim"]
    H, N, V = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    layer = 2 * D * (H + N) * Dh + (H + 2 * N) * Dh + D + H + E * (D + 1) + E * (3 * D * F + 2 * F + D) + 2 * D
    return 2 * V * D + D + n_layers * layer


def gpt_oss_layers(gb: float, c: dict = GPT_OSS_SHAPE) -> int:
    """As many gpt_oss layers of config `c` as make `gb` GB of fp32 parameters (at least 2)."""
    one = gpt_oss_params(c, 1) - gpt_oss_params(c, 0)
    return max(2, round((gb * 1e9 / 4 - gpt_oss_params(c, 0)) / one))


def write_gpt_oss_mxfp4(out: str, gb: float, c: dict = GPT_OSS_SHAPE) -> None:
    """A random gpt_oss checkpoint of config `c` as openai/gpt-oss ships it: each layer's experts as MXFP4 `*_blocks`
    (random codes) and `*_scales` (2^-7 .. 2^-2), everything else BF16 ~ N(0, 0.02); one shard per layer."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    n = gpt_oss_layers(gb, c)
    D, F, E, Dh = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], c["head_dim"]
    H, N, V = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    rng = np.random.default_rng(0)
    bf16 = lambda *shape: (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    mxfp4 = lambda *shape: (rng.integers(0, 256, (*shape, 16), np.uint8), rng.integers(120, 126, shape, np.uint8))
    weight_map = {}

    def shard(name, tensors):
        save_file(tensors, os.path.join(out, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    shard("ends.safetensors", {"model.embed_tokens.weight": bf16(V, D), "lm_head.weight": bf16(V, D),
                               "model.norm.weight": bf16(D)})
    for i in range(n):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": bf16(D), p + "post_attention_layernorm.weight": bf16(D),
             p + "self_attn.sinks": bf16(H), p + "mlp.router.weight": bf16(E, D), p + "mlp.router.bias": bf16(E),
             p + "mlp.experts.gate_up_proj_bias": bf16(E, 2 * F), p + "mlp.experts.down_proj_bias": bf16(E, D)}
        for w, rows in (("q", H * Dh), ("k", N * Dh), ("v", N * Dh)):
            t[f"{p}self_attn.{w}_proj.weight"], t[f"{p}self_attn.{w}_proj.bias"] = bf16(rows, D), bf16(rows)
        t[p + "self_attn.o_proj.weight"], t[p + "self_attn.o_proj.bias"] = bf16(D, H * Dh), bf16(D)
        for w, rows, cols in (("gate_up_proj", 2 * F, D), ("down_proj", D, F)):
            t[f"{p}mlp.experts.{w}_blocks"], t[f"{p}mlp.experts.{w}_scales"] = mxfp4(E, rows, cols // 32)
        shard(f"layer-{i:03d}.safetensors", t)
    Path(out, "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    quant = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                        "lm_head"], "quant_method": "mxfp4"}
    Path(out, "config.json").write_text(json.dumps(dict(c, model_type="gpt_oss", num_hidden_layers=n,
                                                        quantization_config=quant)))


def measure(src: str, checkpoint: str) -> dict:
    """One load of `checkpoint` by the moe.hf of tree `src`, in a fresh process."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", MEASURE, checkpoint], env=env, capture_output=True, text=True,
                          cwd=os.path.abspath(src))
    if done.returncode:
        raise SystemExit(f"loading with {src} failed:\n{done.stderr[-2000:]}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    growth = r["peak"] - r["rss_before"]
    return {"src": src, "fp32 model MB": r["fp32_bytes"] / 1e6, "RSS before MB": r["rss_before"] / 1e6,
            "peak RSS MB": r["peak"] / 1e6, "growth MB": growth / 1e6, "ratio": growth / r["fp32_bytes"],
            "load s": r["seconds"]}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_import_memory", description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0, help="the model's fp32 parameter bytes, in GB (1e9)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float8", "mxfp4"],
                   help="the checkpoint's dtype (float8: DeepSeek's block FP8 for the Linear weights; mxfp4: a "
                        "gpt_oss checkpoint with MXFP4 experts)")
    p.add_argument("--shard_mb", type=int, default=100, help="largest safetensors shard, MiB")
    p.add_argument("--src", default=".", help="comma-separated source trees whose moe.hf loads the checkpoint")
    p.add_argument("--json", default="", help="also write the rows here")
    args = p.parse_args(argv)
    if args.gb <= 0 or args.shard_mb < 1:
        p.exit(2, "error: --gb and --shard_mb must be positive\n")
    srcs = [s for s in args.src.split(",") if s]
    for s in srcs:
        if not os.path.isfile(os.path.join(s, "moe", "hf", "load.py")):
            p.exit(2, f"error: --src {s} has no moe/hf/load.py\n")
    with tempfile.TemporaryDirectory(prefix="hf_import_memory_") as tmp:
        t0 = time.perf_counter()
        write_checkpoint(tmp, args.gb, args.dtype, args.shard_mb)
        shards = sorted(f for f in os.listdir(tmp) if f.endswith(".safetensors"))
        size = sum(os.path.getsize(os.path.join(tmp, f)) for f in shards)
        kind, n = ("gpt_oss", gpt_oss_layers(args.gb)) if args.dtype == "mxfp4" else ("glm4_moe",
                                                                                    model_config(args.gb).n_layers)
        print(f"checkpoint: {kind}, {n} layers, {args.dtype}, {len(shards)} shards, "
              f"{size / 1e6:.0f} MB on disk, written in {time.perf_counter() - t0:.0f} s")
        rows = [measure(s, tmp) for s in srcs]
    print(f"{time.strftime('%Y-%m-%d')} | {host_cpu()}\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "host": host_cpu(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
