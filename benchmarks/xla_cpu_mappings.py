"""Memory mappings held by XLA:CPU's compiled programs in one process: each program a jit cache keeps holds its
code and data sections as separate mappings until the cache lets it go, and the kernel allows a process
vm.max_map_count of them (65,530 by default). Past that, LLVM's mmap fails ("Cannot allocate memory") and XLA
segfaults; the test suite's workers clear JAX's caches before they get there (tests/conftest.py).
XLA_FLAGS as given (tests/conftest.py's FAST_COMPILE_XLA_FLAGS for the suite's programs; the fusion-emitter flag
exists only below jaxlib 0.11):

    XLA_FLAGS="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false" \
        python -m benchmarks.xla_cpu_mappings --programs 300     # mappings per kept program, then after clearing
    ... --programs 3000                                           # past the limit: expect the process to crash
"""

import argparse
import gc
import os
import time


def mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=300, help="distinct programs to compile and keep")
    a = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    start, t0, kept = mappings(), time.time(), []
    print(f"jax {jax.__version__}, flags: {os.environ.get('XLA_FLAGS', '')!r}, limit {limit:,}, at start {start:,}")
    for i in range(a.programs):
        def f(x, i=i):  # a different program each time: depth and constant vary
            for k in range(1 + i % 7):
                x = jnp.tanh(x @ x.T + i) * (k + 1)
            return x.sum()
        kept.append(jax.jit(jax.grad(f)))
        kept[-1](jnp.ones((8 + i % 13, 8 + i % 13))).block_until_ready()
        if (i + 1) % max(1, a.programs // 10) == 0:
            held = mappings()
            print(f"{i + 1:6d} programs: {held:7,} mappings ({(held - start) / (i + 1):.1f} per program), "
                  f"{time.time() - t0:.0f} s", flush=True)
    jax.clear_caches()
    gc.collect()
    print(f"after jax.clear_caches(): {mappings():,} mappings")


if __name__ == "__main__":
    main()
