"""The train step compiled for a GPU on this machine, without one: XLA:GPU's compile time and the optimized
program's kernel counts, per dispatch, grouped matmul, layer scan and expert count. A compile that would hang
on the lent GPU can be found and fixed here, at no device time.

    bash benchmarks/gpu_compile_setup.sh                     # the CUDA PJRT plugin into /tmp/jax-cuda-site
    PYTHONPATH=/tmp/jax-cuda-site /tmp/venv-jax011/bin/python -m benchmarks.gpu_compile --experts 8,64
    ... -m benchmarks.gpu_compile --n_layers 2 --grouped_matmul slab,ragged_dot --scan_layers on,off --timeout 600
    ... -m benchmarks.gpu_compile --dispatch dropless,capacity,expert_parallel --grouped_matmul slab,tokamax
    ... -m benchmarks.gpu_compile --experts 8,64 --remat full,save_moe,off   # memory: the `temp GiB` column

JAX compiles ahead of time for a GPU described by a target config (`jax.experimental.topologies`, "deviceless
AOT"): every XLA:GPU pass, LLVM and ptxas run here, nothing is autotuned (a GPU would autotune its GEMMs on top),
and the compiled program is not run. `benchmarks/gpu_targets/h200.txtpb` describes the lent H200 (compute
capability 9.0, 132 SMs; bandwidth and clocks approximate: they steer cost models, not correctness). Each row is
compiled in a subprocess with a time limit, so a hung compile is a row that says so. Attention is JAX's Pallas
flash attention standing in for cuDNN's (whose compile needs the cuDNN library, which the plugin's minimal install
leaves out): the same residuals, so `temp GiB` is the memory XLA plans for the step on the GPU (`--attention
xla`: XLA's attention, [B, H, L, L] logits kept). tokamax, without a device, picks its
`xla` implementation: its rows say nothing of the Mosaic-GPU kernel's compile. ptxas comes from a CUDA toolkit on
PATH (or the `nvidia-cuda-nvcc-cu12` wheel).
"""

import argparse
import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental import topologies

import moe.attention
from benchmarks import hlo_flops
from benchmarks.common import (
    add_remat_flag,
    comma_subset,
    dispatch_list,
    remat_label,
    remat_settings,
    table,
    variants,
)
from benchmarks.train_step import _config, batch_sharding, random_batch
from moe import train_flops_per_token
from moe.dispatch.kernels import GROUPED_SWIGLU
from train import optim
from train.preflight import parse
from train.state import state_shapes
from train.step import forward, make_train_step

TARGET = os.path.join(os.path.dirname(__file__), "gpu_targets", "h200.txtpb")
SETUP_HINT = "bash benchmarks/gpu_compile_setup.sh, then PYTHONPATH=/tmp/jax-cuda-site (Python 3.12, jax 0.11.x)"


def _kernel_stats(hlo: str) -> dict:
    """Counts from the optimized HLO: how XLA:GPU built the program."""
    return {"fusions": hlo.count(" fusion("), "triton GEMMs": hlo.count("__triton_nested_gemm_fusion")
            + hlo.count('"__triton_gemm"'), "scatters": hlo.count(" scatter("), "whiles": hlo.count(" while("),
            "conditionals": hlo.count(" conditional("), "HLO MB": round(len(hlo) / 1e6, 2)}


def compile_row(spec: dict) -> dict:
    """Compile one train step for the target GPU (in this process) and describe it."""
    topology = topologies.get_topology_desc(platform="cuda", target_config=open(spec["target"]).read(),
                                            topology="1x1x1")
    # The model picks its per-backend defaults (slab's layouts, `auto`, cuDNN attention) from jax.default_backend(),
    # which is this machine's CPU; the program is for the GPU.
    jax.default_backend = lambda: "gpu"
    c = _config("gpu", spec["dispatch"], spec["experts"], 1.25, spec["grouped"], "xla", spec["batch"], 0, spec["scan"],
                spec["remat"])
    c.train.batch_size = spec["batch"]  # one GPU, whatever devices this host's JAX sees
    if spec["n_layers"]:
        c.model.n_layers = spec["n_layers"]
    if spec["attention"] == "pallas_flash":
        _flash_attention_standin()
    mcfg, t = parse(c).model, c.train
    mesh = topologies.make_mesh(topology, (1, 1, 1, 1), ("data", "fsdp", "expert", "tensor"))
    tx = optim.optimizer(t)
    shaped = lambda tree, shardings: jax.tree.map(  # shapes placed on the GPU's mesh: nothing allocated
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
    graphdef, _, abstract, shardings = state_shapes(mcfg, tx, mesh)
    state = shaped(abstract, shardings)
    batch = jax.eval_shape(lambda: random_batch(t.batch_size, c.data.seq_len, mcfg.vocab_size))
    batch = shaped(batch, jax.tree.map(lambda _: batch_sharding(mesh), batch))
    ex = parse(c).execution_on(mesh)
    step = jax.jit(make_train_step(graphdef, tx, optim.schedule(t), t, ex, functools.partial(forward, fused_loss=True)))
    t0 = time.perf_counter()
    lowered = step.lower(state, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    memory = compiled.memory_analysis()
    hlo = compiled.as_text()
    tokens = t.batch_size * c.data.seq_len
    return {**_row_keys(spec), "layers": mcfg.n_layers, "scan layers": "on" if ex.scan_layers else "off",
            "remat": remat_label(ex),
            "lower s": round(t1 - t0, 1),
            "compile s": round(t2 - t1, 1), **_kernel_stats(hlo),
            # the matmuls the program runs (slab's cheapest layout; attention's kernel not included) against the
            # model FLOPs MFU counts (attention included)
            "GEMM TFLOP": round(hlo_flops.matmul_flops(hlo) / 1e12, 1),
            "model TFLOP": round(train_flops_per_token(mcfg, c.data.seq_len) * tokens / 1e12, 1),
            # XLA's buffer assignment: what the step needs beyond its arguments and outputs (every switch branch's)
            "temp GiB": round(memory.temp_size_in_bytes / 2**30, 1),
            # the state and batch (the training loop donates the state, so its outputs reuse these buffers)
            "args GiB": round(memory.argument_size_in_bytes / 2**30, 1)}


def _flash_attention_standin():
    """The model's `jax.nn.dot_product_attention` calls run JAX's Pallas (Triton) flash attention instead, for an
    H200: cuDNN's compile needs the cuDNN library, and XLA's implementation keeps [B, H, L, L] logits per layer
    for the backward pass (~6 GiB a layer at configs/gpu_1b.py's batch 16 x 2048), which cuDNN's does not. Both
    flash kernels keep q, k, v, the output and the log-sum-exp, so memory figures match cuDNN's; compile time
    and kernels are Triton's. The mask is dropped: the benchmark batch is one causal document per row, which
    `causal=True` alone masks. kv heads are repeated to the query heads (the kernel has no GQA)."""
    # GPU-only Pallas modules, imported only for the stand-in (gpu_info is private, jax >= 0.11: no public way to
    # name the target GPU without one)
    from jax._src.pallas.triton import gpu_info
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    gpu_info.get_gpu_info = lambda *a, **k: gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)

    def flash(q, k, v, mask=None, is_causal=False, implementation=None, **_):
        g = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        return pallas_attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=is_causal)

    moe.attention.jax = _Namespace(jax, nn=_Namespace(jax.nn, dot_product_attention=flash))


class _Namespace:
    """`base` with some attributes replaced (the stand-in patches moe.attention's view of jax only)."""

    def __init__(self, base, **replaced):
        self._base, self._replaced = base, replaced

    def __getattr__(self, name):
        return self._replaced[name] if name in self._replaced else getattr(self._base, name)


def run_group(cmd: list[str], timeout: int, env: dict) -> subprocess.CompletedProcess:
    """cmd in a process group of its own, all of it killed at the timeout (then TimeoutExpired): XLA:GPU runs
    ptxas as child processes, which would otherwise outlive a hung compile and keep the cores busy."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException:  # the timeout, and Ctrl-C or SIGTERM here: nothing of the row may keep running
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _run_in_subprocess(spec: dict, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.gpu_compile", "--_row", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        p = run_group(cmd, timeout, {**os.environ, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"})
    except subprocess.TimeoutExpired:
        return {**_row_keys(spec), "compile s": f"> {timeout} (not finished)"}
    out = [line for line in p.stdout.splitlines() if line.startswith("ROW ")]
    if p.returncode or not out:
        lines = p.stderr.strip().splitlines() or ["?"]
        err = ([line for line in lines if "Error" in line] or lines)[-1][:200]  # JAX ends with a note, not the error
        return {**_row_keys(spec), "compile s": f"failed after {time.perf_counter() - t0:.0f} s: {err}"}
    return json.loads(out[-1][4:])


def _row_keys(spec: dict) -> dict:
    return {"dispatch": spec["dispatch"], "grouped matmul": spec["grouped"], "experts": spec["experts"],
            "layers": spec["n_layers"] or "config",
            "scan layers": spec["scan"] or "config", "remat": spec["remat"] or "config", "attention": spec["attention"]}


def plugin_ready() -> bool:
    """Whether JAX here can compile for CUDA without a GPU (the plugin is importable)."""
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dispatch", default="dropless", help="dropless, capacity, expert_parallel; comma-separated")
    ap.add_argument("--experts", default="8", help="routed experts, comma-separated")
    ap.add_argument("--grouped_matmul", default="slab", help="comma-separated")
    ap.add_argument("--scan_layers", default="on", help="on, off or both (on,off)")
    add_remat_flag(ap)
    ap.add_argument("--attention", default="pallas_flash", choices=["pallas_flash", "xla"],
                    help="pallas_flash: JAX's Pallas flash attention, standing in for cuDNN's (whose compile needs "
                         "the cuDNN library): the same residuals (q, k, v, out, log-sum-exp), so the same memory; "
                         "xla: jax.nn.dot_product_attention's XLA implementation ([B, H, L, L] logits)")
    ap.add_argument("--n_layers", type=int, default=0, help="0: configs/gpu_1b.py's 16")
    ap.add_argument("--batch", type=int, default=16, help="rows of 2048 tokens (the gpu preset's 16)")
    ap.add_argument("--target", default=TARGET, help="the GPU's XLA target config (text proto)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per row")
    ap.add_argument("--_row", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._row:
        print("ROW " + json.dumps(compile_row(json.loads(a._row))), flush=True)
        return
    if not plugin_ready():
        print(f"error: no CUDA PJRT plugin importable here; {SETUP_HINT}", file=sys.stderr)
        sys.exit(2)
    if not os.path.isfile(a.target):
        print(f"error: --target {a.target} is not a file; pass an XLA GPU target config", file=sys.stderr)
        sys.exit(2)
    scans = comma_subset(ap, "--scan_layers", a.scan_layers, ("on", "off"))
    remats = remat_settings(ap, a.remat)
    dispatches = dispatch_list(ap, a.dispatch)
    comma_subset(ap, "--grouped_matmul", a.grouped_matmul, ("auto", *GROUPED_SWIGLU))
    if not all(e.isdigit() and int(e) > 0 for e in a.experts.split(",")):
        ap.error(f"--experts takes positive integers, comma-separated; got {a.experts!r}")
    rows = []
    for d, g in variants(dispatches, a.grouped_matmul.split(",")):
        for e in (int(x) for x in a.experts.split(",")):
            for sc in scans:
                for r in remats:
                    spec = dict(dispatch=d, grouped=g, experts=e, scan=sc, remat=r, n_layers=a.n_layers,
                                batch=a.batch, target=a.target, attention=a.attention)
                    rows.append(_run_in_subprocess(spec, a.timeout))
                    print(table(rows[-1:]), flush=True)
    print(f"\nXLA:GPU compile on this CPU (deviceless, {os.cpu_count()} cores, target {os.path.basename(a.target)}):")
    print(table(rows))


if __name__ == "__main__":
    main()
