"""docs/inference.md's statistics (experiments/common/inference.py), the masked-LM neighbour bigram and the
re-derivation, against SciPy and hand-computed values."""

import itertools
import json
import math

import numpy as np
import pytest
from scipy import stats as sp

from experiments.common import inference as inf
from experiments.common import rederive
from experiments.common import rerun_family as rf
from experiments.common.stats import holm, paired_t_interval
from experiments.mlm import neighbour_bigram as nb


def _member(diffs, gate=True, margin=None):
    return {"diffs": diffs, "gate_passed": gate, "labels": ("a better", "a worse"), "margin": margin}


def test_holm_runs_across_the_whole_family_and_failed_gates_still_count():
    strong = [-0.3066, -0.2639, -0.3779, -0.2666]  # the committed causal_all - causal
    nulls = [_member([0.1 * k, -0.1, 0.05, -0.02 * k]) for k in range(1, 21)]
    fam = inf.family([_member(strong), _member([0.3, 0.2, 0.25, 0.35], gate=False), *nulls])
    ps = [m["p"] for m in fam]
    assert [m["p_holm"] for m in fam] == pytest.approx(holm(ps))
    assert min(ps) == fam[0]["p"] and fam[0]["p_holm"] == pytest.approx(22 * fam[0]["p"])  # first Holm step: m * p
    assert fam[0]["verdict"] == "a better" and fam[1]["verdict"] == "not interpretable"
    assert {m["verdict"] for m in fam[2:]} == {"null"}
    alone = inf.family([_member(strong)])[0]
    assert alone["p_holm"] == pytest.approx(alone["p"])  # a family of one is not corrected


def test_a_mean_one_seed_drives_is_not_confirmed():
    d = [0.02, 0.01, 0.03, -1.5, 0.02, 0.01]  # one seed far below: the mean says "better", the rank estimate not
    m = inf.family([_member(d)])[0]
    assert m["mean"] < 0 < m["hodges_lehmann"]
    m2 = dict(m, p_holm=0.001)
    assert inf._verdict(m2) == "null (one seed drives the mean)"


def test_wilcoxon_exact_matches_scipy_without_ties():
    rng = np.random.default_rng(0)
    for n in (4, 5, 6, 8, 10):
        for shift in (0.0, 0.5, 1.5):
            d = rng.normal(shift, 1.0, n)
            assert inf.wilcoxon_p(d) == pytest.approx(sp.wilcoxon(d, method="exact").pvalue, rel=1e-12)


def test_wilcoxon_exact_by_hand():
    assert inf.wilcoxon_p([0.3, 0.2, 0.4, 0.1]) == pytest.approx(2 / 16)  # the floor at 4 seeds
    assert inf.wilcoxon_p([1, 2, 3, 4, 5, 6]) == pytest.approx(2 / 64)
    # ties: |d| = 1, 2, 2, 3 -> mid-ranks 1, 2.5, 2.5, 4; W+ = 9; of the 16 sign patterns two reach >= 9
    assert inf.wilcoxon_p([-1, 2, 2, 3]) == pytest.approx(2 * 2 / 16)
    assert inf.wilcoxon_p([0, 0]) == 1.0


def test_hodges_lehmann_by_hand():
    # Walsh averages of 1, 2, 10: 1, 2, 10, 1.5, 5.5, 6 -> median (2 + 5.5) / 2
    assert inf.hodges_lehmann([1, 2, 10]) == pytest.approx(3.75)
    # the committed prefix - causal: mean -0.038, but the rank estimate sits at ~0 (seed 2 alone is -0.198)
    assert inf.hodges_lehmann([0.027529, -0.007130, -0.197892, 0.024942]) == pytest.approx((-0.007130 + 0.008906) / 2, abs=1e-9)


def test_tost_matches_scipy_and_the_interval():
    d = np.array([0.01, -0.004, 0.006, 0.002, -0.001])
    for margin in (0.005, 0.01, 0.02):
        want = max(sp.ttest_1samp(d, -margin, alternative="greater").pvalue,
                   sp.ttest_1samp(d, margin, alternative="less").pvalue)
        assert inf.tost_p(d, margin) == pytest.approx(want, rel=1e-6)
        _, lo, hi = paired_t_interval(d, level=0.90)  # TOST at 0.05 <=> the 90% interval inside the margin
        assert (inf.tost_p(d, margin) < 0.05) == (-margin < lo and hi < margin)
    assert inf.tost_p(d, None) == 1.0


def test_equivalence_margin_is_relative_to_the_effect_above_chance():
    assert inf.equivalence_margin(0.438) == pytest.approx(0.0438)
    assert inf.equivalence_margin(0.309 - 0.25) == pytest.approx(0.0059)  # 4-way choice: 0.06 above chance
    assert inf.equivalence_margin(-1.98) is None  # the reference is worse than the baseline: nothing to keep


def test_slow_seeds_by_hand():
    assert inf.slow_seeds({0: 3.72, 1: 3.64, 2: 4.01, 3: 3.64}) == [2]  # fast half 3.64: 0.37 above it
    # two stalled seeds of four: the median (3.83) sits between the modes and finds none; the fast half finds both
    cell = {0: 4.006, 1: 3.691, 2: 3.974, 3: 3.650}
    assert inf.slow_seeds(cell) == [0, 2]
    assert not [s for s, v in cell.items() if v - np.median(list(cell.values())) > inf.SLOW_MARGIN]
    assert inf.slow_seeds({0: 3.6, 1: 3.7, 2: 3.75}) == [] and inf.slow_seeds({0: 3.6}) == []


def test_seed_clustered_slope():
    x = [1, 2, 3, 4]
    y = {0: [0.2606, 0.0275, 0.2604, 0.1494], 1: [0.0591, -0.0071, -0.0170, 0.1097]}  # committed head sweep
    slopes = inf.seed_slopes(x, y)
    for s in y:
        assert slopes[s] == pytest.approx(sp.linregress(x, y[s]).slope)
    # by hand: x - mean = -1.5, -0.5, 0.5, 1.5 (sum of squares 5); seed 0: (-0.3909 - 0.01375 + 0.1302 + 0.2241) / 5
    assert slopes[0] == pytest.approx(-0.01007, abs=1e-6) and slopes[1] == pytest.approx(0.01419, abs=1e-6)
    c = inf.clustered(list(slopes.values()))
    half = 12.7062 * abs(slopes[0] - slopes[1]) / 2  # t_0.975 at 1 df, se = |a - b| / 2 for two values
    assert c["hi"] - c["mean"] == pytest.approx(half, rel=1e-4)
    pooled = sp.linregress(x * 2, y[0] + y[1])  # the old interval: 8 points as if independent
    assert c["hi"] - c["lo"] > 2 * sp.t.ppf(0.975, 6) * pooled.stderr


def _brute_neighbour(uni, cond, left, x, right, vocab):
    q = [(cond[left, v] if left >= 0 else uni[v]) * (cond[v, right] if right >= 0 else 1.0) for v in range(vocab)]
    return -math.log(q[x] / sum(q))


def test_seeds_for_halfwidth_is_the_fewest_seeds_whose_interval_is_that_narrow():
    diffs = [0.31, 0.05, 0.22, -0.04]  # sd 0.159
    n = inf.seeds_for_halfwidth(diffs, 0.05)

    def halfwidth(k):  # the interval of k seeds with exactly the observed spread
        z = np.linspace(-1, 1, k)
        lo, hi = paired_t_interval(z / z.std(ddof=1) * np.std(diffs, ddof=1))[1:]
        return (hi - lo) / 2

    assert halfwidth(n) <= 0.05 < halfwidth(n - 1)
    assert 40 <= n <= 45  # about (1.96 * 0.159 / 0.05)^2 = 39, a little more for t's tails
    assert inf.seeds_for_halfwidth([0.0, 0.005], 0.05) == 2  # narrow enough even at t(1) = 12.7
    assert inf.seeds_for_halfwidth([-5.0, 5.0], 0.05, most=100) is None


def test_neighbour_bigram_by_brute_force():
    stream = np.array([2, 3, 4, 2, 5, 4, 3, 2, 3, 4, 5, 2, 0, 3, 4])
    uni, pairs = nb.counts(stream, 7)
    assert pairs[2, 3] == 2 and pairs.sum() == len(stream) - 1
    cond = nb.conditional(uni, pairs, 0.8)
    np.testing.assert_allclose(cond.sum(1), 1.0)
    assert np.allclose(cond[6], uni)  # id 6 never occurs as a context: the unigram
    cases = list(itertools.product([-1, 2, 4], [3, 5], [-1, 4, 2]))
    left, target, right = (np.array(c) for c in zip(*cases))
    got = nb.neighbour_nll(uni, cond, left, target, right, vocab=6, chunk=5)
    want = [_brute_neighbour(uni, cond, a, x, b, 6) for a, x, b in cases]
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_neighbour_bigram_reads_only_visible_neighbours():
    MASK = 9
    rows = {"tokens": np.array([[MASK, 4, MASK, MASK, 6, 1]]), "targets": np.array([[3, 4, 5, 2, 6, 1]]),
            "segment_ids": np.array([[1, 1, 1, 1, 1, 0]]), "loss_mask": np.array([[1, 0, 1, 1, 0, 0]], np.float32)}
    left, target, right = nb.masked_neighbours(rows, MASK)
    np.testing.assert_array_equal(target, [3, 5, 2])
    np.testing.assert_array_equal(left, [-1, 4, -1])  # row start; token 4; a [MASK]
    np.testing.assert_array_equal(right, [4, -1, 6])  # token 4; a [MASK]; token 6 (then padding)
    cyc = np.tile([2, 3, 4, 5], 200)
    uni, pairs = nb.counts(cyc, 6)
    cond = nb.conditional(uni, pairs, 0.99)
    assert nb.neighbour_nll(uni, cond, [2], [3], [4], 6)[0] < 0.05  # both neighbours pin it down
    assert nb.neighbour_nll(uni, cond, [-1], [3], [-1], 6)[0] == pytest.approx(-math.log(uni[3] / uni[:6].sum()))


def test_committed_rederivation_is_reproduced():
    fam = inf.family(rederive.members()[0])
    assert len(fam) == 22
    assert [m["contrast"] for m in fam if m["verdict"].endswith(("better", "worse"))] == ["causal_all - causal"]
    for study in ("masks_round2", "head_sweep", "encdec", "mlm"):
        committed = json.loads((rederive.ROOT / study / "results/rederived.json").read_text())
        fresh = [m for m in fam if m["study"] == study]
        assert [m["contrast"] for m in committed["members"]] == [m["contrast"] for m in fresh]
        for c, f in zip(committed["members"], fresh):
            assert c["p_holm"] == pytest.approx(f["p_holm"]) and c["verdict"] == f["verdict"]
            assert c["status"] == rederive.status(f)


def test_a_declared_family_counts_its_tests_not_yet_run_at_p_one():
    present = [_member([-0.30, -0.26, -0.38, -0.27]), _member([0.1, -0.1, 0.05, -0.02])]
    fam = inf.family(present, size=11)
    assert [m["p_holm"] for m in fam] == pytest.approx(holm([m["p"] for m in fam] + [1.0] * 9)[:2])
    assert fam[0]["p_holm"] == pytest.approx(11 * fam[0]["p"])  # not 2 * p: the family is 11, whatever has run
    with pytest.raises(ValueError):
        inf.family(present, size=1)


def _write_runs(folder, cells, seeds, loss_of, bigram=4.19):
    """A rerun's committed files: folder/references.json and folder/<cell>/seed<k>/result.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "references.json").write_text(json.dumps({"bigram": bigram}))
    for cell in cells:
        for s in seeds:
            d = folder / cell / f"seed{s}"
            d.mkdir(parents=True)
            d.joinpath("result.json").write_text(json.dumps(
                {"seed": s, "val_loss": loss_of(cell, s), "input_replacement_gap": 0.15, "choice_accuracy": 0.4,
                 "choice_chance": 0.25}))


def test_the_rerun_family_reads_both_reruns_and_waits_for_paired_seeds(tmp_path):
    masks, encdec = tmp_path / "masks", tmp_path / "encdec"
    shift = {"decoder_P": 0.0, "decoder_2P": -0.05, "encdec_P": 0.25, "encdec_2P": 0.2}
    _write_runs(encdec, tuple(shift), (0, 1, 2), lambda c, s: 3.6 + shift[c] + 0.01 * s * (c == "encdec_P"))
    doc = rf.decide(masks, encdec)  # the mask rerun has not run: its 6 tests wait
    assert len(doc["declared"]) == 11 and len(doc["waiting_for_seeds"]) == 6
    ed = {m["contrast"]: m for m in doc["members"]}
    assert ed["encdec: encdec_P - decoder_P"]["mean"] == pytest.approx(0.26)
    assert ed["encdec: encdec_P - decoder_P"]["p_holm"] >= 6 * ed["encdec: encdec_P - decoder_P"]["p"] - 1e-12
    assert doc["cells"]["encdec"]["decoder_P"]["passed"]  # 0.59 below the bigram, gap 0.15

    arms = ("causal", "prefix", "mixed", "causal_all")
    _write_runs(masks, arms, (0,), lambda a, s: 3.7)  # one seed: nothing to pair yet
    assert len(rf.decide(masks, encdec)["waiting_for_seeds"]) == 6
    _write_runs(masks, arms, (1, 2), lambda a, s: 3.7 - 0.3 * (a == "causal_all") + 0.01 * s)
    doc = rf.decide(masks, encdec)
    assert doc["waiting_for_seeds"] == [] and len(doc["members"]) == 11
    ca = next(m for m in doc["members"] if m["contrast"] == "masks_round2: causal_all - causal")
    assert ca["seeds"] == [0, 1, 2] and ca["mean"] == pytest.approx(-0.2)
