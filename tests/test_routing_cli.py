"""python -m analysis.routing on the shared tiny run: outputs, --token pieces, --compare_step, bad input."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from analysis.routing import cli as routing

MAX_TOKENS = "1500"  # per domain: a few batches, enough for every view


@pytest.fixture(scope="module")
def analysed(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("routing_out")
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        routing.main(["--workdir", str(tiny_run), "--out", str(out), "--max_tokens", MAX_TOKENS, "--compare_step",
                      "10", "--token", "supercalifragilistic", "--token", " the", "--layer", "1", "--no_progress"])
    (out / "console.txt").write_text(console.getvalue())
    return out


def test_console_summary_names_the_step_and_counts_in_words(analysed):
    console = (analysed / "console.txt").read_text()
    assert "1 MoE layer," in console and "through the checkpoint of step 20 in" in console, console


def test_outputs_exist_and_shares_sum_to_k(analysed):
    names = ["routing.json", "routing.npz", "tokens.html", "domain_experts_layer1.png", "domain_heatmap.png",
             "domain_specialization_top1.png", "tokens_tracked.png", "tokens_frequent.png", "locality.png",
             "vocab_specialization.png", "coactivation.png", "maxvio_global.png", "maxvio_training.png",
             "saturation.png"]
    for name in names:
        assert (analysed / name).stat().st_size > 1000, name
    doc = json.loads((analysed / "routing.json").read_text())
    assert doc["step"] == 20 and doc["layer_ids"] == [1] and len(doc["domains"]) == 9
    K = doc["top_k"]
    for layer, per_domain in doc["per_layer"].items():
        for domain, d in per_domain.items():
            assert 0 < d["n_tokens"] <= int(MAX_TOKENS), (layer, domain)
            np.testing.assert_allclose(sum(d["share"]), K, rtol=1e-6)
            np.testing.assert_allclose(sum(d["first_choice_share"]), 1, rtol=1e-6)
            np.testing.assert_allclose(sum(d["gate_share"]), 1, rtol=1e-4)  # normalized top-k gates
    npz = np.load(analysed / "routing.npz")
    np.testing.assert_allclose(npz["share_LxDxE"].sum(-1), K, rtol=1e-6)
    assert doc["metrics"]["n_tokens"] == int(npz["n_tokens"]) == doc["timing"]["tokens"]
    assert [s["maxvio"] for s in doc["maxvio_training"].values()]  # read from metrics.jsonl
    html = (analysed / "tokens.html").read_text()
    assert html.count('class="sample"') == 9 * 2 and "layer 1" in html


def test_multi_piece_token_tracks_its_pieces(analysed):
    doc = json.loads((analysed / "routing.json").read_text())
    assert len(doc["token_notes"]) == 1 and "supercalifragilistic" in doc["token_notes"][0]
    tracked = {t["text"]: t for t in doc["tokens"] if t["kind"] == "track"}
    assert {"su", "per", "istic", " the"} <= set(tracked)
    the = tracked[" the"]
    assert the["n"] > 0
    np.testing.assert_allclose(np.sum(the["share_LxE"], -1), doc["top_k"], rtol=1e-6)
    assert len([t for t in doc["tokens"] if t["kind"] == "freq"]) == 20


def test_compare_step_saturation(analysed):
    sat = json.loads((analysed / "routing.json").read_text())["saturation"]
    assert len(sat["saturation_L"]) == 1 and 0 <= sat["saturation_L"][0] <= 1


def _exit_code(argv, capsys):
    with pytest.raises(SystemExit) as e:
        routing.main(argv)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return e.value.code, err


@pytest.mark.parametrize("extra, expected", [
    (["--step", "7"], "available steps: [10, 20]"),
    (["--compare_step", "3"], "available steps: [10, 20]"),
    (["--layer", "0"], "valid MoE layers: [1]"),
    (["--layer", "5"], "valid MoE layers: [1]"),
    (["--token", ""], "encodes to no token"),
    (["--max_tokens", "0"], "--max_tokens must be >= 1"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_input_one_line_exit_2(tiny_run, tmp_path, capsys, extra, expected):
    code, err = _exit_code(["--workdir", str(tiny_run), "--out", str(tmp_path), *extra], capsys)
    assert code == 2 and expected in err
    assert not (tmp_path / "routing.json").exists()


def test_no_checkpoint_subprocess(tmp_path):
    """The real entry point: one line on stderr and exit code 2 for a workdir without checkpoints."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    (tmp_path / "nothing").mkdir()
    proc = subprocess.run([sys.executable, "-m", "analysis.routing", "--workdir", str(tmp_path / "nothing")],
                          capture_output=True, text=True, env=env, cwd=Path(__file__).parents[1], timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no checkpoints in" in lines[0], proc.stderr
