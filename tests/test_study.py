"""The mask study's runner and report pieces on tiny, synthetic inputs: n-gram references on the scored targets,
the gate and verdict logic, the report (files, "not interpretable" when the gate fails), the runner's flags."""

import json

import numpy as np
import pytest

from experiments.common import stats as study_stats
from experiments.common import verdicts as study_verdicts
from experiments.common.refs import references, scored_pairs
from experiments.masks_round2 import report as study_report
from experiments.masks_round2 import runner as study
from train import ngram
from train.data.packing import TokenCache, prefix_rows


@pytest.fixture(scope="module")
def rows():
    lengths = [12, 5, 30, 9, 7, 20]
    toks = (np.arange(sum(lengths)) * 7 % 50 + 3).astype(np.uint16)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    cache = TokenCache(toks, offsets, np.array([0, 0, 0, 1, 1, 1], np.int32), ("a", "b"))
    return prefix_rows(cache, 16, seed=0, start=0, count=6, prefix_frac=0.5)


def test_pair_references_equal_stream_references():
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 20, 3000), rng.integers(0, 20, 400)
    a = ngram.ngram_references(train, val, 20)
    b = ngram.ngram_pair_references(train, val[:-1], val[1:], 20)
    assert a["bigram"] == pytest.approx(b["bigram"]) and a["bigram_lambda"] == b["bigram_lambda"]
    # the unigram of the stream scores val[1:] and val[0] too: close, not equal
    assert a["unigram"] == pytest.approx(b["unigram"], abs=0.05)


def test_scored_pairs_are_exactly_the_loss_masked_targets(rows):
    prev, nxt, dom = scored_pairs(rows)
    assert len(nxt) == int(rows["loss_mask"].sum())
    b, i = np.nonzero(rows["loss_mask"])
    np.testing.assert_array_equal(prev, rows["tokens"][b, i])
    np.testing.assert_array_equal(nxt, rows["targets"][b, i])
    assert set(dom.tolist()) == {0, 1}


def test_references_per_domain_average_to_the_total(rows):
    train = (np.arange(5000) * 7 % 50 + 3).astype(np.int64)  # the same periodic text: a bigram predicts it
    refs = references(train, rows, 64, ("a", "b"))
    assert refs["bigram"] < refs["unigram"] - 1.0
    _, _, dom = scored_pairs(rows)
    w = np.bincount(dom) / len(dom)
    avg = sum(w[d] * refs["by_domain"][n]["bigram"] for d, n in enumerate(("a", "b")))
    assert avg == pytest.approx(refs["bigram"], rel=1e-9)


def test_paired_t_p_at_the_tables_critical_value():
    # mean / (sd / sqrt(3)) = 4.303 is the two-sided 5% critical t for df = 2
    d = np.array([-1.0, 0.0, 1.0]) + 4.302653 / np.sqrt(3)
    assert study_stats.paired_t_p(d) == pytest.approx(0.05, abs=1e-4)
    assert study_stats.paired_t_p([0.1, -0.1, 0.2, -0.2]) > 0.9


def fake_result(arm, seed, loss, gap=0.3, acc=0.5):
    return {"arm": arm, "seed": seed, "val_loss": loss, "input_replacement_gap": gap, "input_shuffle_gap": 0.05,
            "choice_accuracy": acc, "choice_chance": 0.25, "choice_n": 8, "train_seconds": 1.0, "steps": 10,
            "tokens_seen": 100, "val_curve": [(5, loss + 0.5), (10, loss)],
            "val_loss_by_domain": {"a": loss - 0.1, "b": loss + 0.1}}


REFS = {"unigram": 6.0, "bigram": 5.0, "bigram_lambda": 0.5,
        "by_domain": {"a": {"unigram": 6.1, "bigram": 4.9}, "b": {"unigram": 5.9, "bigram": 5.1}}}
OFFSETS = [0.01, -0.012, 0.004, -0.003]


def results(causal=4.5, gap=0.3, prefix_shift=-0.2, mixed_shift=0.0):
    out = []
    for s, o in enumerate(OFFSETS):
        out += [fake_result("causal", s, causal + o, gap), fake_result("prefix", s, causal + o + prefix_shift + o / 5, gap),
                fake_result("mixed", s, causal + o + mixed_shift + o / 5, gap)]
    return out


def test_family_verdicts_gates_and_holm_across_the_family():
    groups = study_verdicts.by_arm(results())
    g = study_verdicts.study_gate(groups, REFS)
    assert g["passed"] and all(g["per_seed"].values())
    rows = study_verdicts.decide(study_verdicts.masks_family(groups, REFS["bigram"]))
    # declared order: the loss tests, then the accuracy tests, of the arms present
    assert [r["contrast"] for r in rows] == ["prefix - causal", "mixed - causal",
                                             "prefix - causal, 4-way choice accuracy",
                                             "mixed - causal, 4-way choice accuracy"]
    by = {r["contrast"]: r for r in rows}
    assert by["prefix - causal"]["verdict"] == "prefix better" and by["prefix - causal"]["wins"] == 4
    assert by["mixed - causal"]["verdict"] == "equivalent"
    # the margin is a tenth of causal's distance below the bigram (5.0 - 4.49975), not a fixed 0.02
    assert by["mixed - causal"]["margin"] == pytest.approx(0.1 * (5.0 - np.mean([4.5 + o for o in OFFSETS])))
    assert by["prefix - causal"]["p_holm"] == pytest.approx(min(1.0, 4 * by["prefix - causal"]["p"]))  # 4 tests
    # the causal model barely beats the bigram: nothing against causal is interpreted, however clear the differences
    groups = study_verdicts.by_arm(results(causal=4.9))
    rows = study_verdicts.decide(study_verdicts.masks_family(groups, REFS["bigram"]))
    assert {r["verdict"] for r in rows} == {"not interpretable"}
    # it beats the bigram but ignores its input
    g = study_verdicts.study_gate(study_verdicts.by_arm(results(gap=0.05)), REFS)
    assert not g["passed"] and g["beats_bigram_by"] > 0.3


def test_noisy_small_difference_is_null():
    rs = [fake_result("causal", s, 4.5) for s in range(4)]
    rs += [fake_result("prefix", s, 4.5 + d) for s, d in enumerate([0.05, -0.04, 0.03, -0.01])]
    (row, _) = study_verdicts.decide(study_verdicts.masks_family(study_verdicts.by_arm(rs), REFS["bigram"]))
    assert row["verdict"] == "null" and row["p_equiv_holm"] >= 0.05


def test_each_test_is_gated_on_its_own_reference_arm():
    """causal_nope - causal passes on causal's gate; prefix_nope - prefix fails when prefix learned nothing."""
    rs = []
    for s, o in enumerate(OFFSETS):
        rs += [fake_result("causal", s, 4.5 + o), fake_result("prefix", s, 4.9 + o),
               fake_result("causal_nope", s, 4.7 + o + o / 3), fake_result("prefix_nope", s, 4.95 + o / 2)]
    rows = {r["contrast"]: r for r in study_verdicts.decide(study_verdicts.masks_family(study_verdicts.by_arm(rs),
                                                                                        REFS["bigram"]))}
    assert rows["causal_nope - causal"]["verdict"] == "causal_nope worse"
    assert rows["prefix_nope - prefix"]["verdict"] == "not interpretable"
    assert rows["(causal_nope - causal) - (prefix_nope - prefix)"]["verdict"] == "not interpretable"


def test_report_files_and_gate_wording(tmp_path):
    base = {"model": {"d_model": 8, "n_layers": 2, "first_k_dense": 1, "n_heads": 2, "n_kv_heads": 1,
                      "head_dim": 4, "n_routed_experts": 4, "top_k": 2, "n_shared_experts": 1, "vocab_size": 64},
            "data": {"tokenizer": "", "name": "x", "seq_len": 16, "prefix_frac": 0.5},
            "train": {"batch_size": 2, "lr": 1e-3, "warmup_steps": 1, "schedule": "cosine"},
            "eval": {"every": 5, "rows_per_domain": 2}}
    path = study_report.write_report(results(causal=4.9), REFS, tmp_path / "r", base)
    text = path.read_text()
    assert "**not interpretable**" in text and "prefix better" not in text
    assert "| +0.0500 | - |" in text  # input-shuffle gap, then no input-order gap in these older results
    for png in ("val_curves", "paired_loss", "domains", "probes"):
        assert (tmp_path / "r" / f"{png}.png").stat().st_size > 1000
    assert "lr 0.001, warmup" in text
    text = study_report.write_report(results(), REFS, tmp_path / "r2", base).read_text()
    assert "**interpretable**" in text and "**prefix better**" in text
    # arms at their own rates: the setup line does not claim the config's rate
    chosen = {arm: {"lr": 3e-3, "losses": {1e-3: 4.0, 3e-3: 3.9}, "at_edge": True} for arm in ("causal", "prefix")}
    text = study_report.write_report(results(), REFS, tmp_path / "r3", base, lr_choice=chosen).read_text()
    assert "each arm at its own learning rate (below), warmup" in text and "lr 0.001," not in text
    assert "| causal | 4.0000 | **3.9000** | 0.003 (edge) |" in text


def test_report_cli_from_a_study_directory(tmp_path, capsys):
    out = tmp_path / "study"
    for r in results()[:6]:
        (out / r["arm"] / f"seed{r['seed']}").mkdir(parents=True)
        (out / r["arm"] / f"seed{r['seed']}" / "result.json").write_text(json.dumps(r))
    (out / "references.json").write_text(json.dumps(REFS))
    base = {"model": {"d_model": 8, "n_layers": 2, "first_k_dense": 1, "n_heads": 2, "n_kv_heads": 1,
                      "head_dim": 4, "n_routed_experts": 4, "top_k": 2, "n_shared_experts": 1, "vocab_size": 64},
            "data": {"tokenizer": "", "name": "x", "seq_len": 16, "prefix_frac": 0.5},
            "train": {"batch_size": 2, "lr": 1e-3, "warmup_steps": 1, "schedule": "cosine"},
            "eval": {"every": 5, "rows_per_domain": 2}}
    (out / "study.json").write_text(json.dumps({"arms": ["causal", "prefix", "mixed"], "seeds": 4, "config": base}))
    study_report.main(["--out", str(out)])
    text = (out / "report" / "report.md").read_text()
    assert "Partial study" in text and "mixed seed 3" in text
    with pytest.raises(SystemExit) as e:
        study_report.main(["--out", str(tmp_path / "nothing")])
    assert e.value.code == 2 and "not a study directory" in capsys.readouterr().err


@pytest.mark.parametrize("flags,msg", [(["--arms", "prefix,mixed"], "including causal"),
                                       (["--arms", "causal,bidirectional"], "--arms"),
                                       (["--seeds", "1"], "--seeds"), (["--steps", "0"], "--steps"),
                                       (["--probe_rows", "4,4"], "--probe_rows")])
def test_bad_flags_are_one_line_errors(flags, msg, capsys):
    with pytest.raises(SystemExit) as e:
        study.main(["prog", *flags])
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_arm_configs_differ_only_in_mask_and_loss():
    from experiments.masks_round2.config import get_config

    base = get_config()
    cs = {a: study.arm_config(base, a, 1, 7).to_dict() for a in study.ARMS}
    assert not cs["prefix_nope"]["model"]["rope"] and cs["prefix"]["model"]["rope"]
    assert cs["causal_all"]["train"]["prefix_loss"] and cs["causal_all"]["model"]["mask"] == "causal"
    assert cs["causal_half"]["train"]["equal_targets"] and cs["causal_half"]["train"]["prefix_loss"]
    assert sum(c["train"]["equal_targets"] for c in cs.values()) == 1
    for a, c in cs.items():
        c["model"].pop("mask")
        c["train"].pop("prefix_loss")
        c["train"].pop("equal_targets")
        c["model"].pop("rope")
        assert c == cs["causal"], a


def test_equal_targets_keep_as_many_targets_as_the_output_part_spread_over_the_window():
    from train.inputs import PrefixSampler

    lengths = [40, 25, 64, 33, 50, 47]
    toks = (np.arange(sum(lengths)) * 7 % 50 + 3).astype(np.uint16)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    cache = TokenCache(toks, offsets, np.zeros(6, np.int32), ("a",))
    out = PrefixSampler(cache, 32, 0, 0.5, False).rows(0, 6)
    every = PrefixSampler(cache, 32, 0, 0.5, True).rows(0, 6)
    half = PrefixSampler(cache, 32, 0, 0.5, True, equal_targets=True)
    eq = half.rows(0, 6)
    assert (eq["loss_mask"].sum(-1) == out["loss_mask"].sum(-1)).all()  # the count of output-only
    assert (eq["loss_mask"] <= every["loss_mask"]).all()  # only real targets
    on_input = (eq["loss_mask"] * (1 - out["loss_mask"])).sum()
    assert 0 < on_input < eq["loss_mask"].sum()  # spread over the input and the output, not moved to either
    # a row's subset depends on (seed, row) alone: the same in any batch split, different for another seed
    assert (half.rows(2, 3)["loss_mask"] == eq["loss_mask"][2:5]).all()
    assert (PrefixSampler(cache, 32, 1, 0.5, True, equal_targets=True).rows(0, 6)["loss_mask"] != eq["loss_mask"]).any()
    assert len({tuple(np.nonzero(m)[0][:4]) for m in eq["loss_mask"]}) > 1


def test_equal_targets_needs_prefix_loss():
    from experiments.masks_round2.config import get_config
    from plumbing.errors import UserError
    from train.preflight import parse

    c = get_config()
    c.train.equal_targets = True
    with pytest.raises(UserError, match="train.prefix_loss=True"):
        parse(c)
    c.train.prefix_loss = True
    parse(c)


def test_equal_targets_tests_split_causal_alls_gain(tmp_path):
    rs = []
    for s, o in enumerate(OFFSETS):
        rs += [fake_result("causal", s, 4.5 + o), fake_result("causal_all", s, 4.2 + o + o / 4),
               fake_result("causal_half", s, 4.5 + o - o / 3)]
    rows = study_verdicts.decide(study_verdicts.masks_family(study_verdicts.by_arm(rs), REFS["bigram"]))
    by = {r["contrast"]: r for r in rows}
    assert [r["contrast"] for r in rows if "accuracy" not in r["contrast"]] == [
        "causal_all - causal", "causal_half - causal", "causal_all - causal_half"]
    assert by["causal_all - causal_half"]["verdict"] == "causal_all better"
    assert by["causal_all - causal_half"]["mean"] == pytest.approx(-0.3, abs=0.001)
    assert by["causal_half - causal"]["verdict"] in ("equivalent", "null") and abs(by["causal_half - causal"]["mean"]) < 0.01
    base = {"model": {"d_model": 8, "n_layers": 2, "first_k_dense": 1, "n_heads": 2, "n_kv_heads": 1,
                      "head_dim": 4, "n_routed_experts": 4, "top_k": 2, "n_shared_experts": 1, "vocab_size": 64},
            "data": {"tokenizer": "", "name": "x", "seq_len": 16, "prefix_frac": 0.5},
            "train": {"batch_size": 2, "lr": 1e-3, "warmup_steps": 1, "schedule": "cosine"},
            "eval": {"every": 5, "rows_per_domain": 2}}
    text = study_report.write_report(rs, REFS, tmp_path / "r", base).read_text()
    assert "## The family under docs/inference.md's rules" in text and "| causal_all - causal_half | 4 | -0.3" in text
    saved = json.loads((tmp_path / "r" / "results.json").read_text())
    assert "causal_all - causal_half" in [r["contrast"] for r in saved["family"]]


def test_first_rows_per_domain(rows):
    sub = study.first_rows_per_domain(rows, 2)
    assert sub["domains"][:, 0].tolist() == [0, 0, 1, 1]


def test_token_weighted_equals_the_pooled_loss(rows):
    rng = np.random.default_rng(0)
    ce_BxL = rng.random(rows["loss_mask"].shape) * rows["loss_mask"]
    n = rows["loss_mask"].sum(-1)
    loss, by_dom = study.token_weighted(ce_BxL.sum(-1) / n, rows)
    assert loss == pytest.approx(ce_BxL.sum() / n.sum())
    d0 = rows["domains"][:, 0] == 0
    assert by_dom[0] == pytest.approx(ce_BxL[d0].sum() / n[d0].sum())


@pytest.mark.slow  # trains 2 arms x 2 seeds of the tiny model for 2 steps, probes 3 windows per domain
def test_study_end_to_end_and_cached(tmp_path, monkeypatch):
    from experiments.common import rows as study_rows
    from tests.conftest import tiny_config

    # the final loss and probes on 3 windows per domain (the curve's 2 plus one), not on all ~8,000 32-token
    # validation windows: scoring those was over a third of this test
    monkeypatch.setattr(study, "all_rows", lambda c: study_rows.first_rows_per_domain(study_rows.all_rows(c), 3))
    base = tiny_config(**{"data.task": "prefix", "data.windows": True, "data.tokenizer": "tokenizer_1k.json",
                          "model.vocab_size": 1024, "data.seq_len": 32, "eval.every": 1, "eval.output_only": True,
                          "eval.rows_per_domain": 2, "checkpoint.every": 100})
    logs = []
    report = study.run_study(base, ["causal", "causal_all"], 2, 2, tmp_path, log=lambda m: (print(m), logs.append(m)),
                             sizes=(2, 2, 2))
    text = report.read_text()
    assert "not interpretable" in text  # 2 steps cannot beat a bigram
    r = json.loads((tmp_path / "causal_all" / "seed1" / "result.json").read_text())
    assert r["prefix_loss"] and r["n_val_rows"] == 9 * 3 and [s for s, _ in r["val_curve"]] == [1, 2]
    assert 0 <= r["choice_accuracy"] <= 1 and r["n_gap_rows"] == 18
    assert np.isfinite(r["input_order_gap"])
    # a result from before the input-order probe: re-running adds it from the checkpoint, the same number
    old = dict(r)
    del old["input_order_gap"]
    (tmp_path / "causal_all" / "seed1" / "result.json").write_text(json.dumps(old))
    logs.clear()
    study.run_study(base, ["causal", "causal_all"], 2, 2, tmp_path, log=logs.append, sizes=(2, 2, 2))
    assert sum("cached" in line for line in logs) == 4 and sum("input_order_gap" in line for line in logs) == 1
    again = json.loads((tmp_path / "causal_all" / "seed1" / "result.json").read_text())
    assert again["input_order_gap"] == pytest.approx(r["input_order_gap"], abs=1e-6)


@pytest.mark.slow  # compiles the tiny NoPE model twice (~30 s each on the shared CPU)
@pytest.mark.parametrize("mask,invariant", [("prefix", True), ("causal", False)])
def test_nope_prefix_lm_is_exactly_invariant_to_shuffling_its_input(mask, invariant, rows):
    """Item 7: without positions, bidirectional attention over the input is permutation-equivariant, so the loss of
    every output token predicted from an output position cannot depend on the input's order; a causal model's can.
    (The first output token is predicted from the last input position, whose token the shuffle changes.)"""
    from experiments.common.probes import row_losses, shuffle_inputs
    from tests.model_fixtures import tiny_model

    def after_first(r):
        r = dict(r, loss_mask=r["loss_mask"].copy())
        r["loss_mask"][np.arange(len(r["prefix_len"])), r["prefix_len"] - 1] = 0.0
        return r

    model = tiny_model(mask=mask, rope=False)
    own = row_losses(model, after_first(rows), 8)
    shuffled = row_losses(model, after_first(shuffle_inputs(rows, seed=3)), 8)
    # with the last input token kept in place (the input-order probe), on every output token, the first included
    own_all = row_losses(model, rows, 8)
    kept = row_losses(model, shuffle_inputs(rows, seed=3, keep_last=True), 8)
    if invariant:
        np.testing.assert_allclose(shuffled, own, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(kept, own_all, rtol=2e-5, atol=2e-5)
    else:
        assert np.nanmax(np.abs(shuffled - own)) > 1e-4 and np.nanmax(np.abs(kept - own_all)) > 1e-4


def test_shuffle_keeping_the_last_input_token(rows):
    from experiments.common.probes import parts, shuffle_inputs

    for keep_last in (False, True):
        s = shuffle_inputs(rows, seed=1, keep_last=keep_last)
        moved_last = False
        for b in range(len(rows["tokens"])):
            (a, out), (a2, out2) = parts(rows, b), parts(s, b)
            assert sorted(a) == sorted(a2) and list(out) == list(out2)
            moved_last |= a[-1] != a2[-1]
            if keep_last:
                assert a[-1] == a2[-1]
        assert keep_last or moved_last


def test_nope_interaction_test_and_report(tmp_path):
    rs = []
    for s, o in enumerate(OFFSETS):
        rs += [fake_result("causal", s, 4.5 + o), fake_result("prefix", s, 4.5 + o / 2),
               fake_result("causal_nope", s, 4.6 + o + o / 3), fake_result("prefix_nope", s, 4.8 + o / 2)]
    groups = study_verdicts.by_arm(rs)
    row = study_verdicts.decide([study_verdicts.interaction_member(groups, REFS["bigram"])])[0]
    # per seed (0.1 + o/3) - 0.3: the causal model loses 0.2 less without positions
    assert row["diffs"] == pytest.approx([0.1 + o / 3 - 0.3 for o in OFFSETS])
    assert row["verdict"] == "causal mask's NoPE cost smaller" and row["wins"] == 4
    assert study_verdicts.interaction_member(study_verdicts.by_arm([r for r in rs if r["arm"] != "prefix"]),
                                             REFS["bigram"]) is None
    base = {"model": {"d_model": 8, "n_layers": 2, "first_k_dense": 1, "n_heads": 2, "n_kv_heads": 1,
                      "head_dim": 4, "n_routed_experts": 4, "top_k": 2, "n_shared_experts": 1, "vocab_size": 64},
            "data": {"tokenizer": "", "name": "x", "seq_len": 16, "prefix_frac": 0.5},
            "train": {"batch_size": 2, "lr": 1e-3, "warmup_steps": 1, "schedule": "cosine"},
            "eval": {"every": 5, "rows_per_domain": 2}}
    text = study_report.write_report(rs, REFS, tmp_path / "r", base).read_text()
    assert "(causal_nope - causal) - (prefix_nope - prefix) | 4 | -0.2" in text
    assert "**causal mask's NoPE cost smaller**" in text
