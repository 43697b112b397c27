"""Orbax checkpoints under WORKDIR/checkpoints: train state + metadata (config, data position, tokenizer).

Each step directory holds two items:
  state  params, routing biases, optimizer state, step (sharded arrays; restored into the run's shardings)
  meta   {"step", "config" (the full run config), "model" (moe.ModelConfig fields), "data_position" (the next
         global batch index: the sampler is a pure function of (seed, step)), "tokenizer" (its JSON text)}

Reading always takes the newest *readable* checkpoint: a damaged one (a killed save, a truncated file) is
reported in one line and skipped. Only the trainer, which holds the run's lock, moves it aside.
"""

import contextlib
import dataclasses
import functools
import logging
from pathlib import Path

import jax
import orbax.checkpoint as ocp
import tokenizers
from absl import logging as absl_logging
from orbax.checkpoint.type_handlers import ArrayHandler

from moe import ConfigError, ModelConfig
from moe.config import LEGACY_EXECUTION_FIELDS, RENAMED_FIELDS
from moe.hf.paths import OutsideDirectoryError, tree_inside
from moe.model import abstract_model, merge_model, split_model
from plumbing.errors import UserError, warn
from rundir.run_config import RunConfig


def _array_metadata_store():
    """The metadata store orbax's default handler has: a private module, so none where an orbax lacks it."""
    try:
        from orbax.checkpoint._src.metadata.array_metadata_store import Store
    except ImportError:
        return None
    return Store()


@functools.cache  # once per process
def _write_replicas_whole_in_one_process() -> None:
    """orbax splits each replicated array among its replicas so that several hosts write it together
    ("replica-parallel"; its default unless JAX_PLATFORMS names cuda or gpu). In one process the same host writes
    every slice, so the split only adds a compiled slice per array shape and a transfer per slice: on 8 CPU devices
    the first save of 77 small arrays took 1.63 s with it and 0.16 s without, later saves 0.38 and 0.19 s
    (docs/training.md). Several processes keep orbax's default. The files are the same arrays either way (only
    tensorstore's chunking differs), so checkpoints restore across the setting."""
    if jax.process_count() == 1:
        # orbax's own default handler (orbax 0.12's type_handler_registry) with that one option changed; orbax
        # warns of any override, this one meant
        handler = ArrayHandler(use_replica_parallel=False, array_metadata_store=_array_metadata_store())
        with quiet_orbax():
            ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)


def manager(ckpt_dir, keep: int = 3, async_save: bool = True, read_only: bool = False) -> ocp.CheckpointManager:
    """The trainer's manager (keeps `keep`, cleans up tmp dirs of killed saves), or a reader's (creates,
    deletes and cleans nothing; orbax's own read_only flag logs warnings on every use, so it is not used)."""
    _write_replicas_whole_in_one_process()
    if read_only:
        opts = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
    else:
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
                                            cleanup_tmp_directories=True)
    return ocp.CheckpointManager(Path(ckpt_dir).absolute(), options=opts)


def save(mngr: ocp.CheckpointManager, step: int, state, rc: RunConfig, tokenizer_path) -> None:
    meta = {"step": int(step), "config": rc.to_dict(), "model": dataclasses.asdict(rc.model),
            "data_position": int(step), "tokenizer": Path(tokenizer_path).read_text(encoding="utf-8")}
    mngr.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                 meta=ocp.args.JsonSave(meta)), force=True)


@contextlib.contextmanager
def quiet_orbax():
    """Orbax logs its own tracebacks when a read fails; we report a damaged checkpoint in one line instead."""
    loggers = [logging.getLogger(n) for n in ("absl", "orbax", "jax._src.distributed")]
    levels = [lg.level for lg in loggers]
    verbosity = absl_logging.get_verbosity()
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    absl_logging.set_verbosity(absl_logging.FATAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        absl_logging.set_verbosity(verbosity)


def read_meta(mngr: ocp.CheckpointManager, step: int) -> dict:
    """The step's metadata; ValueError (a damaged checkpoint) when it is incomplete or its tokenizer unreadable."""
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    if not isinstance(meta, dict) or not {"step", "config", "model", "tokenizer"} <= set(meta):
        raise ValueError("metadata incomplete")
    try:
        tokenizers.Tokenizer.from_str(meta["tokenizer"])
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on malformed JSON
        raise ValueError(f"metadata's tokenizer is unreadable ({' '.join(str(e).split())[:60]})") from None
    return meta


def _leaf_name(path) -> str:
    """'params.blocks.0.attn.wq.value' for a tree path of dict keys, sequence indices or attributes."""
    return ".".join(str(next(getattr(k, a) for a in ("key", "idx", "name") if hasattr(k, a))) for k in path)


def check_stored_shapes(step_dir: Path, target) -> None:
    """ValueError (a damaged checkpoint) unless every array of `target` is stored under `step_dir/state` with the
    same shape: metadata claiming other sizes than the arrays written (say a vocabulary of 10^9) must not make a
    reader allocate and read for minutes."""
    stored = ocp.StandardCheckpointer().metadata(Path(step_dir).absolute() / "state")
    shapes = {_leaf_name(p): tuple(m.shape) for p, m in
              jax.tree_util.tree_leaves_with_path(getattr(stored, "item_metadata", stored))}
    for path, leaf in jax.tree_util.tree_leaves_with_path(target):
        name = _leaf_name(path)
        got = shapes.get(name)
        if got != tuple(leaf.shape):
            raise ValueError(f"its metadata's model needs {name} of shape {list(leaf.shape)}, the checkpoint holds "
                             + ("none" if got is None else str(list(got))))


def check_compatible(saved_model: dict, mcfg: ModelConfig, where: str) -> None:
    """The same architecture is required to resume; name the first field that differs. Execution settings
    (dispatch, dtype, ...) are not architecture: checkpoints written when the model config still held them
    carry them under "model", and they are ignored (ModelConfig.from_dict)."""
    ours = dataclasses.asdict(mcfg)
    # A field missing from a checkpoint written before it existed had its default value then (every field added
    # since is off by default), so such checkpoints still resume.
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    saved = {**defaults, **{RENAMED_FIELDS.get(k, k): v for k, v in saved_model.items()
                            if k not in LEGACY_EXECUTION_FIELDS}}
    for key in sorted(set(ours) | set(saved)):
        if saved.get(key) != ours.get(key):
            raise UserError(f"checkpoint in {where} was written with model.{key}={saved.get(key)!r} but the "
                            f"config says {ours.get(key)!r}; use a new --workdir or the checkpoint's config")


def _damaged(step, directory, e, log):
    log(f"warning: checkpoint {step} in {directory} is unreadable ({type(e).__name__}: "
        f"{' '.join(str(e).split())[:120]}); using the previous one")


def restore_latest(mngr: ocp.CheckpointManager, abstract_state, mcfg: ModelConfig, log=warn):
    """(state, meta) of the newest readable checkpoint, or (None, None) if there is none.

    A damaged newest checkpoint is reported, moved aside to `<step>.damaged` (kept for inspection; the run will
    write that step again) and the previous one is used; an incompatible one is an error.
    """
    steps = sorted(mngr.all_steps(), reverse=True)
    damaged = []
    for step in steps:
        try:
            check_inside(mngr, step)
            with quiet_orbax():
                meta = read_meta(mngr, step)
                check_compatible(meta["model"], mcfg, str(mngr.directory))
                restored = mngr.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state)))
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - any read failure means this checkpoint is unusable
            _damaged(step, mngr.directory, e, log)
            damaged.append(step)
            continue
        _set_aside(mngr, damaged, log)
        return restored.state, meta
    if steps:
        raise UserError(f"no readable checkpoint in {mngr.directory} (steps {sorted(steps)} are all damaged); "
                        "move them away to start over, or use a new --workdir")
    return None, None


def _set_aside(mngr: ocp.CheckpointManager, steps, log) -> None:
    if not steps or jax.process_index() != 0:
        return
    for step in steps:
        src = Path(mngr.directory) / str(step)
        dst = src.with_name(f"{step}.damaged")
        n = 1
        while dst.exists():
            dst, n = src.with_name(f"{step}.damaged{n}"), n + 1
        src.rename(dst)
        log(f"warning: moved damaged checkpoint {step} to {dst}")
    mngr.reload()


def steps_in(ckpt_dir) -> list[int]:
    """Step numbers of the checkpoint directories (readable or not), ascending."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.is_dir() and p.name.isdigit())


def restore_model(ckpt_dir, step: int | None, log=warn):
    """(model, meta) of checkpoint `step`, or of the newest readable one when step is None; params and routing
    biases on the default device, no optimizer state. UserError when nothing usable is there."""
    steps = steps_in(ckpt_dir)
    if not steps:
        raise UserError(f"no checkpoints in {ckpt_dir}: train first, or pass the right --workdir")
    if step is not None and step not in steps:
        raise UserError(f"no checkpoint for step {step} in {ckpt_dir}; available steps: {steps}")
    mngr = manager(ckpt_dir, read_only=True)
    for s in [step] if step is not None else reversed(steps):
        try:
            with quiet_orbax():
                return _restore_params(mngr, s)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - any read failure means this checkpoint is unusable
            if step is not None:
                others = [x for x in steps if x != step]
                raise UserError(f"checkpoint {step} in {ckpt_dir} is unreadable ({type(e).__name__}); "
                                f"pick another --step ({others}) or leave --step out for the newest readable "
                                "one") from None
            _damaged(s, ckpt_dir, e, log)
    raise UserError(f"no readable checkpoint in {ckpt_dir} (steps {steps} are all damaged)")


def check_inside(mngr: ocp.CheckpointManager, step: int) -> None:
    """UserError unless every file of checkpoint `step` resolves inside its step directory: a run copied from
    elsewhere must not make orbax read through a symlink out of it. (checkpoints/ itself, or the whole run, may
    be a symlink to another disk.)"""
    try:
        tree_inside((Path(mngr.directory) / str(step)).resolve(), ".", f"checkpoint {step}")
    except OutsideDirectoryError as e:
        raise UserError(f"{mngr.directory}: {e}; remove the link or copy the files in") from None


def _restore_params(mngr, step):
    check_inside(mngr, step)
    meta = read_meta(mngr, step)
    try:
        mcfg = ModelConfig.from_dict(meta["model"])
    except (ConfigError, TypeError) as e:
        raise UserError(f"checkpoint {step} in {mngr.directory} holds a model config this version cannot build "
                        f"({e}); use the moe-lm version that wrote it") from None
    graphdef, params, bias = split_model(abstract_model(mcfg))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"params": params, "bias": bias}
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), target)
    check_stored_shapes(Path(mngr.directory) / str(step), target)
    restored = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                     partial_restore=True)))
    return merge_model(graphdef, restored.state["params"], restored.state["bias"]), meta
