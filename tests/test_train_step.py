"""The sharded train step equals the single-device step; aux-loss-free balancing drives load toward balance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe import Execution, ModelConfig, Transformer, router, routing_biases, set_routing_biases, sharding
from moe.model import split_model
from tests.conftest import tiny_config
from train import optim
from train.preflight import parse
from train.state import init_state
from train.step import forward, make_train_step, train_forward


def _batch(B=8, L=16, V=64, seed=0):
    rng = np.random.default_rng(seed)
    seg = np.ones((B, L), np.int32)
    seg[:, L // 2:] = 2  # two documents per row
    pos = np.concatenate([np.arange(L // 2), np.arange(L - L // 2)])[None].repeat(B, 0).astype(np.int32)
    return {"tokens": rng.integers(0, V, (B, L)).astype(np.int32),
            "targets": rng.integers(0, V, (B, L)).astype(np.int32),
            "segment_ids": seg, "positions": pos,
            "loss_mask": (rng.random((B, L)) > 0.1).astype(np.float32),
            "domains": rng.integers(0, 3, (B, L)).astype(np.int32)}


def _two_steps(mesh_shape, grad_accum=1, dispatch="dropless", loss_chunks=1, fused_loss=True, remat="",
               grouped="ragged_dot"):
    """Two train steps. The experts' grouped matmul is ragged_dot (it compiles in a fraction of the slab's
    time); CPU's default (auto: slab) runs on one mesh below, and equals ragged_dot in tests/test_grouped_kernels.py."""
    c = tiny_config(**{"model.vocab_size": 64, "train.grad_accum": grad_accum, "train.bias_update_rate": 1e-2})
    mcfg = parse(c).model
    n = int(np.prod(mesh_shape))
    mesh = sharding.make_mesh(*mesh_shape, devices=jax.devices()[:n])
    tx = optim.optimizer(c.train)
    graphdef, state, shardings = init_state(mcfg, tx, 0, mesh)
    dispatch, _, permute = dispatch.partition(":")  # dropless:gather: execution.permute_grad
    ex = Execution(dispatch=dispatch, mesh=mesh, loss_chunks=loss_chunks, remat=bool(remat),
                   remat_policy=remat or "full", permute_grad=permute or "auto", grouped_matmul=grouped)
    step = jax.jit(make_train_step(graphdef, tx, optim.schedule(c.train), c.train, ex,
                                   train_forward if fused_loss else forward))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    metrics = []
    for s in range(2):
        batch = jax.device_put(_batch(seed=s), spec)
        state, m = step(state, batch)
        metrics.append(jax.device_get(m))
    return jax.device_get(state), metrics


@pytest.fixture(scope="module")
def single_device():
    return _two_steps((1, 1, 1, 1))


@pytest.mark.parametrize("mesh_shape,dispatch,remat,grouped", [
    ((8, 1, 1, 1), "dropless", "", "ragged_dot"), ((2, 2, 2, 1), "dropless", "", "ragged_dot"),
    ((2, 2, 2, 1), "dropless:gather", "", "ragged_dot"),  # a GPU's default, partitioned by XLA
    ((2, 2, 2, 1), "expert_parallel_dropless", "", "ragged_dot"),
    ((2, 2, 2, 1), "expert_parallel_dropless:gather", "", "auto"),  # CPU's grouped matmul inside shard_map
    ((1, 2, 2, 2), "expert_parallel_dropless", "", "ragged_dot"),
    ((2, 2, 2, 1), "expert_parallel_dropless", "save_moe", "ragged_dot")])  # the exchanged rows kept for backward
def test_sharded_step_equals_single_device(single_device, mesh_shape, dispatch, remat, grouped):
    ref_state, ref_metrics = single_device
    state, metrics = _two_steps(mesh_shape, dispatch=dispatch, remat=remat, grouped=grouped)
    for a, b in zip(metrics, ref_metrics):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(ref_state["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # The bias follows the GLOBAL load, so it is identical however the batch is split.
    for a, b in zip(jax.tree.leaves(state["bias"]), jax.tree.leaves(ref_state["bias"])):
        np.testing.assert_allclose(a, b, atol=1e-7)
    assert any(np.abs(b).max() > 0 for b in jax.tree.leaves(state["bias"]))


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1, 1), (2, 2, 1, 2)])
def test_fused_loss_step_equals_autodiff_of_the_per_token_loss(mesh_shape):
    """The default step (its LM head's gradient computed in the forward pass, here in 4 chunks; masked tokens,
    two micro-batches) against autodiff of the per-token cross-entropy on one device, two steps."""
    ref_state, ref_metrics = _two_steps((1, 1, 1, 1), grad_accum=2, fused_loss=False)
    state, metrics = _two_steps(mesh_shape, grad_accum=2, loss_chunks=4)
    for a, b in zip(metrics, ref_metrics):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_grad_accumulation_equals_one_big_batch(single_device):
    ref_state, ref_metrics = single_device
    state, metrics = _two_steps((1, 1, 1, 1), grad_accum=4)
    np.testing.assert_allclose(metrics[-1]["loss"], ref_metrics[-1]["loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_bias_update_balances_a_skewed_router():
    """A router that prefers a few experts: repeated updates b += gamma * sign(mean - load) even out the load."""
    rng = np.random.default_rng(0)
    T, E, K = 2048, 16, 2
    skew = np.linspace(-2.0, 2.0, E)  # expert 15 is strongly preferred
    scores = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(T, E)) + skew, jnp.float32))
    bias = jnp.zeros(E)

    @jax.jit
    def update(bias):
        load = router.expert_load(router.select_experts(scores, bias, K), E)
        return router.update_bias(bias, load, 1e-2), router.max_violation(load)

    _, first = update(bias)
    for _ in range(400):
        bias, vio = update(bias)
    assert float(first) > 2.0
    assert float(vio) < 0.25, float(vio)
    assert float(bias[-1]) < float(bias[0])  # the favoured expert is pushed down, the neglected one up


def test_bias_leaves_are_in_layer_order():
    """The train step pairs the RoutingBias leaves of the state with the rows of expert_load (layer order): with
    more than ten MoE layers a string-sorted tree would put layer 10 before layer 2."""
    cfg = ModelConfig(vocab_size=16, d_model=8, n_layers=12, n_heads=2, n_kv_heads=2, head_dim=4, d_ff=8,
                      n_routed_experts=4, top_k=2, moe_d_ff=4)
    model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    set_routing_biases(model, [jnp.full((4,), float(i)) for i in range(cfg.n_moe_layers)])
    leaves = jax.tree.leaves(split_model(model)[2])
    assert [float(b[0]) for b in leaves] == [float(b[0]) for b in routing_biases(model)] == list(range(11))
