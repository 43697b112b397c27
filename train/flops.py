"""Peak FLOP/s of this device, measured with a large matmul (the MFU denominator when none is configured)."""

import time

import jax
import jax.numpy as jnp

from moe.dispatch import platform


def measure_peak_flops(n: int | None = None, dtype=None, repeats: int = 5) -> float:
    """Best achieved FLOP/s of an n x n matmul on the default device (bf16 on accelerators, fp32 on CPU)."""
    on_cpu = platform.current() == "cpu"
    n = n or (1024 if on_cpu else 8192)
    dtype = dtype or (jnp.float32 if on_cpu else jnp.bfloat16)
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best
