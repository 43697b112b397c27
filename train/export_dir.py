"""An export directory: writing one from a run (hf, safetensors or orbax; `export`), replacing a previous one safely,
and reading any back (`load_export`). `python -m train.export` (train/export.py) is the command.

The export is written into a temporary directory next to its destination and renamed into place at the end: a
failure never leaves a half export or touches an existing one; a killed export's leftovers are cleared by the next
export into the same place, under a lock (`exporting_into`).
"""

import contextlib
import dataclasses
import fcntl
import glob
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from moe import ModelConfig
from moe.hf import load_model
from moe.hf.paths import OutsideDirectoryError, file_inside, tree_inside
from moe.hf.safetensors_io import CONFIG_FILE, load_config, load_safetensors, save_safetensors
from moe.hf.write import ExportError, check_exportable, write_hf_checkpoint
from moe.model import abstract_model, merge_model, split_model
from plumbing.errors import UserError, warn
from rundir import RunDir, is_run_dir, metrics, open_run
from train.data.tokenizer import load_tokenizer

ORBAX_DIR = "params"  # the orbax item inside an orbax export: {"params": nnx.State, "bias": nnx.State}
EXPORT_MARKER = "moe-export.json"  # what --overwrite looks for: {"format", "export_format", "files", ...}


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


def export_format(path: Path) -> str:
    """"hf", "safetensors" or "orbax", from the files an export directory holds."""
    if (path / "config.json").is_file():
        return "hf"
    if (path / "moe_config.json").is_file() and (path / "model.safetensors").is_file():
        return "safetensors"
    if (path / "moe_config.json").is_file() and (path / ORBAX_DIR).is_dir():
        return "orbax"
    raise UserError(f"--export {path}: not an export directory (no config.json, or moe_config.json with "
                    "model.safetensors or params/); write one with `python -m train.export`")


def load_export(path):
    """(model, tokenizer) from an export directory of any format."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"--export {path} does not exist; write it with `python -m train.export`")
    if (path / "moe-run.json").is_file() or (path / "checkpoints").is_dir():
        raise UserError(f"--export {path} is a training run, not an export; pass it as --workdir {path}")
    fmt = export_format(path)
    try:  # the weights of an HF or safetensors export are checked by their loaders
        file_inside(path, "tokenizer.json", "file")
        if fmt == "orbax":  # orbax and tensorstore walk params/: every entry below it must stay inside too
            tree_inside(path, ORBAX_DIR, "file")
    except OutsideDirectoryError as e:
        raise UserError(f"--export {path}: {e}") from None
    try:
        if fmt == "hf":
            model = load_model(str(path))
        elif fmt == "safetensors":
            model = load_safetensors(str(path))
        else:
            model = load_orbax_export(path)
    except (UserError, OSError):
        raise
    except Exception as e:  # noqa: BLE001 - HFImportError, a truncated safetensors file, a bad orbax export
        reason = " ".join(str(e).split())
        if (path / EXPORT_MARKER).is_file():  # one of ours: writing it again is the fix
            raise UserError(f"--export {path} is unreadable ({type(e).__name__}: {reason}); write it again with "
                            "`python -m train.export`") from None
        raise UserError(f"--export {path}: {reason}") from None  # a third party's model: the loader names the fix
    if not (path / "tokenizer.json").is_file():
        raise UserError(f"--export {path} has no tokenizer.json; write it again with `python -m train.export`")
    return model, load_tokenizer(path / "tokenizer.json")


def export_trained_len(path) -> int | None:
    """The sequence length an HF export was trained on (its max_position_embeddings); None for other formats."""
    try:
        return int(json.loads((Path(path) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
