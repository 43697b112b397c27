"""Multi-token prediction (moe/mtp.py, train/step.py): each depth equals a reference written from the paper's
equations, the causal chain holds (a depth-k position never sees a token past the one it predicts, nor across packed
documents: by perturbation), the fused objective equals autodiff of the per-token loss, the main model is
unchanged by adding MTP (its init, and its gradient when lambda is 0), and the train step logs each depth's loss and
its MoE block's load, sharded as on one device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe import ConfigError, ModelConfig, Transformer, sharding
from moe.model import split_model
from tests.conftest import tiny_config
from tests.model_fixtures import TINY, ragged_execution
from train import optim
from train.preflight import parse
from train.state import init_state
from train.step import make_train_step

EX = ragged_execution(dispatch="dropless", loss_chunks=1)
B, L = 2, 12


@functools.cache
def model(depth=2, **kw) -> Transformer:
    return Transformer(ModelConfig(**{**TINY, "mtp_depth": depth, **kw}), nnx.Rngs(0))


def stream(seed=0, n=L + 1):
    return np.random.default_rng(seed).integers(1, TINY["vocab_size"], (B, n)).astype(np.int32)


@functools.cache
def mtp_ce_fn(depth=2):
    """A jitted (stream [B, L+1], segment_ids or None) -> (mtp_ce [K, B, L], mtp_weights [K, B, L])."""
    graphdef, state = nnx.split(model(depth))

    @jax.jit
    def f(s, seg):
        m = nnx.merge(graphdef, state)
        _, aux = m.token_losses(s[:, :-1], s[:, 1:], execution=EX, mtp=True, segment_ids_BxL=seg)
        return aux.mtp.ce, aux.mtp.weights

    return f


def reference_mtp_ce(m: Transformer, s):
    """The paper's equations, position by position in the shifts: h^0 = the main model's final-normed hidden state;
    h^k = Block(eh_proj [enorm(Emb(t_{i+k})); hnorm(h^{k-1})]); ce of t_{i+k+1} under head(head_norm(h^k))."""
    tokens = jnp.asarray(s[:, :-1])
    x, _ = m.forward(tokens, execution=EX)
    h = m.final_norm(x)
    out = []
    for k, mod in enumerate(m.mtp, start=1):
        nxt = jnp.asarray(np.pad(s[:, k:], ((0, 0), (0, k)))[:, :L])  # t_{i+k}, 0 past the row's end
        emb = jnp.take(m.embed[...], nxt, axis=0)
        inp = jnp.concatenate([mod.enorm(emb), mod.hnorm(h)], -1) @ mod.eh_proj[...]
        h = mod.block(inp, m.block_inputs(tokens), EX.resolved()).x
        logits = mod.head_norm(h) @ m.head()
        tgt = np.pad(s[:, k + 1:], ((0, 0), (0, k + 1)))[:, :L]
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), jnp.asarray(tgt)[..., None], -1)[..., 0]
        out.append(np.asarray(ce))
    return np.stack(out)


def test_each_depth_equals_the_papers_equations():
    s = stream()
    ce, w = mtp_ce_fn()(s, None)
    ref = reference_mtp_ce(model(), s)
    for k in (1, 2):
        valid = L - k  # positions whose target t_{i+k+1} lies in the row
        np.testing.assert_allclose(np.asarray(ce)[k - 1, :, :valid], ref[k - 1, :, :valid], rtol=2e-5, atol=2e-5)
        assert np.all(np.asarray(w)[k - 1, :, :valid] == 1) and np.all(np.asarray(w)[k - 1, :, valid:] == 0)


def test_no_depth_sees_past_the_token_it_predicts():
    """ce of depth k at position i (predicting s_{i+k+1}) is unchanged when any later token of the stream changes."""
    s = stream(1)
    f = mtp_ce_fn()
    ce0 = np.asarray(f(s, None)[0])
    for j in (4, 7, L):
        t = s.copy()
        t[:, j] = (t[:, j] % (TINY["vocab_size"] - 1)) + 1
        ce1 = np.asarray(f(t, None)[0])
        for k in (1, 2):
            blind = j - k - 1  # positions i with i + k + 1 < j never see s_j
            np.testing.assert_array_equal(ce1[k - 1, :, :blind], ce0[k - 1, :, :blind])
            assert np.abs(ce1[k - 1, :, blind:L - k] - ce0[k - 1, :, blind:L - k]).max() > 0  # and later ones do


def test_packed_documents_do_not_leak_into_each_other():
    """Two documents per row: every scored depth-k loss of one document is unchanged when the other's tokens change,
    and no position is scored on a target from the other document."""
    s = stream(2)
    seg = np.ones((B, L), np.int32)
    seg[:, 5:] = 2
    f = mtp_ce_fn()
    ce0, w = (np.asarray(a) for a in f(s, seg))
    for k in (1, 2):
        assert np.all(w[k - 1, :, 4 - k:5] == 0)  # the last k + 1 positions of document 1 predict into document 2
        assert np.all(w[k - 1, :, :4 - k] == 1) and np.all(w[k - 1, :, 5:L - k] == 1)
    for lo, hi in ((0, 5), (5, L + 1)):  # the stream's tokens of document 1 (s_0..s_4) or of document 2
        t = s.copy()
        t[:, lo:hi] = (t[:, lo:hi] % (TINY["vocab_size"] - 1)) + 1
        ce1 = np.asarray(f(t, seg)[0])
        other = (w > 0) & ((np.arange(L) >= 5) if lo == 0 else (np.arange(L) < 5))
        np.testing.assert_array_equal(ce1[other], ce0[other])
        assert np.abs(ce1 - ce0)[(w > 0) & ~other].max() > 0


def test_fused_objective_equals_autodiff_of_the_per_token_loss():
    m = model()
    graphdef, params, bias = split_model(m)
    s, weights = stream(3), jnp.asarray(np.random.default_rng(3).random((B, L)) > 0.2, jnp.float32)

    def loss(params, fused):
        mm = nnx.merge(graphdef, params, bias)
        _, aux = mm.token_losses(s[:, :-1], s[:, 1:], execution=EX, mtp=True,
                                 loss_weights_BxL=weights if fused else None)
        if fused:
            return aux.mtp.objective.sum()
        # the unfused weights are ones: apply the main weights shifted as depth_targets does
        w = jnp.stack([jnp.pad(weights[:, k:], ((0, 0), (0, k))) for k in (1, 2)])
        return (aux.mtp.ce * w).sum()

    (a, ga), (b, gb) = (jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, f) for f in (True, False))
    np.testing.assert_allclose(a, b, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_adding_mtp_keeps_the_main_model_and_its_outputs():
    plain, with_mtp = Transformer(ModelConfig(**TINY), nnx.Rngs(0)), model()
    for a, b in zip(jax.tree.leaves(nnx.state(plain, nnx.Param)),
                    jax.tree.leaves(nnx.state(with_mtp, nnx.Param))[:len(jax.tree.leaves(nnx.state(plain, nnx.Param)))]):
        np.testing.assert_array_equal(a, b)
    s = stream(4)
    logits = nnx.jit(lambda m, s: m(s, execution=EX)[0])
    np.testing.assert_allclose(logits(with_mtp, s), logits(plain, s), rtol=1e-6)
    assert with_mtp.cfg.train_load_layer_ids == (1, 2, 3, 4) and with_mtp.cfg.moe_layer_ids == (1, 2)


def test_mtp_needs_the_causal_mask():
    with pytest.raises(ConfigError, match="model.mtp_depth: multi-token prediction needs mask 'causal'"):
        ModelConfig(**{**TINY, "mtp_depth": 1, "mask": "prefix"})
    with pytest.raises(ConfigError, match=r"model.mtp_depth: must be in \[0, 4096\], got -1"):
        ModelConfig(**{**TINY, "mtp_depth": -1})


def _batch(seed=0, n=8, length=16, vocab=64):
    rng = np.random.default_rng(seed)
    s = rng.integers(0, vocab, (n, length + 1)).astype(np.int32)
    seg = np.ones((n, length), np.int32)
    seg[:, length // 2:] = 2
    pos = np.concatenate([np.arange(length // 2), np.arange(length - length // 2)])[None].repeat(n, 0)
    return {"tokens": s[:, :-1], "targets": s[:, 1:], "segment_ids": seg, "positions": pos.astype(np.int32),
            "loss_mask": (rng.random((n, length)) > 0.1).astype(np.float32)}


def _steps(mesh_shape=(1, 1, 1, 1), depth=1, weight=0.3, steps=2, balance=1e-4):
    c = tiny_config(**{"model.vocab_size": 64, "model.mtp_depth": depth, "train.mtp_weight": weight,
                       "train.bias_update_rate": 1e-2, "train.balance_loss_weight": balance})
    mcfg = parse(c).model
    mesh = sharding.make_mesh(*mesh_shape, devices=jax.devices()[:int(np.prod(mesh_shape))])
    tx = optim.optimizer(c.train)
    graphdef, state, _ = init_state(mcfg, tx, 0, mesh)
    step = jax.jit(make_train_step(graphdef, tx, optim.schedule(c.train), c.train, ragged_execution(mesh=mesh)))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    metrics = []
    for i in range(steps):
        state, m = step(state, jax.device_put(_batch(i), spec))
        metrics.append(jax.device_get(m))
    return mcfg, jax.device_get(state), metrics


@pytest.fixture(scope="module")
def one_device():
    return _steps()


def test_train_step_logs_each_depth_and_updates_the_mtp_routing_bias(one_device):
    mcfg, state, metrics = one_device
    m = metrics[-1]
    assert np.isfinite(m["mtp/loss_1"]) and abs(m["mtp/loss_1"] - np.log(64)) < 1.0 and m["mtp_weight"] == 0.3
    n_rows = len(mcfg.train_load_layer_ids)
    assert n_rows == mcfg.n_moe_layers + 1 and m["maxvio"].shape == (n_rows,)
    biases = jax.tree.leaves(state["bias"])
    assert len(biases) == n_rows and np.abs(biases[-1]).max() > 0  # the MTP block's own bias moved


def test_main_model_learns_the_same_when_lambda_is_zero(one_device):
    """With lambda 0 (and no balance loss, which the MTP block's router also feeds back into the main model) the MTP
    modules change nothing of the main model's update; with lambda > 0 they do."""
    _, plain, _ = _steps(depth=0, balance=0.0)
    _, zero, _ = _steps(weight=0.0, balance=0.0)
    _, on, _ = one_device  # lambda 0.3
    main = lambda st: {k: v for k, v in st["params"].items() if k != "mtp"}
    for a, b in zip(jax.tree.leaves(main(zero)), jax.tree.leaves(main(plain))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(main(on)), jax.tree.leaves(main(plain)))) > 1e-4


def test_sharded_mtp_step_equals_one_device(one_device):
    _, ref, ref_metrics = one_device
    _, state, metrics = _steps((2, 2, 2, 1))
    for a, b in zip(metrics, ref_metrics):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
        np.testing.assert_allclose(a["mtp/loss_1"], b["mtp/loss_1"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(ref["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    for a, b in zip(jax.tree.leaves(state["bias"]), jax.tree.leaves(ref["bias"])):
        np.testing.assert_allclose(a, b, atol=1e-7)


def test_lambda_schedule():
    from train.step import mtp_weight

    t = tiny_config(**{"train.steps": 100, "train.mtp_weight": 0.3, "train.mtp_weight_late": 0.1,
                       "train.mtp_weight_switch": 0.7}).train
    assert [float(mtp_weight(t, s)) for s in (0, 69, 70, 99)] == pytest.approx([0.3, 0.3, 0.1, 0.1])


def test_accounting_counts_every_mtp_module():
    """Parameters: the tree's; active and FLOPs: the main model's plus, per depth, its block (MoE here: layers 3 and
    4 of a 3-layer model), eh_proj, three norms and one more pass through the shared head."""
    from moe import param_counts, train_flops_per_token
    from moe.accounting import matmul_params_per_token

    m, plain = model(), Transformer(ModelConfig(**TINY), nnx.Rngs(0))
    assert param_counts(m.cfg)["total"] == sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
    D, V = TINY["d_model"], TINY["vocab_size"]
    attn_matmul = D * TINY["head_dim"] * (2 * TINY["n_heads"] + 2 * TINY["n_kv_heads"])
    moe_matmul = D * TINY["n_routed_experts"] + (TINY["top_k"] + TINY["n_shared_experts"]) * 3 * D * TINY["moe_d_ff"]
    per_depth = attn_matmul + moe_matmul + 2 * D * D + D * V
    assert matmul_params_per_token(m.cfg) == matmul_params_per_token(plain.cfg) + 2 * per_depth
    extra_active = 2 * (attn_matmul + 2 * D + moe_matmul + 2 * D * D + 3 * D)
    assert param_counts(m.cfg)["active"] == param_counts(plain.cfg)["active"] + extra_active
    attention = 6 * 2 * 16 * TINY["n_heads"] * TINY["head_dim"]  # one more block's attention per depth, L = 16
    assert train_flops_per_token(m.cfg, 16) == train_flops_per_token(plain.cfg, 16) + 6 * 2 * per_depth + 2 * attention
