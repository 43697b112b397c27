"""experiments/common/lr_select.py and the encoder-decoder runner's --lr_grid (docs/inference.md rule 10): each
cell's rate is chosen on the held-out seed alone, before and apart from the comparison seeds, which all run at
their cell's rate; the report shows the whole grid."""

import json
import math

import pytest

from experiments.common import lr_select
from experiments.encdec import runner as encdec_study
from plumbing.errors import UserError


@pytest.mark.parametrize("text,grid", [("6e-3,1.5e-3,3e-3", (1.5e-3, 3e-3, 6e-3)), ("0.1, 0.2", (0.1, 0.2))])
def test_grid_is_parsed_and_sorted(text, grid):
    assert lr_select.parse_grid(text) == grid


@pytest.mark.parametrize("text", ["3e-3", "3e-3,3e-3", "3e-3,-1e-3", "3e-3,abc", "0,1e-3", "nan,1e-3", ""])
def test_bad_grids_are_refused(text):
    with pytest.raises(UserError, match="--lr_grid takes two or more distinct positive"):
        lr_select.parse_grid(text)


def test_choice_is_the_lowest_loss_a_diverged_run_loses_and_edges_are_marked():
    assert lr_select.choose({1e-3: 4.0, 2e-3: 3.5, 4e-3: 3.7}) == (2e-3, False)
    assert lr_select.choose({1e-3: 4.0, 2e-3: 3.9, 4e-3: 3.7}) == (4e-3, True)
    assert lr_select.choose({1e-3: 3.0, 2e-3: math.nan, 4e-3: 3.7}) == (1e-3, True)
    assert lr_select.choose({1e-3: 3.5, 2e-3: 3.5, 4e-3: 3.7}) == (1e-3, True)  # a tie: the smaller rate


def test_select_runs_the_held_out_seed_only_and_writes_the_selection(tmp_path):
    calls = []

    def train(cell, lr, seed, workdir):
        calls.append((cell, lr, seed, workdir))
        return {"val_loss": {"a": abs(lr - 2e-3), "b": abs(lr - 4e-3)}[cell]}

    chosen = lr_select.select(["a", "b"], (1e-3, 2e-3, 4e-3), train, tmp_path, log=lambda *_: None)
    assert {s for _, _, s, _ in calls} == {lr_select.HELD_OUT_SEED} and len(calls) == 6
    assert len({w for *_, w in calls}) == 6 and all(w.is_relative_to(tmp_path / "lr_sweep") for *_, w in calls)
    assert chosen["a"]["lr"] == 2e-3 and not chosen["a"]["at_edge"]
    assert chosen["b"]["lr"] == 4e-3 and chosen["b"]["at_edge"]
    saved = json.loads((tmp_path / "lr_sweep" / "selection.json").read_text())
    assert saved["held_out_seed"] == lr_select.HELD_OUT_SEED and saved["cells"]["a"]["lr"] == 2e-3
    lines = "\n".join(lr_select.report_lines(chosen))
    assert "| a | 0.0010 | **0.0000** | 0.0020 | 0.002 |" in lines and "| b |" in lines and "0.004 (edge)" in lines


def test_encdec_comparison_seeds_run_at_their_cells_chosen_rate(tmp_path, monkeypatch):
    """The runner's wiring, with training replaced by a loss that depends on the cell, the rate and the seed: the
    sweep sees only the held-out seed, every comparison run gets its cell's chosen rate, the report shows it."""
    from tests.conftest import tiny_config

    best = {"decoder_P": 6e-3, "decoder_2P": 1.5e-3, "encdec_P": 3e-3, "encdec_2P": 1.5e-3}
    trained = []

    def fake_train(c, cell, log=print):
        lr, seed = float(c.train.lr), int(c.train.seed)
        trained.append((cell.name, lr, seed))
        loss = 3.0 + abs(math.log2(lr / best[cell.name])) + 0.01 * seed
        domains = json.loads((tmp_path / "references.json").read_text())["by_domain"]
        return {"cell": cell.name, "seed": seed, "steps": int(c.train.steps), "lr": lr,
                "key": encdec_study.run_key(c, cell), "decoder_mask": "causal", "n_layers": int(c.model.n_layers),
                "encoder_layers": cell.encoder_layers, "params": 10, "params_non_embedding": 5, "train_seconds": 1.0,
                "tokens_seen": 100, "val_loss": loss, "val_loss_by_domain": dict.fromkeys(domains, loss), "input_replacement_gap": 0.2,
                "val_curve": [[2, loss]], "train_curve": [[2, loss]]}

    monkeypatch.setattr(encdec_study, "train_cell", fake_train)
    base = tiny_config(**{"data.task": "prefix", "data.windows": True, "data.tokenizer": "tokenizer_1k.json",
                              "model.vocab_size": 1024, "model.first_k_dense": 0, "data.seq_len": 32})
    grid = (1.5e-3, 3e-3, 6e-3)
    report = encdec_study.run_study(base, 2, 2, tmp_path, "causal", log=lambda *_: None, lr_grid=grid)
    sweep = [t for t in trained if t[2] == lr_select.HELD_OUT_SEED]
    assert len(sweep) == 12 and sorted(trained[:12]) == sorted(sweep)  # the whole sweep before any comparison
    comparison = trained[12:]
    assert sorted((c, s) for c, _, s in comparison) == sorted((c, s) for c in best for s in (0, 1))
    assert all(lr == best[c] for c, lr, _ in comparison)
    text = report.read_text()
    assert "## Learning rate per cell" in text and "each cell at its own learning rate" in text
    assert "| decoder_2P | 0.0015 |" in text  # the cells table's lr column
    # the same command again trains nothing, and --report_only finds the same runs
    trained.clear()
    encdec_study.run_study(base, 2, 2, tmp_path, "causal", log=lambda *_: None, lr_grid=grid)
    again = encdec_study.run_study(base, 2, 2, tmp_path, "causal", log=lambda *_: None, lr_grid=grid,
                                   report_only=True)
    assert trained == [] and again.read_text() == text
