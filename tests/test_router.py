"""Gate math against a direct NumPy transcription of DeepSeek-V3's formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe import router


def numpy_route(u, w, b, K, G, KG, rsf, normalize):
    """Straight from the paper: s = sigmoid(u.e), top-K of s+b inside the best groups, gates from s."""
    s = 1 / (1 + np.exp(-(u.astype(np.float64) @ w.astype(np.float64))))
    T, E = s.shape
    ids, gates = np.zeros((T, K), int), np.zeros((T, K))
    for t in range(T):
        c = s[t] + b
        eligible = np.ones(E, bool)
        if G > 1:
            per = E // G
            gscore = [np.sort(c[g * per:(g + 1) * per])[-2:].sum() for g in range(G)]
            best = np.argsort(gscore)[::-1][:KG]
            eligible = np.isin(np.arange(E) // per, best)
        c = np.where(eligible, c, -np.inf)
        ids[t] = np.argsort(-c, kind="stable")[:K]
        g = s[t, ids[t]]
        gates[t] = (g / g.sum() if normalize else g) * rsf
    return s, ids, gates


@pytest.mark.parametrize("G,KG,normalize", [(1, 1, True), (4, 2, True), (4, 1, False)])
def test_route_matches_numpy(G, KG, normalize):
    rng = np.random.default_rng(0)
    T, D, E, K = 64, 16, 16, 3 if KG > 1 or G == 1 else 2
    u, w = rng.normal(size=(T, D)).astype(np.float32), rng.normal(size=(D, E)).astype(np.float32)
    b = rng.normal(size=E).astype(np.float32) * 0.3
    s, ids, gates = router.route(jnp.asarray(u), jnp.asarray(w), jnp.asarray(b), top_k=K, n_group=G,
                                 topk_group=KG, routed_scaling_factor=2.5, normalize=normalize)
    s_ref, ids_ref, gates_ref = numpy_route(u, w, b, K, G, KG, 2.5, normalize)
    np.testing.assert_allclose(s, s_ref, rtol=1e-5)
    np.testing.assert_array_equal(np.sort(ids, -1), np.sort(ids_ref, -1))
    order = np.argsort(ids, -1)
    order_ref = np.argsort(ids_ref, -1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(gates), order, -1),
                               np.take_along_axis(gates_ref, order_ref, -1), rtol=1e-5)
    if normalize:
        np.testing.assert_allclose(np.asarray(gates).sum(-1), 2.5, rtol=1e-5)


def test_bias_changes_choice_not_gate_values():
    rng = np.random.default_rng(1)
    scores = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(32, 8)), jnp.float32))
    ids0 = router.select_experts(scores, jnp.zeros(8), 2)
    bias = jnp.zeros(8).at[7].set(10.0)  # force expert 7 into every top-2
    ids1 = router.select_experts(scores, bias, 2)
    assert not np.array_equal(ids0, ids1)
    assert np.all(np.any(np.asarray(ids1) == 7, -1))
    g1 = router.gate_weights(scores, ids1)
    # Gates come from the unbiased scores: recompute them by hand.
    s = np.take_along_axis(np.asarray(scores), np.asarray(ids1), -1)
    np.testing.assert_allclose(g1, s / s.sum(-1, keepdims=True), rtol=1e-6)


def test_group_limited_never_picks_dropped_group():
    rng = np.random.default_rng(2)
    E, G, KG = 16, 4, 2
    scores = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(256, E)), jnp.float32))
    bias = jnp.asarray(rng.normal(size=E) * 0.1, jnp.float32)
    ids = np.asarray(router.select_experts(scores, bias, 4, G, KG))
    c = np.asarray(scores + bias).reshape(256, G, E // G)
    gscore = np.sort(c, -1)[..., -2:].sum(-1)
    best = np.argsort(-gscore, -1)[:, :KG]
    for t in range(256):
        assert set((ids[t] // (E // G)).tolist()) <= set(best[t].tolist())


def test_group_score_max_matches_deepseek_v2():
    """DeepSeek-V2's group_limited_greedy, transcribed: softmax scores, a group scores as its best expert, top-K
    inside the best groups, gates = the chosen probabilities x routed_scaling_factor (not renormalized). One expert
    per group is allowed there; the default (sum of the two best) differs on these scores."""
    rng = np.random.default_rng(5)
    T, D, E, G, KG, K = 256, 16, 16, 4, 2, 3
    u, w = rng.normal(size=(T, D)).astype(np.float32), rng.normal(size=(D, E)).astype(np.float32)
    s, ids, gates = router.route(jnp.asarray(u), jnp.asarray(w), jnp.zeros(E), top_k=K, n_group=G, topk_group=KG,
                                 routed_scaling_factor=1.5, normalize=False, router="softmax", group_score="max")
    logits = u.astype(np.float64) @ w.astype(np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    best = np.argsort(-p.reshape(T, G, E // G).max(-1), -1)[:, :KG]
    eligible = (np.arange(E)[None, None, :] // (E // G) == best[:, :, None]).any(1)  # [T, E]
    masked = np.where(eligible, p, 0.0)  # transformers masks with 0: every kept probability is > 0
    ids_ref = np.argsort(-masked, -1, kind="stable")[:, :K]
    np.testing.assert_allclose(s, p, rtol=1e-5)
    np.testing.assert_array_equal(np.sort(ids, -1), np.sort(ids_ref, -1))
    np.testing.assert_allclose(np.sort(gates, -1), np.sort(np.take_along_axis(p, ids_ref, -1) * 1.5, -1), rtol=1e-5)
    top2 = router.select_experts(s, jnp.zeros(E), K, G, KG)
    assert not np.array_equal(np.sort(top2, -1), np.sort(ids, -1))
    singles = router.select_experts(s, jnp.zeros(E), 2, E, 2, group_score="max")  # one expert per group
    np.testing.assert_array_equal(np.sort(singles, -1), np.sort(np.argsort(-p, -1)[:, :2], -1))


def test_load_counts_and_padding():
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 8, size=(50, 3)))
    load = router.expert_load(ids, 8)
    assert float(load.sum()) == 50 * 3
    np.testing.assert_array_equal(load, np.bincount(np.asarray(ids).ravel(), minlength=8))
    valid = jnp.arange(50) < 20
    assert float(router.expert_load(ids, 8, valid).sum()) == 20 * 3


def test_balance_loss_formula():
    rng = np.random.default_rng(4)
    B, L, E, K = 3, 20, 8, 2
    s = 1 / (1 + np.exp(-rng.normal(size=(B, L, E))))
    ids = np.argsort(-s, -1)[..., :K]
    valid = np.ones((B, L), bool)
    valid[2, 15:] = False
    expected = []
    for b in range(B):
        T = valid[b].sum()
        f = np.array([E / (K * T) * sum(i in ids[b, t] for t in range(L) if valid[b, t]) for i in range(E)])
        p = (s[b][valid[b]] / s[b][valid[b]].sum(-1, keepdims=True)).mean(0)
        expected.append((f * p).sum())
    got = router.sequence_balance_loss(jnp.asarray(s, jnp.float32), jnp.asarray(ids), jnp.asarray(valid))
    np.testing.assert_allclose(got, np.mean(expected), rtol=1e-5)
    # A fully padded row (the last evaluation batch's filler) has no load: it leaves the mean unchanged.
    padded = np.concatenate([valid, np.zeros((1, L), bool)])
    got = router.sequence_balance_loss(jnp.asarray(np.concatenate([s, s[:1]]), jnp.float32),
                                       jnp.asarray(np.concatenate([ids, ids[:1]])), jnp.asarray(padded))
    np.testing.assert_allclose(got, np.mean(expected), rtol=1e-5)


def test_bias_update_rule_and_maxvio():
    load = jnp.asarray([10.0, 0.0, 5.0, 5.0])  # mean 5
    b = router.update_bias(jnp.zeros(4), load, 1e-3)
    np.testing.assert_allclose(b, [-1e-3, 1e-3, 0.0, 0.0])
    np.testing.assert_allclose(router.max_violation(load), 1.0)
