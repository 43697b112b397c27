"""benchmarks/hlo_flops.py counts the matmul FLOPs an optimized program runs: loops by their trip count, one
branch of a switch, gradients included."""

import jax
import jax.numpy as jnp

from benchmarks import hlo_flops

X, W = jnp.ones((32, 64)), jnp.ones((64, 64))
DOT = 2 * 32 * 64 * 64  # one [32, 64] x [64, 64] product


def _scanned(x, w):
    y, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=5)
    return (y @ w.T).sum()


def _program(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def test_a_loop_counts_its_trip_count_and_the_gradient_its_products():
    assert hlo_flops.matmul_flops(_program(_scanned, X, W)) == 6 * DOT
    # the forward loop (5), the backward loop (the carry's and the weight's gradient: 10) and the last product's
    # two gradients; its own value is unused and removed
    assert hlo_flops.matmul_flops(_program(jax.grad(_scanned, argnums=1), X, W)) == (5 + 10 + 2) * DOT


def test_a_switch_counts_the_branch_asked_for():
    def switch(i, x, w):
        return jax.lax.switch(i, [lambda x: x @ w, lambda x: (x @ w) @ w], x).sum()

    program = _program(switch, 0, X, W)
    assert hlo_flops.matmul_flops(program, branch=0) == DOT
    assert hlo_flops.matmul_flops(program, branch=1) == 2 * DOT
