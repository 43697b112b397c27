"""XLA:CPU's matmul libraries on the routed experts' shapes: where the many-expert MoE layer's floor comes from.

    python -m benchmarks.cpu_dots                              # the default train step's widths, 8..128 experts
    python -m benchmarks.cpu_dots --experts 16,64 --step        # + the whole default train step per library

XLA:CPU hands every dot it can to a matmul library chosen at compile time. This compiles the same functions both
ways in one process (compile options per executable, everything timed round-robin, so load hits all alike):

- `default`: XLA:CPU as shipped: YNNPACK takes every dot it supports (row-major operands), and reductions;
- `eigen`: YNNPACK's fusions off (`xla_cpu_experimental_ynn_fusion_type=""`): XLA's own dot thunk (Eigen).
  (XNNPACK's `xla_cpu_experimental_xnn_fusion_type` leaves a plain dot in the program, so which library ran
  cannot be checked: not offered.)

Per expert count E, with N = tokens x top-k rows and N / E rows per expert (perfect balance), the rows are: the
gate projection as the experts' batched dot `[E, N/E, D] x [E, D, F]` and as the flat dot `[N, D] x [D, F]` of the
same FLOPs (`x flat` = batched / flat time, same library), and the experts' SwiGLU forward + backward (the
moe_layer benchmark's "expert matmuls alone" row) against the dense SwiGLU of the same active FLOPs (`x dense`).
`--step` adds the default train step (`benchmarks.train_step`, dropless) per library: what a library change
would do to training, where every other matmul, reduction and fusion changes too.
"""

import argparse

import jax
import jax.numpy as jnp

from benchmarks.common import PRESETS, comma_subset, describe, preset, table, time_fns
from benchmarks.train_step import prepare
from moe.dispatch import kernels
from train import host_memory

LIBRARIES = {
    "default": None,
    "eigen": {"xla_cpu_experimental_ynn_fusion_type": ""},
}


def compiled(fn, args, library: str):
    """fn compiled for args under the library's compile options; None where this jaxlib has no such option."""
    lowered = jax.jit(fn).lower(*args)
    try:
        return lowered.compile(compiler_options=LIBRARIES[library]) if LIBRARIES[library] else lowered.compile()
    except jax.errors.JaxRuntimeError as e:  # an XLA:CPU flag renamed or dropped in another jaxlib
        if "compile option" not in str(e):
            raise
        return None


def cases(name: str, n_experts: int) -> list[tuple[str, object, tuple, float, str | None]]:
    """(label, fn, args, FLOPs, label of the row it is compared with) for one expert count."""
    m, p = preset(name, n_experts)["model"], preset(name)
    T, D, F, K = p["batch"] * p["seq_len"], m["d_model"], m["moe_d_ff"], m["top_k"]
    E = n_experts
    C = -(-T * K // E)
    ks = jax.random.split(jax.random.key(0), 8)
    rand = lambda i, shape: jax.random.normal(ks[i], shape, jnp.float32) * shape[-2] ** -0.5
    x_ExCxD, w_ExDxF = rand(0, (E, C, D)), rand(1, (E, D, F))
    ws = [w_ExDxF, rand(2, (E, D, F)), rand(3, (E, F, D))]
    dense = [rand(4, (D, K * F)), rand(5, (D, K * F)), rand(6, (K * F, D))]
    flat, dense_ffn = f"gate dot, flat [{E * C}, {D}] x [{D}, {F}]", f"dense SwiGLU fwd + bwd, width {K * F}"
    return [
        (f"gate dot, batched [{E}, {C}, {D}] x [{E}, {D}, {F}]", lambda x, w: jnp.einsum("ecd,edf->ecf", x, w),
         (x_ExCxD, w_ExDxF), 2 * E * C * D * F, flat),
        (flat, lambda x, w: x.reshape(-1, D) @ w[0], (x_ExCxD, w_ExDxF), 2 * E * C * D * F, None),
        (f"experts' SwiGLU fwd + bwd, {E} x {C} rows",
         jax.grad(lambda x, *w: kernels.swiglu_batched(x, *w)[0].sum(), argnums=(0, 1, 2, 3)), (x_ExCxD, *ws),
         6 * E * C * 3 * D * F, dense_ffn),
        (dense_ffn, jax.grad(lambda x, *w: kernels.swiglu(x, *w).sum(), argnums=(0, 1, 2, 3)),
         (rand(7, (T, D)), *dense), 6 * T * 3 * D * K * F, None),
    ]


def step_call(name: str, n_experts: int, library: str):
    """The train step (dropless, `auto` grouped matmul) and its args, compiled under the library's options."""
    (run, args), = prepare(name, "dropless", n_experts, peak=1.0, compile_step=False)[0]
    return compiled(run, args, library), args


def bench(name: str, expert_counts, libraries, steps: int, step: bool = False) -> list[dict]:
    """One row per (expert count, op, library); every compiled call timed round-robin with all the others."""
    rows, calls = [], []
    for E in expert_counts:
        for label, fn, args, flops, base in cases(name, E):
            for lib in libraries:
                rows.append({"experts": E, "op": label, "library": lib, "flops": flops, "base": base})
                calls.append((compiled(fn, args, lib), args))
        for lib in libraries if step else ():
            rows.append({"experts": E, "op": "train step (dropless)", "library": lib, "flops": 0, "base": None})
            calls.append(step_call(name, E, lib))
    live = [i for i, (fn, _) in enumerate(calls) if fn is not None]
    seconds = dict(zip(live, time_fns([calls[i] for i in live], steps)))
    for i, r in enumerate(rows):
        r["ms"] = seconds[i] * 1e3 if i in seconds else None
        r["GFLOP/s"] = r["flops"] / seconds[i] / 1e9 if i in seconds and r["flops"] else None
    ms = {(r["experts"], r["op"], r["library"]): r["ms"] for r in rows}
    for r in rows:  # batched / flat dot, experts' / dense SwiGLU: the same library and expert count
        base_ms = ms.get((r["experts"], r.pop("base"), r["library"]))
        r["x flat or dense"] = r["ms"] / base_ms if r["ms"] and base_ms else None
        del r["flops"]
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS), help="the widths and tokens per step")
    ap.add_argument("--experts", default="8,16,32,64,128", help="comma-separated routed-expert counts")
    ap.add_argument("--libraries", default=",".join(LIBRARIES), help=f"comma-separated from {','.join(LIBRARIES)}")
    ap.add_argument("--steps", type=int, default=30, help="timed calls per row (median)")
    ap.add_argument("--step", action="store_true", help="also time the train step per library")
    a = ap.parse_args(argv)
    host_memory.keep_freed_memory()  # as `python -m train` runs (train/host_memory.py)
    libraries = comma_subset(ap, "--libraries", a.libraries, LIBRARIES)
    if jax.default_backend() != "cpu":
        ap.error(f"this compares XLA:CPU's matmul libraries: run it on the CPU, not {jax.default_backend()}")
    print(describe())
    print(table(bench(a.preset, [int(e) for e in a.experts.split(",")], libraries, a.steps, a.step)))


if __name__ == "__main__":
    main()
