"""The chance levels beside every routing figure can fail: the load-matched null, the token-identity null and the
untrained router. The exact nulls of analysis.routing.nulls equal the mean of the permutations the specialization
command draws; a routing that is a function of the token id reads exactly its token-identity null (however much
domain information it carries), and one with domain or context structure beyond the token id is above it."""

import json

import numpy as np
import pytest

from analysis.routing import collect, outputs, step0
from analysis.routing import stats as rs
from analysis.routing.nulls import PairCounts, load_matched_locality, token_null_locality
from analysis.specialization import baselines, compare
from rundir import open_run


def _record(tokens_BxS, domains_BxS, ids_BxSxK, n_experts, vocab, segment_ids_BxS=None):
    """A RoutingRecord of one batch and one MoE layer, every token valid."""
    ids = np.asarray(ids_BxSxK, np.int16)
    shape = ids.shape[:2]
    batch = {"tokens": np.asarray(tokens_BxS), "domains": np.asarray(domains_BxS), "valid": np.ones(shape, bool),
             "segment_ids": np.ones(shape, np.int32) if segment_ids_BxS is None else np.asarray(segment_ids_BxS),
             "ids": [ids], "gates": [np.ones(ids.shape, np.float32)]}
    return baselines.RoutingRecord([batch], ["a", "b"], n_experts, ids.shape[-1], vocab_size=vocab)


def _top_k(logits_BxSxE, k):
    return np.argsort(-logits_BxSxE, -1)[..., :k]


def _aggregate(record, n_shuffles=20):
    """(trained headline, compare.aggregate of the record as one run); its "step 0" a router of random ids."""
    rng = np.random.default_rng(99)
    batch = record.batches[0]
    shape = batch["ids"][0].shape
    untrained = _record(batch["tokens"], batch["domains"], _top_k(rng.random(shape[:2] + (record.n_experts,)),
                                                                  shape[-1]), record.n_experts, record.vocab_size)
    trained = baselines.headline(baselines.accumulate(record))
    return trained, compare.aggregate([{
        "trained": trained, "step0": baselines.headline(baselines.accumulate(untrained)),
        "random": baselines.random_router(record, n_shuffles, seed=0),
        "token_null": baselines.token_null(record, n_shuffles, seed=0)}])


def test_hand_cases():
    # Loads 3 and 1 of 4 tokens: 3 * 2 / (4 * 3) of the ordered pairs of distinct tokens share a first choice.
    assert load_matched_locality([3, 1], [3, 1], 1) == pytest.approx((0.5, 0.5))
    # One pair (u=0, v=1); u always goes to expert 0, v half to 0 and half to 1: P = 1 * 0.5.
    first_VxE = np.array([[2, 0], [1, 1]])
    assert token_null_locality(first_VxE, first_VxE, [2, 2], [0 * 2 + 1], [1], 2, 1)[0] == pytest.approx(0.5)
    # A pair of two occurrences of one id with counts (1, 1): the other occurrence is the other expert, P = 0.
    assert token_null_locality(first_VxE, first_VxE, [2, 2], [1 * 2 + 1], [1], 2, 1)[0] == 0.0


def test_pair_counts_merge_equals_one_count():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 7, 50)
    pc = PairCounts(merge_every=3)
    for chunk in np.array_split(keys, 9):
        pc.add(chunk)
    k, c = pc.merge()
    np.testing.assert_array_equal(k, np.unique(keys))
    np.testing.assert_array_equal(c, np.bincount(keys)[np.unique(keys)])


def test_exact_nulls_are_the_means_of_the_permutations():
    """The streamed exact expectations (stats) against the permutations analysis.specialization draws."""
    rng = np.random.default_rng(1)
    E, K, V, B, S = 6, 2, 5, 4, 40
    tokens = rng.integers(0, V, (B, S))
    seg = np.where(np.arange(S) < 25, 1, 2)[None].repeat(B, 0)
    # Token preference, plus noise that persists along the row (context): both nulls sit below the trained value.
    noise = np.cumsum(rng.normal(0, 1, (B, S, E)), 1) * 0.5
    ids = _top_k(2.0 * (np.arange(E) == tokens[..., None] % E) + noise, K)
    record = _record(tokens, np.zeros((B, S), int), ids, E, V, seg)
    exact = baselines.accumulate(record)
    for within, key in ((False, "loadmatched"), (True, "tokennull")):
        draws = np.array([[(r := baselines.accumulate(record, rng=rng, within_tokens=within))["loc_first_L"][0],
                           r["loc_overlap_L"][0]] for _ in range(300)])
        mean, se = draws.mean(0), draws.std(0) / np.sqrt(len(draws))
        for i, m in enumerate(("first", "overlap")):
            assert abs(mean[i] - exact[f"{key}_{m}_L"][0]) < 4 * se[i] + 1e-9, (key, m, mean[i])
    assert exact["loc_first_L"][0] > exact["tokennull_first_L"][0] + 0.1  # the context is beyond the token id


def test_permutation_within_tokens_moves_sets_only_among_one_ids_occurrences():
    rng = np.random.default_rng(2)
    tok_N = rng.integers(0, 4, 200)
    perm_N = baselines._within(tok_N, rng)
    assert sorted(perm_N) == list(range(200))
    np.testing.assert_array_equal(tok_N[perm_N], tok_N)
    assert (perm_N != np.arange(200)).mean() > 0.5


def _two_domains(rng, B=8, S=64, V=16):
    domains = np.repeat(np.arange(B) % 2, S).reshape(B, S)
    return domains, V, B, S


def test_token_function_routing_does_not_beat_the_token_null():
    """Domain a draws tokens 0-7, domain b 8-15; the first choice is token id // 2. Routing carries a full bit of domain
    information and beats the load-matched null by far, but it is token identity only: every permutation within
    token ids reproduces it, so the token-identity null equals it and the trained value is not above it."""
    rng = np.random.default_rng(3)
    domains, V, B, S = _two_domains(rng)
    tokens = rng.integers(0, 8, (B, S)) + 8 * domains
    first = tokens // 2  # experts 0-3 in domain a, 4-7 in domain b
    record = _record(tokens, domains, np.stack([first, (first + 1) % 8], -1), 8, V)
    trained, agg = _aggregate(record)
    null = baselines.token_null(record, 20, seed=0)
    assert trained["domain_mi_bits"][0] == pytest.approx(1.0)
    assert agg["domain_mi_bits"]["random"]["above"][0][0]  # the load-matched null is fooled ...
    for name in ("domain_mi_bits", "top1_max_share", "loc_first"):  # ... the token-identity null is not
        np.testing.assert_allclose(null[name][:, 0], trained[name][0], err_msg=name)
        assert not agg[name]["token_null"]["above"][0][0], name
    exact = baselines.accumulate(record)
    assert exact["tokennull_first_L"][0] == pytest.approx(exact["loc_first_L"][0])
    assert exact["tokennull_overlap_L"][0] == pytest.approx(exact["loc_overlap_L"][0])
    assert agg["vocab_spec"]["token_null"]["kept_by_construction"] and agg["vocab_spec"]["token_null"]["above"] is None


def test_noisy_token_routing_stays_inside_the_token_null():
    """The expert is the token's with probability 0.7, else one of 8 at random (independent of the domain): no
    structure beyond the token id, and the trained values lie inside the token-identity null's band."""
    rng = np.random.default_rng(4)
    domains, V, B, S = _two_domains(rng)
    tokens = rng.integers(0, 12, (B, S)) + 4 * domains  # overlapping vocabularies
    first = np.where(rng.random((B, S)) < 0.7, tokens % 8, rng.integers(0, 8, (B, S)))
    ids = np.stack([first, (first + 1) % 8], -1)
    trained, agg = _aggregate(_record(tokens, domains, ids, 8, V), n_shuffles=40)
    for name in ("domain_mi_bits", "top1_max_share", "loc_first"):
        null = agg[name]["token_null"]
        assert null["low"][0] <= trained[name][0] <= null["high"][0], (name, trained[name][0], null)


def test_domain_specialization_beyond_token_identity_beats_the_token_null():
    """Both domains draw the same tokens; the first choice is token id % 4 in domain a, 4 + token id % 4 in b.
    Token identity explains nothing of the domain difference: the trained mutual information (1 bit: the
    domain is read off any token's expert) is far above the token-identity null, which is far above zero only
    by finite-sample bias."""
    rng = np.random.default_rng(5)
    domains, V, B, S = _two_domains(rng)
    tokens = rng.integers(0, V, (B, S))
    first = tokens % 4 + 4 * domains
    ids = np.stack([first, (first + 1) % 8], -1)
    trained, agg = _aggregate(_record(tokens, domains, ids, 8, V))
    mi = agg["domain_mi_bits"]
    assert trained["domain_mi_bits"][0] > 0.9 and mi["token_null"]["high"][0] < 0.1
    assert mi["token_null"]["above"][0][0] and mi["random"]["above"][0][0]


def test_context_locality_beats_the_token_null():
    """One expert per document, tokens at random: consecutive tokens always share their first choice, which
    no token-id permutation keeps (the exact token null is the load-matched level); the same tokens routed by
    id alone read exactly their token null."""
    rng = np.random.default_rng(6)
    B, S, V, E = 8, 64, 16, 8
    tokens = rng.integers(0, V, (B, S))
    doc_expert = rng.integers(0, E, (B, 1)).repeat(S, 1)
    acc = rs.RoutingAccumulator(1, E, 1, 1, V)
    acc.update([doc_expert[..., None]], tokens, np.zeros((B, S), int))
    out = acc.finalize()
    assert out["loc_first_L"][0] == 1.0
    assert out["tokennull_first_L"][0] < 0.35 and abs(out["tokennull_first_L"][0] - out["loadmatched_first_L"][0]) < 0.1
    acc = rs.RoutingAccumulator(1, E, 1, 1, V)
    acc.update([(tokens % E)[..., None]], tokens, np.zeros((B, S), int))
    out = acc.finalize()
    assert out["tokennull_first_L"][0] == pytest.approx(out["loc_first_L"][0])


def test_untrained_router_is_the_initialization_without_a_step0_checkpoint(tiny_run):
    run = open_run(tiny_run, 10, log=lambda *a: None)
    model, source = step0.untrained(run)
    assert "fresh initialization" in source and f"seed {run.config.train.seed}" in source
    assert baselines.init_model is step0.init_model and model.cfg == run.model.cfg


def test_routing_json_has_every_chance_level_and_provenance(tiny_run, tmp_path):
    run = open_run(tiny_run, 20, log=lambda *a: None)
    a = collect.analyse(run, max_tokens=256, progress=False)
    outputs.write_run_outputs(a, tmp_path, run, tiny_run, 0, max_tokens=256)
    doc = json.loads((tmp_path / "routing.json").read_text())
    assert set(doc["provenance"]) == {"commit", "jax", "machine"} and "fresh initialization" in doc["step0_source"]
    cell = doc["locality"]["layer 1"]["first"]
    assert set(cell) == {"trained", "uniform", "load_matched_null", "token_identity_null", "step0"}
    assert cell["uniform"] == pytest.approx(1 / run.model.cfg.n_routed_experts)
    assert cell["step0"] != cell["trained"] and 0 < cell["load_matched_null"] < 1
    assert set(doc["locality"]["layer 1"]["any"]) == {"trained", "uniform", "step0"}  # no exact null for it
    assert (tmp_path / "locality.png").stat().st_size > 10_000


def test_specialization_json_has_both_nulls_step0_source_and_provenance(tiny_run):
    run = open_run(tiny_run, 20, log=lambda *a: None)
    measured = compare.measure(run, None, 128, 3)
    doc = compare.document([run], [measured], None, 128, 3)
    assert set(doc["provenance"]) == {"commit", "jax", "machine"} and "fresh initialization" in doc["step0_source"][0]
    m = doc["metrics"]
    assert m["vocab_spec"]["token_null"]["low"] == pytest.approx(m["vocab_spec"]["trained"]["mean"])
    assert m["domain_mi_bits"]["token_null"]["above"] is not None and m["domain_mi_bits"]["token_null"]["n"] == 3
    assert "token-identity null" in compare.table(doc)


def test_domain_share_nulls():
    """The token-identity null of the domain shares is the mean share under permutations within token ids; it
    equals the trained share for routing by token id and misses a domain shift the token ids do not explain."""
    rng = np.random.default_rng(7)
    domains, V, B, S = _two_domains(rng)
    tokens = rng.integers(0, 12, (B, S)) + 4 * domains
    for shift, equal in ((0, True), (4, False)):
        first = (tokens + shift * domains) % 8
        record = _record(tokens, domains, np.stack([first, (first + 3) % 8], -1), 8, V)
        exact = baselines.accumulate(record)
        draws = np.mean([baselines.accumulate(record, rng=rng, within_tokens=True)["share_LxDxE"]
                         for _ in range(200)], 0)
        np.testing.assert_allclose(exact["tokennull_share_LxDxE"], draws, atol=0.01)
        np.testing.assert_allclose(exact["tokennull_share_LxDxE"].sum(-1), 2.0)
        assert np.allclose(exact["tokennull_share_LxDxE"], exact["share_LxDxE"]) == equal
        np.testing.assert_allclose(exact["loadmatched_share_LxE"][0], exact["load_LxE"][0] / exact["n_tokens"])
