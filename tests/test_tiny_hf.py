"""The recipe for trying `analysis.routing --hf` without a download (analysis/tiny_hf.py, docs/hf_import.md): a
tiny random glm4_moe checkpoint with a tokenizer, read back exactly by moe.hf, analysed end to end."""

import json
import os

import numpy as np
import pytest

from analysis import tiny_hf
from analysis.routing import cli as routing
from moe.hf import load_hf_moe
from moe.hf.safetensors_io import flat_variables
from plumbing.errors import UserError


def test_the_recipe_writes_a_checkpoint_the_importer_reads_back_exactly(tmp_path):
    out = tmp_path / "tiny_hf"
    old = os.umask(0o022)
    try:
        tiny_hf.main(["--out", str(out)])
    finally:
        os.umask(old)
    # readable by whoever may read the directory's other files, as exports are (safetensors itself writes 0600)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {p.name: "0o644" for p in out.iterdir()}
    model, tokenizer = load_hf_moe(str(out))
    ours = flat_variables(tiny_hf.tiny_model())
    got = flat_variables(model)
    assert got.keys() == ours.keys()
    for k in ours:
        np.testing.assert_array_equal(got[k], ours[k], err_msg=k)
    assert tokenizer.get_vocab_size() <= model.cfg.vocab_size
    assert any(np.asarray(v).any() for k, v in ours.items() if k.endswith("ffn.bias"))  # biases are not all 0
    text = tmp_path / "poem.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    routing.main(["--hf", str(out), "--text", str(text), "--out", str(tmp_path / "routing"), "--no_progress"])
    doc = json.loads((tmp_path / "routing" / "routing.json").read_text())
    assert doc["model_type"] == "glm4_moe" and doc["domains"] == ["poem"]
    with pytest.raises(UserError, match="is not empty"):
        tiny_hf.run(tiny_hf.parse_args(["--out", str(out)]))
