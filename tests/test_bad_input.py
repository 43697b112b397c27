"""Bad input and faults through the real CLIs, in-process: each case exits 2 with one line on stderr, no
traceback, every file that existed before (the shared tiny run, the case's own files) is unchanged, and no file
was created.

Each case is (id, cli, expected text, setup); setup(ctx) builds what the case needs in its own directory and
returns the argv. ctx.run is the shared trained tiny run (read-only), ctx.tmp the case's directory.
"""

import dataclasses
import hashlib
import shutil
from pathlib import Path

import pytest

from analysis import loss_curves
from analysis.rank import cli as rank
from analysis.routing import cli as routing
from experiments.masks_round1 import runner as experiments
from rundir.lock import RunLock
from train import __main__ as train_cli
from train import export, generate

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.py")


@dataclasses.dataclass
class Ctx:
    run: Path
    tmp: Path
    exports: dict  # format -> a module-wide export of the tiny run (read-only)

    def copy_run(self, name="copy") -> Path:
        dst = self.tmp / name
        shutil.copytree(self.run, dst)
        return dst

    def file(self, name="file.txt", text="x") -> Path:
        p = self.tmp / name
        p.write_text(text)
        return p


def train(*args, workdir=None):
    def setup(ctx):
        wd = workdir(ctx) if workdir else ctx.tmp / "new_run"
        return ["train", f"--config={TINY}", f"--workdir={wd}", "--config.log.progress=False",
                "--config.log.peak_flops=1e12", *args]
    return setup


def config_file(body):
    def setup(ctx):
        return ["train", f"--config={ctx.file('cfg.py', body)}", f"--workdir={ctx.tmp / 'run'}"]
    return setup


def holding_lock(ctx):
    work = ctx.copy_run()
    ctx.lock = RunLock(work / ".lock").acquire()  # released by the test
    return work


def no_checkpoints(ctx):
    work = ctx.copy_run()
    shutil.rmtree(work / "checkpoints")
    return work


def an_export(fmt):
    return lambda ctx: ctx.exports[fmt]


def damaged_newest(ctx):
    work = ctx.copy_run()
    for f in (work / "checkpoints" / "20" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    return work


def edited_export(edit):
    def setup(ctx):
        out = ctx.tmp / "exp"
        shutil.copytree(ctx.exports["safetensors"], out)
        edit(out)
        return ["--export", str(out), "--prompt", "hi"]
    return setup


def _bidirectional(out):
    cfg = (out / "moe_config.json").read_text().replace('"mask": "causal"', '"mask": "bidirectional"')
    (out / "moe_config.json").write_text(cfg)


def _truncate(out):
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])


def _export(out, **kw):
    def setup(ctx):
        o = out(ctx)
        return ["--workdir", str(kw.get("workdir", lambda c: c.run)(ctx)), "--out", str(o),
                *kw.get("extra", ["--overwrite"])]
    return setup


CASES = [
    # python -m train: config files and keys
    ("unknown_key", train_cli.main, "did you mean train.steps", train("--config.train.stepz=5")),
    ("unknown_flag", train_cli.main, "unrecognized arguments", train("--stepz=5")),
    ("missing_config", train_cli.main, "not found", lambda ctx: ["train", "--config=nope.py"]),
    ("config_syntax", train_cli.main, "syntax error at line 1", config_file("def get_config(:\n")),
    ("config_no_fn", train_cli.main, "no get_config", config_file("x = 1\n")),
    ("config_wrong_type", train_cli.main, "returned a dict", config_file("def get_config():\n    return {}\n")),
    ("config_raises", train_cli.main, "failed (ZeroDivisionError", config_file("def get_config():\n    1/0\n")),
    ("config_unknown_key", train_cli.main, "did you mean train.steps",
     config_file("from configs.tiny import get_config as g\ndef get_config():\n    c = g()\n"
                 "    c.train.stepz = 3\n    return c\n")),
    ("lr_negative", train_cli.main, "train.lr: must be > 0", train("--config.train.lr=-1")),
    ("b2_above_1", train_cli.main, "train.b2: must be in [0, 1)", train("--config.train.b2=2")),
    ("warmup_negative", train_cli.main, "train.warmup_steps: must be >= 0", train("--config.train.warmup_steps=-5")),
    ("prefix_frac", train_cli.main, "data.prefix_frac: must be in (0, 1)", train("--config.data.prefix_frac=1.5")),
    ("bias_rate", train_cli.main, "train.bias_update_rate", train("--config.train.bias_update_rate=-0.1")),
    ("balance_nan", train_cli.main, "finite", train("--config.train.balance_loss_weight=nan")),
    ("scaling_inf", train_cli.main, "finite", train("--config.model.routed_scaling_factor=inf")),
    ("capacity_inf", train_cli.main, "finite", train("--config.execution.capacity_factor=inf")),
    ("bool_as_int", train_cli.main, "takes an integer", train("--config.model.n_shared_experts=True")),
    ("float_as_int", train_cli.main, "takes an integer", train("--config.train.steps=1e3")),
    ("bad_bool", train_cli.main, "takes true or false", train("--config.model.rope=maybe")),
    ("eval_batch_0", train_cli.main, "eval.batch_size: must be > 0", train("--config.eval.batch_size=0")),
    ("seq_len_huge", train_cli.main, "activations 373.3", train("--config.data.seq_len=100000")),
    ("state_too_big", train_cli.main, "train state", train("--config.model.moe_d_ff=100000000")),
    ("tokenizer_missing", train_cli.main, "tokenizer file", train("--config.data.tokenizer=/nope.json")),
    ("vocab_too_small", train_cli.main, "model.vocab_size", train("--config.model.vocab_size=100")),
    ("corpus_missing", train_cli.main, "/nope", train("--config.data.corpus_dir=/nope")),
    ("seq_len_1", train_cli.main, "data.seq_len: must be >= 2", train("--config.data.seq_len=1")),
    ("schedule", train_cli.main, "train.schedule: must be one of", train("--config.train.schedule=linear")),
    ("task", train_cli.main, "data.task: must be one of", train("--config.data.task=foo")),
    ("min_lr_ratio", train_cli.main, "train.min_lr_ratio", train("--config.train.min_lr_ratio=2")),
    ("checkpoint_every_0", train_cli.main, "checkpoint.every: must be > 0", train("--config.checkpoint.every=0")),
    ("prefix_mask_lm", train_cli.main, "needs a per-row prefix", train("--config.model.mask=prefix")),
    ("mlm_causal", train_cli.main, "needs model.mask bidirectional or mixed", train("--config.data.task=mlm")),
    ("mlm_no_mask_id", train_cli.main, "[MASK] id",
     train("--config.data.task=mlm", "--config.model.mask=bidirectional", "--config.model.vocab_size=8192")),
    ("mesh", train_cli.main, "mesh", train("--config.mesh.data=3")),
    # python -m train: the work directory
    ("workdir_empty", train_cli.main, "--workdir is empty", lambda ctx: ["train", f"--config={TINY}", "--workdir="]),
    ("workdir_file", train_cli.main, "is a file", train(workdir=lambda ctx: ctx.file())),
    ("workdir_foreign", train_cli.main, "not a training run",
     train(workdir=lambda ctx: ctx.file("notes.txt").parent)),
    ("workdir_is_export", train_cli.main, "not a training run", train(workdir=an_export("hf"))),
    ("checkpoints_gone", train_cli.main, "no checkpoint", train(workdir=no_checkpoints)),
    ("incompatible", train_cli.main, "model.d_model", train("--config.model.d_model=32", workdir=lambda c: c.copy_run())),
    ("locked", train_cli.main, "in use by another training process", train(workdir=holding_lock)),
    # python -m train.export
    ("export_parent_of_run", export.main, "contains the run", _export(lambda ctx: ctx.run.parent)),
    ("export_onto_run", export.main, "contains the run", _export(lambda ctx: ctx.run)),
    ("export_onto_other_run", export.main, "is a training run", _export(lambda ctx: ctx.copy_run())),
    ("export_out_file", export.main, "not a directory", _export(lambda ctx: ctx.file())),
    ("export_foreign", export.main, "not an export", _export(lambda ctx: ctx.file("notes.txt").parent / ".")),
    ("export_no_overwrite", export.main, "pass --overwrite", _export(an_export("orbax"), extra=[])),
    ("export_damaged_step", export.main, "checkpoint 20", _export(lambda ctx: ctx.tmp / "o", workdir=damaged_newest,
                                                                  extra=["--step", "20"])),
    ("export_inside_run", export.main, "inside the training run",
     _export(lambda ctx: ctx.copy_run() / "checkpoints" / "30", extra=[])),
    ("export_out_empty", export.main, "--out is empty", _export(lambda ctx: "", extra=[])),
    ("export_format", export.main, "--format: invalid choice: 'onnx'", _export(lambda ctx: ctx.tmp / "o", extra=["--format", "onnx"])),
    ("export_no_checkpoints", export.main, "no checkpoints",
     _export(lambda ctx: ctx.tmp / "o", workdir=no_checkpoints, extra=[])),
    # python -m train.generate
    ("gen_temperature_nan", generate.main, "--temperature",
     lambda ctx: ["--workdir", str(ctx.run), "--prompt", "hi", "--temperature", "nan"]),
    ("gen_non_utf8", generate.main, "UTF-8",
     lambda ctx: ["--workdir", str(ctx.run), "--prompt", b"caf\xe9".decode("utf-8", "surrogateescape")]),
    ("gen_bidirectional", generate.main, "bidirectional", edited_export(_bidirectional)),
    ("gen_truncated", generate.main, "unreadable", edited_export(_truncate)),
    ("gen_missing_export", generate.main, "does not exist", lambda ctx: ["--export", str(ctx.tmp / "x"), "--prompt", "a"]),
    ("gen_export_is_run", generate.main, "is a training run", lambda ctx: ["--export", str(ctx.run), "--prompt", "a"]),
    ("gen_kv_cache_too_big", generate.main, "KV cache",
     lambda ctx: ["--workdir", str(ctx.run), "--prompt", "a", "--max_new_tokens", "100000000000"]),
    ("gen_top_p", generate.main, "--top_p", lambda ctx: ["--workdir", str(ctx.run), "--prompt", "a", "--top_p", "0"]),
    # analysis CLIs
    ("routing_out_file", routing.main, "is a file", lambda ctx: ["--workdir", str(ctx.run), "--out", str(ctx.file())]),
    ("routing_step", routing.main, "no checkpoint for step 7", lambda ctx: ["--workdir", str(ctx.run), "--step", "7",
                                                                           "--out", str(ctx.tmp / "o")]),
    ("routing_missing", routing.main, "does not exist", lambda ctx: ["--workdir", str(ctx.tmp / "x")]),
    ("rank_out_file", rank.main, "is a file", lambda ctx: ["--workdir", str(ctx.run), "--out", str(ctx.file())]),
    ("rank_sequences", rank.main, "--sequences", lambda ctx: ["--workdir", str(ctx.run), "--sequences", "0"]),
    ("rank_workdir_file", rank.main, "is a file", lambda ctx: ["--workdir", str(ctx.file()), "--out", str(ctx.tmp)]),
    ("curves_no_metrics", loss_curves.main, "no metrics.jsonl", lambda ctx: ["--workdir", str(ctx.tmp)]),
    ("curves_out_suffix", loss_curves.main, "must end in .png",
     lambda ctx: ["--workdir", str(ctx.run), "--out", str(ctx.tmp / "metrics.jsonl")]),
    ("curves_out_dir", loss_curves.main, "is a directory",
     lambda ctx: ["--workdir", str(ctx.run), "--out", str(ctx.tmp)]),
    ("exp_unknown_key", experiments.main, "did you mean",
     lambda ctx: ["x", "compare-masks", "--config.train.stepz=1", f"--out={ctx.tmp}"]),
    ("exp_masks", experiments.main, "--masks", lambda ctx: ["x", "compare-masks", "--masks=foo", f"--out={ctx.tmp}"]),
    ("exp_no_command", experiments.main, "command", lambda ctx: ["x", f"--out={ctx.tmp}"]),
]


def _digest(root: Path) -> dict:
    return {p: hashlib.sha1(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def exports(tiny_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input_exports")
    out = {}
    for fmt in ("hf", "safetensors", "orbax"):
        export.main(["--workdir", str(tiny_run), "--out", str(root / fmt), "--format", fmt])
        out[fmt] = root / fmt
    return out


def test_there_are_at_least_40_cases():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line_and_changes_nothing(case, tiny_run, exports, tmp_path, capsys):
    name, cli, expected, setup = case
    ctx = Ctx(tiny_run, tmp_path, exports)
    argv = setup(ctx)
    before = {**_digest(tiny_run), **_digest(tmp_path), **_digest(exports["hf"].parent)}
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as e:
            cli(argv)
    finally:
        if getattr(ctx, "lock", None) is not None:
            ctx.lock.release()
    err = capsys.readouterr().err
    assert e.value.code == 2, (e.value.code, err)
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert expected in err, err
    after = {**_digest(tiny_run), **_digest(tmp_path), **_digest(exports["hf"].parent)}
    changed = [str(p) for p in before if after.get(p) != before[p] and not p.name == ".lock"]
    assert not changed, changed
    created = sorted(str(p) for p in set(after) - set(before))
    assert not created, created  # nothing half-made: a refused run or export leaves no directory behind
