"""The suite's guard against the kernel's mapping limit (tests/conftest.py, release_compiled_programs): every
XLA:CPU executable a jit cache keeps holds memory mappings, and clearing JAX's caches gives them back."""

import gc

import jax
import jax.numpy as jnp
import pytest

from tests.conftest import MAX_MAPS, _mappings


@pytest.mark.skipif(not MAX_MAPS, reason="no /proc/self/maps: not Linux, no mapping limit to guard")
def test_cached_programs_hold_mappings_until_jax_caches_are_cleared():
    jax.clear_caches()
    gc.collect()
    before = _mappings()
    kept = [jax.jit(jax.grad(lambda x, i=i: jnp.tanh(x @ x.T + i).sum())) for i in range(40)]
    for f in kept:  # 40 distinct programs, each held by its function's jit cache while the function lives
        f(jnp.ones((8, 8))).block_until_ready()
    held = _mappings() - before
    assert held >= 40 * 4, held  # ~8 for a program this small, ~30 for a tiny model's
    jax.clear_caches()  # the functions still live: only the caches held their programs
    gc.collect()
    assert _mappings() - before < held / 2, (held, _mappings() - before)
