"""How long XLA takes to compile one dropless MoE forward + backward with each grouped matmul, at the test suite's
shapes: the reason tests whose subject is not the experts' kernel run ragged_dot (tests/model_fixtures.py). Run
with the suite's XLA_FLAGS to see what the suite pays (the fusion-emitter flag exists only below jaxlib 0.11):

    XLA_FLAGS="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false" \
        python -m benchmarks.grouped_compile_time
"""

import argparse
import os
import statistics
import time

GROUPED = ("slab", "ragged_dot", "blocked")


def compile_seconds(grouped: str, repeat: int, T=64, D=12, E=8, F=10, K=3) -> list[float]:
    """Seconds of `.compile()` for `repeat` fresh lowerings (new jitted closures: no cache hit) of the gradient of
    a loss of experts.dropless(grouped=...), routed inside the loss as in tests/test_dispatch_paths.py."""
    import jax
    import jax.numpy as jnp

    from moe import router
    from moe.dispatch import experts

    ks = jax.random.split(jax.random.key(0), 5)
    x, w_router = jax.random.normal(ks[0], (T, D)), jax.random.normal(ks[1], (D, E))
    ws = (jax.random.normal(ks[2], (E, D, F)), jax.random.normal(ks[3], (E, D, F)), jax.random.normal(ks[4], (E, F, D)))
    seconds = []
    for i in range(repeat):
        def loss(x, w_router, ws, i=i):
            _, ids, gates = router.route(x, w_router, jnp.zeros(E), top_k=K)
            return jnp.sum(jnp.sin(experts.dropless(x, ids, gates, *ws, grouped=grouped))) + i
        lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(x, w_router, ws)
        t0 = time.perf_counter()
        lowered.compile()
        seconds.append(time.perf_counter() - t0)
    return seconds


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grouped", default=",".join(GROUPED), help=f"comma-separated, of {', '.join(GROUPED)}")
    ap.add_argument("--repeat", type=int, default=5, help="compilations per grouped matmul (the median is printed)")
    a = ap.parse_args(argv)
    choices = a.grouped.split(",")
    if bad := [g for g in choices if g not in GROUPED]:
        ap.error(f"--grouped: unknown {', '.join(bad)}; choose from {', '.join(GROUPED)}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    print(f"jax {jax.__version__}, {jax.default_backend()}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print("| grouped matmul | compile s, median | min | max |\n|---|---|---|---|")
    for g in choices:
        s = compile_seconds(g, a.repeat)
        print(f"| {g} | {statistics.median(s):.2f} | {min(s):.2f} | {max(s):.2f} |", flush=True)


if __name__ == "__main__":
    main()
