"""analysis/rank/logits.py: the masks, the baselines' known ranks, and trained logits that reproduce the model's
own attention probabilities."""

import numpy as np
import pytest

from analysis.rank import logits as rl
from tests.model_fixtures import tiny_model
from train.data.packing import TokenCache, prefix_rows


def test_masks_and_uniform_baselines():
    n, P = 12, 6
    c, p = rl.mask_matrix("causal", n, P), rl.mask_matrix("prefix", n, P)
    assert np.array_equal(c, np.tril(np.ones((n, n), bool)))
    assert p[:P, :P].all() and np.array_equal(p[P:], c[P:])
    u = rl.measure(np.zeros((1, n, n), np.float32), P)
    # uniform causal attention is triangular with a positive diagonal: full rank; the prefix block is rank one
    assert u["causal"]["rank"] == 1.0
    assert u["prefix_input"]["rank"] == pytest.approx(1 / P)
    assert u["prefix"]["rank"] == pytest.approx((n - P + 1) / n)


def test_random_logits_have_rank_d_and_causal_softmax_restores_full_rank():
    lg = rl.random_logits(2, 32, 4, seed=0)
    r = rl.measure(lg, 16)
    assert r["logits"]["rank"] == pytest.approx(4 / 32)
    # triangular with a positive diagonal: mathematically full rank; numerically (float32 tolerance) nearly so
    p = rl.masked_softmax(lg, rl.mask_matrix("causal", 32, 16))
    assert (np.diagonal(p, axis1=-2, axis2=-1) > 0).all()
    assert r["causal"]["rank"] > 0.9 > 4 / 32
    assert r["prefix_input"]["erank"] < r["causal_input"]["erank"]


def test_sweep_shapes():
    s = rl.sweep(n=32, H=1, d_heads=(16, 4), seeds=(0,), scales=(1.0,))
    assert [r["n_over_d"] for r in s["random"]] == [2.0, 8.0]
    assert s["random"][0]["logits"]["rank"] == pytest.approx(0.5)


@pytest.mark.slow  # compiles the tiny model's forward paths (~1 min on the shared CPU)
def test_trained_logits_reproduce_the_models_attention():
    model = tiny_model(mask="prefix")
    lengths = [14, 9, 16]
    toks = (np.arange(sum(lengths)) * 5 % 50 + 3).astype(np.uint16)
    cache = TokenCache(toks, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                       np.zeros(3, np.int32), ("a",))
    rows = prefix_rows(cache, 12, seed=0, start=0, count=3)
    logits, prefix = rl.trained_logits(model, rows, max_rows=3)
    _, aux = model(rows["tokens"], positions_BxL=rows["positions"], segment_ids_BxL=rows["segment_ids"],
                   prefix_len_B=rows["prefix_len"], return_attention=True)
    for i, lg in enumerate(logits):
        layer, b = divmod(i, 3)
        n = lg.shape[-1]
        want = np.asarray(aux["attention"][layer])[b, :, :n, :n]
        got = rl.masked_softmax(lg, rl.mask_matrix("prefix", n, prefix[b]))
        np.testing.assert_allclose(got, want, atol=2e-6)


def test_bad_flags(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        rl.main(["--out", str(tmp_path), "--n", "10"])
    assert e.value.code == 2 and "--n" in capsys.readouterr().err
