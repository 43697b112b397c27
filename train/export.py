"""Export a trained run: `python -m train.export --workdir DIR --out EXPORT_DIR [--step N]
[--dtype float32|bfloat16] [--format hf|safetensors|orbax] [--mtp keep|drop] [--overwrite]`.

  hf           HuggingFace (config.json, safetensors, tokenizer, model card), exact logits, in the architecture the
               model is: Glm4MoeForCausalLM (grouped-query attention) or DeepseekV3ForCausalLM (model.attention=mla)
  safetensors  our lossless format (moe/hf/safetensors_io.py) + tokenizer.json: any config (prefix mask, NoPE ...)
  orbax        params + routing biases (no optimizer state) + moe_config.json + tokenizer.json, for JAX users:
               `model = train.export.load_orbax_export(EXPORT_DIR)`

A model with multi-token prediction (model.mtp_depth) keeps its MTP modules in every format. In hf, --mtp keep
writes them as DeepSeek-V3 stores them (layer n_layers + k, num_nextn_predict_layers; what vLLM and SGLang read
for speculative decoding; transformers loads the rest and lists them as unexpected keys); --mtp drop writes the
plain HF model alone.

The export is written into a temporary directory next to --out and renamed into place at the end: a failure
never leaves a half export or touches an existing one. Bad input prints one line on stderr and exits 2.
"""

import contextlib
import dataclasses
import fcntl
import glob
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from moe import ConfigError, ModelConfig
from moe.hf.paths import tree_inside
from moe.hf.safetensors_io import CONFIG_FILE, load_config, save_safetensors
from moe.hf.write import ExportError, check_exportable, write_hf_checkpoint
from moe.model import abstract_model, merge_model, split_model
from plumbing.args import ArgParser
from plumbing.errors import UserError, exit_with, hide_orbax_tracebacks, os_error, storage_full, warn
from rundir import RunDir, is_run_dir, metrics, open_run

FORMATS = ("hf", "safetensors", "orbax")
DTYPES = ("float32", "bfloat16")
ORBAX_DIR = "params"  # the orbax item inside an orbax export: {"params": nnx.State, "bias": nnx.State}
EXPORT_MARKER = "moe-export.json"  # what --overwrite looks for: {"format", "export_format", "files", ...}


def parse_args(argv):
    p = ArgParser(prog="python -m train.export", description="Export a trained run (HF, safetensors or orbax).")
    p.add_argument("--workdir", required=True, help="run directory with checkpoints/")
    p.add_argument("--out", required=True, help="export directory (must not exist or be empty, see --overwrite)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--dtype", default="float32", help="weights dtype for --format hf: float32 | bfloat16")
    p.add_argument("--format", default="hf", help="hf | safetensors | orbax")
    p.add_argument("--mtp", default="keep", help="--format hf: keep the MTP modules as DeepSeek-V3 stores them, or "
                                                 "drop them (keep | drop)")
    p.add_argument("--overwrite", action="store_true", help="replace a previous export in --out (never anything else)")
    args = p.parse_args(argv)
    if args.mtp not in ("keep", "drop"):
        raise UserError(f"--mtp {args.mtp!r} is not supported; use keep or drop")
    if args.format not in FORMATS:
        raise UserError(f"--format {args.format!r} is not supported; use one of {', '.join(FORMATS)}")
    if args.dtype not in DTYPES:
        raise UserError(f"--dtype {args.dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if args.dtype != "float32" and args.format != "hf":
        raise UserError(f"--dtype {args.dtype} applies to --format hf only; {args.format} exports are lossless "
                        "float32")
    return args


def check_out(out: Path, workdir, overwrite: bool) -> None:
    """Refuse (nothing written) an --out that would replace anything but a previous export of ours: a run, a
    directory holding the run being exported, or a directory with other content."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory; choose another --out")
    o, w = out.resolve(), Path(workdir).resolve()
    if o == w or o in w.parents:
        raise UserError(f"--out {out} is or contains the run being exported ({workdir}); choose another --out")
    inside = next((p for p in o.parents if is_run_dir(p)), None)
    if inside is not None:
        raise UserError(f"--out {out} is inside the training run {inside}; choose a directory outside any run")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if is_run_dir(out):
        raise UserError(f"--out {out} is a training run; an export never replaces a run, choose another --out")
    if not overwrite:
        raise UserError(f"--out {out} exists and is not empty; pass --overwrite to replace a previous export "
                        "there, or choose another --out")
    marker = read_export_marker(out)
    if marker is None:
        raise UserError(f"--out {out} is not an export written by train.export (no {EXPORT_MARKER}); --overwrite "
                        "replaces only a previous export: choose another --out or empty it yourself")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in set(marker["files"]) | {EXPORT_MARKER})
    if foreign:
        raise UserError(f"--out {out} holds files the previous export did not write ({', '.join(foreign[:3])}); "
                        "--overwrite would delete them: move them away or choose another --out")


def read_export_marker(path: Path) -> dict | None:
    try:
        doc = json.loads((path / EXPORT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == "moe-lm export" and \
        isinstance(doc.get("files"), list) else None


def write_export_marker(out_dir: Path, fmt: str, workdir, step: int) -> None:
    files = sorted(p.name for p in out_dir.iterdir())
    doc = {"format": "moe-lm export", "export_format": fmt, "workdir": str(Path(workdir).resolve()),
           "step": int(step), "files": files}
    (out_dir / EXPORT_MARKER).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def final_val_loss(workdir, step: int) -> float | None:
    """The last "val/loss" in WORKDIR/metrics.jsonl at or before `step` (None if there is none)."""
    loss = None
    for row in metrics.read_rows(RunDir(Path(workdir)).metrics):
        v = row.get("val/loss")
        if isinstance(v, (int, float)) and math.isfinite(v) and row["step"] <= step:
            loss = float(v)
    return loss


def model_card(workdir, meta: dict) -> dict:
    # Total / active parameter counts are in the card's model table (train/hf_export.model_card_text).
    data = meta["config"].get("data", {})
    card = {"name": Path(workdir).resolve().name,
            "description": "A decoder-only Mixture-of-Experts language model trained with moe-lm (JAX/Flax NNX).",
            "data": data.get("name", "unknown"), "steps": meta["step"],
            "sequence_length": data.get("seq_len")}
    loss = final_val_loss(workdir, meta["step"])
    if loss is not None:
        card["final_val_loss"] = f"{loss:.4f}"
    return card


def save_orbax_export(model, out_dir, tokenizer_text: str) -> None:
    """Params + routing biases only (no optimizer state), moe_config.json and tokenizer.json."""


    _, params, bias = split_model(model)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(Path(out_dir).absolute() / ORBAX_DIR, {"params": params, "bias": bias})
    ckptr.wait_until_finished()
    (Path(out_dir) / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(model.cfg), indent=2, sort_keys=True))
    (Path(out_dir) / "tokenizer.json").write_text(tokenizer_text, encoding="utf-8")


def load_orbax_export(path_dir):
    """The model (moe.Transformer on the default device) from a `--format orbax` export."""


    tree_inside(path_dir, ORBAX_DIR, "file")  # orbax reads whatever params/ links to: nothing may leave the export
    cfg = load_config(str(path_dir))
    graphdef, params, bias = split_model(abstract_model(cfg))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                          {"params": params, "bias": bias})
    restored = ocp.StandardCheckpointer().restore(Path(path_dir).absolute() / ORBAX_DIR, target)
    return merge_model(graphdef, restored["params"], restored["bias"])


def write_export(model, meta: dict, workdir, out_dir: Path, fmt: str, dtype: str, mtp: bool = True) -> None:
    """Write the export into `out_dir` (an existing empty directory); mtp: hf keeps the MTP modules."""
    if fmt == "hf":

        with tempfile.TemporaryDirectory() as tmp:
            tok = Path(tmp) / "tokenizer.json"
            tok.write_text(meta["tokenizer"], encoding="utf-8")
            write_hf_checkpoint(model, str(out_dir), str(tok), dtype, model_card(workdir, meta),
                                max_position_embeddings=int(meta["config"]["data"]["seq_len"]), mtp=mtp)
    elif fmt == "safetensors":

        save_safetensors(model, str(out_dir), extra_meta={"step": meta["step"], "workdir": str(workdir)})
        (out_dir / "tokenizer.json").write_text(meta["tokenizer"], encoding="utf-8")
    else:
        save_orbax_export(model, out_dir, meta["tokenizer"])


def _umask_permissions(root: Path) -> None:
    # mkdtemp (and safetensors' atomic writes) create owner-only entries; give the export the usual modes.
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(root, 0o777 & ~mask)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o777 & ~mask)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o666 & ~mask)


def _swap_in(new: Path, out: Path) -> None:
    """Replace directory `out` by `new`: `out` goes aside first and comes back if the second rename fails; the
    previous export is deleted only once the new one is in place."""
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    try:
        os.replace(out, old / "x")
    except BaseException:
        old.rmdir()
        raise
    try:
        os.replace(new, out)
    except BaseException:
        os.replace(old / "x", out)
        old.rmdir()
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def exporting_into(out: Path, say=warn):
    """Hold `out` for one export (an flock on `.OUT.lock` beside it, removed when done; the kernel releases it if
    the process dies), after clearing what a killed export of `out` left there: its temporary directories (deleted) and the previous
    export an interrupted swap set aside (moved back when `out` is missing, deleted when the swap had finished)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / f".{out.name}.lock"
    while True:  # removed when done: hold it only if the file locked is still the one at `path`
        lock = open(path, "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise UserError(f"another export into --out {out} is running; wait for it, or choose another --out") \
                from None
        try:
            if os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        lock.close()
    try:
        for leftover in sorted(out.parent.glob(f".{glob.escape(out.name)}.tmp-*")):
            shutil.rmtree(leftover, ignore_errors=True)
            say(f"removed {leftover}, the unfinished output of an interrupted export")
        for aside in sorted(out.parent.glob(f".{glob.escape(out.name)}.old-*")):
            if (aside / "x").is_dir() and not out.exists():
                os.replace(aside / "x", out)
                say(f"restored the previous export to {out} (an interrupted export had moved it to {aside})")
            shutil.rmtree(aside, ignore_errors=True)
        yield
    finally:
        path.unlink(missing_ok=True)
        lock.close()


def export(workdir, out, step=None, dtype="float32", fmt="hf", overwrite=False, mtp=True) -> Path:
    """Export checkpoint `step` (default newest) of `workdir` to `out`; returns `out`. Raises UserError. mtp: hf
    keeps the MTP modules (--mtp keep)."""

    if not str(out).strip():
        raise UserError("--out is empty; pass an export directory, e.g. --out exports/my_run")
    out = Path(out).resolve()  # "." and "x/.." name a real directory (with a name and a parent)
    if not Path(workdir).is_dir():
        raise UserError(f"--workdir {workdir} does not exist; pass a run directory written by `python -m train`")
    check_out(out, workdir, overwrite)  # before anything is written beside it
    with exporting_into(out):
        check_out(out, workdir, overwrite)  # a restored previous export is checked like any other
        return _export(workdir, out, step, dtype, fmt, mtp)


def _export(workdir, out: Path, step, dtype, fmt, mtp) -> Path:
    run = open_run(workdir, step)
    model, meta = run.model, run.meta
    if fmt == "hf":
        try:
            check_exportable(ModelConfig.from_dict(meta["model"]))
        except ExportError as e:
            raise UserError(f"{e} (use --format safetensors or orbax)") from None
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write_export(model, meta, workdir, tmp, fmt, dtype, mtp)
        write_export_marker(tmp, fmt, workdir, meta["step"])
        _umask_permissions(tmp)
        if out.exists():  # empty, or --overwrite: move it aside first so a failed rename can restore it
            _swap_in(tmp, out)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    hide_orbax_tracebacks()
    try:
        args = parse_args(argv)

        try:
            out = export(args.workdir, args.out, args.step, args.dtype, args.format, args.overwrite,
                         args.mtp == "keep")
        except (ExportError, ConfigError) as e:
            raise UserError(str(e)) from None
        except OSError as e:
            raise os_error(e) from None
        except Exception as e:
            full = storage_full(e)
            if full:
                raise UserError(f"{full[0]} while writing the export to {args.out}; nothing was replaced, "
                                f"{full[1]} and run the export again") from None
            raise
    except UserError as e:
        exit_with(e)
    kind = args.format
    if args.format == "hf":  # the architecture picked from the model (moe.hf.write.architecture)
        kind = f"hf {json.loads((out / 'config.json').read_text())['architectures'][0]}"
    print(f"exported {args.workdir} ({kind}, {args.dtype}) to {out}")


if __name__ == "__main__":
    main()
