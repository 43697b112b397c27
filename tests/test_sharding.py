"""A forward pass under a (data=2, fsdp=2, expert=2, tensor=1) mesh equals the single-device one, with the
routed experts auto-sharded (dropless) and expert-parallel (all_to_all, no-drop buffers)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe import Execution, sharding
from tests.model_fixtures import forward_fn, ragged_execution, tiny_model


@pytest.mark.parametrize("dispatch,grouped,scan", [("dropless", "slab", False), ("dropless", "blocked", False),
                                                   ("expert_parallel_dropless", "auto", False),
                                                   ("dropless", "slab", True),
                                                   ("expert_parallel_dropless", "auto", True)])
def test_sharded_forward_matches_single_device(dispatch, grouped, scan):
    assert jax.device_count() == 8, "tests/conftest.py must set 8 fake CPU devices before jax is imported"
    mesh = sharding.make_mesh(2, 2, 2, 1)
    graphdef, state = nnx.split(tiny_model())
    state = jax.device_put(state, sharding.state_shardings(state, mesh))

    # Expert weights are really split along the expert axis: each device holds E / 2 experts.
    w = state["blocks"][1]["ffn"]["w_gate"][...]
    assert w.sharding.spec[0] == "expert"
    assert {s.data.shape[0] for s in w.addressable_shards} == {w.shape[0] // 2}

    # slab: XLA partitions its lax.switch; the tiny model's MoE layers (groups of up to 32 and 52 copies over
    # slabs of 24 rows) take spill layouts.
    # scan: the two MoE layers as one lax.scan over their stacked (sharded) states.
    ex = Execution(dispatch=dispatch, grouped_matmul=grouped, mesh=mesh, scan_layers=scan)

    @jax.jit
    def fwd(state, tokens):
        return nnx.merge(graphdef, state)(tokens, execution=ex)[0]

    tokens = jax.random.randint(jax.random.key(0), (8, 12), 0, 61)
    tokens = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(("batch", "length"))))
    sharded = fwd(state, tokens)
    np.testing.assert_allclose(sharded, forward_fn()(jnp.asarray(np.asarray(tokens))), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scan", [False, True])
def test_sharded_blockwise_attention_and_chunked_loss_match_single_device(scan):
    """The default blockwise attention (64 positions: 2 query blocks) and the train step's fused chunked objective
    (4 chunks, its gradient computed in the forward pass) on a mesh that splits the batch and, along tensor, the
    heads and the vocabulary: the per-token losses and the gradients of their mean equal one device's einsum
    attention with autodiff of all logits at once; also with the MoE layers scanned (execution.scan_layers)."""
    mesh = sharding.make_mesh(2, 1, 1, 2)
    graphdef, state = nnx.split(tiny_model(vocab_size=64))  # the vocabulary splits over tensor
    tokens, targets = jax.random.randint(jax.random.key(0), (2, 4, 64), 0, 64)
    ce_shape, ce_size = targets.shape, targets.size

    def losses_and_grads(state, tokens, ex):
        def mean_loss(state):
            if ex.mesh is None:  # autodiff of the per-token losses
                ce, _ = nnx.merge(graphdef, state).token_losses(tokens, targets, execution=ex)
                return ce.mean(), ce
            ce, aux = nnx.merge(graphdef, state).token_losses(tokens, targets, execution=ex,
                                                              loss_weights_BxL=jnp.full(ce_shape, 1 / ce_size))
            return aux["objective"], ce
        (_, ce), grads = jax.value_and_grad(mean_loss, has_aux=True)(state)
        return ce, grads

    want_ce, want_grads = jax.jit(losses_and_grads, static_argnums=2)(
        state, tokens, ragged_execution(attention_impl="einsum", loss_chunks=1))
    sharded_state = jax.device_put(state, sharding.state_shardings(state, mesh))
    batch_spec = jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(("batch", "length")))
    ex = ragged_execution(attention_impl="blockwise", loss_chunks=4, mesh=mesh, scan_layers=scan)
    got_ce, got_grads = jax.jit(losses_and_grads, static_argnums=2)(
        sharded_state, jax.device_put(tokens, batch_spec), ex)
    np.testing.assert_allclose(got_ce, want_ce, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_a_parameter_that_does_not_split_is_one_line_naming_the_field():
    """9 experts over mesh.expert=2: a ConfigError naming the parameter, model.n_routed_experts and mesh.expert,
    from the sharding rules and from expert-parallel dispatch alike (JAX's own errors are multi-line dumps)."""
    from moe import ConfigError

    mesh = sharding.make_mesh(1, 1, 2, 1, devices=jax.devices()[:2])
    model = tiny_model(n_routed_experts=9, top_k=2, n_group=1, topk_group=1)
    with pytest.raises(ConfigError, match=r"w_\w+.*logical axis 'expert'.*model.n_routed_experts.*mesh.expert") as e:
        sharding.state_shardings(nnx.state(model), mesh)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"model.n_routed_experts \(9\) over mesh.expert \(2\)"):
        model(jnp.zeros((2, 4), jnp.int32), execution=Execution(dispatch="expert_parallel_dropless", mesh=mesh))
