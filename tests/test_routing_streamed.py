"""analysis.routing --hf streamed one layer at a time (analysis/routing/streamed.py) and on a device mesh
(analysis/routing/sharded.py): the same routing.npz as the in-memory analysis; a stopped streamed analysis resumes
after its last finished layer and ends with the same outputs; auto mode streams when the model does not fit
--memory_gb."""

import json
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

torch = pytest.importorskip("torch", reason="torch builds the reference models")
transformers = pytest.importorskip("transformers", reason="transformers builds the reference models")
transformers.utils.logging.disable_progress_bar()

from analysis import hf_memory  # noqa: E402
from analysis.routing import cli as routing  # noqa: E402
from moe.hf.stream import LayerStream  # noqa: E402
from plumbing.errors import UserError  # noqa: E402
from tests import test_hf_deepseek  # noqa: E402
from tests.hf_random import random_hf  # noqa: E402

WORDS = "the quick brown fox jumps over lazy dog def return print x y again".split()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random DeepSeek-V3 (MLA, a dense layer then two MoE layers) with a word-level tokenizer, and two
    text files."""
    path = tmp_path_factory.mktemp("hf")
    config = test_hf_deepseek.FAMILIES["deepseek_v3"]()
    config.num_hidden_layers = 3
    random_hf(config).save_pretrained(str(path))
    vocab = {w: i for i, w in enumerate(["<|endoftext|>", "<|pad|>", "[UNK]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "prose.txt").write_text("the quick brown fox jumps over the lazy dog again\n" * 12)
    (path / "code.txt").write_text("def x return y print x again x y\n" * 12)
    return path


def _args(hf_dir, out, *extra):
    return routing.parse_args(["--hf", str(hf_dir), "--text", str(hf_dir / "prose.txt"), "--text",
                               str(hf_dir / "code.txt"), "--out", str(out), "--seq_len", "16", "--batch_size", "4",
                               "--no_progress", "--token", "the", "--token", "x", *extra])


def _run(hf_dir, out, *extra):
    lines = []
    a, _ = routing.run(_args(hf_dir, out, *extra), log=lines.append)
    return a, "\n".join(map(str, lines))


@pytest.fixture(scope="module")
def in_memory(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("memory")
    _run(hf_dir, out, "--mode", "memory")
    return out


def _same_outputs(out, want, exact=True):
    with np.load(out / "routing.npz") as got, np.load(want / "routing.npz") as ref:
        assert set(got) == set(ref)
        for k in ref:
            if exact or ref[k].dtype.kind in "iub":
                np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
            else:
                np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
    doc, ref_doc = (json.loads((p / "routing.json").read_text()) for p in (out, want))
    assert doc["domains"] == ref_doc["domains"] and doc["layer_ids"] == ref_doc["layer_ids"]
    return doc


def test_streamed_analysis_writes_the_in_memory_outputs(hf_dir, in_memory, tmp_path):
    a, log = _run(hf_dir, tmp_path, "--mode", "stream")
    doc = _same_outputs(tmp_path, in_memory)
    assert doc["mode"] == "stream" and a.n_tokens > 0
    assert "s per 1,000 tokens" in log and "peak memory" in log, log
    state = json.loads((tmp_path / "stream" / "state.json").read_text())
    assert state["done"] == 3 + 2  # embedding, 3 blocks, head


def test_a_stopped_analysis_resumes_after_its_last_finished_layer(hf_dir, in_memory, tmp_path, monkeypatch):
    read, block = [], LayerStream.block

    def stop_at_block_2(self, i, **kw):
        read.append(i)
        if i == 2 and read.count(2) == 1:
            raise KeyboardInterrupt
        return block(self, i, **kw)

    monkeypatch.setattr(LayerStream, "block", stop_at_block_2)
    with pytest.raises(KeyboardInterrupt):
        _run(hf_dir, tmp_path, "--mode", "stream")
    assert read == [0, 1, 2] and not (tmp_path / "routing.npz").exists()
    _, log = _run(hf_dir, tmp_path, "--mode", "stream")
    assert read == [0, 1, 2, 2], read  # blocks 0 and 1 were not run again
    assert "resuming" in log and "2 of 3 layers done" in log, log
    _same_outputs(tmp_path, in_memory)
    # the same OUT with other rows is refused in one line, naming what differs
    with pytest.raises(UserError, match="other rows") as e:
        _run(hf_dir, tmp_path, "--mode", "stream", "--max_tokens", "20")
    assert "\n" not in str(e.value)


def test_auto_mode_streams_when_the_model_does_not_fit(hf_dir, in_memory, tmp_path):
    stream = LayerStream(str(hf_dir))
    est = hf_memory.needs(stream, n_rows=8, seq_len=16, batch_size=4)
    assert est["stream"] < est["memory"]
    between = (est["stream"] + est["memory"]) / 2e9
    _, log = _run(hf_dir, tmp_path, "--memory_gb", f"{between:.9f}")
    assert "streamed one layer at a time" in log, log
    _same_outputs(tmp_path, in_memory)
    with pytest.raises(UserError, match="does not fit --memory_gb .* even streamed") as e:
        _run(hf_dir, tmp_path / "small", "--memory_gb", f"{est['stream'] / 2e9:.9f}")
    assert "\n" not in str(e.value)


def test_the_analysis_on_a_mesh_equals_the_single_device_one(hf_dir, in_memory, tmp_path):
    """Experts over 4 devices, rows over 2: the weights imported into their shards; the same routing up to the
    summation order of the partitioned contractions."""
    _run(hf_dir, tmp_path, "--mesh.expert", "4", "--mesh.data", "2")
    doc = _same_outputs(tmp_path, in_memory, exact=False)
    assert doc["mode"] == "mesh" and doc["mesh"] == {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}


def test_mode_flags_are_checked(hf_dir, tmp_path):
    for extra, match in ((["--mode", "stream", "--mesh.expert", "2"], "exclude each other"),
                         (["--memory_gb", "0"], "--memory_gb must be > 0")):
        with pytest.raises(UserError, match=match):
            _args(hf_dir, tmp_path, *extra)
    shutil.rmtree(tmp_path, ignore_errors=True)
