"""The whole GPU benchmark and the GPU-only tests in one command, written to one Markdown report:

    python -m benchmarks.gpu_report --out gpu_report.md          # on one H100/H200 (configs/gpu_1b.py shapes)
    python -m benchmarks.gpu_report --sections tests,train        # a subset (a short lease: ~4 min per section)
    python -m benchmarks.gpu_report --tiny --out /tmp/report.md  # the same code paths at toy shapes, any backend

On the lent machine the image lacks some packages: `bash benchmarks/gpu_wheels.sh` here prepares them and prints
the command to run there.

Sections: device and measured bf16 matmul peak (train.flops.measure_peak_flops, 8192^2); GPU-only tests
(cuDNN attention == einsum, tokamax grouped-matmul kernels as accurate as ragged_dot; run by pytest with
JAX_PLATFORMS=cuda, skipped off GPU); each grouped matmul's bf16 error against the fp32 truth
(benchmarks.kernel_accuracy); MoE layer vs the dense FFN of equal active FLOPs at 8 and 64 experts per grouped
matmul, with dropless's dispatch alone and its backward by scatter-adds or by gathers only (`dropless:scatter`, `dropless:gather`);
the layer at 64 experts under skewed routings, where slab runs its 3x slab or its padded-block fallback (against
slabs of up to 2x, and tokamax; `fallback`); the train step of configs/gpu_1b.py (MFU against the measured
peak, tokens/s, peak memory) at 8 and 64 experts per grouped matmul and `--remat` setting, and the 64/8 step-time
ratio. Goals: MFU >= 40%, layer <= 1.3x dense, 64/8 <= 1.15x.
Every section runs even if an earlier one fails (its error goes into the report), in the order tests, accuracy,
train step (first grouped matmul), layer, fallback, a profile of the first train step (its 25 largest XLA ops,
benchmarks.profile_step), train step (the others), and the report is rewritten after each: a run cut off by the
lease's time limit keeps what finished.
"""

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import jax

from benchmarks import decode_cache, kernel_accuracy, moe_layer, profile_step, speculative_cost, train_step
from benchmarks.common import add_remat_flag, add_scan_layers_flag, describe, remat_settings, table
from moe.dispatch.kernels import tokamax_swiglu
from train.flops import measure_peak_flops

SECTIONS = ("tests", "accuracy", "train", "layer", "fallback", "profile", "decode", "speculative")
GPU_TESTS = ["tests/test_attention_impl.py::test_cudnn_equals_einsum_on_gpu", "tests/test_grouped_kernels.py"]


def _grouped_choices() -> list[str]:
    """The grouped matmuls worth timing, `auto`'s GPU choice first: `slab` (batched matmuls on slabs, exact; the
    fastest train step on a GPU), tokamax's kernels when installed, XLA's ragged_dot last (slowest there, and
    minutes per row at 64 experts)."""
    return ["slab"] + (["tokamax"] if tokamax_swiglu.available() else []) + ["ragged_dot"]


def save_target_config(out: str) -> str:
    """XLA's description of this GPU (`gpu_target_config.pbtxt`, dumped when it compiles a small program in a
    fresh process) saved beside the report: benchmarks/gpu_compile.py compiles for it on a machine without a GPU.
    Returns a line for the report."""
    path = os.path.splitext(out)[0] + ".target_config.txtpb"
    with tempfile.TemporaryDirectory() as dump:
        # No compilation cache (a cached program is not compiled, so nothing would be dumped); no preallocation
        # (this process already holds most of the GPU's memory).
        env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump}", JAX_ENABLE_COMPILATION_CACHE="false",
                   XLA_PYTHON_CLIENT_PREALLOCATE="false")
        code = "import jax, jax.numpy as jnp; print(jax.jit(lambda x: x * 3 + 1)(jnp.ones(4)))"
        try:
            subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60)
        except subprocess.TimeoutExpired:
            return "XLA target config: not saved (its process ran past 60 s)"
        found = sorted(glob.glob(os.path.join(dump, "*gpu_target_config.pbtxt")))
        if not found:
            return "XLA target config: none (not a GPU)"
        shutil.copyfile(found[0], path + ".tmp")
        os.replace(path + ".tmp", path)
    return f"XLA target config: `{path}` (for benchmarks/gpu_compile.py --target)"


def run_gpu_tests(tiny: bool) -> str:
    """pytest on the GPU-only tests; on CPU they skip (tiny mode only checks that they collect)."""
    # One process (-n 0), allocating as it goes: this process already holds most of the GPU's memory.
    env = dict(os.environ, JAX_PLATFORMS="cuda" if jax.default_backend() == "gpu" else "cpu",
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    # -v: a line per test, printed as it ends, so a run cut off by a time limit (benchmarks/gpu_session.sh) still
    # leaves each finished test's result in the console.
    cmd = [sys.executable, "-m", "pytest", "-q" if tiny else "-v", "-rfs", "--tb=line", "-p", "no:cacheprovider",
           "-o", "addopts=", *GPU_TESTS]
    if tiny:
        cmd += ["-k", "gpu", "--co"]  # collect only: the GPU tests are found and importable
    lines = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        watchdog = threading.Timer(600, p.kill)  # a hung GPU test must not hang the report
        watchdog.start()
        try:
            for line in p.stdout:
                print(line, end="", flush=True)
                lines.append(line.rstrip("\n"))
            returncode = p.wait()
        finally:
            watchdog.cancel()
    tail = "\n".join(line[:300] for line in lines[-40:])
    return f"`{' '.join(cmd[2:])}` (JAX_PLATFORMS={env['JAX_PLATFORMS']}): exit {returncode}\n\n```\n{tail}\n```"


def layer_section(preset: str, experts: list[int], grouped: list[str]) -> str:
    """The layer rows per grouped matmul. (slab's spill layouts, the CPU default, run slower than its pure
    slabs on a GPU: not timed here.)"""
    rows = []
    for e in experts:
        rows += moe_layer.bench(preset, e, ["dropless:scatter", "dropless:gather", "capacity"], grouped)
    return table(rows)


def fallback_section(preset: str, experts: int, grouped: list[str]) -> str:
    """slab under uneven routings (moe_layer's `skewed@0.06`, busiest expert ~2.8x the mean at 64 experts, and
    `skewed`, ~4.2x, as the deep layers of a fresh configs/gpu_1b.py route): its slabs of up to 3x the mean
    against those of up to 2x (`slab:1.25/1.5/2`, which sends the first routing to the 512-row fallback), and
    tokamax where installed (no padding, whatever the routing). The fallback's block rows and the 512-row
    spill layouts are settled (moe/dispatch/kernels/slab.py): not timed here."""
    tried = ["slab", "slab:1.25/1.5/2"] + ["tokamax"] * ("tokamax" in grouped)
    return table(moe_layer.bench(preset, experts, ["dropless"], tried, routings=("skewed@0.06", "skewed")))


def accuracy_section(grouped: list[str]) -> str:
    """bf16 error against the fp32 truth of each grouped matmul, tokamax's GPU kernels by name (see
    benchmarks/kernel_accuracy.py): what the GPU test asserts, as figures."""
    names = [n for g in grouped if g != "ragged_dot"
             for n in (["tokamax:mosaic"] if g == "tokamax" and jax.default_backend() == "gpu" else [g])]
    return table(kernel_accuracy.rows(names))


def train_section(preset: str, experts: list[int], grouped: str, attention: str, peak: float,
                  scan_layers: str = "", remats: tuple[str, ...] = ("",)) -> str:
    """The train step at each expert count, per remat setting (off or a policy; "": the config's)."""
    rows, ratios = [], []
    for r in remats:
        for e in experts:  # each row printed when done: a 16-layer compile takes minutes, a lease may end first
            rows.append(train_step.bench(preset, "dropless", e, peak, grouped=grouped, attention=attention,
                                         scan_layers=scan_layers, remat=r))
            print(table(rows[-1:]), flush=True)
        if len(experts) == 2:
            ratios.append("- " + train_step.expert_ratio(grouped + (f" / remat {r}" if r else ""), rows[-2:],
                                                         experts))
    return "\n".join([table(rows), *ratios])


def _short_traceback() -> str:
    """This project's frames of the exception being handled (library frames hide them in a plain tail), then
    the tail of the whole traceback."""
    tb = traceback.format_exc()
    ours = [line for line in tb.splitlines() if 'File "' in line and "site-packages" not in line]
    return "our frames:\n" + "\n".join(ours[-12:]) + "\n...\n" + tb[-1500:]


def write_report(path: str, sections: list[tuple[str, str]], elapsed_s: float) -> str:
    """The report so far, replaced atomically: a run cut off by a time limit still leaves every finished section.
    Returns its text."""
    text = f"# GPU report ({elapsed_s:.0f} s)\n\n" + "\n\n".join(f"## {t}\n\n{b}" for t, b in sections) + "\n"
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    return text


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_report.md")
    ap.add_argument("--tiny", action="store_true", help="toy shapes (preset tiny): checks the script, not speed")
    ap.add_argument("--attention_impl", default="cudnn", help="train step attention (configs/gpu_1b.py: cudnn)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"which of {', '.join(SECTIONS)} to run (e.g. a rerun of what failed in a short lease)")
    ap.add_argument("--grouped_matmul", default="",
                    help="comma-separated grouped matmuls to time (default: slab, tokamax if installed, ragged_dot; "
                         "the first also runs the train step right after the tests)")
    add_scan_layers_flag(ap, "the train and profile sections' train step:")
    add_remat_flag(ap, "the train section's")
    ap.add_argument("--no_target_config", action="store_true",
                    help="skip saving XLA's target config (a JAX process of up to 60 s; once per GPU is enough)")
    return ap


def main(argv=None) -> str:
    ap = parser()
    a = ap.parse_args(argv)
    remats = tuple(remat_settings(ap, a.remat))
    wanted = set(a.sections.split(","))
    if wanted - set(SECTIONS):
        ap.error(f"--sections takes {', '.join(SECTIONS)}; got {a.sections}")
    preset = "tiny" if a.tiny else "gpu"
    # tiny: one grouped matmul, two expert counts: every section and the ratio line, few compilations
    experts = [4, 8] if a.tiny else [8, 64]
    grouped = a.grouped_matmul.split(",") if a.grouped_matmul else _grouped_choices()[:1 if a.tiny else None]
    t0 = time.time()
    peak = measure_peak_flops(256 if a.tiny else None)
    sections = [("Device", f"{describe()}\n\nMeasured matmul peak: {peak / 1e12:.4g} TFLOP/s "
                           f"({'bf16 8192^2' if jax.default_backend() != 'cpu' else 'fp32, CPU'})\n\n"
                           + ("XLA target config: not saved (--no_target_config)" if a.no_target_config
                              else save_target_config(a.out)))]
    # Most telling first (a lease may end mid-run): the correctness tests, the train step on the first grouped
    # matmul (MFU), the layer ratios, then the train step on the others.
    train = lambda g: (f"Train step ({g}), preset {preset}, attention {a.attention_impl}",
                       lambda: train_section(preset, experts, g, a.attention_impl, peak, a.scan_layers, remats))
    steps = [("tests", ("GPU-only tests", lambda: run_gpu_tests(a.tiny))),
             ("accuracy", ("Grouped matmuls' bf16 error against the fp32 truth", lambda: accuracy_section(grouped))),
             ("train", train(grouped[0])),
             ("layer", ("MoE layer vs dense FFN (forward + backward)",
                        lambda: layer_section(preset, experts, grouped))),
             ("fallback", (f"MoE layer, skewed routings, {experts[-1]} experts: slab's 2.5x / 3x slabs and its "
                          "fallback", lambda: fallback_section(preset, experts[-1], _grouped_choices()))),
             ("profile", (f"Train step profile ({grouped[0]}, {experts[0]} experts): the largest ops",
                          lambda: profile_step.profile(preset, "dropless", experts[0], grouped[0], a.attention_impl,
                                                       steps=2, top=25, scan_layers=a.scan_layers))),
             ("decode", ("Decoding at long context: GQA vs MLA (absorbed, naive), tokens/s and cache",
                         lambda: table(decode_cache.rows(preset, [64, 128] if a.tiny else [1024, 4096, 16384],
                                                         4 if a.tiny else 32, 1, 1 if a.tiny else 3,
                                                         "float32" if a.tiny else "bfloat16",
                                                         on_row=decode_cache.print_row)))),
             ("speculative", ("Speculative decoding with the MTP draft: a step's cost in plain greedy steps, and the "
                              "acceptance rate above which it pays",
                              lambda: table(speculative_cost.rows(preset, 8 if a.tiny else 1024,
                                                                  8 if a.tiny else 128, 1 if a.tiny else 3,
                                                                  "float32" if a.tiny else "bfloat16")))),
             *[("train", train(g)) for g in grouped[1:]]]
    steps = [step for section, step in steps if section in wanted]
    print(f"## {sections[0][0]}\n\n{sections[0][1]}\n", flush=True)
    report = write_report(a.out, sections, time.time() - t0)
    for title, fn in steps:
        try:
            body = fn()
        except Exception:  # keep going: one broken section must not hide the others
            body = "FAILED:\n\n```\n" + _short_traceback() + "\n```"
        sections.append((title, body))
        print(f"## {title}\n\n{body}\n", flush=True)
        report = write_report(a.out, sections, time.time() - t0)
    print(f"wrote {a.out}")
    return report


if __name__ == "__main__":
    main()
