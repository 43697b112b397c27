"""experiments/common/stats.py against hand-computed and textbook values."""

import math

import numpy as np
import pytest

from experiments.common import stats as st
from train.ngram import ngram_references


@pytest.mark.parametrize("p,df,want", [(0.975, 1, 12.7062), (0.975, 3, 3.1824), (0.975, 4, 2.7764),
                                       (0.95, 10, 1.8125), (0.975, 1000, 1.9623)])
def test_t_quantile_matches_tables(p, df, want):
    assert st.t_quantile(p, df) == pytest.approx(want, abs=2e-4)


def test_betainc_known_values():
    assert st.betainc(1, 1, 0.3) == pytest.approx(0.3)  # uniform
    assert st.betainc(2, 1, 0.5) == pytest.approx(0.25)  # x^2
    assert st.betainc(0.5, 0.5, 0.5) == pytest.approx(0.5)  # symmetric


def test_paired_t_interval_by_hand():
    d = [0.1, 0.2, 0.3, 0.4]
    mean, lo, hi = st.paired_t_interval(d)
    se = np.std(d, ddof=1) / 2
    assert mean == pytest.approx(0.25)
    assert (hi - mean) == pytest.approx(3.1824 * se, rel=1e-4) and (mean - lo) == pytest.approx(3.1824 * se, rel=1e-4)
    with pytest.raises(ValueError):
        st.paired_t_interval([0.1])


def test_sign_test_exact():
    assert st.sign_test([1, 1, 1]) == pytest.approx(0.25)  # "better in all 3 seeds" is p = 0.25
    assert st.sign_test([1, 1, 1, 1, 1]) == pytest.approx(2 / 32)
    assert st.sign_test([1, -1, 1, -1]) == 1.0
    assert st.sign_test([1, 1, 1, -1, 0]) == pytest.approx(2 * (1 + 4) / 16)  # tie dropped: n=4, k=1


def test_holm_by_hand():
    assert st.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert st.holm([0.5]) == [0.5]


def test_equivalence_needs_a_tight_interval():
    assert st.equivalent([0.001, -0.002, 0.0005, 0.0015], margin=0.02)
    assert not st.equivalent([0.001, -0.03, 0.02, 0.0], margin=0.02)  # mean ~0 but the interval is wide


def test_gate():
    ok = st.gate(causal_loss=4.0, bigram_loss=4.5, replaced_input_loss=4.2)
    assert ok["passed"] and ok["verdict"] == "interpretable"
    assert not st.gate(4.0, 4.2, 4.5)["passed"]  # not 0.3 better than bigram
    assert not st.gate(4.0, 4.5, 4.05)["passed"]  # ignores its input


def test_ngram_references_on_a_deterministic_stream():
    # A stream where every token fixes the next one: the bigram is nearly perfect, the unigram is ~log(V used).
    cycle = np.array([2, 3, 4, 5])
    train, val = np.tile(cycle, 500), np.tile(cycle, 50)
    ref = ngram_references(train, val, vocab_size=8)
    assert ref["bigram"] < 0.1 < ref["unigram"]
    assert ref["unigram"] == pytest.approx(-math.log((500 + 1) / (2000 + 8)), rel=1e-6)
