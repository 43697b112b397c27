"""python -m train.export / train.generate on the trained tiny run: the HF export loads in transformers with our
logits, tokens and greedy continuation; safetensors and orbax exports round-trip exactly; bad input exits 2 with
one line and leaves an existing --out untouched."""

import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moe
from moe.hf.paths import OutsideDirectoryError
from plumbing.errors import UserError
from rundir import open_run
from train import export as export_cli
from train import export_dir, generation
from train import generate as generate_cli
from train.data.tokenizer import EOS_ID, load_tokenizer
from train.export_dir import load_orbax_export

PROMPTS = ["The quick brown fox", "Once upon a time, there"]


def _hf():
    torch = pytest.importorskip("torch", reason="torch is needed to load the export with transformers")
    transformers = pytest.importorskip("transformers", reason="transformers is needed to load the export")
    return torch, transformers


@nnx.jit
def _logits(model, tokens):
    return model(tokens)[0]


def load_model(workdir, step=None):
    run = open_run(workdir, step)
    return run.model, run.meta


@pytest.fixture(scope="module")
def ours(tiny_run):
    return load_model(tiny_run)


@pytest.fixture(scope="module")
def tokens(ours):
    return np.random.RandomState(0).randint(2, ours[0].cfg.vocab_size, (2, 16))


@pytest.fixture(scope="module")
def hf_out(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("exports") / "hf"
    export_cli.main(["--workdir", str(tiny_run), "--out", str(out)])
    return out


def test_hf_export_loads_with_our_logits(tiny_run, ours, tokens, hf_out):
    torch, transformers = _hf()
    model, meta = ours
    biases = [np.asarray(b) for b in moe.routing_biases(model)]
    assert biases and all(np.abs(b).max() > 0 for b in biases), "the trained run's routing biases must matter"
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(hf_out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    np.testing.assert_array_equal(hf.model.layers[1].mlp.gate.e_score_correction_bias.numpy(), biases[0])
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens)).logits.float().numpy()
    mine = np.asarray(_logits(model, jnp.asarray(tokens)))
    err, scale = np.abs(mine - theirs).max(), np.abs(mine).max()
    assert err <= 1e-4 * scale, (err, scale)

    config = json.loads((hf_out / "config.json").read_text())
    assert config["max_position_embeddings"] == meta["config"]["data"]["seq_len"]
    card = (hf_out / "README.md").read_text()
    rows = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    val = [r["val/loss"] for r in rows if "val/loss" in r]
    assert f"{val[-1]:.4f}" in card and f"{moe.param_counts(model.cfg)['active']:,}" in card
    assert f"# {tiny_run.name}" in card and "moe_corpus" in card
    assert not [p for p in os.listdir(hf_out.parent) if p.startswith(".")], "temporary directories left"


def test_hf_tokenizer_encodes_like_ours(hf_out):
    _, transformers = _hf()
    mine = load_tokenizer(hf_out / "tokenizer.json")
    theirs = transformers.AutoTokenizer.from_pretrained(str(hf_out))
    for text in [*PROMPTS, "mixture of experts<|endoftext|>zebra!", " two  spaces\n"]:
        assert theirs(text)["input_ids"] == mine.encode(text).ids


def test_generate_cli_matches_hf_greedy(tiny_run, hf_out, capsys):
    torch, transformers = _hf()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_out))
    tok = load_tokenizer(hf_out / "tokenizer.json")
    n = 12
    for prompt in PROMPTS:
        new = generate_cli.main(["--export", str(hf_out), "--prompt", prompt, "--max_new_tokens", str(n)])
        ids = tok.encode(prompt).ids
        assert capsys.readouterr().out == tok.decode(ids + new, skip_special_tokens=False) + "\n"
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              do_sample=False, max_new_tokens=n)
        theirs = out[0, len(ids):].tolist()
        # HF stops after emitting EOS (and keeps it); ours stops before it.
        if theirs and theirs[-1] == EOS_ID:
            theirs = theirs[:-1]
        assert new == theirs, (prompt, new, theirs)
    # The checkpoint itself gives the same greedy continuation.
    assert generate_cli.main(["--workdir", str(tiny_run), "--prompt", PROMPTS[-1], "--max_new_tokens", str(n)]) \
        == new
    capsys.readouterr()


@pytest.mark.parametrize("fmt", ["safetensors", "orbax"])
def test_own_formats_round_trip(tiny_run, ours, tokens, tmp_path, fmt):
    out = tmp_path / fmt
    export_cli.main(["--workdir", str(tiny_run), "--out", str(out), "--format", fmt, "--step", "10"])
    assert export_dir.export_format(out) == fmt
    model, tok = export_dir.load_export(out)
    ref, _ = load_model(tiny_run, 10)
    assert model.cfg == ref.cfg and tok.get_vocab_size() > 2
    np.testing.assert_array_equal(np.asarray(_logits(model, jnp.asarray(tokens))),
                                  np.asarray(_logits(ref, jnp.asarray(tokens))))
    for a, b in zip(moe.routing_biases(model), moe.routing_biases(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_hf_export_loads(tiny_run, ours, tokens, tmp_path):
    torch, transformers = _hf()
    out = tmp_path / "bf16"
    export_cli.main(["--workdir", str(tiny_run), "--out", str(out), "--dtype", "bfloat16"])
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    # And back into our model (weights rounded to bf16, so only close).
    model, _ = export_dir.load_export(out)
    mine, back = (np.asarray(_logits(m, jnp.asarray(tokens))) for m in (ours[0], model))
    assert np.abs(mine - back).max() <= 0.05 * np.abs(mine).max()


def test_overwrite_replaces_and_failure_keeps_old(tiny_run, tmp_path, monkeypatch):
    out = tmp_path / "out"
    export_cli.main(["--workdir", str(tiny_run), "--out", str(out), "--format", "orbax"])
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(export_dir, "write_export", boom)
    with pytest.raises(RuntimeError):
        export_cli.main(["--workdir", str(tiny_run), "--out", str(out), "--format", "safetensors", "--overwrite"])
    assert os.listdir(tmp_path) == ["out"]
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    monkeypatch.undo()
    export_cli.main(["--workdir", str(tiny_run), "--out", str(out), "--format", "safetensors", "--overwrite"])
    assert sorted(os.listdir(out)) == ["model.safetensors", "moe-export.json", "moe_config.json", "tokenizer.json"]
    assert os.listdir(tmp_path) == ["out"]


def _refusing_open_run(**changes):
    def fake(workdir, step=None):
        run = open_run(workdir, step)
        run.meta = {**run.meta, "model": {**run.meta["model"], **changes}}
        return run

    return fake


@pytest.mark.parametrize("case, expect", [
    ("no_workdir", "does not exist"),
    ("no_step", "no checkpoint for step 7"),
    ("not_empty", "exists and is not empty"),
    ("foreign", "not an export written by train.export"),
    ("dtype", "argument --dtype: invalid choice: 'float64' (choose from 'float32', 'bfloat16')"),
    ("format", "argument --format: invalid choice: 'onnx' (choose from 'hf', 'safetensors', 'orbax')"),
    ("mtp", "argument --mtp: invalid choice: 'maybe' (choose from 'keep', 'drop')"),
    ("bf16_orbax", "applies to --format hf only"),
    ("prefix", "prefix mask"),
    ("nope", "no position encoding (NoPE)"),
])
def test_bad_input_exits_2_with_one_line(tiny_run, tmp_path, monkeypatch, capsys, case, expect):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    args = {"--workdir": str(tiny_run), "--out": str(out / "new")}
    if case == "no_workdir":
        args["--workdir"] = str(tmp_path / "missing")
    elif case == "no_step":
        args["--step"] = "7"
    elif case == "not_empty":
        args["--out"] = str(out)
    elif case == "foreign":  # --overwrite on a directory that is not an export
        args.update({"--out": str(out), "--overwrite": None})
    elif case == "dtype":
        args["--dtype"] = "float64"
    elif case == "format":
        args["--format"] = "onnx"
    elif case == "mtp":
        args["--mtp"] = "maybe"
    elif case == "bf16_orbax":
        args.update({"--format": "orbax", "--dtype": "bfloat16"})
    else:
        changes = {"mask": "prefix"} if case == "prefix" else {"rope": False}
        monkeypatch.setattr(export_dir, "open_run", _refusing_open_run(**changes))
    argv = [x for k, v in args.items() for x in ([k] if v is None else [k, v])]
    with pytest.raises(SystemExit) as e:
        export_cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and expect in err, err
    assert os.listdir(tmp_path) == ["out"] and os.listdir(out) == ["keep.txt"]


def test_generation_runs_dropless_fp32():
    """Generation runs with its own Execution whatever the run trained with: dropless (a row's continuation must
    not depend on the rest of the batch) and fp32."""
    assert generation.GENERATION == moe.Execution(dispatch="dropless", dtype="float32")


def test_generate_bad_input_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        generate_cli.main(["--export", str(tmp_path), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "not an export directory" in err


def test_cli_subprocess_one_line_exit_2(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    r = subprocess.run([sys.executable, "-m", "train.export", "--workdir", str(tmp_path), "--out", str(out),
                        "--format", "onnx"], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert os.listdir(out) == ["keep.txt"]



@pytest.mark.parametrize("target", ["run", "inside_run", "parent_of_run"])
def test_an_out_symlinked_at_a_run_is_refused(tiny_run, tmp_path, target):
    """--out is resolved after symlinks before anything is checked: a link to a run, into one, or to a directory
    holding the run being exported is refused and nothing under the run changes."""
    where = {"run": tiny_run, "inside_run": tiny_run / "analysis_export", "parent_of_run": tiny_run.parent}[target]
    tree = lambda: sorted((str(p), p.stat().st_size) for p in tiny_run.rglob("*") if p.is_file())
    before = tree()
    link = tmp_path / "link"
    os.symlink(where, link)
    with pytest.raises(UserError, match="run"):
        export_dir.export(str(tiny_run), str(link))
    assert tree() == before and not list(tiny_run.parent.glob(".link*")) and not list(tmp_path.glob(".link*"))


def _link_out(directory, outside):
    """Move the first regular file below `directory` to `outside` and leave a symlink to it in its place."""
    inner = next(p for p in sorted(directory.rglob("*")) if p.is_file() and not p.is_symlink())
    shutil.move(inner, outside)
    os.symlink(outside, inner)
    return inner


def test_a_symlink_inside_an_orbax_export_is_refused(tiny_run, tmp_path):
    """Not only params/ itself: any entry below it that resolves outside the export is refused before orbax
    reads it (a link to another user's files must never be followed)."""
    out = tmp_path / "orbax"
    export_cli.main(["--workdir", str(tiny_run), "--out", str(out), "--format", "orbax"])
    export_dir.load_export(out)  # the intact export loads
    inner = _link_out(out / export_dir.ORBAX_DIR, tmp_path / "elsewhere")
    with pytest.raises(UserError, match=f"{inner.name} resolves to .*outside") as e:
        export_dir.load_export(out)
    assert "\n" not in str(e.value)
    with pytest.raises(OutsideDirectoryError):
        load_orbax_export(out)


def test_a_symlink_inside_a_checkpoint_is_refused(tiny_run, tmp_path):
    """A run copied from elsewhere: a checkpoint file linked out of its step directory is refused by every reader
    (and a run whose checkpoints/ directory is itself a link, to another disk, still reads)."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("*.lock"))
    disk = tmp_path / "disk"
    shutil.move(run / "checkpoints", disk)
    os.symlink(disk, run / "checkpoints")
    open_run(run)
    step_dir = max((p for p in disk.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    _link_out(step_dir / "state", tmp_path / "elsewhere")
    with pytest.raises(UserError, match="outside the directory"):
        open_run(run, int(step_dir.name))


def test_a_killed_exports_leftovers_are_cleared_and_its_old_export_restored(tiny_run, tmp_path):
    """A kill mid-write leaves `.OUT.tmp-*` (removed by the next export of OUT); a kill between the swap's two
    renames leaves OUT missing and the previous export under `.OUT.old-*/x` (moved back, never lost)."""
    out = tmp_path / "e"
    junk = tmp_path / ".e.tmp-killed"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"half")
    export_dir.export(tiny_run, out, fmt="safetensors")
    assert not junk.exists() and (out / "moe-export.json").is_file()
    aside = tmp_path / ".e.old-killed"
    aside.mkdir()
    os.replace(out, aside / "x")  # the state after the first rename of a swap
    with pytest.raises(UserError, match="exists and is not empty; pass --overwrite"):
        export_dir.export(tiny_run, out, fmt="safetensors")  # restored, and not replaced without --overwrite
    assert (out / "moe-export.json").is_file() and not aside.exists()
    (aside / "x").mkdir(parents=True)  # a swap that finished its second rename: the old export is deleted
    export_dir.export(tiny_run, out, fmt="safetensors", overwrite=True)
    assert not aside.exists() and not [p.name for p in tmp_path.iterdir() if p.name.startswith(".e.")]


def test_a_second_export_into_the_same_out_is_refused_while_one_runs(tiny_run, tmp_path):
    import fcntl

    out = tmp_path / "e"
    with open(tmp_path / ".e.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(UserError, match="another export into --out"):
            export_dir.export(tiny_run, out, fmt="safetensors")
    assert not out.exists()
