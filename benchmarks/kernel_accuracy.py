"""How far each grouped SwiGLU is from the fp32 truth in bf16, values and gradients, with uneven, empty and padding
groups; the same measurement tests/test_grouped_kernels.py asserts on:

    python -m benchmarks.kernel_accuracy                        # tokamax's implementations here (xla on CPU)
    python -m benchmarks.kernel_accuracy --grouped slab,tokamax:mosaic   # on a Hopper GPU

Why against the truth and not against XLA's bf16 `ragged_dot`: two bf16 paths round differently, so a kernel is
judged by whether its own error is ragged_dot's. Error = max |got - truth| / max |truth| per output.

The weights are at the fan-in scale (N(0, 1 / fan_in)), so pre-activations and outputs are O(1) and the loss's
sine is well-conditioned: an error measures rounding. At N(0, 0.09) weights (outputs ~30) the sine turns
bf16's 0.4% rounding of y into gradient errors of tens of percent that swing with the rounding pattern, so two
kernels computing the same products in bf16 come out far apart by chance.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import describe, table
from moe.dispatch import kernels
from moe.dispatch.kernels import tokamax_swiglu

OUTPUTS = ("y", "d/dx", "d/dw_gate", "d/dw_up", "d/dw_down")
# Mosaic-GPU copies rows with TMA, whose strides must be multiples of 16 bytes: 128-wide rows.
N, D, F, E = 256, 128, 128, 6
CASES = {
    "balanced": [40, 45, 38, 44, 42, 47],
    "skewed": [160, 0, 12, 0, 50, 34],
    "empty_and_padding": [30, 0, 40, 20, 0, 36],  # 126 of 256 rows in groups, the rest padding
}


def inputs(dtype=jnp.float32, n=N, d=D, f=F, e=E):
    """x [n, d] standard normal and the expert weights (gate, up [e, d, f]; down [e, f, d]) at the fan-in scale."""
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (n, d), dtype)
    ws = (jax.random.normal(ks[1], (e, d, f)) / d**0.5, jax.random.normal(ks[2], (e, d, f)) / d**0.5,
          jax.random.normal(ks[3], (e, f, d)) / f**0.5)
    return x, tuple(w.astype(dtype) for w in ws)


def value_and_grads(fn, sizes, x, ws):
    """((loss, (d/dx, d/dw_gate, d/dw_up, d/dw_down, and d/d of any further argument in ws)), y) of fn(x,
    group_sizes, *ws) under a fixed nonlinear loss that weights every entry differently, so that a wrong row or
    column shows."""
    grads, forward = _compiled(fn, len(ws))
    gs = jnp.asarray(sizes, jnp.int32)
    # fp32 products in full precision on every backend (GPUs default to TF32): comparisons of algorithms.
    with jax.default_matmul_precision("highest"):
        return grads(x, gs, *ws), forward(x, gs, *ws)


@functools.cache
def _compiled(fn, n_ws: int):
    """fn's jitted loss gradients and forward, the group sizes an argument: one program per fn and shapes, whatever
    the routing."""
    def loss(x, gs, *w):
        n, d = x.shape
        weight_N = jnp.arange(n * d, dtype=jnp.float32).reshape(n, d) / (n * d)
        return jnp.sum(jnp.sin(fn(x, gs, *w).astype(jnp.float32)) * weight_N)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, *range(2, 2 + n_ws)))), jax.jit(fn)


def relative_errors(fn, sizes, x, ws) -> np.ndarray:
    """Per output (OUTPUTS), max |fn - truth| / max |truth|; truth: the fp32 ragged_dot on the same inputs (bf16
    values are exact in fp32) at full precision. NaN where fn's output is not finite."""
    (_, got_grads), got_y = value_and_grads(fn, sizes, x, ws)
    (_, true_grads), true_y = value_and_grads(kernels.grouped_swiglu_ragged, sizes, x.astype(jnp.float32),
                                              tuple(w.astype(jnp.float32) for w in ws))
    f32 = lambda a: np.asarray(a, np.float32)
    return np.array([np.abs(f32(a) - f32(b)).max() / np.abs(f32(b)).max()
                     for a, b in zip((got_y, *got_grads), (true_y, *true_grads))])


def grouped_swiglu(name: str):
    """A grouped matmul by `execution.grouped_matmul` name, or `tokamax:<implementation>` for one of tokamax's."""
    if name.startswith("tokamax:"):
        return functools.partial(tokamax_swiglu.grouped_swiglu_tokamax, implementation=name.split(":", 1)[1])
    return kernels.grouped_swiglu_for(name)


def rows(names: list[str], dtype=jnp.bfloat16) -> list[dict]:
    """One row per case and output: each grouped matmul's error and XLA ragged_dot's, at the same dtype."""
    x, ws = inputs(dtype)
    out = []
    for case, sizes in CASES.items():
        errs = {n: relative_errors(grouped_swiglu(n), sizes, x, ws) for n in ["ragged_dot", *names]}
        for i, output in enumerate(OUTPUTS):
            out.append({"case": case, "output": output, **{f"{n} error": float(e[i]) for n, e in errs.items()}})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "slab,tokamax:xla" if tokamax_swiglu.available() else "slab"
    ap.add_argument("--grouped", default=default,
                    help=f"grouped matmuls to compare with ragged_dot (default {default}; tokamax:mosaic, "
                         "tokamax:triton for its GPU kernels)")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args(argv)
    print(describe() + f" | {a.dtype}, {N} rows, d {D}, f {F}, {E} experts")
    print(table(rows(a.grouped.split(","), jnp.dtype(a.dtype))))


if __name__ == "__main__":
    main()
