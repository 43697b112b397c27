"""Routing statistics on tiny hand-built routings with known answers."""

import json
import math

import numpy as np
import pytest

from analysis.routing import stats as rs
from moe import router

E, K = 8, 2


def _acc(n_layers=1, n_domains=2, vocab=16, **kw):
    return rs.RoutingAccumulator(n_layers, E, K, n_domains, vocab, **kw)


def _random_ids(rng, shape, n_experts=E, top_k=K):
    # Distinct top-k per token: first K of a random permutation.
    return np.argsort(rng.random(shape + (n_experts,)), -1)[..., :top_k].astype(np.int32)


def test_code_to_expert_3_gives_specialization_1():
    domains_BxS = np.array([[0, 0, 1, 1, 1, 0]])
    ids_BxSxK = np.where(domains_BxS[..., None] == 1, [3, 5], [0, 1]).astype(np.int32)
    acc = _acc()
    acc.update([{"expert_ids": ids_BxSxK, "gates": np.full(ids_BxSxK.shape, 0.5)}],
               np.zeros_like(domains_BxS), domains_BxS)
    out = acc.finalize()
    assert out["share_LxDxE"][0, 1, 3] == 1.0 and out["share_top1_LxDxE"][0, 1, 3] == 1.0
    assert out["share_LxDxE"][0, 1].sum() == K
    np.testing.assert_allclose(out["share_norm_LxDxE"][0].sum(-1), 1.0)
    assert out["gate_share_LxDxE"][0, 1, 3] == 0.5
    assert out["share_top1_LxDxE"][0, 0, 3] == 0.0


def test_constant_router_locality_is_one():
    ids_BxSxK = np.broadcast_to(np.array([2, 6], np.int32), (3, 5, K))
    acc = _acc()
    acc.update([ids_BxSxK], np.zeros((3, 5), int), np.zeros((3, 5), int))
    out = acc.finalize()
    assert out["loc_first_L"][0] == out["loc_any_L"][0] == out["loc_overlap_L"][0] == 1.0
    assert out["n_pairs"] == 3 * 4


def test_random_router_locality_near_baseline():
    rng = np.random.default_rng(0)
    ids_BxSxK = _random_ids(rng, (8, 1000))
    acc = _acc()
    acc.update([ids_BxSxK], np.zeros((8, 1000), int), np.zeros((8, 1000), int))
    out = acc.finalize()
    first, any_overlap, frac = rs.locality_baseline(E, K)
    assert first == 1 / E and frac == K / E
    assert any_overlap == pytest.approx(1 - math.comb(E - K, K) / math.comb(E, K))
    assert out["loc_first_L"][0] == pytest.approx(first, abs=0.01)
    assert out["loc_any_L"][0] == pytest.approx(any_overlap, abs=0.015)
    assert out["loc_overlap_L"][0] == pytest.approx(frac, abs=0.01)


def test_locality_excludes_segment_boundaries_and_invalid():
    # First choices: 1 1 | 1 1 pad; same expert everywhere, but only (0,1) and (2,3) are real pairs.
    ids_BxSxK = np.array([[[1, 2], [1, 3], [1, 4], [1, 5], [1, 6]]], np.int32)
    seg_BxS = np.array([[0, 0, 1, 1, 1]])
    valid_BxS = np.array([[True, True, True, True, False]])
    acc = _acc()
    acc.update([ids_BxSxK], np.zeros((1, 5), int), np.zeros((1, 5), int), valid_BxS, seg_BxS)
    assert acc.n_pairs == 2
    # Now make the cross-boundary and padding pairs the only disagreeing ones: locality stays 1.
    ids_BxSxK = np.array([[[1, 2], [1, 2], [4, 5], [4, 5], [7, 0]]], np.int32)
    acc = _acc()
    acc.update([ids_BxSxK], np.zeros((1, 5), int), np.zeros((1, 5), int), valid_BxS, seg_BxS)
    out = acc.finalize()
    assert out["loc_first_L"][0] == 1.0 and out["loc_any_L"][0] == 1.0
    assert out["n_tokens"] == 4 and out["load_LxE"][0, 7] == 0


def test_coactivation_hand_built():
    ids_NxK = np.array([[0, 1], [0, 1], [0, 2], [3, 1]], np.int32)[None]  # one row of 4 tokens
    acc = _acc()
    acc.update([ids_NxK], np.zeros((1, 4), int), np.zeros((1, 4), int))
    coact_ExE = acc.finalize()["coact_LxExE"][0]
    assert coact_ExE[0, 1] == pytest.approx(2 / 3) and coact_ExE[0, 2] == pytest.approx(1 / 3)
    assert coact_ExE[1, 0] == pytest.approx(2 / 3) and coact_ExE[1, 3] == pytest.approx(1 / 3)
    assert coact_ExE[2, 0] == 1.0 and coact_ExE[3, 1] == 1.0
    assert np.all(np.diag(coact_ExE) == 0) and np.all(coact_ExE[4:] == 0)
    np.testing.assert_allclose(coact_ExE[:4].sum(-1), K - 1)


def test_favourite_agreement_hand_case():
    # 4 eligible ids (n >= 10) and one rare id; favourites a = [0, 1, 1, 2], b = [0, 2, 1, 2] -> 3 of 4 agree.
    # Marginals over the 4 ids: a (1/4, 2/4, 1/4), b (1/4, 1/4, 2/4) over experts 0..2 -> chance
    # 1/16 + 2/16 + 2/16 = 5/16.
    fav_a, fav_b = [0, 1, 1, 2, 0], [0, 2, 1, 2, 1]
    a, b = np.zeros((1, 5, 3)), np.zeros((1, 5, 3))
    for v in range(5):
        a[0, v, fav_a[v]], b[0, v, fav_b[v]] = 7, 7
    agree, chance, n = rs.favourite_agreement(a, b, np.array([10, 12, 10, 30, 9]))
    assert n == 4 and agree[0] == pytest.approx(0.75) and chance[0] == pytest.approx(5 / 16)
    assert np.isnan(rs.favourite_agreement(a, b, np.zeros(5))[0]).all()


def test_vocab_specialization_threshold():
    # Token 5: 10 occurrences, always (2, x) -> max expert 2 gets 10 of 20 assignments = 0.5.
    # Token 6: 10 occurrences, always (4, 7) -> 0.5 as well; token 7: 9 occurrences -> excluded.
    tokens_S = np.array([5] * 10 + [6] * 10 + [7] * 9)
    ids_SxK = np.array([[2, e] for e in [0, 1, 3, 4, 5, 6, 7, 0, 1, 3]] + [[4, 7]] * 10 + [[1, 1]] * 9)
    acc = _acc(vocab=8, track_tokens=[5, 7])
    acc.update([ids_SxK[None]], tokens_S[None], np.zeros((1, len(tokens_S)), int))
    out = acc.finalize()
    assert out["vocab_n_eligible"] == 2
    assert out["vocab_spec_L"][0] == pytest.approx(0.5)
    assert out["vocab_spec_LxE"][0, 2] == pytest.approx(0.5)
    assert np.isnan(out["vocab_spec_LxE"][0, 1])  # token 7 would make expert 1 fully specialized
    assert list(out["freq_ids_N"][:2]) == [5, 6] and out["freq_n_N"][0] == 10
    assert out["track_share_TxLxE"][1, 0, 1] == 2.0  # [1, 1] counts twice (not a valid top-k, but counted)
    assert out["track_share_TxLxE"][0, 0, 2] == 1.0


def test_maxvio_and_dead_experts():
    load_LxE = np.array([[4, 4, 4, 4], [8, 4, 4, 0]])
    np.testing.assert_allclose(router.max_violation(load_LxE), [0.0, 1.0])
    assert rs.dead_experts(load_LxE) == [[], [3]]


def test_saturation():
    rng = np.random.default_rng(1)
    final_BxSxK = _random_ids(rng, (2, 6))
    disjoint_BxSxK = np.stack([np.setdiff1d(np.arange(E), t)[:K] for t in final_BxSxK.reshape(-1, K)])
    acc = rs.SaturationAccumulator(2)
    acc.update([final_BxSxK, final_BxSxK], [final_BxSxK, disjoint_BxSxK.reshape(2, 6, K)])
    np.testing.assert_allclose(acc.finalize()["saturation_L"], [1.0, 0.0])
    assert rs.saturation([[0, 1]], [[1, 5]]) == 0.5


def test_streaming_equals_one_batch():
    rng = np.random.default_rng(2)
    B, S, L = 6, 12, 2
    ids_LxBxSxK = _random_ids(rng, (L, B, S))
    gates_LxBxSxK = rng.random((L, B, S, K))
    tokens_BxS, domains_BxS = rng.integers(0, 16, (B, S)), rng.integers(0, 3, (B, S))
    valid_BxS, seg_BxS = rng.random((B, S)) > 0.1, np.cumsum(rng.random((B, S)) > 0.8, -1)
    whole, streamed = _acc(L, 3, track_tokens=[1, 2]), _acc(L, 3, track_tokens=[1, 2])
    routing = lambda sl: [{"expert_ids": ids_LxBxSxK[i, sl], "gates": gates_LxBxSxK[i, sl]} for i in range(L)]
    whole.update(routing(slice(None)), tokens_BxS, domains_BxS, valid_BxS, seg_BxS)
    for sl in (slice(0, 1), slice(1, 4), slice(4, 6)):
        streamed.update(routing(sl), tokens_BxS[sl], domains_BxS[sl], valid_BxS[sl], seg_BxS[sl])
    a, b = whole.finalize(), streamed.finalize()
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], err_msg=key)
    json.dumps(rs.to_jsonable(a))
    summary = rs.summary_text(a, ["a", "b", "c"], layer=0)
    assert "maxvio" in summary and "layer 0 b: e" in summary


def test_read_maxvio_series(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 10, "moe/layer_0/maxvio": 2.0, "moe/layer_1/maxvio": 3.0, "loss": 1.0},
            {"step": 20, "loss": 0.9},
            {"step": 30, "moe/layer_0/maxvio": 1.0, "moe/layer_1/maxvio": 0.5}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    series = rs.read_maxvio_series(path)
    assert list(series) == [0, 1]
    np.testing.assert_array_equal(series[0][0], [10, 30])
    np.testing.assert_array_equal(series[1][1], [3.0, 0.5])
    assert rs.read_maxvio_series(path, key_pattern=r"moe/layer_(1)/maxvio").keys() == {1}


def test_bad_domain_is_one_line_error():
    with pytest.raises(ValueError, match="domain ids"):
        _acc().update([np.zeros((1, 2, K), int)], np.zeros((1, 2), int), np.full((1, 2), 9))
