"""The training loop, top to bottom: claim the run, resume, step, log, evaluate, checkpoint, stop cleanly.

`run(config, workdir)` is what `python -m train` calls; experiments call it too.
"""

import math
import os
import threading
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from moe import param_counts, router, train_flops_per_token
from moe.errors import UserError
from rundir import checkpoints as checkpoint
from rundir import compile_cache, layout
from rundir import metrics as metrics_file
from rundir.lock import RunLock
from train import host_memory, inputs, optim, signals
from train import mesh as mesh_lib
from train.config import causality_warning, check, check_memory, check_mesh, execution, to_json
from train.data.packing import iterate
from train.flops import measure_peak_flops
from train.loss_curves import plot_loss_curves
from train.metrics import MetricsWriter, flatten
from train.progress import Progress, duration, eval_line
from train.state import abstract_state, init_state
from train.step import make_eval_step, make_train_step


def maybe_init_distributed() -> None:
    """Several processes (SLURM, or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID set by hand)."""
    multi = int(os.environ.get("SLURM_NTASKS", "1")) > 1 or "JAX_COORDINATOR_ADDRESS" in os.environ
    if multi and not jax.distributed.is_initialized():
        # jax reads JAX_COORDINATOR_ADDRESS itself but not the other two (SLURM sets all three its own way).
        n, i = os.environ.get("JAX_NUM_PROCESSES"), os.environ.get("JAX_PROCESS_ID")
        jax.distributed.initialize(num_processes=None if n is None else int(n),
                                   process_id=None if i is None else int(i))


def _to_global(batch: dict, mesh) -> dict:
    """This process's rows -> global arrays sharded over (data, fsdp) on the batch axis."""
    spec = PartitionSpec(("data", "fsdp"))
    return {k: jax.make_array_from_process_local_data(NamedSharding(mesh, spec), v) for k, v in batch.items()}


def evaluate(eval_step, state, batches, mesh, domain_names, moe_layer_ids) -> dict:
    ce, count, load = 0.0, 0.0, 0.0
    for b in batches:
        out = jax.device_get(eval_step(state, _to_global(b, mesh)))
        ce, count, load = ce + out["ce_sum"], count + out["count"], load + out["load"]
    result = {"val/loss": float(np.sum(ce) / max(np.sum(count), 1.0))}
    for d, name in enumerate(domain_names):
        if count[d] > 0:
            result[f"val/loss/{name}"] = float(ce[d] / count[d])
    for layer, load_E in zip(moe_layer_ids, np.atleast_2d(load)):
        result[f"moe/layer_{layer}/maxvio_global"] = float(router.max_violation(load_E))
    return result


def run(config, workdir, log=print) -> dict:
    """Train (or resume) the run in `workdir`. Returns the last logged metrics plus the last eval, with
    "stopped_by" set when SIGTERM / SIGINT stopped it early (after saving a checkpoint)."""
    mcfg = check(config)
    host_memory.keep_freed_memory()  # before JAX computes anything: made later, it changes little
    maybe_init_distributed()
    t = config.train
    mesh = mesh_lib.make_mesh(config.mesh)
    dp = mesh_lib.data_parallel_size(mesh)
    if dp % jax.process_count():
        raise UserError(f"mesh.data x mesh.fsdp ({dp}) must be a multiple of the {jax.process_count()} processes: "
                        "each process feeds its own batch rows; keep mesh.expert/tensor within a host")
    if t.batch_size % (dp * t.grad_accum):
        raise UserError(f"train.batch_size ({t.batch_size}) must be divisible by the data-parallel size "
                        f"(mesh.data x mesh.fsdp = {dp}) times train.grad_accum ({t.grad_accum})")
    check_mesh(config, mcfg, mesh)
    check_memory(config, mcfg, mesh, jax.devices()[0])
    # Tokenizer, data set and vocabulary are checked before anything is written into the run directory.
    pi, pc = jax.process_index(), jax.process_count()
    inputs.check_vocab(config.data, mcfg.vocab_size)
    data = inputs.sampler(config), inputs.eval_batches(config, pi, pc)
    # Only process 0 writes into the run directory; the others would race with its creation.
    run_dir = layout.check_workdir(workdir) if jax.process_index() == 0 else layout.RunDir(Path(workdir))
    compile_cache.enable(config.train.get("compile_cache_dir", ""), log)  # after the input checks
    own_signals = not signals.installed() and threading.current_thread() is threading.main_thread()
    if own_signals:
        signals.install()
    lock = None
    try:
        if jax.process_index() == 0:
            run_dir.root.mkdir(parents=True, exist_ok=True)
            lock = RunLock(run_dir.lock).acquire()
            if lock.previous:
                log(f"took over the lock left by a stopped process ({lock.previous})")
            if not run_dir.is_run():
                layout.create(run_dir, to_json(config))
        return _train(config, mcfg, mesh, run_dir, data, log)
    finally:
        if lock is not None:
            lock.release()
        if own_signals:
            signals.uninstall()


def _check_history(run_dir) -> None:
    """Refuse to restart at step 0 a run whose checkpoints are gone: it would append a second history to
    metrics.jsonl. A run killed before its first checkpoint completed is simply started again."""
    if checkpoint.steps_in(run_dir.checkpoints):
        return
    last = metrics_file.last_step(run_dir.metrics)
    marker = run_dir.read_marker()
    if last > 0 and (marker is None or marker.get("checkpointed", True)):
        raise UserError(f"{run_dir.root} has metrics up to step {last} but no checkpoint (checkpoints/ is missing "
                        "or empty), so it cannot resume; to start over on purpose move metrics.jsonl away, or "
                        "use a new --workdir")


def _last_rows(run_dir) -> dict:
    last = {}
    for row in metrics_file.read_rows(run_dir.metrics):
        last.update({k: v for k, v in row.items() if k != "step"})
    return last


def _train(config, mcfg, mesh, run_dir, data, log) -> dict:
    t, workdir = config.train, run_dir.root
    pi, pc = jax.process_index(), jax.process_count()
    say = log if pi == 0 else (lambda *a: None)
    _check_history(run_dir)
    (sampler, domain_names), val_batches = data

    lr_schedule = optim.schedule(t)
    tx = optim.optimizer(t)
    graphdef, state, shardings = init_state(mcfg, tx, t.seed, mesh)
    mngr = checkpoint.manager(run_dir.checkpoints, config.checkpoint.keep, config.checkpoint.async_save)
    restored, meta = checkpoint.restore_latest(mngr, abstract_state(state), mcfg, say)
    start = 0
    if restored is not None:
        state, start = restored, int(meta["data_position"])
        if start >= t.steps:
            say(f"{workdir} is already trained to step {start} (train.steps={t.steps}); nothing to do. "
                "Raise --config.train.steps to train longer.")
            return _last_rows(run_dir)
        say(f"resuming {workdir} from step {start}")
    if pi == 0:
        dropped = metrics_file.truncate_after(run_dir.metrics, start)
        if dropped:
            say(f"metrics.jsonl: dropped {dropped} row(s) after step {start} (a stopped run logged them; they are "
                "logged again)")
        if restored is not None and not (run_dir.read_marker() or {}).get("checkpointed"):
            run_dir.write_marker(checkpointed=True)  # also marks a run written before the marker existed
    tok_path = inputs.tokenizer_path(config.data)

    train_ex, eval_ex = execution(config, mesh), execution(config, mesh, evaluation=True)
    warning = causality_warning(config, mcfg)
    if warning:
        say(warning)
    if mesh.shape["expert"] > 1 and train_ex.dispatch == "dropless":
        say(f"note: execution.dispatch=dropless on mesh.expert={mesh.shape['expert']}: XLA partitions the sorted "
            "grouped matmul; execution.dispatch=expert_parallel_dropless moves tokens with all_to_all instead "
            "(docs/scaling.md)")
    step_fn = make_train_step(graphdef, tx, lr_schedule, t, train_ex)

    def sharded_step(state, batch):  # the new state keeps the layout of the old one (and of checkpoints)
        new_state, metrics = step_fn(state, batch)
        return jax.lax.with_sharding_constraint(new_state, shardings), metrics

    train_step = jax.jit(sharded_step, donate_argnums=0)
    eval_step = jax.jit(make_eval_step(graphdef, len(domain_names), eval_ex))

    moe_layer_ids = mcfg.moe_layer_ids
    counts = param_counts(mcfg)
    tokens_per_step = t.batch_size * config.data.seq_len
    flops_per_step = train_flops_per_token(mcfg, config.data.seq_len) * tokens_per_step
    peak = float(config.log.peak_flops) or measure_peak_flops()
    say(f"model: {counts['total'] / 1e6:.2f}M params, {counts['active'] / 1e6:.2f}M active | mesh "
        f"{dict(mesh.shape)} | dispatch {train_ex.dispatch} | batch {t.batch_size} x {config.data.seq_len} | steps {start}->{t.steps}")
    say(f"mfu is relative to {peak / 1e12:.3g} TFLOP/s per device ("
        + ("from log.peak_flops)" if config.log.peak_flops else "measured now; fix it with --config.log.peak_flops)"))

    writer = MetricsWriter(workdir, config.log.tensorboard, purge_step=start + 1 if start else None)
    progress = Progress(t.steps, start, pi == 0, config.log.progress, say)
    last, pending = {}, None
    last_saved = start if restored is not None else None
    checkpointed = restored is not None
    timer = (time.perf_counter(), start)
    t_begin, stopped_by = time.perf_counter(), signals.requested()

    def restart_clock(step):
        """tokens/s and the ETA measure training only: not the first step's compile, evaluations or saves."""
        nonlocal timer
        timer = (time.perf_counter(), step)
        progress.unpause()

    def pull(step, metrics):
        """Host side of step `step`: NaN check every step; log every log.every steps."""
        nonlocal last, timer
        host = jax.device_get(metrics)
        if not all(math.isfinite(float(host[k])) for k in ("loss", "grad_norm", "param_norm")):
            good = f"the last good checkpoint is step {last_saved}" if last_saved else "no checkpoint was saved"
            raise UserError(f"loss, gradients or parameters became NaN/Inf at step {step}; stopped, {good} in {workdir}; "
                            "lower train.lr or raise train.warmup_steps")
        tps = None
        if step % config.log.every == 0 or step == t.steps:
            now = time.perf_counter()
            elapsed, n = now - timer[0], step - timer[1]
            timer = (now, step)
            tps = n * tokens_per_step / max(elapsed, 1e-9)
            last = flatten(host, moe_layer_ids)
            last.update(tokens_per_sec=tps, peak_flops=peak,
                        mfu=tps / tokens_per_step * flops_per_step / (peak * jax.device_count()))
            writer.write(step, last)
        progress.step(step, float(host["loss"]), tps, config.log.every)
        if step == start + 1:  # compile time is worth knowing (execution.scan_layers cuts it on deep models)
            progress.line(f"step {step}: done {time.perf_counter() - t_begin:.1f} s into training, compiling the "
                          "train step included")
            restart_clock(step)

    saving = []  # steps whose (asynchronous) save has not been reported complete yet

    def report_saved(wait=False):
        if saving and (wait or not mngr.is_saving_in_progress()):
            if wait:
                mngr.wait_until_finished()
            for s in saving:
                progress.line(f"step {s}: saved checkpoint {run_dir.checkpoints / str(s)}")
            saving.clear()

    if stopped_by:
        say(f"{stopped_by} before the first step: nothing trained, nothing to save")
        writer.close()
        progress.close()
        return {"stopped_by": stopped_by}
    step = start
    try:
        data = iterate(sampler, start, t.batch_size, pi, pc)
        for step in range(start + 1, t.steps + 1):
            _, batch = next(data)
            state, metrics = train_step(state, _to_global(batch, mesh))
            if pending is not None:  # step N-1's metrics, pulled after step N is dispatched
                pull(*pending)
            pending = (step, metrics)
            stopped_by = signals.requested()
            boundary = step == t.steps or stopped_by
            if step % config.eval.every == 0 or step == t.steps:
                pull(*pending)
                pending = None
                ev = evaluate(eval_step, state, val_batches, mesh, domain_names, moe_layer_ids)
                writer.write(step, ev)
                last.update(ev)
                progress.line(eval_line(step, ev))
                if pi == 0:
                    draw_loss_curves(run_dir, say)
                restart_clock(step)
            if step % config.checkpoint.every == 0 or boundary:
                if pending is not None:
                    pull(*pending)  # never save a state whose step went NaN
                    pending = None
                report_saved()  # the previous save, if it has finished meanwhile
                checkpoint.save(mngr, step, state, config, mcfg, tok_path)
                last_saved = step
                saving.append(step)
                if not checkpointed:  # the first completed checkpoint: from now on the run can resume
                    mngr.wait_until_finished()
                    if pi == 0:
                        run_dir.write_marker(checkpointed=True)
                    checkpointed = True
                report_saved()
                restart_clock(step)
            if stopped_by:
                break
        if pending is not None:
            pull(*pending)
        report_saved(wait=True)
    finally:
        mngr.wait_until_finished()
        mngr.close()
        writer.close()
        progress.close()
    seconds = time.perf_counter() - t_begin
    if stopped_by:
        say(f"{stopped_by}: saved a checkpoint at step {step} in {run_dir.checkpoints}; re-run the same command "
            f"to resume from step {step}")
        return {**last, "stopped_by": stopped_by}
    say(summary(run_dir, step, t.steps, seconds, (step - start) * tokens_per_step, last))
    return last


def draw_loss_curves(run_dir, say) -> None:
    """WORKDIR/loss_curves.png from metrics.jsonl, redrawn at every evaluation (written beside, then renamed);
    a plotting problem is a warning, never the end of a run."""
    tmp = run_dir.loss_curves.with_name(f".{run_dir.loss_curves.stem}.tmp.png")
    try:
        plot_loss_curves(metrics_file.read_rows(run_dir.metrics), tmp, title=str(run_dir.root))
        os.replace(tmp, run_dir.loss_curves)
    except Exception as e:  # noqa: BLE001
        tmp.unlink(missing_ok=True)
        say(f"warning: could not draw {run_dir.loss_curves} ({type(e).__name__}: {str(e)[:100]})")


def summary(run_dir, step: int, steps: int, seconds: float, tokens: int, last: dict) -> str:
    root = run_dir.root
    lines = [f"done: step {step}/{steps} in {duration(seconds)} ({tokens / max(seconds, 1e-9):,.0f} tokens/s incl. "
             f"compile and evaluation)"]
    losses = []
    if "loss" in last:
        losses.append(f"train loss {last['loss']:.4f}")
    if "val/loss" in last:
        losses.append(f"val loss {last['val/loss']:.4f}")
    if losses:
        lines.append("  " + ", ".join(losses))
    outputs = [f"checkpoints/{step}", "metrics.jsonl"] + [p.name + ("/" if p.is_dir() else "")
                                                         for p in (run_dir.loss_curves, run_dir.tensorboard)
                                                         if p.exists()]
    lines.append(f"  outputs in {root}: {', '.join(outputs)}")
    lines.append(f"  next: python -m analysis.routing --workdir {root}")
    return "\n".join(lines)
