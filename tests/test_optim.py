"""train.optim: the gradient clipping written as one scalar factor is optax.clip_by_global_norm's function."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs.default import get_config
from train import optim


def _tree(scale: float):
    ks = jax.random.split(jax.random.key(0), 3)
    return {"w": scale * jax.random.normal(ks[0], (4, 8, 6)), "b": {"scale": scale * jax.random.normal(ks[1], (6,))},
            "head": scale * jax.random.normal(ks[2], (6, 5))}


@pytest.mark.parametrize("scale", [1e-3, 10.0])  # global norm ~0.01 (kept as is) and ~100 (clipped to 1)
def test_clip_equals_optax(scale):
    g = _tree(scale)
    ours, _ = jax.jit(lambda g: optim.clip_by_global_norm(1.0).update(g, optax.EmptyState()))(g)
    ref, _ = jax.jit(lambda g: optax.clip_by_global_norm(1.0).update(g, optax.EmptyState()))(g)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
        if scale < 1:  # unclipped: g * 1, bitwise
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=4e-7, atol=0)
    norm = float(optax.tree.norm(ours))
    assert norm == pytest.approx(min(float(optax.tree.norm(g)), 1.0), rel=1e-6)


def test_optimizer_state_and_step_match_optax():
    """The same optimizer-state tree as the optax chain it replaces (checkpoints restore either way), and a clipped
    AdamW step within float rounding of it."""
    t = get_config().train
    ref_tx = optax.chain(optax.clip_by_global_norm(t.grad_clip),
                         optax.adamw(optim.schedule(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                                     mask=optim.decay_mask))
    tx = optim.optimizer(t)
    params, grads = _tree(0.1), _tree(10.0)
    state, ref_state = tx.init(params), ref_tx.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)

    def step(tx, params, state):
        for _ in range(3):  # past warmup's first step, where the learning rate is 0
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return params, state

    out, ref = jax.jit(lambda p, s: step(tx, p, s))(params, state), jax.jit(lambda p, s: step(ref_tx, p, s))(
        params, ref_state)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(out[0])))
    assert jnp.all(jnp.isfinite(jax.tree.leaves(out[0])[0]))
