"""experiments/common/probes.py: splicing rebuilds prefix rows exactly, the probes change what they say, and the
per-row loss agrees with the trainer's evaluation."""

import numpy as np
import pytest

from experiments.common import probes as sp
from train.data.packing import TokenCache, prefix_rows


@pytest.fixture(scope="module")
def rows():
    lengths = [12, 5, 30, 9, 7, 20]  # some rows cut at seq_len, some padded
    toks = np.arange(2, 2 + sum(lengths), dtype=np.uint16) % 55 + 2
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    cache = TokenCache(toks, offsets, np.array([0, 0, 0, 1, 1, 1], np.int32), ("a", "b"))
    return prefix_rows(cache, 16, seed=0, start=0, count=6, prefix_frac=0.5)


def test_splice_of_parts_rebuilds_the_rows(rows):
    split = [sp.parts(rows, b) for b in range(6)]
    again = sp.splice([a for a, _ in split], [b for _, b in split], 16, rows["domains"][:, 0])
    for key in ("tokens", "targets", "segment_ids", "positions", "loss_mask", "prefix_len", "domains"):
        np.testing.assert_array_equal(again[key], rows[key], err_msg=key)


def test_replace_and_shuffle_keep_outputs(rows):
    rep, shuf = sp.replace_inputs(rows, seed=1), sp.shuffle_inputs(rows, seed=1)
    donors = sp.donors(rows["domains"][:, 0], 1)
    assert all(donors != np.arange(6)) and all(rows["domains"][donors, 0] == rows["domains"][:, 0])
    for b in range(6):
        a, out = sp.parts(rows, b)
        ra, rout = sp.parts(rep, b)
        sa, sout = sp.parts(shuf, b)
        n_out = min(len(out), 17 - len(ra))  # the donor's input may be longer: the output is then cut
        np.testing.assert_array_equal(rout, out[:n_out])
        np.testing.assert_array_equal(ra, sp.parts(rows, donors[b])[0])
        np.testing.assert_array_equal(sout, out)
        np.testing.assert_array_equal(np.sort(sa), np.sort(a))


def test_continuation_choice_with_a_scorer_that_knows_the_answer(rows):
    own = {b: tuple(sp.parts(rows, b)[1]) for b in range(6)}

    def oracle(spliced):  # loss 0 for a row whose output follows its own input, else 1
        out = []
        for i in range(len(spliced["tokens"])):
            a, b = sp.parts(spliced, i)
            match = [k for k in own if tuple(sp.parts(rows, k)[0]) == tuple(a)]
            out.append(0.0 if match and tuple(b) == own[match[0]] else 1.0)
        return np.asarray(out)

    r = sp.continuation_choice(None, rows, n_candidates=3, score_fn=oracle)
    assert r["accuracy"] == 1.0 and r["chance"] == pytest.approx(1 / 3) and r["n"] == 6
    r = sp.continuation_choice(None, rows, n_candidates=3, score_fn=lambda s: -oracle(s))
    assert r["accuracy"] == 0.0


def test_row_losses_match_the_trainers_evaluation(rows):
    import jax
    from flax import nnx

    from moe import Execution, ModelConfig, Transformer
    from train.step import make_eval_step

    model = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                                    d_ff=48, n_routed_experts=4, top_k=2, moe_d_ff=16, mask="prefix"), nnx.Rngs(0))
    losses = sp.row_losses(model, rows, batch_size=4)
    graphdef, params, bias = nnx.split(model, nnx.Param, ...)
    out = jax.jit(make_eval_step(graphdef, 2, Execution()))({"params": params, "bias": bias}, rows)
    per_domain = [np.nansum(losses[rows["domains"][:, 0] == d] * rows["loss_mask"].sum(-1)[rows["domains"][:, 0] == d])
                  / rows["loss_mask"].sum(-1)[rows["domains"][:, 0] == d].sum() for d in (0, 1)]
    np.testing.assert_allclose(per_domain, np.asarray(out["ce_sum"]) / np.asarray(out["count"]), rtol=1e-5)
