"""This project and MaxText training the same DeepSeek-style MoE shape, one command, tokens/s and model FLOP/s:

    python -m benchmarks.maxtext_side_by_side                  # CPU shape: d_model 256, 4 layers (1 dense), 16
                                                               # routed experts top-4 + 1 shared, seq 256, batch 8, fp32
    python -m benchmarks.maxtext_side_by_side --shape gpu      # configs/gpu_1b.py widths, bf16, seq 2048, batch 8

MaxText (PyPI `maxtext`; it needs Python >= 3.12 and a newer JAX than this project pins) runs as a subprocess in
its own virtual environment, so neither project's JAX changes (`--maxtext_python`, default $MAXTEXT_PYTHON or
/work/venv-maxtext/bin/python). `bash benchmarks/setup_maxtext.sh` builds that venv: maxtext 0.2.5 with its `tpu`
extra's requirements minus libtpu / NVIDIA wheels / linters (benchmarks/maxtext_requirements.py).

Matched: widths, depth, first dense layers, experts, top-k, shared experts, vocabulary, sequence, batch, dtype,
synthetic tokens, one device, AdamW, and the attention: MLA on both sides at MaxText's deepseek3-tiny ranks (query
latent 32, kv latent 16; 48 + 16 query/key dims and 64-wide values per head: benchmarks.common.MAXTEXT_MLA).
Each --pairs entry runs both sides the same way: `dropless` (ours dropless; MaxText sparse_matmul, megablox off on
CPU / tokamax on GPU) and `capacity` (ours the capacity dispatch; MaxText's dense path with the same
capacity_factor, 1.25). MaxText runs its layers unscanned (scan_layers=false: about 8% faster than its scanned
default on CPU); on CPU its process gets our side's glibc malloc settings (GLIBC_TUNABLES,
train.host_memory.glibc_tunables). FLOPs, counted by each side:
  - ours: moe.accounting.train_flops_per_token (6 x active matmul weights incl. router and unembedding, plus the
    full L x L attention square), the figure the training loop's MFU uses;
  - MaxText: its own `TFLOP/s/device` log (maxtext_utils.calculate_tflops_training_per_device: 3 x forward
    matmul FLOPs of FFN/MoE (+ router), MLA projections, causal attention (half the square) and embedding).
Both columns are printed for both where they apply; tokens/s is the comparison that needs no FLOP convention.
MaxText's MoE paths: `dense` (sparse_matmul=False; with capacity_factor > 0 its dropping einsum dispatch, else
every expert on every token), `ragged_dot` (sparse_matmul=True, megablox=False) or `tokamax` (use_tokamax_gmm=True;
GPU).
"""

import argparse
import os
import re
import shutil
import subprocess
import tempfile

from benchmarks import train_step
from benchmarks.common import add_scan_layers_flag, describe, preset, table
from train import host_memory
from train.flops import measure_peak_flops

STEP_RE = re.compile(r"completed step: (\d+), seconds: ([\d.]+), TFLOP/s/device: ([\d.]+), "
                     r"Tokens/s/device: ([\d.]+)")
DEFAULT_MAXTEXT_PYTHON = "/work/venv-maxtext/bin/python"
MOE_FLAGS = {"dense": ["sparse_matmul=False"], "ragged_dot": ["sparse_matmul=True", "megablox=False"],
             "tokamax": ["sparse_matmul=True", "use_tokamax_gmm=True"]}


def maxtext_attention(shape: str, attention: str = "") -> str:
    """MaxText's attention kernel: as given, else dot_product on CPU and, on GPU, cuDNN through JAX (the kernel our
    side runs there; MaxText's own `autoselected` is tokamax's Pallas-Triton flash attention on GPU)."""
    return attention or ("dot_product" if shape == "cpu" else "cudnn_flash_jax")


PAIRS = ("dropless", "capacity")
CAPACITY_FACTOR = 1.25


def maxtext_moe(pair: str, shape: str) -> str:
    """MaxText's MoE path for a --pairs entry."""
    if pair == "capacity":
        return "dense"
    return "ragged_dot" if shape == "cpu" else "tokamax"


def maxtext_args(shape: str, steps: int, moe: str, workdir: str, attention: str = "", capacity_factor: float = -1.0,
                 scan_layers: bool = False) -> list[str]:
    """MaxText's train CLI overrides for the preset's shape (its deepseek3-tiny config, resized)."""
    p = preset(f"maxtext_{shape}")
    m, ex = p["model"], p["execution"]
    return [
        "model_name=deepseek3-tiny", "override_model_config=True", f"run_name=side_by_side_{shape}",
        f"base_output_directory={workdir}", "dataset_type=synthetic", "enable_checkpointing=false",
        "skip_jax_distributed_system=true", "log_period=1", f"steps={steps}",
        f"hardware={'cpu' if shape == 'cpu' else 'gpu'}",
        f"per_device_batch_size={p['batch']}", f"max_target_length={p['seq_len']}",
        f"base_emb_dim={m['d_model']}", f"base_num_query_heads={m['n_heads']}",
        f"base_num_kv_heads={m['n_kv_heads']}", f"base_mlp_dim={m['d_ff']}", f"base_moe_mlp_dim={m['moe_d_ff']}",
        f"base_num_decoder_layers={m['n_layers']}", f"first_num_dense_layers={m['first_k_dense']}",
        f"num_experts={m['n_routed_experts']}", f"num_experts_per_tok={m['top_k']}",
        f"shared_experts={m['n_shared_experts']}", f"vocab_size={m['vocab_size']}",
        f"dtype={ex['dtype']}", "weight_dtype=float32",  # params fp32 in both projects
        # MLA, ours at the same ranks and widths (benchmarks.common.MAXTEXT_MLA)
        f"q_lora_rank={m['q_lora_rank']}", f"kv_lora_rank={m['kv_lora_rank']}",
        f"qk_nope_head_dim={m['qk_nope_head_dim']}", f"qk_rope_head_dim={m['qk_rope_head_dim']}",
        f"v_head_dim={m['v_head_dim']}",
        f"attention={maxtext_attention(shape, attention)}",
        f"remat_policy={'full' if ex.get('remat') else 'none'}", f"scan_layers={scan_layers}",
        f"capacity_factor={capacity_factor}",
        *MOE_FLAGS[moe],
    ]


def parse_maxtext_log(text: str, warmup: int = 2) -> dict:
    """Median step seconds and MaxText's own TFLOP/s over the steps after `warmup` (compilation, first steps)."""
    steps = [(int(s), float(sec), float(tf), float(tok)) for s, sec, tf, tok in STEP_RE.findall(text)]
    timed = [r for r in steps if r[0] >= warmup] or steps
    if not timed:
        raise RuntimeError("no 'completed step' lines in MaxText's output")
    timed.sort(key=lambda r: r[1])
    mid = timed[len(timed) // 2]
    return {"step s": mid[1], "maxtext TFLOP/s": mid[2], "tokens/s (maxtext log)": mid[3], "steps timed": len(timed)}


def run_maxtext(python: str, shape: str, steps: int, moe: str, timeout: int, attention: str = "",
                capacity_factor: float = -1.0, env_extra: dict | None = None) -> dict:
    """MaxText's train run as a subprocess of `python` (a path, or a command on PATH: on the lent GPU machine
    `python3` with MaxText's wheels on PYTHONPATH, `bash benchmarks/gpu_wheels.sh --maxtext`)."""
    if not shutil.which(python):
        raise FileNotFoundError(f"no MaxText Python at {python}: build it with `bash benchmarks/setup_maxtext.sh` or "
                                "pass --maxtext_python")
    probe = subprocess.run([python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode:  # e.g. a wheel missing on the GPU machine: name the module
        raise RuntimeError(f"{python} cannot import maxtext: " + " | ".join(probe.stderr.strip().splitlines()[-2:]))
    pkg = probe.stdout.strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu" if shape == "cpu" else "cuda", **(env_extra or {}))
    env.pop("XLA_FLAGS", None)  # one device, as this project's side runs
    with tempfile.TemporaryDirectory() as workdir:
        cmd = [python, "-m", "maxtext.trainers.pre_train.train", os.path.join(pkg, "configs", "base.yml"),
               *maxtext_args(shape, steps, moe, workdir, attention, capacity_factor)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    if p.returncode:
        raise RuntimeError(f"MaxText exited {p.returncode}: " + " | ".join(out.strip().splitlines()[-5:]))
    return parse_maxtext_log(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--maxtext_python", default=os.environ.get("MAXTEXT_PYTHON", DEFAULT_MAXTEXT_PYTHON))
    ap.add_argument("--pairs", default=",".join(PAIRS), help="dropless, capacity or both: each side run the same way")
    ap.add_argument("--maxtext_attention", default="", help="MaxText's attention kernel (default: dot_product on "
                                                            "CPU, cudnn_flash_jax on GPU; e.g. autoselected)")
    ap.add_argument("--maxtext_steps", type=int, default=6, help="steps run; the first 2 are not timed")
    ap.add_argument("--grouped_matmul", default="auto", help="this project's execution.grouped_matmul")
    ap.add_argument("--attention_impl", default="", help="this project's (default: blockwise on CPU, cudnn on GPU)")
    add_scan_layers_flag(ap, "this project's side: its")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--skip_maxtext", action="store_true")
    a = ap.parse_args(argv)
    pairs = a.pairs.split(",")
    if set(pairs) - set(PAIRS):
        ap.error(f"--pairs takes {', '.join(PAIRS)}; got {a.pairs}")
    kept = host_memory.keep_freed_memory()  # our side as `python -m train` runs (train/host_memory.py)
    same_malloc = {"GLIBC_TUNABLES": host_memory.glibc_tunables()} if kept else {}
    attention = a.attention_impl or ("blockwise" if a.shape == "cpu" else "cudnn")
    name = f"maxtext_{a.shape}"
    p = preset(name)
    tokens = p["batch"] * p["seq_len"]
    peak = measure_peak_flops()
    print(describe() + f" | matmul peak {peak / 1e12:.3g} TFLOP/s")
    rows = []
    for pair in pairs:
        ours = train_step.bench(name, pair, p["model"]["n_routed_experts"], peak, capacity_factor=CAPACITY_FACTOR,
                                grouped=a.grouped_matmul, attention=attention, scan_layers=a.scan_layers)
        our_flops_per_token = ours["MFU %"] / 100 * peak * ours["step ms"] / 1e3 / tokens
        rows.append({"pair": pair, "project": "this (moe-lm)",
                     "MoE path": f"{pair} / {a.grouped_matmul}, scan {ours['scan layers']}", "attention": attention,
                     "tokens/step": tokens, "step s": ours["step ms"] / 1e3, "tokens/s": ours["tokens/s"],
                     "model TFLOP/s (ours)": our_flops_per_token * ours["tokens/s"] / 1e12,
                     "model TFLOP/s (maxtext)": None})
        print(table(rows[-1:]), flush=True)  # a MaxText run cut off by a lease's time limit leaves our row printed
        if a.skip_maxtext:
            print("MaxText: skipped (--skip_maxtext)")
            continue
        moe = maxtext_moe(pair, a.shape)
        try:
            mt = run_maxtext(a.maxtext_python, a.shape, a.maxtext_steps, moe, a.timeout, a.maxtext_attention,
                             CAPACITY_FACTOR if pair == "capacity" else -1.0, same_malloc)
            rows.append({"pair": pair, "project": "MaxText 0.2.5", "MoE path": f"{moe}, scan False",
                         "attention": maxtext_attention(a.shape, a.maxtext_attention),
                         "tokens/step": tokens, "step s": mt["step s"], "tokens/s": tokens / mt["step s"],
                         # our count for the matched shape applies to MaxText's run
                         "model TFLOP/s (ours)": our_flops_per_token * tokens / mt["step s"] / 1e12,
                         "model TFLOP/s (maxtext)": mt["maxtext TFLOP/s"]})
        except Exception as e:  # report why, keep our row
            print(f"MaxText: did not run: {type(e).__name__}: {e}")
    print(table(rows))
    for pair in pairs:
        both = [r for r in rows if r["pair"] == pair]
        if len(both) == 2:
            print(f"{pair}: tokens/s, this project / MaxText: x{both[0]['tokens/s'] / both[1]['tokens/s']:.2f}")
    return rows


if __name__ == "__main__":
    main()
