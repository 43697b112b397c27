"""experiments/encdec/task.py, runner.py and report.py: the encoder-decoder scores exactly the decoder-only
model's targets from the same information, the 2x2 cells have the stated depths, and the runner trains, caches
and reports them."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.common.probes import parts
from experiments.encdec import report as encdec_report
from experiments.encdec import runner as encdec_study
from experiments.encdec import task as encdec_task
from train.data.packing import TokenCache, prefix_rows

L = 16


@pytest.fixture(scope="module")
def rows():
    lengths = [12, 5, 30, 9, 7, 20, 16, 17]  # some rows cut at seq_len, some padded
    toks = np.arange(2, 2 + sum(lengths), dtype=np.uint16) % 55 + 2
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    cache = TokenCache(toks, offsets, np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32), ("a", "b"))
    return prefix_rows(cache, L, seed=0, start=0, count=8, prefix_frac=0.5)


@pytest.mark.parametrize("frac", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("seq_len", [16, 33, 256])
def test_lengths_hold_every_row_length(frac, seq_len):
    S, T = encdec_task.lengths(seq_len, frac)
    for n in range(2, seq_len + 2):
        p = int(np.clip(np.round(frac * n), 1, n - 1))
        assert p <= S and n - p <= T, (n, p, S, T)


def test_encdec_rows_score_the_same_targets_from_the_same_information(rows):
    S, T = encdec_task.lengths(L, 0.5)
    ed = encdec_task.encdec_rows(rows, S, T)
    assert set(ed) == set(encdec_task.ROW_KEYS)
    for b in range(len(rows["tokens"])):
        inp, out = parts(rows, b)  # the row's real tokens: input, then output
        scored = rows["loss_mask"][b] > 0
        # the same targets in the same order, and nothing else scored
        np.testing.assert_array_equal(ed["targets"][b][ed["loss_mask"][b] > 0], rows["targets"][b][scored])
        np.testing.assert_array_equal(rows["targets"][b][scored], out)
        # the encoder sees exactly the input; the decoder reads the last input token, then the output
        np.testing.assert_array_equal(ed["src"][b][ed["src_segment_ids"][b] > 0], inp)
        m = int(ed["segment_ids"][b].sum())
        np.testing.assert_array_equal(ed["tokens"][b, :m], np.append(inp[-1:], out[:-1]))
        assert m == len(out) and (ed["domains"][b, :m] == rows["domains"][b, 0]).all()


def test_output_positions_bucket_the_same_targets_in_both_forms(rows):
    def fake_forward(graphdef, params, bias, batch, ex):  # "loss" = the target id, on scored tokens
        return jnp.asarray(batch["targets"], jnp.float32) * batch["loss_mask"], {}

    fn = encdec_task.output_position_loss_fn(fake_forward, None, None, edges=(0, 1, 3))
    state = {"params": None, "bias": None}
    S, T = encdec_task.lengths(L, 0.5)
    dec = np.asarray(fn(state, rows))
    ed = np.asarray(fn(state, encdec_task.encdec_rows(rows, S, T)))
    np.testing.assert_array_equal(dec, ed)
    for b in range(len(rows["tokens"])):
        _, out = parts(rows, b)
        # buckets [0, 1), [1, 3), [3, ...): the first output token, the next two, the rest
        expect = [out[:1].sum(), out[1:3].sum(), out[3:].sum()]
        np.testing.assert_array_equal(dec[b, 0], expect)
        np.testing.assert_array_equal(dec[b, 1], [min(len(out), 1), len(out[1:3]), len(out[3:])])
    total = encdec_task.by_output_position(dec, edges=(0, 1, 3))
    assert sum(total["tokens"]) == int((rows["loss_mask"] > 0).sum())


def test_position_labels_are_one_based_token_ranges():
    assert encdec_report.position_labels(encdec_task.POSITION_EDGES) == [
        "1", "2", "3-4", "5-8", "9-16", "17-32", "33-64", "65+"]


def test_rows_that_do_not_fit_are_refused(rows):
    with pytest.raises(ValueError, match="does not fit"):
        encdec_task.encdec_rows(rows, 3, 3)


def test_cells_have_the_stated_depths():
    from tests.conftest import tiny_config

    base = tiny_config(**{"model.n_layers": 4})
    depth = {}
    for cell in encdec_study.CELLS:
        c, spec = encdec_study.cell_config(base, cell, 1, 7, "prefix")
        depth[cell] = (spec.encoder_layers, int(c.model.n_layers))
        assert c.train.seed == 1 and c.train.steps == 7 and not c.train.prefix_loss and c.model.first_k_dense == 0
        assert c.model.mask == ("prefix" if cell.startswith("decoder") else "causal")
    assert depth == {"decoder_P": (0, 4), "decoder_2P": (0, 8), "encdec_P": (2, 2), "encdec_2P": (4, 4)}
    keys = {encdec_study.run_key(*encdec_study.cell_config(base, cell, 0, 7, "causal")) for cell in encdec_study.CELLS}
    assert len(keys) == 4  # every cell is its own cached run


def test_block_passes_count_the_compute_of_each_cell():
    cells = {"decoder_P": (0, 4), "decoder_2P": (0, 8), "encdec_P": (2, 2), "encdec_2P": (4, 4)}
    n = {c: encdec_report.block_passes({"encoder_layers": e, "n_layers": d}, 256, 0.5) for c, (e, d) in cells.items()}
    assert n["decoder_P"] == 4 * 256 and n["decoder_2P"] == 2 * n["decoder_P"]
    # the encoder-decoder's blocks each see about half the window (129 padded tokens of 257)
    assert n["encdec_P"] == 4 * 129 and n["encdec_2P"] == 2 * n["encdec_P"]


@pytest.mark.parametrize("flags,msg", [(["--seeds", "1"], "--seeds must be at least 2"),
                                       (["--decoder_mask", "mixed"], "--decoder_mask takes causal or prefix"),
                                       (["--config.model.n_layers=3"], "model.n_layers must be even"),
                                       (["--cells", "encdec_P"], "that includes decoder_P"),
                                       (["--cells", "decoder_P,decoder_3P"], "--cells takes"),
                                       (["--config.model.tie_embeddings=true"], "tie_embeddings is not supported")])
def test_bad_flags_are_one_line_errors(flags, msg, capsys):
    with pytest.raises(SystemExit) as e:
        encdec_study.main(["prog", "--config", "configs/tiny.py", "--config.data.task=prefix", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1


@pytest.mark.slow  # trains the four cells x 2 seeds of a tiny model for 2 steps (seeds share compiled programs)
def test_two_by_two_end_to_end_and_cached(tmp_path, monkeypatch):
    from tests.conftest import tiny_config
    from train.inputs import eval_rows

    # the final loss on eval.rows_per_domain windows per domain, not on all ~8,000 32-token validation windows
    monkeypatch.setattr(encdec_study, "all_rows", eval_rows)
    base = tiny_config(**{"data.task": "prefix", "data.windows": True, "data.tokenizer": "tokenizer_1k.json",
                          "model.vocab_size": 1024, "model.first_k_dense": 0, "data.seq_len": 32,
                          "eval.every": 1, "eval.rows_per_domain": 2, "eval.output_only": True, "log.every": 1})
    logs = []
    report = encdec_study.run_study(base, 2, 2, tmp_path, "causal", log=logs.append)
    text = report.read_text()
    assert "not interpretable" in text and "encdec_P - decoder_2P" in text  # 2 steps cannot beat a bigram
    res = {(r["cell"], r["seed"]): r for r in json.loads((tmp_path / "report" / "results.json").read_text())["results"]}
    assert len(res) == 8
    assert "## Loss by output position" in text
    for name in ("val_curves.png", "paired_loss.png", "domains.png", "output_position.png"):
        assert (tmp_path / "report" / name).stat().st_size > 10_000, name
    p = {cell: res[(cell, 0)]["params_non_embedding"] for cell in encdec_study.CELLS}
    # 2P doubles the layers (one final norm either way); the encoder-decoder adds only cross-attention (and
    # the encoder's norm) to the same number of blocks
    assert p["decoder_2P"] - p["decoder_P"] == p["decoder_P"] - base.model.d_model
    assert p["decoder_P"] < p["encdec_P"] < p["decoder_2P"] < p["encdec_2P"]
    for r in res.values():
        assert np.isfinite(r["val_loss"]) and [s for s, _ in r["val_curve"]] == [1, 2]
        assert r["val_loss"] < 1.05 * np.log(1024)  # scored like the trainer: about ln V at initialization
        pos = r["val_loss_by_output_position"]  # the same scored tokens, split by output position
        assert np.isclose(sum(n * v for n, v in zip(pos["tokens"], pos["loss"]) if n) / sum(pos["tokens"]),
                          r["val_loss"], rtol=1e-5)
    # the seeds differ, the cells differ
    assert res[("decoder_P", 0)]["val_loss"] != res[("decoder_P", 1)]["val_loss"]
    assert res[("decoder_P", 0)]["val_loss"] != res[("encdec_P", 0)]["val_loss"]
    logs.clear()
    encdec_study.run_study(base, 2, 2, tmp_path, "causal", log=logs.append)
    assert sum("cached" in line for line in logs) == 8
    logs.clear()  # a subset of the cells: trains nothing more, reports only those
    subset = encdec_study.run_study(base, 2, 2, tmp_path, "causal", log=logs.append, cells=("decoder_P", "encdec_P"))
    text = subset.read_text()
    assert sum("cached" in line for line in logs) == 4 and "encdec_P - decoder_P" in text and "decoder_2P" not in text
    assert subset.parent.name == "report_decoder_P+encdec_P" and report.read_text() != text  # the 2x2 kept
    # results from before the position measurement give the report they gave then: no position section
    old = [{k: v for k, v in r.items() if k != "val_loss_by_output_position"} for r in res.values()]
    refs = json.loads((tmp_path / "references.json").read_text())
    without = encdec_study.write_report(old, refs, tmp_path / "old", base, "causal").read_text()
    full = report.read_text()
    start, end = full.index("## Loss by output position"), full.index("## Figures")
    assert without == full[:start] + full[end:]
    assert not (tmp_path / "old" / "output_position.png").exists()
