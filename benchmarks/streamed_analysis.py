"""The layer-streamed routing analysis (analysis/routing/streamed.py): its peak host memory and speed on a generated
random checkpoint, and what the MoE models people study would need.

    # a random checkpoint with DeepSeek-V2-Lite's exact layer shapes, --layers of its 27 layers (bf16, sharded as
    # the Hub shards it, experts stored one by one), analysed streamed under /usr/bin/time -v:
    python -m benchmarks.streamed_analysis measure --layers 12 --dir /tmp/v2lite12 --max_tokens 500
    # disk, memory and hours per 10k tokens of DeepSeek-V2-Lite, Moonlight-16B, GLM-4.7-Flash, Qwen3-30B-A3B,
    # gpt-oss-120b and DeepSeek-V3 from their configs (benchmarks/data/moe_configs.json), at a measured speed:
    python -m benchmarks.streamed_analysis table [--result benchmarks/results/streamed_analysis.json]

`measure` prints the bound the issue states (the largest layer's weights as held, their fp32 copies inside the
computation, the activations and routing tables, and a fixed overhead: analysis/hf_memory.py's estimate) beside
the peak resident memory /usr/bin/time reports, and writes both with the read rate and the time per 1,000 tokens
to --result. `table` sizes each model from its config.json fields alone (parameters per layer; bytes as stored:
bf16, FP8 with its scales, MXFP4 experts) and prices 10k tokens at the read rate and the compute rate per active
parameter of that measurement (or --read_mb_s / --gflops).
"""

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

DATA = Path(__file__).parent / "data"
RESULT = Path(__file__).parent / "results" / "streamed_analysis.json"
SHARD_BYTES = 4 * 10**9  # the Hub's usual shard size for bf16 checkpoints


# ---------------------------------------------------------------------------------------------------- measure


def hf_tensors(config: dict) -> dict:
    """name -> (shape, dtype name) of every tensor a transformers checkpoint of `config` stores, routed experts
    one by one (as the Hub stores them), from transformers' model built on the meta device (nothing allocated)."""
    import torch
    import transformers

    c = {k: v for k, v in config.items() if k not in ("auto_map", "architectures")}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**c))
    out = {}
    for name, t in model.state_dict().items():
        shape = tuple(t.shape)
        fused = re.match(r"(.*\.experts\.)(gate_up_proj|down_proj)$", name)
        if not fused:
            out[name] = (shape, "float32" if name.endswith("mlp.gate.weight") else "bfloat16")
            continue
        p, which = fused.groups()
        E = shape[0]
        parts = (("gate_proj", "up_proj"), (shape[1] // 2, shape[2])) if which == "gate_up_proj" else \
            (("down_proj",), shape[1:])
        for e in range(E):
            for w in parts[0]:
                out[f"{p}{e}.{w}.weight"] = (parts[1], "bfloat16")
    return out


def write_checkpoint(path: Path, layers: int, seed: int = 0) -> int:
    """A random DeepSeek-V2-Lite-shaped checkpoint with `layers` layers in `path` (bf16 N(0, 0.02) weights, norms
    near 1, the router in fp32), in shards of SHARD_BYTES with an index, and the project's tokenizer; returns its
    bytes. Values come from one pool of random numbers read at random offsets (fast; every tensor differs)."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from train.data.tokenizer import DEFAULT_TOKENIZER

    config = json.loads((DATA / "deepseek_v2_lite_config.json").read_text())
    config["num_hidden_layers"] = layers
    tensors = hf_tensors(config)
    rng = np.random.default_rng(seed)
    pool = (0.02 * rng.standard_normal(2**25)).astype(ml_dtypes.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    weight_map, shard, size, n_shards, total = {}, {}, 0, 0, 0

    def flush():
        nonlocal shard, size, n_shards
        if shard:
            n_shards += 1
            name = f"model-{n_shards:05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for name, (shape, dtype) in tensors.items():
        n = math.prod(shape)
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            arr = (1 + 0.1 * rng.standard_normal(n)).astype(ml_dtypes.bfloat16)
        else:
            parts, got = [], 0
            while got < n:  # the pool at random offsets, as many pieces as the tensor needs
                k = min(n - got, len(pool) // 2)
                at = int(rng.integers(0, len(pool) - k + 1))
                parts.append(pool[at:at + k])
                got += k
            arr = np.concatenate(parts) if len(parts) > 1 else parts[0].copy()
        arr = arr.reshape(shape).astype(np.float32 if dtype == "float32" else ml_dtypes.bfloat16)
        if size + arr.nbytes > SHARD_BYTES:
            flush()
        shard[name], size, total = arr, size + arr.nbytes, total + arr.nbytes
    flush()
    names = sorted(set(weight_map.values()))
    for i, old in enumerate(names, 1):  # model-0000i-of-0000n.safetensors, as the Hub names shards
        new = f"model-{i:05d}-of-{n_shards:05d}.safetensors"
        os.replace(path / old, path / new)
        weight_map = {k: new if v == old else v for k, v in weight_map.items()}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    shutil.copy(DEFAULT_TOKENIZER, path / "tokenizer.json")
    return total


def bound(path: Path, n_rows: int, seq_len: int, batch_size: int) -> dict:
    """analysis/hf_memory.py's estimate of the streamed analysis's peak, and its parts."""
    from analysis import hf_memory
    from moe.hf.stream import LayerStream

    stream = LayerStream(str(path))
    return hf_memory.needs(stream, n_rows=n_rows, seq_len=seq_len, batch_size=batch_size)


def measure(args) -> dict:
    path = Path(args.dir)
    t0 = time.time()
    if not (path / "model.safetensors.index.json").is_file():
        print(f"writing a random checkpoint of {args.layers} DeepSeek-V2-Lite layers to {path} ...", flush=True)
        write_checkpoint(path, args.layers)
    written = time.time() - t0
    disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    out = Path(args.out or f"{path}_routing")
    shutil.rmtree(out, ignore_errors=True)
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "analysis.routing", "--hf", str(path), "--out", str(out),
           "--mode", "stream", "--max_tokens", str(args.max_tokens), "--seq_len", str(args.seq_len), "--batch_size",
           str(args.batch_size)]
    print(" ".join(cmd), flush=True)
    run = subprocess.run(cmd, capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode:
        raise SystemExit(f"the analysis failed ({run.returncode}):\n{log[-3000:]}")
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", log).group(1)) * 1024
    wall = re.search(r"Elapsed \(wall clock\) time.*: ([\d:.]+)", log).group(1)
    info = json.loads((out / "routing.json").read_text())["stream"]
    n_rows = math.ceil(info["tokens"] / args.seq_len) + args.batch_size  # rows routed, padding rows included
    est = bound(path, n_rows, args.seq_len, args.batch_size)
    stored_config = json.loads((path / "config.json").read_text())
    result = {"command": "python -m benchmarks.streamed_analysis " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": _machine(),
              "layers": stored_config["num_hidden_layers"], "checkpoint_bytes": disk, "write_seconds": written,
              "bound_bytes": est["stream"], "bound_parts": est, "peak_rss_bytes": peak, "wall": wall,
              "active_params": active_params(_as_table_config(stored_config)), **info}
    print(_measure_lines(result))
    if args.result:
        Path(args.result).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(str(args.result) + ".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, args.result)
    return result


def _measure_lines(r: dict) -> str:
    gb = 1e9
    return "\n".join([
        f"checkpoint {r['checkpoint_bytes'] / gb:.2f} GB ({r['layers']} layers), {r['checkpoint_bytes'] / r['bound_bytes']:.1f}x "
        f"the streaming bound {r['bound_bytes'] / gb:.2f} GB (largest layer {r['bound_parts']['largest_layer'] / gb:.2f} GB"
        f" as held, activations {r['bound_parts']['activations'] / gb:.3f} GB, routing tables "
        f"{r['bound_parts']['tables'] / gb:.2f} GB, overhead 1.0 GB)",
        f"peak RSS {r['peak_rss_bytes'] / gb:.2f} GB (/usr/bin/time -v), {r['peak_rss_bytes'] / r['bound_bytes']:.2f}x the bound",
        f"{r['tokens']:,} tokens in {r['seconds']:.0f} s ({r['seconds_per_1000_tokens']:.0f} s per 1,000 tokens; wall "
        f"{r['wall']}); read {r['bytes_read'] / gb:.2f} GB in {r['read_seconds']:.0f} s ({r['read_MB_per_s']:.0f} MB/s)"])


def _machine() -> str:
    from benchmarks.common import host_cpu

    mem = next((int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal")), 0)
    return f"{host_cpu()}, {mem / 2**20:.0f} GiB RAM"


# ---------------------------------------------------------------------------------------------------- table


def _as_table_config(c: dict) -> dict:
    """A HF config.json dict with the fields moe_configs.json uses (stored bf16)."""
    return {"stored": "bf16", **c}


def layer_params(c: dict, moe: bool) -> dict:
    """Parameters of one decoder layer from config.json fields: {"attention", "ffn", "experts" (routed experts'
    weights), "active_ffn" (what one token runs)}."""
    D, H = c["hidden_size"], c["num_attention_heads"]
    if "kv_lora_rank" in c:  # multi-head latent attention
        R, Q, n, r, v = c["kv_lora_rank"], c.get("q_lora_rank"), c["qk_nope_head_dim"], c["qk_rope_head_dim"], \
            c["v_head_dim"]
        q = D * Q + Q + Q * H * (n + r) if Q else D * H * (n + r)
        attn = q + D * (R + r) + R + R * H * (n + v) + H * v * D
    else:
        hd, kv = c.get("head_dim") or D // H, c.get("num_key_value_heads", H)
        attn = 2 * D * H * hd + 2 * D * kv * hd
        attn += 2 * hd if c["model_type"] == "qwen3_moe" else 0  # q_norm, k_norm
        attn += (H * hd + 2 * kv * hd + D + H) if c.get("attention_bias") else 0  # biases, gpt-oss's sinks
    norms = 2 * D
    if not moe:
        ffn = 3 * D * c["intermediate_size"]
        return {"attention": attn + norms, "ffn": ffn, "experts": 0, "active_ffn": ffn}
    E = c.get("n_routed_experts") or c.get("num_experts") or c["num_local_experts"]
    F = c["moe_intermediate_size"] if "moe_intermediate_size" in c else c["intermediate_size"]
    K = c["num_experts_per_tok"]
    expert = 3 * D * F + ((2 * F + D) if c["model_type"] == "gpt_oss" else 0)  # gpt-oss: expert biases
    shared = c.get("n_shared_experts") or 0
    router = D * E + (E if c["model_type"] in ("deepseek_v3", "glm4_moe_lite", "gpt_oss") else 0)
    return {"attention": attn + norms, "ffn": router + shared * 3 * D * F, "experts": E * expert,
            "active_ffn": router + shared * 3 * D * F + K * expert}


def sizes(c: dict) -> dict:
    """Parameters, bytes on disk, bytes per layer as the streamed analysis holds it, active parameters."""
    from analysis.hf_memory import KERNEL_GATHER

    D, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    dense = c.get("first_k_dense_replace", 0)
    layers = [layer_params(c, i >= dense) for i in range(L)]
    mtp = c.get("num_nextn_predict_layers", 0)
    mtp_params = mtp * (sum(layers[-1].values()) - layers[-1]["active_ffn"] + 2 * D * D + 3 * D + 2 * V * D)
    ends = V * D * (1 if c.get("tie_word_embeddings") else 2) + D
    total = sum(p["attention"] + p["ffn"] + p["experts"] for p in layers) + ends + mtp_params

    def stored(p):  # bytes on disk of a layer's parameters
        if c["stored"] == "fp8":  # Linear weights e4m3 with one F32 scale per 128 x 128 tile; norms, router bf16
            return (p["attention"] + p["ffn"] + p["experts"]) * (1 + 4 / 128**2)
        if c["stored"] == "mxfp4":  # routed experts' weights: 4-bit codes + one byte per 32; the rest bf16
            return p["experts"] * (0.5 + 1 / 32) + 2 * (p["attention"] + p["ffn"])
        return 2 * (p["attention"] + p["ffn"] + p["experts"])

    def held(p):  # a block as the streamed forward holds it (fp32, converted tensor by tensor as read), plus the
        # routed experts' weights the CPU kernel gathers (analysis/hf_memory.py KERNEL_GATHER)
        return 4 * (p["attention"] + p["ffn"] + p["experts"]) + KERNEL_GATHER * 4 * p["experts"]

    disk = sum(stored(p) for p in layers) + 2 * ends + (mtp_params * 2 if c["stored"] == "bf16" else mtp_params)
    active = sum(p["attention"] + p["active_ffn"] for p in layers)
    return {"params": total, "disk": disk, "largest_layer_held": max(held(p) for p in layers),
            "ends_held": 4 * V * D, "active": active, "n_moe": sum(i >= dense for i in range(L)),
            "experts": c.get("n_routed_experts") or c.get("num_experts") or c["num_local_experts"]}


def active_params(c: dict) -> int:
    return sizes(c)["active"]


def table_rows(read_mb_s: float, gflops: float, tokens: int = 10_000, seq_len: int = 256) -> list[dict]:
    """One row per model of moe_configs.json: disk, memory in memory and streamed, hours for `tokens` tokens."""
    from analysis import hf_memory

    rows = []
    for name, c in json.loads((DATA / "moe_configs.json").read_text()).items():
        if name.startswith("_"):
            continue
        s = sizes(c)
        cfg = types.SimpleNamespace(n_moe_layers=s["n_moe"], vocab_size=c["vocab_size"], n_candidates=s["experts"],
                                    d_model=c["hidden_size"], n_heads=c["num_attention_heads"], d_ff=0,
                                    top_k=c["num_experts_per_tok"], moe_d_ff=0)
        acts = hf_memory.activation_bytes(cfg, math.ceil(tokens / seq_len), seq_len, 16)
        tables = hf_memory.routing_table_bytes(cfg)
        streamed = max(s["largest_layer_held"], s["ends_held"]) + acts + tables + hf_memory.OVERHEAD
        in_memory = hf_memory.IMPORT_PEAK * 4 * s["params"] + acts + tables + hf_memory.OVERHEAD
        read_h = s["disk"] / (read_mb_s * 1e6) / 3600
        compute_h = tokens * 2 * s["active"] / (gflops * 1e9) / 3600
        rows.append({"model": name, "stored": c["stored"], "params (B)": f"{s['params'] / 1e9:.1f}",
                     "active (B)": f"{s['active'] / 1e9:.2f}", "disk (GB)": f"{s['disk'] / 1e9:.0f}",
                     "in memory, fp32 (GB)": f"{in_memory / 1e9:.0f}", "streamed (GB)": f"{streamed / 1e9:.1f}",
                     "read (h)": f"{read_h:.2f}", "compute (h)": f"{compute_h:.2f}",
                     f"h per {tokens // 1000}k tokens": f"{read_h + compute_h:.1f}"})
    return rows


def table(args) -> list[dict]:
    from benchmarks.common import table as markdown

    read_mb_s, gflops = args.read_mb_s, args.gflops
    if read_mb_s is None or gflops is None:
        if not Path(args.result).is_file():
            raise SystemExit(f"{args.result}: no measurement; run `measure` first, or pass --read_mb_s and --gflops")
        r = json.loads(Path(args.result).read_text())
        compute = r["seconds"] - r["read_seconds"]
        read_mb_s = read_mb_s or r["read_MB_per_s"]
        gflops = gflops or r["tokens"] * 2 * r["active_params"] / compute / 1e9
        print(f"rates of {args.result} ({r['date']}, {r['machine']}): read {read_mb_s:.0f} MB/s, "
              f"{gflops:.1f} GFLOP/s per active parameter (2 FLOPs each)")
    rows = table_rows(read_mb_s, gflops, args.tokens)
    print(markdown(rows))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.streamed_analysis", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("measure", help="generate a random checkpoint and measure a streamed analysis of it")
    m.add_argument("--layers", type=int, default=12, help="of DeepSeek-V2-Lite's 27 layers (exact shapes)")
    m.add_argument("--dir", required=True, help="where the checkpoint is (written when it holds none)")
    m.add_argument("--out", default=None, help="the analysis's --out (default DIR_routing)")
    m.add_argument("--max_tokens", type=int, default=500, help="tokens per domain of the bundled corpus")
    m.add_argument("--seq_len", type=int, default=256)
    m.add_argument("--batch_size", type=int, default=8)
    m.add_argument("--result", default=str(RESULT), help="JSON written with the figures ('' for none)")
    t = sub.add_parser("table", help="disk / memory / hours of the published models from their configs")
    t.add_argument("--result", default=str(RESULT), help="the measurement whose rates price the table")
    t.add_argument("--read_mb_s", type=float, default=None, help="disk read rate (default: the measurement's)")
    t.add_argument("--gflops", type=float, default=None,
                   help="compute rate, 2 FLOPs per active parameter per token (default: the measurement's)")
    t.add_argument("--tokens", type=int, default=10_000)
    args = ap.parse_args(argv)
    return measure(args) if args.what == "measure" else table(args)


if __name__ == "__main__":
    main()
