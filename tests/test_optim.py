"""train.optim: the gradient clipping written as one scalar factor is optax.clip_by_global_norm's function."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs.default import get_config
from train import optim


def _tree(scale: float, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(0), 3)
    return {"w": (scale * jax.random.normal(ks[0], (4, 8, 6))).astype(dtype),
            "b": {"scale": scale * jax.random.normal(ks[1], (6,))},
            "head": scale * jax.random.normal(ks[2], (6, 5))}


def _clip(clip, max_norm, g):
    return jax.jit(lambda g: clip(max_norm).update(g, optax.EmptyState())[0])(g)


@pytest.mark.parametrize("max_norm", [1.0, 0.5])
@pytest.mark.parametrize("scale", [1e-3, 10.0])  # global norm ~0.015 (kept as is) and ~150 (clipped)
def test_clip_equals_optax(scale, max_norm):
    g = _tree(scale)
    ours, ref = _clip(optim.clip_by_global_norm, max_norm, g), _clip(optax.clip_by_global_norm, max_norm, g)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
        if scale < 1:  # unclipped: g * 1, bitwise
            np.testing.assert_array_equal(a, b)
        else:  # g * (max / norm) against optax's g / norm * max: a rounding or two apart
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
    assert float(optax.tree.norm(ours)) == pytest.approx(min(float(optax.tree.norm(g)), max_norm), rel=1e-6)


def test_clip_mixed_dtypes_equals_optax():
    """A bf16 leaf beside fp32 ones: the norm in fp32 as optax's, each leaf scaled in its own dtype."""
    g = _tree(10.0, jnp.bfloat16)
    ours, ref = _clip(optim.clip_by_global_norm, 1.0, g), _clip(optax.clip_by_global_norm, 1.0, g)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
        assert a.dtype == b.dtype
        tol = 2.0 ** -7 if a.dtype == jnp.bfloat16 else 1e-6
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=0)


def _adamw_steps(tx, params, grads, n=3):
    state = tx.init(params)
    for _ in range(n):  # past warmup's first step, where the learning rate is 0
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


@pytest.mark.parametrize("grad_scale", [1e-3, 10.0])
def test_optimizer_state_and_steps_match_optax(grad_scale):
    """The same optimizer-state tree as the optax chain it replaces (checkpoints restore either way), and three
    AdamW steps bitwise equal to it when nothing is clipped, within float rounding when clipped."""
    t = get_config().train
    ref_tx = optax.chain(optax.clip_by_global_norm(t.grad_clip),
                         optax.adamw(optim.schedule(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                                     mask=optim.decay_mask))
    tx = optim.optimizer(t)
    params, grads = _tree(0.1), _tree(grad_scale)
    assert jax.tree.structure(tx.init(params)) == jax.tree.structure(ref_tx.init(params))
    out = jax.jit(lambda p, g: _adamw_steps(tx, p, g))(params, grads)
    ref = jax.jit(lambda p, g: _adamw_steps(ref_tx, p, g))(params, grads)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        if grad_scale < 1:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    new_params = jax.tree.leaves(out[0])
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in new_params)
    assert not any(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), new_params))  # it moved
