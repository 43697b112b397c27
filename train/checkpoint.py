"""Orbax checkpoints under WORKDIR/checkpoints: train state + metadata (config, data position, tokenizer).

Each step directory holds two items:
  state  params, routing biases, optimizer state, step (sharded arrays; restored into the run's shardings)
  meta   {"step", "config" (the full run config), "model" (moe.ModelConfig fields), "data_position" (the next
         global batch index: the sampler is a pure function of (seed, step)), "tokenizer" (its JSON text)}
"""

import dataclasses
from pathlib import Path

import jax
import ml_collections
import orbax.checkpoint as ocp

from moe import ModelConfig
from train.errors import UserError


def manager(workdir, keep: int = 3, async_save: bool = True) -> ocp.CheckpointManager:
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
    return ocp.CheckpointManager(Path(workdir).absolute() / "checkpoints", options=opts)


def save(mngr: ocp.CheckpointManager, step: int, state, config: ml_collections.ConfigDict, mcfg: ModelConfig,
         tokenizer_path) -> None:
    meta = {"step": int(step), "config": config.to_dict(), "model": dataclasses.asdict(mcfg),
            "data_position": int(step), "tokenizer": Path(tokenizer_path).read_text(encoding="utf-8")}
    mngr.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                 meta=ocp.args.JsonSave(meta)), force=True)


def read_meta(mngr: ocp.CheckpointManager, step: int) -> dict:
    return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta


def check_compatible(saved_model: dict, mcfg: ModelConfig, where: str) -> None:
    """The same architecture is required to resume; name the first field that differs."""
    ours = dataclasses.asdict(mcfg)
    # These change numerics or speed, not shapes: they may differ on resume (and may be missing from checkpoints
    # written before they existed).
    free = {"dtype", "dispatch", "capacity_factor", "grouped_matmul", "attention_impl", "remat",
            "balance_loss_weight"}
    for key in sorted(set(ours) | set(saved_model)):
        if key not in free and saved_model.get(key) != ours.get(key):
            raise UserError(f"checkpoint in {where} was written with model.{key}={saved_model.get(key)!r} but the "
                            f"config says {ours.get(key)!r}; use a new --workdir or the checkpoint's config")


def restore_latest(mngr: ocp.CheckpointManager, abstract_state, mcfg: ModelConfig, log=print):
    """(state, meta) of the newest readable checkpoint, or (None, None) if there is none.

    A damaged newest checkpoint is reported, moved aside to `<step>.damaged` (kept for inspection; the run will
    write that step again) and the previous one is used; an incompatible one is an error.
    """
    steps = sorted(mngr.all_steps(), reverse=True)
    damaged = []
    for step in steps:
        try:
            meta = read_meta(mngr, step)
            check_compatible(meta["model"], mcfg, str(mngr.directory))
            restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - any read failure means this checkpoint is unusable
            log(f"warning: checkpoint {step} in {mngr.directory} is damaged ({type(e).__name__}: "
                f"{str(e)[:120]}); trying the previous one")
            damaged.append(step)
            continue
        _set_aside(mngr, damaged, log)
        return restored.state, meta
    if steps:
        raise UserError(f"no readable checkpoint in {mngr.directory} (steps {steps} are all damaged); "
                        "remove them or use a new --workdir")
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


def load_model(workdir, step: int | None = None):
    """For analysis, export and generation: (model, meta) restored on the default device, no optimizer state.

    Raises UserError for a workdir without checkpoints or a step that does not exist.
    """
    from train.state import abstract_model, merge_model, split_model

    ckpt_dir = Path(workdir) / "checkpoints"
    if not ckpt_dir.is_dir():
        raise UserError(f"no checkpoints in {workdir}: train first with "
                        f"`python -m train --workdir {workdir}` or pass the right --workdir")
    mngr = ocp.CheckpointManager(ckpt_dir.absolute())
    steps = sorted(mngr.all_steps())
    if not steps:
        raise UserError(f"no checkpoints in {ckpt_dir}: train first or pass the right --workdir")
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise UserError(f"no checkpoint for step {step} in {ckpt_dir}; available steps: {steps}")
    meta = read_meta(mngr, step)
    mcfg = ModelConfig(**meta["model"])
    graphdef, params, bias = split_model(abstract_model(mcfg))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"params": params, "bias": bias}
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), target)
    restored = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                     partial_restore=True)))
    model = merge_model(graphdef, restored.state["params"], restored.state["bias"])
    return model, meta


def meta_config(meta: dict) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(meta["config"])


def tokenizer_json(meta: dict) -> str:
    return meta["tokenizer"]


def dump_tokenizer(meta: dict, path) -> Path:
    path = Path(path)
    path.write_text(meta["tokenizer"], encoding="utf-8")
    return path


def steps_in(workdir) -> list[int]:
    ckpt_dir = Path(workdir) / "checkpoints"
    return sorted(ocp.CheckpointManager(ckpt_dir.absolute()).all_steps()) if ckpt_dir.is_dir() else []

