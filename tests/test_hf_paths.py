"""The HF loader never reads outside the directory it was given: shard names, config, tokenizer and symlinks that
leave it are refused with one line naming the entry; the Hub cache's snapshot -> blob symlinks still load. The
same holds for our safetensors and orbax exports read by train.generate; quantized or integer tensors are refused
rather than cast; and a damaged index or config names its file."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from analysis.hf_source import text_cache
from moe import ModelConfig
from moe.hf import HFImportError, load_hf_moe
from moe.hf.paths import OutsideDirectoryError, file_inside
from moe.hf.safetensors_io import flat_variables, load_safetensors, save_safetensors
from moe.hf.tensors import read_tensors
from moe.hf.write import write_hf_checkpoint
from plumbing.errors import UserError
from tests.model_fixtures import tiny_model
from train import export_dir
from train.data.tokenizer import DEFAULT_TOKENIZER, load_tokenizer

INDEX = "model.safetensors.index.json"
VOCAB = load_tokenizer().get_vocab_size(with_added_tokens=True)  # the bundled tokenizer's ids all index the model


def _model():
    return tiny_model(vocab_size=VOCAB)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A two-shard HF export of the tiny model (the loader's happy path), copied fresh per test by `hf_dir`."""
    out = tmp_path_factory.mktemp("hf") / "model"
    write_hf_checkpoint(_model(), str(out), str(DEFAULT_TOKENIZER), max_shard_bytes=100_000)
    assert (out / INDEX).is_file()
    return out


@pytest.fixture
def hf_dir(sharded, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(sharded, out)
    return out


def _point_first_shard_at(hf_dir, name):
    index = json.loads((hf_dir / INDEX).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"] = {k: (name if v == first else v) for k, v in index["weight_map"].items()}
    (hf_dir / INDEX).write_text(json.dumps(index))
    return first


def test_a_sharded_export_loads_exactly(hf_dir):
    model, tokenizer = load_hf_moe(str(hf_dir))
    ours = flat_variables(_model())
    for k, v in flat_variables(model).items():
        np.testing.assert_array_equal(v, ours[k], err_msg=k)
    assert tokenizer is not None


@pytest.mark.parametrize("entry", ["../elsewhere/model.safetensors", "ABSOLUTE", "sub/../../x.safetensors"])
def test_weight_map_entries_that_leave_the_directory_are_refused(hf_dir, tmp_path, entry):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    entry = str(elsewhere / "model.safetensors") if entry == "ABSOLUTE" else entry
    first = _point_first_shard_at(hf_dir, entry)
    shutil.copy(hf_dir / first, elsewhere / "model.safetensors")  # real, readable files outside
    shutil.copy(hf_dir / first, tmp_path / "x.safetensors")
    with pytest.raises(HFImportError, match="weight_map entry") as e:
        read_tensors(str(hf_dir))
    assert repr(entry) in str(e.value) and "\n" not in str(e.value)


def test_a_shard_symlinked_out_of_the_directory_is_refused(hf_dir, tmp_path):
    first = _point_first_shard_at(hf_dir, "shard.safetensors")
    outside = tmp_path / "outside.safetensors"
    shutil.move(hf_dir / first, outside)
    os.symlink(outside, hf_dir / "shard.safetensors")
    with pytest.raises(HFImportError, match="'shard.safetensors' resolves to .*outside the model directory"):
        read_tensors(str(hf_dir))


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", INDEX])
def test_config_tokenizer_and_index_symlinked_out_are_refused(hf_dir, tmp_path, name):
    shutil.move(hf_dir / name, tmp_path / name)
    os.symlink(tmp_path / name, hf_dir / name)
    with pytest.raises(HFImportError, match=f"{name}.*outside the model directory"):
        load_hf_moe(str(hf_dir))


def test_symlinks_inside_the_directory_are_followed(hf_dir):
    first = _point_first_shard_at(hf_dir, "link.safetensors")
    (hf_dir / "blobs").mkdir()
    shutil.move(hf_dir / first, hf_dir / "blobs" / "abc")
    os.symlink("blobs/abc", hf_dir / "link.safetensors")
    assert "model.embed_tokens.weight" in read_tensors(str(hf_dir))


def test_the_hub_caches_snapshot_symlinks_load(sharded, tmp_path):
    """models--ORG--NAME/snapshots/REV/* -> ../../blobs/HASH is how huggingface_hub stores every download."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in sharded.iterdir():
        shutil.copy(f, repo / "blobs" / f"hash-{f.name}")
        os.symlink(f"../../blobs/hash-{f.name}", snapshot / f.name)
    model, _ = load_hf_moe(str(snapshot))
    assert model.cfg == _model().cfg
    # the blob store of *another* repo is outside
    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    shard = json.loads((sharded / INDEX).read_text())["weight_map"]["model.embed_tokens.weight"]
    os.replace(repo / "blobs" / f"hash-{shard}", other / "hash")
    os.remove(snapshot / shard)
    os.symlink(other / "hash", snapshot / shard)
    with pytest.raises(HFImportError, match="outside the model directory"):
        load_hf_moe(str(snapshot))


def test_file_inside_refuses_names_that_are_not_plain(tmp_path):
    for name in ["", "/etc/passwd", "../x", "a/../../x", None]:
        with pytest.raises(OutsideDirectoryError):
            file_inside(tmp_path, name, "entry")
    assert file_inside(tmp_path, "a/b.safetensors", "entry") == (tmp_path / "a" / "b.safetensors").resolve()


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.float64])
def test_tensors_of_a_dtype_fp32_cannot_hold_exactly_are_refused(hf_dir, dtype):
    index = json.loads((hf_dir / INDEX).read_text())
    name = "model.embed_tokens.weight"
    shard = hf_dir / index["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name].astype(dtype)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(HFImportError, match=f"tensor '{name}' is .*convert"):
        read_tensors(str(hf_dir))


@pytest.mark.parametrize("name,text,match", [
    ("config.json", "{not json", "config.json: not valid JSON"),
    ("config.json", "[1, 2]", "config.json: expected a JSON object"),
    (INDEX, "{not json", f"{INDEX}: not valid JSON"),
    (INDEX, '{"metadata": {}}', f"{INDEX}: no weight_map"),
])
def test_a_damaged_config_or_index_names_its_file(hf_dir, name, text, match):
    (hf_dir / name).write_text(text)
    with pytest.raises(HFImportError, match=match) as e:
        load_hf_moe(str(hf_dir))
    assert str(hf_dir) in str(e.value)


def test_our_safetensors_export_refuses_files_symlinked_out(tmp_path):
    save_safetensors(tiny_model(), str(tmp_path / "export"))
    assert load_safetensors(str(tmp_path / "export")).cfg == tiny_model().cfg
    for name in ("model.safetensors", "moe_config.json"):
        shutil.move(tmp_path / "export" / name, tmp_path / name)
        os.symlink(tmp_path / name, tmp_path / "export" / name)
        with pytest.raises(OutsideDirectoryError, match=f"'{name}' resolves to"):
            load_safetensors(str(tmp_path / "export"))
        os.remove(tmp_path / "export" / name)
        shutil.move(tmp_path / name, tmp_path / "export" / name)


def test_generate_refuses_an_export_whose_tokenizer_or_params_leave_it(tmp_path):
    export = tmp_path / "export"
    save_safetensors(tiny_model(), str(export))
    shutil.copy(DEFAULT_TOKENIZER, tmp_path / "tokenizer.json")
    os.symlink(tmp_path / "tokenizer.json", export / "tokenizer.json")
    with pytest.raises(UserError, match="tokenizer.json' resolves to .*outside"):
        export_dir.load_export(export)
    orbax = tmp_path / "orbax"
    orbax.mkdir()
    (orbax / "moe_config.json").write_text(json.dumps(dataclasses.asdict(ModelConfig())))
    shutil.copy(DEFAULT_TOKENIZER, orbax / "tokenizer.json")
    (tmp_path / "params").mkdir()
    os.symlink(tmp_path / "params", orbax / export_dir.ORBAX_DIR)
    with pytest.raises(UserError, match="'params' resolves to .*outside"):
        export_dir.load_export(orbax)


@pytest.mark.parametrize("path", ["/dev/zero", "DIR"])
def test_text_that_is_not_a_regular_file_is_refused(tmp_path, path):
    """--text names the user's own files; a device or directory would read forever or crash."""
    path = str(tmp_path) if path == "DIR" else path
    with pytest.raises(UserError, match="not a regular file"):
        text_cache([path], load_tokenizer(), 0, 1)


def test_a_config_larger_than_its_weights_names_the_tensor(hf_dir):
    config = json.loads((hf_dir / "config.json").read_text())
    config["head_dim"] = config["head_dim"] * 1000  # e.g. a config from a much larger model beside small weights
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFImportError, match=r"tensor 'model.layers.0.self_attn.q_proj.weight' is \[") as e:
        load_hf_moe(str(hf_dir))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("n_layers", [100, 2_000])
def test_a_config_with_far_more_layers_than_stored_is_refused_at_once(hf_dir, n_layers):
    """The layer count is compared with the stored tensor names before any shape is built (100 layers took a
    minute, 2,000 did not finish)."""
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=n_layers)))
    t0 = time.perf_counter()
    with pytest.raises(HFImportError, match=fr"model.layers.3 missing: num_hidden_layers is {n_layers} but the "
                                            r"weights hold model\.layers\.0-2"):
        load_hf_moe(str(hf_dir))
    assert time.perf_counter() - t0 < 1.0


def test_a_weight_map_entry_that_is_a_fifo_is_refused(hf_dir):
    """Opening a FIFO for reading blocks until a writer comes (inside safetensors, holding the GIL): refused before
    it is opened, naming the entry. Run in a child process, so that a loader that blocks fails the test."""
    _point_first_shard_at(hf_dir, "pipe.safetensors")
    os.mkfifo(hf_dir / "pipe.safetensors")
    code = ("import sys; from moe.hf import HFImportError; from moe.hf.tensors import read_tensors\n"
            "try:\n    read_tensors(sys.argv[1])\nexcept HFImportError as e:\n    print(e)")
    try:
        done = subprocess.run([sys.executable, "-c", code, str(hf_dir)], capture_output=True, text=True,
                              timeout=120, cwd=Path(__file__).parents[1], env=dict(os.environ, JAX_PLATFORMS="cpu"))
    except subprocess.TimeoutExpired:
        pytest.fail("the loader blocked opening a FIFO named by the weight_map")
    assert "'pipe.safetensors' is not a regular file" in done.stdout, done.stdout + done.stderr[-2000:]
    assert len(done.stdout.strip().splitlines()) == 1


def _sparse_tokenizer(path, vocab, specials=()):
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(specials))
    tok.save(str(path))
    return tok


@pytest.mark.parametrize("vocab,specials,token,top", [
    ({"[UNK]": 0, "a": 1, "b": 100}, (), "b", 100),  # 3 tokens, fewer than the model's 61, but id 100
    ({"[UNK]": 0, **{f"w{i}": i for i in range(1, 61)}}, ("<|endoftext|>",), "<|endoftext|>", 61),  # an added one
])
def test_a_tokenizer_whose_ids_reach_past_vocab_size_is_refused(tmp_path, vocab, specials, token, top):
    write_hf_checkpoint(tiny_model(), str(tmp_path / "hf"), str(DEFAULT_TOKENIZER))
    _sparse_tokenizer(tmp_path / "hf" / "tokenizer.json", vocab, specials)
    assert tiny_model().cfg.vocab_size == 61
    with pytest.raises(HFImportError, match=f"tokenizer.json: token '{token}' has id {top}, past the model's "
                                            "vocab_size 61") as e:
        load_hf_moe(str(tmp_path / "hf"))
    assert "\n" not in str(e.value)
    _sparse_tokenizer(tmp_path / "hf" / "tokenizer.json", {"[UNK]": 0, "a": 1, "b": 60})  # the largest id fits
    assert load_hf_moe(str(tmp_path / "hf"))[1].token_to_id("b") == 60
