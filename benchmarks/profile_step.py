"""Where a train step's time goes: the largest XLA ops of the jitted step, from a jax.profiler trace.

    python -m benchmarks.profile_step --preset default --experts 16          # configs/default.py's step
    python -m benchmarks.profile_step --preset gpu --experts 8 --top 40      # configs/gpu_1b.py on a GPU

The step is benchmarks.train_step's (same config, state and random batch), traced for --steps calls after a
warm-up. Each row is one op of the compiled program: its time per step (summed over its executions and divided by
--steps), its output shape and the JAX operation it came from (the HLO op_name, e.g. `transpose(jvp())/dot_general`
for a matmul of the backward pass). Only the program's leaf ops are counted (not control flow, not the runtime's
own events); on CPU independent ops run concurrently on the cores, so op times can add up to more than the step.
On a GPU, kernels named other than their HLO op (cuBLAS / cuDNN calls inside custom calls, Triton GEMMs) are
not matched, and the op table under-counts (it caught 4% of GPU run 7's step). So on an accelerator a second
table sums every kernel on the device's stream lines by kernel name, whatever its name, with their total: the
device's busy time per step, against which the step time shows the idle gaps. A kernel XLA emitted from its own
fusion (named after the instruction, '.' made '_') gets that instruction's shape and JAX operation. The trace is left in
--trace_dir for TensorBoard / Perfetto.
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile

import jax

from benchmarks.common import PRESETS, add_scan_layers_flag, describe, table, time_fns
from benchmarks.train_step import prepare
from train import host_memory


def op_metadata(hlo_text: str) -> dict:
    """HLO instruction name -> (output shape, op_name) for the leaf instructions of a compiled module: control
    flow (conditional, while, call) is left out, since its time is that of the ops inside it."""
    meta = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+) (\w[\w-]*)\(.*?op_name=\"([^\"]*)\"", line)
        if m and m.group(3) not in ("conditional", "while", "call"):
            meta[m.group(1)] = (m.group(2), m.group(4))
    return meta


def kernel_ops(meta: dict) -> dict:
    """Kernel name -> HLO instruction name, for the kernels XLA:GPU emits from its own fusions: it names each after
    its instruction with every character but [A-Za-z0-9_] made '_' (`loop_select_fusion.18` runs as
    `loop_select_fusion_18`). cuBLAS / cuDNN kernels inside custom calls match nothing."""
    return {re.sub(r"[^A-Za-z0-9_]", "_", name): name for name in meta}


def trace_events(trace_dir: str) -> list[dict]:
    """The events of the newest Perfetto trace under trace_dir."""
    path = max(glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True), key=os.path.getmtime)
    events = json.load(gzip.open(path))
    return events["traceEvents"] if isinstance(events, dict) else events


def op_times(events: list[dict], names) -> collections.Counter:
    """Op name -> summed duration (microseconds) of the trace events named after one of `names` (the program's
    leaf HLO ops; the runtime's own events are left out)."""
    totals = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("name") in names:
            totals[e["name"]] += e.get("dur", 0)
    return totals


def device_kernel_times(events: list[dict]) -> collections.Counter:
    """Kernel name -> summed duration (microseconds) of the events on the GPU's stream lines (process
    "/device:GPU:N", threads "Stream ..."): every kernel, cuBLAS / cuDNN / Triton ones included. The device's
    derived lines ("XLA Ops", "XLA Modules") repeat the same time and are left out. Empty on CPU."""
    names = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    devices = {e.get("pid") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and re.search(r"/device:GPU", e.get("args", {}).get("name", ""))}
    totals = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in devices and names.get((e["pid"], e.get("tid")), "").startswith("Stream"):
            totals[e["name"]] += e.get("dur", 0)
    return totals


def profile(preset: str, dispatch: str, experts: int, grouped: str, attention: str, steps: int = 3, top: int = 30,
            trace_dir: str = "", scan_layers: str = "") -> str:
    """The step time, the summed op time and a table of the `top` largest ops, as Markdown."""
    calls, _ = prepare(preset, dispatch, experts, peak=1.0, grouped=grouped, attention=attention,
                       scan_layers=scan_layers)
    (compiled, args), = calls  # the compiled train step (run, timed and traced, read for op metadata), its args
    step_s = time_fns([(compiled, args)], 3)[0]
    trace_dir = trace_dir or tempfile.mkdtemp(prefix="profile_step_")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(steps):
            jax.block_until_ready(compiled(*args))
    meta = op_metadata(compiled.as_text())
    events = trace_events(trace_dir)
    totals = op_times(events, meta)
    summed = sum(totals.values())
    rows = [{"op": name, "ms/step": us / steps / 1e3, "share of op time %": 100 * us / summed,
             "shape": meta[name][0][:40], "from": meta[name][1][-80:]}  # totals holds only names in meta
            for name, us in totals.most_common(top)]
    report = (f"step {step_s * 1e3:.1f} ms (untraced median); ops summed {summed / steps / 1e3:.1f} ms/step; trace "
              f"in {trace_dir}\n\n{table(rows)}")
    kernels = device_kernel_times(events)
    if kernels:
        busy = sum(kernels.values())
        ops = kernel_ops(meta)
        krows = []
        for name, us in kernels.most_common(top):
            shape, origin = (meta[ops[name]][0][:40], meta[ops[name]][1][-80:]) if name in ops else ("-", "-")
            krows.append({"kernel": name[:70], "ms/step": us / steps / 1e3, "share of busy time %": 100 * us / busy,
                          "shape": shape, "from": origin})
        report += (f"\n\nDevice kernels (every stream): busy {busy / steps / 1e3:.1f} ms/step of the "
                   f"{step_s * 1e3:.1f} ms step, {len(kernels)} distinct kernels\n\n{table(krows)}")
    return report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--dispatch", default="dropless")
    ap.add_argument("--grouped_matmul", default="auto")
    ap.add_argument("--attention_impl", default="blockwise")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3, help="traced steps")
    ap.add_argument("--top", type=int, default=30, help="ops listed")
    ap.add_argument("--trace_dir", default="", help="where the trace goes (default: a temporary directory)")
    add_scan_layers_flag(ap)
    a = ap.parse_args(argv)
    host_memory.keep_freed_memory()  # as `python -m train` runs (train/host_memory.py)
    print(describe())
    print(profile(a.preset, a.dispatch, a.experts, a.grouped_matmul, a.attention_impl, a.steps, a.top, a.trace_dir,
                  a.scan_layers))


if __name__ == "__main__":
    main()
