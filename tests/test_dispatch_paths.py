"""Every routed-expert path == the loop-over-experts reference (values and gradients), on 8 fake CPU devices:
dropless (local), capacity with a capacity that cannot drop, and expert-parallel (shard_map + all_to_all) over
meshes with expert = 2, 4, 8 combined with data/fsdp/tensor. Drops are counted and drop exactly those copies."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe import Execution, ModelConfig, router, sharding
from moe.dispatch import expert_parallel, experts, routed_experts
from moe.dispatch.kernels import slab
from moe.ffn import MoE
from tests.conftest import tiny_config
from train.loop import run

T, D, E, F, K = 64, 12, 8, 10, 3


def _inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (T, D))
    w_router = jax.random.normal(ks[1], (D, E))
    ws = (jax.random.normal(ks[2], (E, D, F)) * 0.3, jax.random.normal(ks[3], (E, D, F)) * 0.3,
          jax.random.normal(ks[4], (E, F, D)) * 0.3)
    return x, w_router, ws


def _loss(fn, x, w_router, ws):
    # Route inside the loss so gradients reach the router through the gates.
    _, ids, gates = router.route(x, w_router, jnp.zeros(E), top_k=K)
    y = fn(x, ids, gates, *ws)
    return jnp.sum(jnp.sin(y) * jnp.arange(y.size).reshape(y.shape) / y.size)


@functools.cache
def _reference():
    x, w_router, ws = _inputs()
    return jax.jit(jax.value_and_grad(functools.partial(_loss, experts.reference), argnums=(0, 1, 2)))(
        x, w_router, ws)


def _assert_close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


# What a GPU runs, on this CPU: slab's pure slabs and large fallback blocks with one-hot weight-gradient sums, and
# rows moved backward by gathers (moe/dispatch/kernels/slab.py default_layout_sets / weight_sum_for, experts.permute_for).
# These routings fit a pure slab (top-3 of 8 experts: at most 2.7x the mean rows), so the fallback alone (every row
# in blocks; factors=()) is tested too.
GPU_SLAB = functools.partial(slab.grouped_swiglu_slab, fractions=(), factors=slab.NO_SPILL_SLAB_FACTORS,
                             block=slab.NO_SPILL_BLOCK, fallback_block=0, weight_sum="matmul")
GPU_FALLBACK = functools.partial(GPU_SLAB, factors=())

PATHS = {
    "dropless": experts.dropless,  # execution.grouped_matmul "auto": slab on CPU
    "dropless_ragged_dot": functools.partial(experts.dropless, grouped="ragged_dot"),
    "capacity": functools.partial(experts.capacity, capacity_factor=E / K),  # C = T: cannot drop
    "capacity_grouped": functools.partial(experts.capacity, capacity_factor=E / K, group_size=16),
    "dropless_gpu_choices": functools.partial(experts.dropless, grouped=GPU_SLAB, permute="gather"),
    "dropless_gpu_fallback": functools.partial(experts.dropless, grouped=GPU_FALLBACK, permute="gather"),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_local_paths_equal_reference(path):
    x, w_router, ws = _inputs()
    got = jax.jit(jax.value_and_grad(functools.partial(_loss, PATHS[path]), argnums=(0, 1, 2)))(x, w_router, ws)
    _assert_close(got, _reference())


@pytest.mark.parametrize("shape", [(2, 2, 2, 1), (1, 2, 4, 1), (2, 1, 4, 1), (1, 1, 8, 1), (1, 2, 2, 2)])
def test_paths_on_meshes_equal_reference(shape):
    """Tokens sharded over (data, fsdp), expert weights over expert and (ZeRO-3) fsdp along embed: expert-parallel
    (shard_map + all_to_all), and the auto-sharded dropless and no-drop capacity paths."""
    mesh = sharding.make_mesh(*shape)
    x, w_router, ws = _inputs()
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    x = put(x, P(("data", "fsdp")))
    ws = (put(ws[0], P("expert", "fsdp", "tensor")), put(ws[1], P("expert", "fsdp", "tensor")),
          put(ws[2], P("expert", "tensor", "fsdp")))
    fns = {"expert_parallel": lambda *a: expert_parallel.dispatch(*a, mesh=mesh)[0],
           "expert_parallel_ragged_dot": lambda *a: expert_parallel.dispatch(*a, mesh=mesh,
                                                                             grouped_matmul="ragged_dot")[0],
           "expert_parallel_gpu_choices": lambda *a: expert_parallel.dispatch(
               *a, mesh=mesh, grouped_matmul=GPU_SLAB, permute="gather")[0],
           "expert_parallel_gpu_fallback": lambda *a: expert_parallel.dispatch(
               *a, mesh=mesh, grouped_matmul=GPU_FALLBACK, permute="gather")[0],
           **PATHS}
    if shape not in ((2, 2, 2, 1), (1, 2, 2, 2)):
        # Slab (CPU's and the GPU's choices) is held to the reference on two meshes, one with tensor > 1 (every slab
        # variant compiles ~10x slower than ragged_dot); the other meshes test the dispatch around ragged_dot.
        fns = {k: f for k, f in fns.items() if k.endswith("ragged_dot") or k.startswith("capacity")}
    got = jax.jit(lambda *a: {name: jax.value_and_grad(functools.partial(_loss, fn), argnums=(0, 1, 2))(*a)
                              for name, fn in fns.items()})(x, w_router, ws)
    for name in fns:
        _assert_close(got[name], _reference())


def test_expert_parallel_keeps_expert_width_split_over_tensor():
    """With mesh.tensor > 1 each tensor rank computes its slice of the expert width: the compiled program sums
    partial outputs (all-reduce) and never all-gathers the tensor-split weights."""
    mesh = sharding.make_mesh(1, 1, 2, 4)
    x, w_router, ws = _inputs()
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    F4 = 12  # an expert width that splits 4 ways
    ws = (put(jnp.ones((E, D, F4)), P("expert", None, "tensor")), put(jnp.ones((E, D, F4)), P("expert", None, "tensor")),
          put(jnp.ones((E, F4, D)), P("expert", "tensor", None)))
    _, ids, gates = router.route(x, w_router, jnp.zeros(E), top_k=K)
    hlo = jax.jit(lambda *a: expert_parallel.dispatch(*a, mesh=mesh)[0]).lower(x, ids, gates, *ws).compile().as_text()
    assert "all-gather" not in hlo
    assert "all-reduce" in hlo


def _drops_only_unkept(y, keep, x, ids, gates, ws):
    """A dropped copy contributes nothing; every kept one exactly its gated expert output."""
    want = experts.reference(x, ids, gates * keep, *ws)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_capacity_drops_are_counted_and_zero():
    x, w_router, ws = _inputs(seed=1)
    _, ids, gates = router.route(x, w_router, jnp.zeros(E), top_k=K)
    y, keep = jax.jit(functools.partial(experts.capacity_with_stats, capacity_factor=1.0, group_size=16))(
        x, ids, gates, *ws)
    C = experts.expert_capacity(16, K, E, 1.0)
    counts = np.stack([np.bincount(g.reshape(-1), minlength=E) for g in np.asarray(ids).reshape(-1, 16, K)])
    assert int((~keep).sum()) == int(np.maximum(counts - C, 0).sum()) > 0
    # GShard priority: an expert's first choices are served before any second choice.
    keep_g, ids_g = np.asarray(keep).reshape(-1, 16, K), np.asarray(ids).reshape(-1, 16, K)
    for e in range(E):
        first_dropped = (~keep_g[:, :, 0] & (ids_g[:, :, 0] == e)).any(1)
        later_kept = (keep_g[:, :, 1:] & (ids_g[:, :, 1:] == e)).any((1, 2))
        assert not (first_dropped & later_kept).any()
    _drops_only_unkept(y, keep, x, ids, gates, ws)


def test_expert_parallel_drops_are_counted_and_zero():
    mesh = sharding.make_mesh(1, 2, 4, 1)
    x, w_router, ws = _inputs(seed=1)
    _, ids, gates = router.route(x, w_router, jnp.zeros(E), top_k=K)
    y, keep = jax.jit(lambda *a: expert_parallel.dispatch(*a, mesh=mesh, capacity_factor=1.0))(x, ids, gates, *ws)
    n_tok, n_ep = 8, 4  # fsdp * expert token shards; 2 experts per expert shard
    C = expert_parallel.send_capacity(T // n_tok * K, n_ep, 1.0)
    per_source = np.asarray(ids).reshape(n_tok, -1) // (E // n_ep)
    counts = np.stack([np.bincount(s, minlength=n_ep) for s in per_source])
    assert int((~keep).sum()) == int(np.maximum(counts - C, 0).sum()) > 0
    # Priority as in capacity dispatch: from one source shard to one destination, no later top-k choice is kept
    # while an earlier one is dropped (the highest-numbered experts are not the ones dropped first).
    dest_SxTxK = (np.asarray(ids) // (E // n_ep)).reshape(n_tok, -1, K)
    keep_SxTxK = np.asarray(keep).reshape(n_tok, -1, K)
    for d in range(n_ep):
        to_d = dest_SxTxK == d
        dropped_rank = np.where(to_d & ~keep_SxTxK, np.arange(K), K).min((1, 2))
        kept_rank = np.where(to_d & keep_SxTxK, np.arange(K), -1).max((1, 2))
        assert (kept_rank <= dropped_rank).all()
    _drops_only_unkept(y, keep, x, ids, gates, ws)


def test_moe_layer_routing_stats_are_global_under_expert_parallel():
    """With drops, under a mesh: the load (for the bias update) still counts every router choice over the whole
    batch, and dropped_frac is the fraction of valid copies dropped."""
    cfg = ModelConfig(d_model=D, n_routed_experts=E, top_k=K, moe_d_ff=F, n_shared_experts=0)
    with nnx.use_eager_sharding(False):
        layer = MoE(cfg, nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    mesh = sharding.make_mesh(2, 1, 4, 1)
    u = jax.random.normal(jax.random.key(3), (8, 8, D))
    valid = jnp.ones((8, 8), bool).at[:, -2:].set(False)

    ex = Execution(dispatch="expert_parallel", capacity_factor=1.0, mesh=mesh)

    @jax.jit
    def fwd(state, u, valid):
        return nnx.merge(graphdef, state)(u, valid, ex)

    out, routing = fwd(jax.device_put(state, sharding.state_shardings(state, mesh)), u, valid)
    ids = np.asarray(routing["expert_ids"])
    want_load = np.bincount(ids[np.asarray(valid)].reshape(-1), minlength=E)
    np.testing.assert_array_equal(routing["load"], want_load)
    assert 0 < float(routing["dropped_frac"]) < 1
    # No mesh: one shard, other drops, same routing.
    _, routing_local = jax.jit(lambda s, u, v: nnx.merge(graphdef, s)(u, v, ex.replace(mesh=None)))(state, u, valid)
    np.testing.assert_array_equal(routing_local["expert_ids"], ids)
    assert float(routing_local["dropped_frac"]) == 0.0  # one shard: C = 1.0 * N / 1 = N copies fit


@pytest.mark.slow
def test_train_step_logs_dropped_fraction(tmp_path):
    cfg = tiny_config(**{"train.steps": 2, "log.every": 1, "eval.every": 100, "checkpoint.every": 100,
                         "execution.dispatch": "capacity", "execution.capacity_factor": 0.5})
    last = run(cfg, tmp_path, log=lambda *a: None)
    assert 0 < last["moe/layer_1/dropped_frac"] < 1


# Input gating (Llama 4) and zero experts (LongCat-Flash) in every path: the reference loop defines both.

Z = 4  # zero experts: router candidates E .. E+Z-1


def _np_swiglu(x, wg, wu, wd):
    a, b = x @ wg, x @ wu
    return (a / (1 + np.exp(-a)) * b) @ wd


def test_reference_gate_placements_and_zero_experts_match_numpy():
    """y = sum over chosen routed experts of g SwiGLU_e(x) (or SwiGLU_e(g x)), plus g x per chosen zero expert."""
    x, _, ws = _inputs()
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(E + Z)[:K] for _ in range(T)])
    gates = rng.random((T, K)).astype(np.float32)
    wn = [np.asarray(w, np.float64) for w in ws]
    xn = np.asarray(x, np.float64)
    for gate_input in (False, True):
        want = np.zeros((T, D))
        for t in range(T):
            for k in range(K):
                e, g = ids[t, k], gates[t, k]
                if e >= E:
                    want[t] += g * xn[t]
                elif gate_input:
                    want[t] += _np_swiglu(g * xn[t], wn[0][e], wn[1][e], wn[2][e])
                else:
                    want[t] += g * _np_swiglu(xn[t], wn[0][e], wn[1][e], wn[2][e])
        got, keep = routed_experts(Execution(dispatch="reference"), x, jnp.asarray(ids), jnp.asarray(gates), *ws,
                                   group_size=T, gate_input=gate_input, zero_experts=True)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        assert keep is None


def _loss_options(fn, gate_input, x, w_router, ws):
    # Softmax over E + Z candidates, unnormalized gates (LongCat): some copies go to zero experts.
    _, ids, gates = router.route(x, w_router, jnp.zeros(E + Z), top_k=K, router="softmax", normalize=False)
    y = fn(x, ids, gates, *ws, gate_input=gate_input)
    return jnp.sum(jnp.sin(y) * jnp.arange(y.size).reshape(y.shape) / y.size)


def test_input_gating_and_zero_experts_in_every_path():
    """dropless, capacity (no drop), expert-parallel (dropless and with capacity) on a mesh == the reference loop,
    values and gradients, for both gate placements; zero-expert copies are skipped by every path."""
    mesh = sharding.make_mesh(2, 1, 4, 1)
    x, _, ws = _inputs(seed=3)
    w_router = jax.random.normal(jax.random.key(9), (D, E + Z)) * 2.0
    _, ids, _ = router.route(x, w_router, jnp.zeros(E + Z), top_k=K, router="softmax")
    assert 0 < int((ids >= E).sum()) < ids.size
    # The dispatch around the kernel is the subject: ragged_dot (tests/test_grouped_kernels.py holds the others to it)
    ep = functools.partial(expert_parallel.dispatch, mesh=mesh, grouped_matmul="ragged_dot")
    fns = {"reference": experts.reference, **{k: PATHS[k] for k in ("dropless_ragged_dot", "capacity",
                                                                      "capacity_grouped")},
           "expert_parallel_dropless": lambda *a, **kw: ep(*a, **kw)[0],
           "expert_parallel": lambda *a, **kw: ep(*a, capacity_factor=E, **kw)[0]}
    got = jax.jit(lambda *a: {(name, gi): jax.value_and_grad(functools.partial(_loss_options, fn, gi),
                                                             argnums=(0, 1, 2))(*a)
                              for name, fn in fns.items() for gi in (False, True)})(x, w_router, ws)
    for gi in (False, True):
        for name in fns:
            _assert_close(got[name, gi], got["reference", gi])
    assert not np.allclose(got["reference", False][0], got["reference", True][0])  # two different functions


def test_expert_parallel_never_sends_zero_experts():
    """Every token: one routed expert, one zero expert. The send capacity fits exactly the routed copies per
    destination, so any zero-expert copy sent would overflow it: nothing is dropped, and the output is the
    reference's."""
    mesh = sharding.make_mesh(1, 1, 4, 1)
    x, _, ws = _inputs(seed=4)
    t = np.arange(T)
    ids = jnp.asarray(np.stack([t % E, E + t % Z], -1))
    gates = jnp.full((T, 2), 0.5)
    # 16 tokens per shard, 32 copies, 4 routed copies to each of the 4 destinations: C = ceil(0.5 * 32 / 4) = 4.
    assert expert_parallel.send_capacity(T // 4 * 2, 4, 0.5) == 4
    y, keep = jax.jit(lambda *a: expert_parallel.dispatch(*a, mesh=mesh, capacity_factor=0.5))(x, ids, gates, *ws)
    assert bool(keep.all())
    np.testing.assert_allclose(y, experts.reference(x, ids, gates, *ws), rtol=1e-5, atol=1e-6)


def test_moe_layer_options_under_every_dispatch():
    """The MoE layer with Llama 4's input gate, zero experts, gpt-oss's logit bias and Qwen3-Next's sigmoid-gated
    shared expert: every dispatch (expert parallelism over a mesh included) gives the reference's output and
    gradients, and the shared term is sigmoid(u . w) x SwiGLU(u)."""
    cfg = ModelConfig(d_model=D, n_routed_experts=E, n_zero_experts=Z, top_k=K, moe_d_ff=F, n_shared_experts=1,
                      shared_expert_gate=True, router="sigmoid_input", router_logit_bias=True)
    with nnx.use_eager_sharding(False):
        layer = MoE(cfg, nnx.Rngs(0))
    layer.logit_bias.set_value(jnp.linspace(-1.0, 1.0, E + Z))
    graphdef, state = nnx.split(layer)
    mesh = sharding.make_mesh(2, 1, 4, 1)
    u = jax.random.normal(jax.random.key(3), (8, 8, D))
    valid = jnp.ones((8, 8), bool)
    ex = Execution(grouped_matmul="ragged_dot", mesh=mesh)
    exs = {"reference": Execution(dispatch="reference"), "dropless": ex,
           "capacity": ex.replace(dispatch="capacity", capacity_factor=E),
           "expert_parallel": ex.replace(dispatch="expert_parallel", capacity_factor=E),
           "expert_parallel_dropless": ex.replace(dispatch="expert_parallel_dropless")}

    def loss(state, u, ex):
        out, r = nnx.merge(graphdef, state)(u, valid, ex)
        return jnp.sum(jnp.sin(out) * jnp.arange(out.size).reshape(out.shape) / out.size), (out, r.expert_ids)

    got = jax.jit(lambda s, u: {k: jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(s, u, ex)
                                for k, ex in exs.items()})(jax.device_put(state, sharding.state_shardings(state, mesh)), u)
    (_, (out_ref, ids_ref)), _ = got["reference"]
    assert bool((ids_ref >= E).any())
    for name in exs:
        _assert_close(got[name], got["reference"])
    # The shared term, by hand: output - routed part.
    u_TxD = u.reshape(-1, D)
    _, ids, gates = router.route(u_TxD, layer.router[...], layer.bias[...], top_k=K, router="sigmoid_input",
                                 logit_bias_E=layer.logit_bias[...])
    routed = experts.reference(u_TxD, ids, gates, layer.w_gate[...], layer.w_up[...], layer.w_down[...],
                               gate_input=True) + experts.zero_experts(u_TxD, ids, gates, E)
    shared = _np_swiglu(np.asarray(u_TxD, np.float64), np.asarray(layer.shared.w_gate[...]),
                        np.asarray(layer.shared.w_up[...]), np.asarray(layer.shared.w_down[...]))
    g = 1 / (1 + np.exp(-np.asarray(u_TxD, np.float64) @ np.asarray(layer.shared_gate[...])))
    np.testing.assert_allclose(np.asarray(out_ref).reshape(-1, D), np.asarray(routed) + g[:, None] * shared,
                               rtol=1e-4, atol=1e-5)
