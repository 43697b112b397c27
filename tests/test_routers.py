"""Every ROUTERS entry against a NumPy transcription of its family's modeling code (notes/families), the options any
router combines with (zero experts, logit bias, hash layers, per-layer top-k), the z-loss and the balance-loss
scopes, the bias update for every score function, accounting, and the routing analysis on each router."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from analysis.routing import collect, outputs, stats
from moe import (
    ConfigError,
    Execution,
    ModelConfig,
    Transformer,
    param_counts,
    router,
    sharding,
    train_flops_per_token,
)
from moe.accounting import matmul_params_per_token
from tests.model_fixtures import ragged_execution
from train.step import balance_term

T, D, E, K = 48, 16, 8, 2


def _inputs(seed=0, E=E, bias_scale=0.3):
    rng = np.random.default_rng(seed)
    u = rng.normal(size=(T, D)).astype(np.float32)
    w = rng.normal(size=(D, E)).astype(np.float32)
    b = (rng.normal(size=E) * bias_scale).astype(np.float32)
    return u, w, b


def _sorted_pairs(ids, gates):
    """(ids, gates) per token in id order: top-k order is not part of the math."""
    ids, gates = np.asarray(ids), np.asarray(gates)
    order = np.argsort(ids, -1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(gates, order, -1)


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _top(c, k):
    return np.argsort(-c, -1, kind="stable")[:, :k]


# NumPy transcriptions (float64) of each family's router, from the modeling files quoted in notes/families.

def np_deepseek_v4(z, b, k, rsf):
    s = np.sqrt(np.log1p(np.exp(z)))  # ACT2FN["sqrtsoftplus"]
    ids = _top(s + b, k)
    w = np.take_along_axis(s, ids, -1)
    return s, ids, w / (w.sum(-1, keepdims=True) + 1e-20) * rsf


def np_ernie(z, b, k):
    p = _softmax(z)
    ids = _top(p + b, k)  # moe_statics: the bias on the probabilities, for choosing only
    w = np.take_along_axis(p, ids, -1)
    return p, ids, w / np.maximum(w.sum(-1, keepdims=True), 1e-12)  # moe_norm_min


def np_gpt_oss(z, k):
    ids = _top(z, k)  # topk on the router logits (the Linear's bias is already in z)
    return _softmax(z), ids, _softmax(np.take_along_axis(z, ids, -1))


def np_llama4(z, k):
    ids = _top(z, k)
    return 1 / (1 + np.exp(-z)), ids, 1 / (1 + np.exp(-np.take_along_axis(z, ids, -1)))


def np_longcat(z, b, k, rsf):
    p = _softmax(z)  # over the routed and the zero experts
    ids = _top(p + b, k)  # the correction bias covers the zero experts too
    return p, ids, np.take_along_axis(p, ids, -1) * rsf  # not renormalized


def _route(u, w, b, **kw):
    return [np.asarray(a) for a in router.route_logits(jnp.asarray(u), jnp.asarray(w), jnp.asarray(b), **kw)]


def _check(got, want, rtol=1e-5):
    _, s, ids, gates = got
    s_ref, ids_ref, gates_ref = want
    np.testing.assert_allclose(s, s_ref, rtol=rtol, atol=1e-7)
    ids, gates = _sorted_pairs(ids, gates)
    ids_ref, gates_ref = _sorted_pairs(ids_ref, gates_ref)
    np.testing.assert_array_equal(ids, ids_ref)
    np.testing.assert_allclose(gates, gates_ref, rtol=rtol, atol=1e-7)


def test_sqrt_softplus_matches_deepseek_v4():
    u, w, b = _inputs()
    got = _route(u, w, b, top_k=K, router="sqrt_softplus", routed_scaling_factor=1.5, normalize=False)
    _check(got, np_deepseek_v4(u.astype(np.float64) @ w, b, K, 1.5))  # normalize=False: V4 ignores it


def test_softmax_with_bias_matches_ernie_and_its_clamp():
    u, w, b = _inputs(1, bias_scale=0.05)
    _check(_route(u, w, b, top_k=K, router="softmax"), np_ernie(u.astype(np.float64) @ w, b, K))
    # A bias that steers the choice to experts whose probabilities sum below moe_norm_min (1e-12): ERNIE's gates
    # are then p / 1e-12, not renormalized to 1. Logits z = I . z: expert 0 holds ~all the mass.
    z = np.zeros((4, E), np.float32)
    z[:, 0] = 40.0
    bias = np.zeros(E, np.float32)
    bias[0] = -1.0
    _, p, ids, gates = _route(np.eye(4, dtype=np.float32), z, bias, top_k=K, router="softmax")
    _, ids_ref, gates_ref = np_ernie(z.astype(np.float64), bias, K)
    assert not (np.asarray(ids) == 0).any()
    np.testing.assert_allclose(np.sort(gates, -1), np.sort(gates_ref, -1), rtol=1e-4)
    assert np.all(np.asarray(gates).sum(-1) < 1e-3)  # the clamp, not a renormalization to 1


def test_ernie_clamp_is_the_plain_sum_whenever_the_sum_reaches_it():
    """max(sum, 1e-12) and sum + 1e-20 are the same fp32 division (values and gradients) when sum >= 1e-12, as
    every unbiased softmax top-K is (sum >= K/E): the softmax entry kept its numbers for Mixtral, Qwen, DeepSeek-V2."""
    z = jnp.asarray(np.random.default_rng(9).normal(size=(256, E)) * 4, jnp.float32)
    ids = router.select_experts(jax.nn.softmax(z), jnp.zeros(E), K)
    gates = lambda floor: lambda z: router.gate_weights(jax.nn.softmax(z), ids, 1.0, True, floor)
    np.testing.assert_array_equal(gates(1e-12)(z), gates(0.0)(z))
    loss = lambda floor: lambda z: (jnp.sin(gates(floor)(z)) * jnp.arange(K)).sum()
    np.testing.assert_array_equal(jax.grad(loss(1e-12))(z), jax.grad(loss(0.0))(z))


def test_topk_softmax_with_logit_bias_matches_gpt_oss():
    u, w, b = _inputs(2)
    c = np.random.default_rng(3).normal(size=E).astype(np.float32)  # the router Linear's bias
    got = _route(u, w, np.zeros(E, np.float32), top_k=3, router="topk_softmax", logit_bias_E=jnp.asarray(c))
    _check(got, np_gpt_oss(u.astype(np.float64) @ w + c, 3))
    # The selection bias shifts the logits' ranking, not the gates.
    steer = np.zeros(E, np.float32)
    steer[5] = 100.0
    _, _, ids, gates = _route(u, w, steer, top_k=3, router="topk_softmax", logit_bias_E=jnp.asarray(c))
    assert np.all(np.any(np.asarray(ids) == 5, -1))
    z = u.astype(np.float64) @ w + c
    np.testing.assert_allclose(gates, _softmax(np.take_along_axis(z, np.asarray(ids), -1)), rtol=1e-5)


def test_sigmoid_input_matches_llama4_router():
    u, w, b = _inputs(4)
    _check(_route(u, w, np.zeros(E, np.float32), top_k=1, router="sigmoid_input"),
           np_llama4(u.astype(np.float64) @ w, 1))


def test_zero_expert_router_matches_longcat():
    Z = 4
    u, w, b = _inputs(5, E=E + Z)
    got = _route(u, w, b, top_k=3, router="softmax", normalize=False, routed_scaling_factor=6.0)
    _check(got, np_longcat(u.astype(np.float64) @ w, b, 3, 6.0))
    assert (np.asarray(got[2]) >= E).any()  # some zero experts chosen


def _np_mix32(x):
    x = x.astype(np.uint64) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_table_is_a_fixed_seeded_table_of_distinct_experts():
    V, E_, K_ = 4096, 8, 2
    table = np.asarray(router.hash_table(V, E_, K_, seed=3))
    # Transcribed: the K largest of h(seed, token, e), with ties to the lower expert (lax.top_k).
    t = np.arange(V, dtype=np.uint64)[:, None]
    e = np.arange(E_, dtype=np.uint64)[None, :]
    seed_mix = _np_mix32(np.asarray(3 + 0x9E3779B9, np.uint64))
    h = _np_mix32((_np_mix32(t ^ seed_mix) + e * 0x9E3779B9) & 0xFFFFFFFF) >> 1
    np.testing.assert_array_equal(np.sort(table, -1), np.sort(_top(h.astype(np.int64), K_), -1))
    assert all(len(set(row)) == K_ for row in table.tolist())
    load = np.bincount(table.ravel(), minlength=E_)
    assert load.min() > 0.9 * V * K_ / E_ and load.max() < 1.1 * V * K_ / E_  # near-uniform over the vocabulary
    assert not np.array_equal(table, np.asarray(router.hash_table(V, E_, K_, seed=4)))  # per layer
    tokens = jnp.asarray([7, 7, 4000, 3])
    np.testing.assert_array_equal(router.hash_expert_ids(tokens, E_, K_, 3), table[[7, 7, 4000, 3]])


def test_hash_router_gates_are_v4s():
    u, w, _ = _inputs(6)
    tokens = np.random.default_rng(0).integers(0, 500, T)
    _, s, ids, gates = _route(u, w, np.full(E, 9.0, np.float32), top_k=K, router="hash",
                              token_ids_T=jnp.asarray(tokens), hash_seed=2, routed_scaling_factor=1.5)
    np.testing.assert_array_equal(ids, np.asarray(router.hash_table(500, E, K, 2))[tokens])  # the bias ignored
    s_ref = np.sqrt(np.log1p(np.exp(u.astype(np.float64) @ w)))
    g = np.take_along_axis(s_ref, ids, -1)
    np.testing.assert_allclose(gates, g / g.sum(-1, keepdims=True) * 1.5, rtol=1e-5)
    with pytest.raises(ValueError, match="token id"):
        router.route(jnp.asarray(u), jnp.asarray(w), jnp.zeros(E), top_k=K, router="hash")


def test_router_z_loss_formula():
    z = np.random.default_rng(7).normal(size=(T, E)) * 3
    valid = np.arange(T) < 30
    lse = np.log(np.exp(z).sum(-1))
    np.testing.assert_allclose(router.router_z_loss(jnp.asarray(z, jnp.float32), jnp.asarray(valid)),
                               (lse[valid] ** 2).mean(), rtol=1e-5)


def _np_balance(s, ids, valid, groups):
    """sum_i f_i P_i over each group of rows together (Qwen's global batch: one group), averaged over groups."""
    B, L, E_ = s.shape
    K_ = ids.shape[-1]
    out = []
    for rows in np.split(np.arange(B), groups):
        v = valid[rows]
        n = v.sum()
        if n == 0:
            continue
        chosen = np.zeros(E_)
        for b in rows:
            for t in range(L):
                if valid[b, t]:
                    chosen[ids[b, t]] += 1
        f = E_ / (K_ * n) * chosen
        p = (s[rows][v] / s[rows][v].sum(-1, keepdims=True)).sum(0) / n
        out.append((f * p).sum())
    return np.mean(out)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_balance_loss_scopes(groups):
    rng = np.random.default_rng(8)
    B, L = 4, 10
    s = 1 / (1 + np.exp(-rng.normal(size=(B, L, E)) * 2))
    ids = np.argsort(-s - rng.normal(size=s.shape), -1)[..., :K]
    valid = rng.random((B, L)) > 0.2
    valid[3] = False  # a padding row
    rows = router.balance_rows(jnp.asarray(s, jnp.float32), jnp.asarray(ids), jnp.asarray(valid))
    np.testing.assert_allclose(router.balance_loss(rows, groups), _np_balance(s, ids, valid, groups), rtol=1e-5)
    # One group per row is the sequence-wise loss.
    np.testing.assert_allclose(router.balance_loss(rows, B),
                               router.sequence_balance_loss(jnp.asarray(s, jnp.float32), jnp.asarray(ids),
                                                            jnp.asarray(valid)), rtol=1e-6)


@pytest.mark.parametrize("name", [n for n, r in router.ROUTERS.items() if r.selection_bias])
def test_bias_update_balances_every_score_function(name):
    """b += gamma sign(mean - load) evens out a skewed router whatever its scores (it moves the ranking). The skew
    is a logit bias (router_logit_bias); with zero experts every candidate is balanced alike."""
    rng = np.random.default_rng(0)
    E_, Z = 16, 4 if name == "softmax" else 0
    u = jnp.asarray(rng.normal(size=(2048, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(D, E_ + Z)) * 0.3, jnp.float32)
    skew = jnp.linspace(-1.0, 1.0, E_ + Z)

    @jax.jit
    def update(bias):
        ids = router.route_logits(u, w, bias, top_k=2, router=name, logit_bias_E=skew)[2]
        load = router.expert_load(ids, E_ + Z)
        return router.update_bias(bias, load, 5e-3), router.max_violation(load)

    bias = jnp.zeros(E_ + Z)
    _, first = update(bias)
    for _ in range(400):
        bias, vio = update(bias)
    assert float(first) > 1.5 and float(vio) < 0.25, (float(first), float(vio))
    assert float(bias[-1]) < float(bias[0])  # the favoured candidate pushed down


def test_config_errors_name_the_field():
    for kw, field in [(dict(n_zero_experts=-1), "n_zero_experts"), (dict(layer_top_k="2,x"), "layer_top_k"),
                      (dict(n_layers=3, layer_top_k="2"), "layer_top_k"), (dict(layer_top_k="2,2,2,40"), "layer_top_k"),
                      (dict(n_hash_layers=9), "n_hash_layers"), (dict(router="nope"), "router"),
                      (dict(n_zero_experts=3, n_group=2), "n_group")]:
        with pytest.raises(ConfigError, match=f"model.{field}") as e:
            ModelConfig(**kw)
        assert "\n" not in str(e.value)
    cfg = ModelConfig(n_layers=4, n_routed_experts=8, n_zero_experts=8, top_k=12, layer_top_k="12,1,3",
                      n_hash_layers=1, n_group=2, topk_group=2)
    assert [cfg.moe_top_k(i) for i in cfg.moe_layer_ids] == [12, 1, 3] and cfg.n_candidates == 16
    assert [cfg.layer_router(i) for i in cfg.moe_layer_ids] == ["hash", "sigmoid", "sigmoid"]


def test_accounting_counts_expected_real_experts():
    """Active parameters count the expected real experts under uniform routing over the candidates; a zero expert
    costs nothing, each layer counts its own K, the logit bias is a parameter of every token."""
    base = ModelConfig(n_layers=3, first_k_dense=1, n_routed_experts=8, top_k=4, n_shared_experts=0)
    expert, D_ = 3 * base.d_model * base.moe_d_ff, base.d_model
    zero = base.replace(n_zero_experts=8)  # each choice is a real expert with probability 1/2
    assert param_counts(zero)["total"] - param_counts(base)["total"] == 2 * 8 * D_  # 8 more router columns a layer
    assert param_counts(base)["active"] - param_counts(zero)["active"] == 2 * (2 * expert - 8 * D_)
    assert train_flops_per_token(base, 64) - train_flops_per_token(zero, 64) == 6 * 2 * (2 * expert - 8 * D_)
    per_layer = base.replace(layer_top_k="1,3")
    assert param_counts(base)["active"] - param_counts(per_layer)["active"] == (4 - 1 + 4 - 3) * expert
    biased = base.replace(router_logit_bias=True)
    assert param_counts(biased)["active"] - param_counts(base)["active"] == 2 * 8
    assert matmul_params_per_token(biased) == matmul_params_per_token(base)
    # The model holds what param_counts says.
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=3, n_heads=2, n_kv_heads=2, head_dim=8, d_ff=32,
                      n_routed_experts=4, n_zero_experts=2, top_k=2, moe_d_ff=8, router_logit_bias=True,
                      shared_expert_gate=True, n_hash_layers=1)
    model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == param_counts(cfg)["total"]


# One tiny model per router (plus the options) through the training loss and the routing analysis.

TINY = dict(vocab_size=96, d_model=32, n_layers=3, n_heads=2, n_kv_heads=2, head_dim=16, d_ff=48, first_k_dense=1,
            n_routed_experts=8, top_k=2, moe_d_ff=16, n_shared_experts=1)
VARIANTS = {name: dict(router=name) for name in router.ROUTERS} | {
    "longcat": dict(router="softmax", n_zero_experts=4, norm_topk_prob=False, routed_scaling_factor=2.0),
    "v4_hash_layers": dict(router="sqrt_softplus", n_hash_layers=1, layer_top_k="3,2", router_logit_bias=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_routing_analysis_on_every_router(variant, tmp_path):
    cfg = ModelConfig(**TINY, **VARIANTS[variant])
    model = Transformer(cfg, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    route = collect.make_route_fn(graphdef, prefix=False, execution=ragged_execution())
    B, L, n_domains = 4, 16, 2
    acc = stats.RoutingAccumulator(cfg.n_moe_layers, cfg.n_routed_experts, n_domains=n_domains,
                                   vocab_size=cfg.vocab_size, track_tokens=[1, 2],
                                   **collect.layer_routing(cfg, cfg.moe_layer_ids))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (B, L)).astype(np.int32)
    seg = np.ones((B, L), np.int32)
    seg[-1, L // 2:] = 0  # padding
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    routing = jax.device_get(route(state, tokens, pos, seg, np.zeros(B, np.int32)))
    acc.update([{"expert_ids": i, "gates": g} for i, g in routing], tokens, np.arange(B)[:, None] % n_domains
               * np.ones((1, L), int), seg > 0, seg)
    r = acc.finalize()
    r["layer_ids_L"] = np.asarray(cfg.moe_layer_ids)
    Z = cfg.n_zero_experts
    k_L = np.asarray([cfg.moe_top_k(i) for i in cfg.moe_layer_ids])
    np.testing.assert_array_equal(r["top_k_L"], k_L)
    # Each token's K choices: the routed experts' share plus the zero experts' make K.
    total_LxD = r["share_LxDxE"].sum(-1) + (r["zero_share_LxD"] if Z else 0)
    np.testing.assert_allclose(total_LxD, k_L[:, None] * np.ones((1, n_domains)), rtol=1e-6)
    hashed = [cfg.layer_router(i) == "hash" for i in cfg.moe_layer_ids]
    np.testing.assert_array_equal(r["hash_routed_L"], hashed)
    for layer, h in enumerate(hashed):  # a hash layer's experts are its table's
        if h:
            table = np.asarray(router.hash_table(cfg.vocab_size, cfg.n_candidates, k_L[layer],
                                                 cfg.moe_layer_ids[layer]))
            np.testing.assert_array_equal(routing[layer][0][seg > 0], table[tokens[seg > 0]])
    text = stats.summary_text(r, ["a", "b"])
    assert ("routed by hash" in text) == any(hashed) and ("zero experts" in text) == bool(Z)
    a = collect.Analysis(r, ["a", "b"], {1: "x", 2: "y"}, [], [], None, int(r["n_tokens"]), 1.0)
    doc = json.loads(outputs.write_json(a, tmp_path / "routing.json", {}, {}).read_text())
    assert [v["routed_by"] for v in doc["layers"].values()] == ["hash" if h else "top_k" for h in hashed]
    if Z:
        assert doc["n_zero_experts"] == Z and all(len(v["zero_expert_load"]) == Z for v in doc["layers"].values())
        assert r["zero_frac_L"].max() > 0
    # The train step's loss terms for this router are finite, and the scopes agree where they must.
    tgt = np.roll(tokens, -1, 1)
    _, aux = nnx.jit(lambda m, t, y, s: m.token_losses(t, y, segment_ids_BxL=s, execution=ragged_execution()))(
        model, tokens, tgt, seg)
    assert np.isfinite(float(aux.z_loss)) and float(aux.z_loss) > 0
    np.testing.assert_allclose(balance_term(aux, "sequence"), aux.balance_loss, rtol=1e-6)
    np.testing.assert_allclose(balance_term(aux, "micro_batch", B), aux.balance_loss, rtol=1e-5)
    assert np.isfinite(float(balance_term(aux, "global_batch")))


def test_hash_layers_and_per_layer_top_k_in_the_model():
    """The model hands every block the call's token ids: a hash layer's experts are its table's rows of the input
    tokens (an MTP block's too, with router 'hash': the token at its position, t_i); per-layer K shapes each
    layer's routing; scanned layers give the unrolled values (hash and K split the runs of equal blocks)."""
    cfg = ModelConfig(**TINY | dict(n_layers=4, layer_top_k="3,1,2", n_hash_layers=2, mtp_depth=1))
    model = Transformer(cfg, nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12)))
    inspect = nnx.jit(lambda m, t, ex: m.inspect(t, execution=ex), static_argnums=2)
    _, aux = inspect(model, tokens, ragged_execution())
    assert [r.expert_ids.shape[-1] for r in aux.routing] == [3, 1, 2]
    for r, layer in zip(aux.routing[:2], cfg.moe_layer_ids[:2]):
        table = np.asarray(router.hash_table(cfg.vocab_size, cfg.n_routed_experts, cfg.moe_top_k(layer), layer))
        np.testing.assert_array_equal(r.expert_ids, table[np.asarray(tokens)])
        assert float(r.balance_loss) == 0.0 and float(r.rows.tokens_B.sum()) == 0.0  # nothing to balance
    assert float(aux.routing[2].balance_loss) > 0
    _, scanned = inspect(model, tokens, ragged_execution(scan_layers=True))
    for a, b in zip(scanned.routing, aux.routing):
        np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
        np.testing.assert_allclose(a.gates, b.gates, rtol=1e-6)
    # An all-hash model with an MTP module: its block routes by the main token ids at its positions.
    all_hash = Transformer(cfg.replace(router="hash", layer_top_k="", n_hash_layers=0), nnx.Rngs(0))
    _, aux = nnx.jit(lambda m, t: m.token_losses(t, jnp.roll(t, -1, 1), mtp=True, execution=ragged_execution()))(
        all_hash, tokens)
    mtp_routing = aux.mtp.routing[0]
    table = np.asarray(router.hash_table(cfg.vocab_size, cfg.n_routed_experts, cfg.top_k, cfg.n_layers))
    np.testing.assert_array_equal(mtp_routing.expert_ids, table[np.asarray(tokens)])
    assert aux.expert_load.shape == (cfg.n_moe_layers + 1, cfg.n_routed_experts)
    with pytest.raises(ValueError, match="token id"):  # a hash layer called without ids says what it needs
        block = model.blocks[1]
        block.feed_forward(jnp.zeros((1, 4, cfg.d_model)), jnp.ones((1, 4), bool), Execution())


def _train_steps(tmp_path, **overrides):
    from tests.conftest import tiny_config
    from train import optim
    from train.preflight import parse
    from train.state import init_state
    from train.step import make_train_step

    # ragged_dot compiles in a fraction of slab's time; the dispatch paths with zero experts are tested apart
    c = tiny_config(**{"model.vocab_size": 64, "model.n_layers": 3, "model.n_hash_layers": 1, "model.n_zero_experts": 2,
                       "train.bias_update_rate": 1e-2, "train.lr": 1e-2, "execution.grouped_matmul": "ragged_dot",
                       **overrides})
    rc = parse(c)
    mesh = sharding.make_mesh(2, 1, 1, 1, devices=jax.devices()[:2])
    tx = optim.optimizer(rc.train)
    graphdef, state, _ = init_state(rc.model, tx, 0, mesh)
    step = jax.jit(make_train_step(graphdef, tx, optim.schedule(rc.train), rc.train, rc.execution_on(mesh)))
    rng = np.random.default_rng(0)
    B, L = 8, 16
    batch = {"tokens": rng.integers(0, 64, (B, L)).astype(np.int32), "targets": rng.integers(0, 64, (B, L)).astype(np.int32),
             "segment_ids": np.ones((B, L), np.int32), "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)),
             "loss_mask": np.ones((B, L), np.float32)}
    batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"))))
    metrics = []
    for _ in range(3):
        state, m = step(state, batch)
        metrics.append(jax.device_get(m))
    return jax.device_get(state), metrics


def test_train_step_z_loss_scopes_hash_bias_and_zero_experts(tmp_path):
    """The z-loss weight trains the router logits down; a hash layer's bias stays 0 while the learned layer's moves
    (over routed and zero experts alike); the zero experts' share is logged per layer."""
    plain_state, plain = _train_steps(tmp_path)
    z_state, z = _train_steps(tmp_path, **{"train.router_z_loss_weight": 1.0,
                                           "train.balance_loss_scope": "micro_batch"})
    assert plain[0]["router_z_loss"] == pytest.approx(z[0]["router_z_loss"], rel=1e-5)  # the same first forward
    assert z[-1]["router_z_loss"] < plain[-1]["router_z_loss"] - 0.5  # step 0 has lr 0 (warmup): two updates
    for state in (plain_state, z_state):
        hash_bias, learned_bias = jax.tree.leaves(state["bias"])
        assert not np.asarray(hash_bias).any() and np.asarray(learned_bias).any()
        assert learned_bias.shape == (8 + 2,)
    assert all(0 <= m["zero_expert_frac"][i] <= 1 for m in plain for i in range(2))
    assert all(np.isfinite(m["balance_loss"]) and m["balance_loss"] > 0 for m in z)
