"""The routed experts alone (forward + backward), per dispatch path and grouped matmul, against a dense SwiGLU FFN with the same
active FLOPs (width top_k * moe_d_ff), at n_routed_experts = 8 and 64 (fixed top-k and expert width).

    python -m benchmarks.moe_layer --preset cpu
    python -m benchmarks.moe_layer --preset gpu --grouped_matmul ragged_dot,blocked
    # against an older experts.py (e.g. `git show REV:moe/dispatch/experts.py > /tmp/experts_before.py`), same process:
    python -m benchmarks.moe_layer --preset cpu --baseline_experts /tmp/experts_before.py --steps 15
    # other pure-slab sizes than slab.SLAB_FACTORS (multiples of the mean rows per expert), no spill layouts:
    python -m benchmarks.moe_layer --preset cpu --dispatch dropless --grouped_matmul slab,slab:1.25/1.5/2
    # on a GPU, slab's spill layouts (the CPU default) against its pure slabs (the GPU default):
    python -m benchmarks.moe_layer --preset gpu --dispatch dropless --grouped_matmul slab,slab:spill
    # on a GPU, a routing past every pure slab at 64 experts: the fallback in 512-row blocks against 64-row ones
    python -m benchmarks.moe_layer --preset gpu --dispatch dropless --grouped_matmul slab,slab@64,slab:spill512 \
        --routing skewed
    # the routing of a freshly initialized router and of one balanced by the routing bias, as in training:
    python -m benchmarks.moe_layer --preset default --routing random,balanced
    # dropless's backward with scatter-adds (autodiff) or gathers only (experts.permute_copies); plain `dropless`
    # is the model's default (execution.permute_grad=auto: scatter on CPU, gather elsewhere):
    python -m benchmarks.moe_layer --preset gpu --dispatch dropless:scatter,dropless:gather --grouped_matmul slab

All rows of one expert count are timed round-robin (benchmarks.common.time_fns): `x dense` is a same-run ratio.
With `dropless` among the dispatches, a row times its dispatch alone (the grouped matmul replaced by the
identity: sort, row gathers, un-permute and gate sum, forward and backward). Two rows time the experts' batched
matmuls with no dispatch at all, on N / E rows per expert (perfect balance)
and on the slabs of the layout `slab` takes for the benchmark's routing under `dropless` (its spill blocks left out;
expert_parallel's slab sees its capacity rows instead): the floor of any batched-matmul path, and what imbalance adds to it. Their TFLOP/s count the useful
FLOPs (T * K rows), like every row, not the padded slab's.

--routing: `random` (default) routes with the random router alone, as at step 0 of training: its busiest expert
gets well above the mean (MaxVio column). `balanced` adds the routing bias that aux-loss-free balancing would
learn: fitted by the training loop's rule (router.update_bias after every batch, gamma 1e-2 -> 1e-3 -> 1e-4)
on 600 fresh batches of the same distribution, then applied to the timed batch, so its MaxVio is the batch noise
a converged bias leaves (trained models: MaxVio per batch in docs/training.md). `skewed` adds a fixed random bias
(SKEW below) that loads the experts as unevenly as a deep, freshly initialized model does: the routing under which
`slab` falls back to its padded blocks at 64 experts; `skewed@S` scales that bias by S instead (at configs/gpu_1b.py's
widths and 64 experts, the busiest expert gets 2.5x the mean rows at 0.05, 2.8x at 0.06, 4.2x at SKEW's 0.1).
"""

import functools
import importlib.util

import jax
import jax.numpy as jnp

from benchmarks.common import arg_parser, describe, dispatch_list, preset, table, time_fns, variants
from moe import router
from moe.dispatch import expert_parallel, experts, kernels
from moe.dispatch.kernels import slab
from train import host_memory


def _expert_matmuls(*args):
    """The experts' batched SwiGLU on given slabs, no dispatch: its output only."""
    return kernels.swiglu_batched(*args)[0]


def _grouped(name: str):
    """A grouped_matmul name; `slab:F1/F2/...`: the slab path with only pure slabs of those sizes (multiples
    of N / E) and the padded-block fallback (the slab path before its spill layouts); `slab:spill`: the slab
    path with its CPU layouts (spill blocks) on any backend (on GPU `slab` takes pure slabs: this is the A/B);
    `slab:spill512`: the GPU's pure slabs plus mean-sized slabs with 512-row spill blocks for a quarter of the
    rows (by a roofline estimate, faster than the 512-row fallback on the 64-expert step's skewed layers). A
    trailing `@B` sets the fallback's block rows (`slab:1.25/1.5/2@64`: slabs of up to 2x, a fallback of
    64-row blocks)."""
    name, _, fallback = name.partition("@")
    fallback_block = int(fallback) if fallback else None
    if name == "slab:spill512":  # GPU-sized spill blocks beside the GPU's pure slabs: an A/B against `slab`
        return functools.partial(slab.grouped_swiglu_slab, fractions=GPU_SPILL_FRACTIONS,
                                 factors=slab.NO_SPILL_SLAB_FACTORS, block=512, fallback_block=fallback_block)
    if name == "slab:spill":
        return functools.partial(slab.grouped_swiglu_slab, fractions=slab.SPILL_FRACTIONS,
                                 factors=slab.SLAB_FACTORS, fallback_block=fallback_block)
    if name.startswith("slab:"):
        factors = tuple(float(f) for f in name[len("slab:"):].split("/"))
        return functools.partial(slab.grouped_swiglu_slab, fractions=(), factors=factors,
                                 block=slab.NO_SPILL_BLOCK, fallback_block=fallback_block)
    if fallback_block:
        return functools.partial(slab.grouped_swiglu_slab, fallback_block=fallback_block)
    return name


# The spill budget of slab:spill512 (x N rows): its layout costs more than the 1.25x slab (1.31 N rows), so a balanced
# routing still takes the 1.25x slab; larger budgets cost more than the fallback (`layouts` drops them).
GPU_SPILL_FRACTIONS = (1 / 4,)


def _routed_fn(dispatch: str, grouped: str, capacity_factor: float, group_size: int):
    if dispatch.split(":")[0] == "dropless":  # dropless[:auto|scatter|gather] (experts.dropless's permute)
        return functools.partial(experts.dropless, grouped=_grouped(grouped), permute=_permute(dispatch))
    if dispatch == "capacity":
        return functools.partial(experts.capacity, capacity_factor=capacity_factor, group_size=group_size)
    if dispatch.split(":")[0] == "expert_parallel":  # one device: the all_to_all-free single-shard version
        return lambda *a: expert_parallel.dispatch(*a, capacity_factor=capacity_factor,
                                                   grouped_matmul=_grouped(grouped), permute=_permute(dispatch))[0]
    raise ValueError(f"unknown dispatch {dispatch!r}")


def _load_experts(path: str):
    spec = importlib.util.spec_from_file_location("experts_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _permute(dispatch: str) -> str:
    """The backward rule a `NAME:rule` dispatch names ("auto" without one; experts.permute_for checks it)."""
    return dispatch.partition(":")[2] or "auto"


def _identity_grouped(x_NxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, row_scale=None):
    """A stand-in grouped SwiGLU that does no matmul (its rows times their scales, the gates): with it `dropless`
    times its dispatch alone."""
    return kernels.scale_rows(x_NxD, row_scale)


ROUTINGS = ("random", "balanced", "skewed")
# `skewed`: a fixed routing bias of SKEW x N(0, 1) per expert. At configs/gpu_1b.py's widths it gives MaxVio
# ~0.2 at 8 experts and ~2.4 at 64, like the layers of that model at initialization (0.04-0.24 and 0.36-2.45
# on a random batch): past every pure slab at 64 experts, so `slab` runs its fallback.
SKEW = 0.1


def _valid_routing(routing: str) -> bool:
    try:
        return routing in ROUTINGS or _skew(routing) >= 0
    except ValueError:
        return False


def _skew(routing: str) -> float:
    """The bias scale of `skewed` (SKEW) or `skewed@S` (S); ValueError for anything else."""
    name, at, scale = routing.partition("@")
    if name != "skewed" or (at and not scale.replace(".", "", 1).isdigit()):
        raise ValueError(f"routing {routing!r}: skewed or skewed@S with S a number >= 0")
    return float(scale) if at else SKEW
BIAS_SCHEDULE = ((1e-2, 200), (1e-3, 200), (1e-4, 200))  # (gamma, updates)


def balanced_bias(key, T: int, D: int, w_router, top_k: int, dtype=jnp.float32):
    """The routing bias aux-loss-free balancing converges to, found as training finds it: router.update_bias
    after every batch, each a fresh batch of T tokens x ~ N(0, 1) (the benchmark's distribution), with gamma
    stepped down (BIAS_SCHEDULE) so the sign updates settle on the expected load, not one batch's noise."""
    E = w_router.shape[1]

    def update(i, bias, gamma):
        x = jax.random.normal(jax.random.fold_in(key, i), (T, D), dtype).astype(jnp.float32)
        _, ids, _ = router.route(x, w_router, bias, top_k=top_k)
        return router.update_bias(bias, router.expert_load(ids, E), gamma)

    @jax.jit
    def fit(bias):
        start = 0
        for gamma, n in BIAS_SCHEDULE:
            bias = jax.lax.fori_loop(start, start + n, lambda i, b, g=gamma: update(i, b, g), bias)
            start += n
        return bias

    return fit(jnp.zeros(E, jnp.float32))


def bench(name: str, n_experts: int, dispatches, grouped_matmuls=("auto",), capacity_factor: float = 1.25,
          batch: int = 0, steps: int = 0, baseline_experts: str = "", routings=("random",)) -> list[dict]:
    """One device's layer: `batch` (default: the preset's) rows of the preset's sequence length, per routing."""
    p = preset(name, n_experts)
    m = p["model"]
    T, D, F, K = (batch or p["batch"]) * p["seq_len"], m["d_model"], m["moe_d_ff"], m["top_k"]
    dt = jnp.dtype(p["execution"]["dtype"])
    ks = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(ks[0], (T, D), dt)
    w_router = jax.random.normal(ks[1], (D, n_experts), jnp.float32) * D**-0.5
    ws = [(jax.random.normal(k, s, jnp.float32) * s[1] ** -0.5).astype(dt)
          for k, s in zip(ks[2:5], [(n_experts, D, F), (n_experts, D, F), (n_experts, F, D)])]
    route = jax.jit(functools.partial(router.route, top_k=K))
    flops = 6 * T * K * 3 * D * F  # fwd + bwd of K expert SwiGLUs per token
    rows, calls = [], []

    def add(name, grouped, fn, *args, routing="-", maxvio=None):
        # Gradients for x and the three weights; any further arguments (the routing: ids, gates) are inputs of the
        # compiled program too, never constants in it: XLA would fold what depends only on them (the sort, the
        # group sizes, slab's layout choice and index maps) at compile time, which training cannot.
        step = jax.jit(jax.grad(lambda x, *w: fn(x, *w).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3)))
        calls.append((step, args))
        rows.append({"path": name, "grouped matmul": grouped, "routing": routing,
                     "MaxVio": "-" if maxvio is None else round(maxvio, 3), "experts": n_experts, "tokens": T})

    lays = slab.layouts(T * K, n_experts, *slab.default_layout_sets(jax.default_backend()))
    for routing in routings:
        bias = jnp.zeros(n_experts, jnp.float32)
        if routing == "balanced":  # fitted on other batches of the same distribution, timed on this one
            bias = balanced_bias(ks[5], T, D, w_router, K, dt)
        elif routing.startswith("skewed"):
            bias = _skew(routing) * jax.random.normal(ks[5], (n_experts,), jnp.float32)
        _, ids, gates = route(x.astype(jnp.float32), w_router, bias)
        sizes = jnp.bincount(ids.reshape(-1), length=n_experts)
        maxvio = float(router.max_violation(sizes))
        for d, g in variants(dispatches, grouped_matmuls):
            fn = _routed_fn(d, g, capacity_factor, p["seq_len"])
            add(d, g, lambda x, wg, wu, wd, ids, gates, fn=fn: fn(x, ids, gates, wg, wu, wd), x, *ws, ids, gates,
                routing=routing, maxvio=maxvio)
        for d in [d for d in dispatches if d.split(":")[0] == "dropless"]:
            # everything but the matmuls: sort, gathers, un-permute, gate sum, forward and backward
            fn = functools.partial(experts.dropless, grouped=_identity_grouped, permute=_permute(d))
            add(f"{d} dispatch alone (grouped matmul = identity)", "-",
                lambda x, wg, wu, wd, ids, gates, fn=fn: fn(x, ids, gates, wg, wu, wd),
                x, *ws, ids, gates, routing=routing, maxvio=maxvio)
        # The slabs of the layout `slab` picks for this routing (its spill blocks left out): what imbalance adds.
        C, S, b = next(lay for lay in lays if slab.fits(sizes, lay))
        if C:
            xs = jax.random.normal(ks[0], (n_experts, C, D), dt)
            add(f"expert matmuls alone, {C} rows each (this routing's slabs; + {S} spill blocks of {b})", "-",
                _expert_matmuls, xs, *ws, routing=routing, maxvio=maxvio)
    # What dispatch cannot go below: the experts' batched matmuls alone on perfectly balanced rows (N / E each).
    C = -(-T * K // n_experts)
    add(f"expert matmuls alone, {C} rows each (balanced)", "-", _expert_matmuls,
        jax.random.normal(ks[0], (n_experts, C, D), dt), *ws, maxvio=0.0)
    dense = [(jax.random.normal(k, s, jnp.float32) * s[0] ** -0.5).astype(dt)
             for k, s in zip(ks[2:5], [(D, K * F), (D, K * F), (K * F, D)])]
    if baseline_experts:  # the dropless path of another experts.py, e.g. an earlier revision, blocked matmul
        old = _load_experts(baseline_experts)
        add(f"dropless ({baseline_experts})", "blocked",
            lambda x, wg, wu, wd, ids, gates: old.dropless(x, ids, gates, wg, wu, wd, grouped="blocked"), x, *ws,
            ids, gates, routing=routings[-1], maxvio=maxvio)
    add("dense FFN (same active FLOPs)", "-", kernels.swiglu, x, *dense)
    for r, s in zip(rows, time_fns(calls, steps or p["steps"])):
        r.update({"ms": s * 1e3, "TFLOP/s": flops / s / 1e12})
    base = rows[-1]["ms"]
    for r in rows:
        r["x dense"] = r["ms"] / base
    return rows


def main(argv=None):
    ap = arg_parser(__doc__.splitlines()[0])
    ap.add_argument("--baseline_experts", default="", help="path of another experts.py to time beside")
    ap.add_argument("--routing", default="random",
                    help="comma-separated from random,balanced,skewed,skewed@S (see above)")
    a = ap.parse_args(argv)
    host_memory.keep_freed_memory()  # as `python -m train` runs (train/host_memory.py)
    routings = [r for r in a.routing.split(",") if r]
    if not routings or not all(map(_valid_routing, routings)):
        ap.error(f"--routing takes a comma-separated subset of {','.join(ROUTINGS)},skewed@S; got {a.routing!r}")
    print(describe())
    rows = []
    for e in map(int, a.experts.split(",")):
        rows += bench(a.preset, e, dispatch_list(ap, a.dispatch), a.grouped_matmul.split(","), a.capacity_factor, a.batch,
                      a.steps, a.baseline_experts, routings)
    print(table(rows))


if __name__ == "__main__":
    main()
