"""The routed experts alone (forward + backward), per dispatch path and grouped matmul, against a dense SwiGLU FFN with the same
active FLOPs (width top_k * moe_d_ff), at n_routed_experts = 8 and 64 (fixed top-k and expert width).

    python -m benchmarks.moe_layer --preset cpu
    python -m benchmarks.moe_layer --preset gpu --grouped_matmul ragged_dot,blocked
    # against an older experts.py (e.g. `git show REV:moe/experts.py > /tmp/experts_before.py`), same process:
    python -m benchmarks.moe_layer --preset cpu --baseline_experts /tmp/experts_before.py --steps 15
    # other slab sizes than grouped_slab.SLAB_FACTORS (multiples of the mean rows per expert):
    python -m benchmarks.moe_layer --preset cpu --dispatch dropless --grouped_matmul slab,slab:1.25/1.5/1.75/2

All rows of one expert count are timed round-robin (benchmarks.common.time_fns): `x dense` is a same-run ratio.
Two rows time the experts' batched matmuls with no dispatch at all, on N / E rows per expert (perfect balance)
and on the slab `slab` takes for the benchmark's routing under `dropless` (expert_parallel's slab sees its capacity
rows instead): the floor of any batched-matmul path, and what imbalance adds to it. Their TFLOP/s count the useful
FLOPs (T * K rows), like every row, not the padded slab's.
"""

import functools
import importlib.util

import jax
import jax.numpy as jnp

from benchmarks.common import arg_parser, describe, preset, table, time_fns, variants
from moe import expert_parallel, experts, grouped_slab, router


def _grouped(name: str):
    """A grouped_matmul name, or `slab:F1/F2/...`: the slab path with those slab sizes (multiples of N / E)."""
    if name.startswith("slab:"):
        factors = tuple(float(f) for f in name[len("slab:"):].split("/"))
        return functools.partial(grouped_slab.grouped_swiglu_slab, factors=factors)
    return name


def _routed_fn(dispatch: str, grouped: str, capacity_factor: float, group_size: int):
    if dispatch == "dropless":
        return functools.partial(experts.dropless, grouped=_grouped(grouped))
    if dispatch == "capacity":
        return functools.partial(experts.capacity, capacity_factor=capacity_factor, group_size=group_size)
    if dispatch == "expert_parallel":  # one device: the all_to_all-free single-shard version of the same math
        return lambda *a: expert_parallel.dispatch(*a, capacity_factor=capacity_factor,
                                                   grouped_matmul=_grouped(grouped))[0]
    raise ValueError(f"unknown dispatch {dispatch!r}")


def _load_experts(path: str):
    spec = importlib.util.spec_from_file_location("experts_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench(name: str, n_experts: int, dispatches, grouped_matmuls=("auto",), capacity_factor: float = 1.25,
          batch: int = 0, steps: int = 0, baseline_experts: str = "") -> list[dict]:
    """One device's layer: `batch` (default: the preset's) rows of the preset's sequence length."""
    p = preset(name, n_experts)
    m = p["model"]
    T, D, F, K = (batch or p["batch"]) * p["seq_len"], m["d_model"], m["moe_d_ff"], m["top_k"]
    dt = jnp.dtype(p["execution"]["dtype"])
    ks = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(ks[0], (T, D), dt)
    w_router = jax.random.normal(ks[1], (D, n_experts), jnp.float32) * D**-0.5
    ws = [(jax.random.normal(k, s, jnp.float32) * s[1] ** -0.5).astype(dt)
          for k, s in zip(ks[2:5], [(n_experts, D, F), (n_experts, D, F), (n_experts, F, D)])]
    _, ids, gates = jax.jit(functools.partial(router.route, top_k=K))(x.astype(jnp.float32), w_router,
                                                                       jnp.zeros(n_experts))
    flops = 6 * T * K * 3 * D * F  # fwd + bwd of K expert SwiGLUs per token
    rows, calls = [], []

    def add(name, grouped, fn, *args):
        step = jax.jit(jax.grad(lambda x, *w: fn(x, *w).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3)))
        calls.append((step, args))
        rows.append({"path": name, "grouped matmul": grouped, "experts": n_experts, "tokens": T})

    for d, g in variants(dispatches, grouped_matmuls):
        fn = _routed_fn(d, g, capacity_factor, p["seq_len"])
        add(d, g, lambda x, wg, wu, wd, fn=fn: fn(x, ids, gates, wg, wu, wd), x, *ws)
    # What dispatch cannot go below: the experts' batched matmuls alone on perfectly balanced rows (N / E each),
    # and on the slab the `slab` path picks for this routing (its row padding is the cost of imbalance).
    sizes = jnp.bincount(ids.reshape(-1), length=n_experts)
    caps = grouped_slab.capacities(T * K, n_experts)
    slab_rows = next((c for c in caps if c >= int(sizes.max())), None)
    for C, what in ((-(-T * K // n_experts), "balanced"), (slab_rows, "this routing's slab")):
        if C is not None:
            xs = jax.random.normal(ks[0], (n_experts, C, D), dt)
            add(f"expert matmuls alone, {C} rows each ({what})", "-", experts._swiglu_batched, xs, *ws)
    dense = [(jax.random.normal(k, s, jnp.float32) * s[0] ** -0.5).astype(dt)
             for k, s in zip(ks[2:5], [(D, K * F), (D, K * F), (K * F, D)])]
    if baseline_experts:  # the dropless path of another experts.py, e.g. an earlier revision, blocked matmul
        old = _load_experts(baseline_experts)
        add(f"dropless ({baseline_experts})", "blocked",
            lambda x, wg, wu, wd: old.dropless(x, ids, gates, wg, wu, wd, grouped="blocked"), x, *ws)
    add("dense FFN (same active FLOPs)", "-", experts.swiglu, x, *dense)
    for r, s in zip(rows, time_fns(calls, steps or p["steps"])):
        r.update({"ms": s * 1e3, "TFLOP/s": flops / s / 1e12})
    base = rows[-1]["ms"]
    for r in rows:
        r["x dense"] = r["ms"] / base
    return rows


def main(argv=None):
    ap = arg_parser(__doc__.splitlines()[0])
    ap.add_argument("--baseline_experts", default="", help="path of another experts.py to time beside")
    a = ap.parse_args(argv)
    print(describe())
    rows = []
    for e in map(int, a.experts.split(",")):
        rows += bench(a.preset, e, a.dispatch.split(","), a.grouped_matmul.split(","), a.capacity_factor, a.batch,
                      a.steps, a.baseline_experts)
    print(table(rows))


if __name__ == "__main__":
    main()
