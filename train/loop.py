"""The training loop, top to bottom: claim the run, resume, step, log, evaluate, checkpoint, stop cleanly.

`run(config, workdir)` is what `python -m train` calls; experiments call it too. Each concern is a small piece:
the checks (train/preflight.py), the data (train/inputs.py), the state (train/state.py), the step (train/step.py),
the host side of each step (train/step_log.py), validation (train/evaluation.py), checkpoints (train/saver.py).
"""

import contextlib
import os
import threading
import time
from pathlib import Path

import jax

from moe import param_counts, train_flops_per_token
from plumbing.errors import UserError
from rundir import checkpoints, compile_cache, layout
from rundir import metrics as metrics_file
from rundir.lock import RunLock
from train import host_memory, inputs, optim, signals
from train import mesh as mesh_lib
from train.data.packing import iterate
from train.evaluation import draw_loss_curves, evaluate, to_global
from train.flops import measure_peak_flops
from train.preflight import causality_warning, check_memory, check_mesh, parse, resolved_line, to_json
from train.progress import duration
from train.references import gap_line, references
from train.saver import Saver
from train.state import init_state
from train.step import make_eval_step, make_train_step
from train.step_log import StepLog


def maybe_init_distributed() -> None:
    """Several processes (SLURM, or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID set by hand)."""
    multi = int(os.environ.get("SLURM_NTASKS", "1")) > 1 or "JAX_COORDINATOR_ADDRESS" in os.environ
    if multi and not jax.distributed.is_initialized():
        # jax reads JAX_COORDINATOR_ADDRESS itself but not the other two (SLURM sets all three its own way).
        n, i = os.environ.get("JAX_NUM_PROCESSES"), os.environ.get("JAX_PROCESS_ID")
        jax.distributed.initialize(num_processes=None if n is None else int(n),
                                   process_id=None if i is None else int(i))


def run(config, workdir, log=print) -> dict:
    """Train (or resume) the run in `workdir` with `config` (a RunConfig, or a ConfigDict parsed here). Returns
    the last logged metrics plus the last eval, with "stopped_by" set when SIGTERM / SIGINT stopped it early
    (after saving a checkpoint)."""
    rc = parse(config)
    host_memory.keep_freed_memory()  # before JAX computes anything: made later, it changes little
    maybe_init_distributed()
    mesh = make_mesh(rc)
    check_mesh(rc, mesh)
    check_memory(rc, mesh, jax.devices()[0])
    # Tokenizer, data set and vocabulary are checked before anything is written into the run directory.
    inputs.check_vocab(rc.data, rc.model.vocab_size)
    data = inputs.sampler(rc), inputs.eval_batches(rc, jax.process_index(), jax.process_count())
    resolved = rc.execution.resolved()
    with claimed(workdir, rc, resolved, log) as run_dir:
        compile_cache.enable(rc.train.compile_cache_dir, log)  # after the input checks
        return train(rc, mesh, run_dir, data, log)


def make_mesh(rc):
    """The device mesh, after checking that every process feeds whole rows of every micro-batch."""
    t = rc.train
    mesh = mesh_lib.make_mesh(rc.mesh)
    dp = mesh_lib.data_parallel_size(mesh)
    if dp % jax.process_count():
        raise UserError(f"mesh.data x mesh.fsdp ({dp}) must be a multiple of the {jax.process_count()} processes: "
                        "each process feeds its own batch rows; keep mesh.expert/tensor within a host")
    if t.batch_size % (dp * t.grad_accum):
        raise UserError(f"train.batch_size ({t.batch_size}) must be divisible by the data-parallel size "
                        f"(mesh.data x mesh.fsdp = {dp}) times train.grad_accum ({t.grad_accum})")
    return mesh


@contextlib.contextmanager
def claimed(workdir, rc, resolved, log):
    """The run directory, held: checked (never a directory that is not a run), locked, created with its config
    and the platform's execution choices on first use; signal handlers installed. Only process 0 writes into the
    run directory; the others would race with its creation."""
    process0 = jax.process_index() == 0
    run_dir = layout.check_workdir(workdir) if process0 else layout.RunDir(Path(workdir))
    own_signals = not signals.installed() and threading.current_thread() is threading.main_thread()
    if own_signals:
        signals.install()
    lock = None
    try:
        if process0:
            run_dir.root.mkdir(parents=True, exist_ok=True)
            lock = RunLock(run_dir.lock).acquire()
            if lock.previous:
                log(f"took over the lock left by a stopped process ({lock.previous})")
            if not run_dir.is_run():
                layout.create(run_dir, to_json(rc, resolved))
            log(resolved_line(resolved, rc))
        yield run_dir
    finally:
        if lock is not None:
            lock.release()
        if own_signals:
            signals.uninstall()


def _check_history(run_dir) -> None:
    """Refuse to restart at step 0 a run whose checkpoints are gone: it would append a second history to
    metrics.jsonl. A run killed before its first checkpoint completed is simply started again."""
    if checkpoints.steps_in(run_dir.checkpoints):
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


def train(rc, mesh, run_dir, data, log) -> dict:
    """The loop over steps in a claimed run directory: what `run` does once every check has passed."""
    t, mcfg = rc.train, rc.model
    say = log if jax.process_index() == 0 else (lambda *a: None)
    _check_history(run_dir)
    (sampler, domain_names), val_batches = data
    tx = optim.optimizer(t)
    graphdef, state, shardings = init_state(mcfg, tx, t.seed, mesh)
    saver = Saver(rc, run_dir, inputs.tokenizer_path(rc.data), say)
    state, start = saver.restore(state)
    if start >= t.steps:
        say(f"{run_dir.root} is already trained to step {start} (train.steps={t.steps}); nothing to do. "
            "Raise --config.train.steps to train longer.")
        saver.close()
        return _last_rows(run_dir)
    if start:
        say(f"resuming {run_dir.root} from step {start}")
        changed = changed_settings(saver.restored_config, rc)
        if changed:
            say(f"note: the config differs from the one checkpoint {start} was trained with: {'; '.join(changed)}. "
                f"Steps {start + 1} on follow the new values (the learning-rate schedule, bias updates and MTP "
                "weight are functions of the step and these settings); pass the old values to continue as before")
    refs = references(rc) if jax.process_index() == 0 else None  # cached after a run's first use
    train_step, eval_step = compile_steps(rc, mesh, graphdef, tx, shardings, len(domain_names), say)
    tokens_per_step = t.batch_size * rc.data.seq_len
    peak = float(rc.log.peak_flops) or measure_peak_flops()
    say(header(rc, mesh, start))
    steps = StepLog(rc, run_dir, start, tokens_per_step=tokens_per_step, peak=peak,
                    flops_per_step=train_flops_per_token(mcfg, rc.data.seq_len) * tokens_per_step,
                    moe_layer_ids=mcfg.train_load_layer_ids, last_checkpoint=lambda: saver.last_saved, say=say)
    stopped_by, step = signals.requested(), start
    if stopped_by:
        say(f"{stopped_by} before the first step: nothing trained, nothing to save")
        steps.close()
        saver.close()
        return {"stopped_by": stopped_by}
    try:
        batches = iterate(sampler, start, t.batch_size, jax.process_index(), jax.process_count())
        for step in range(start + 1, t.steps + 1):
            state, metrics = train_step(state, to_global(next(batches)[1], mesh))
            steps.push(step, metrics)  # pulls the previous step's metrics now that this one is dispatched
            stopped_by = signals.requested()
            if step % rc.eval.every == 0 or step == t.steps:
                steps.flush()
                ev = evaluate(eval_step, state, val_batches, mesh, domain_names, mcfg.moe_layer_ids)
                saver.report(steps.line, wait=True)  # earlier checkpoints' lines first: the console reads in order
                steps.evaluation(step, ev)
                if jax.process_index() == 0:
                    draw_loss_curves(run_dir, say, refs)
                steps.restart_clock(step)
            if step % rc.checkpoint.every == 0 or step == t.steps or stopped_by:
                steps.flush()  # never save a state whose step went NaN
                saver.save(step, state, steps.line)
                steps.restart_clock(step)
            if stopped_by:
                break
        steps.flush()
        saver.report(steps.line, wait=True)
    finally:
        saver.close()
        steps.close()
    if stopped_by:
        say(f"{stopped_by}: saved a checkpoint at step {step} in {run_dir.checkpoints}; re-run the same command "
            f"to resume from step {step}")
        return {**steps.last, "stopped_by": stopped_by}
    say(summary(run_dir, step, t.steps, time.perf_counter() - steps.t_begin, (step - start) * tokens_per_step,
                steps.last, refs))
    return steps.last


# What shapes a run's trajectory from step to step: a difference on resume is reported, never silent.
SCHEDULE_SECTIONS = ("train", "data")


def changed_settings(saved: dict | None, rc) -> list[str]:
    """'train.steps 60 -> 800', ... for every training or data setting that differs from the saved run config (the
    compilation cache's directory is where programs are cached, not what they compute)."""
    now = rc.to_dict()
    out = []
    for section in SCHEDULE_SECTIONS:
        old = (saved or {}).get(section, {})
        for key, value in now[section].items():
            if key != "compile_cache_dir" and key in old and old[key] != value:
                out.append(f"{section}.{key} {old[key]!r} -> {value!r}")
    return out


def compile_steps(rc, mesh, graphdef, tx, shardings, n_domains: int, say):
    """(train_step, eval_step), jitted: the train step donates the old state and keeps the state's layout (and
    so the checkpoints')."""
    train_ex, eval_ex = rc.execution_on(mesh), rc.execution_on(mesh, evaluation=True)
    warning = causality_warning(rc)
    if warning:
        say(warning)
    if mesh.shape["expert"] > 1 and train_ex.dispatch == "dropless":
        say(f"note: execution.dispatch=dropless on mesh.expert={mesh.shape['expert']}: XLA partitions the sorted "
            "grouped matmul; execution.dispatch=expert_parallel_dropless moves tokens with all_to_all instead "
            "(docs/scaling.md)")
    step_fn = make_train_step(graphdef, tx, optim.schedule(rc.train), rc.train, train_ex)

    def sharded_step(state, batch):
        new_state, metrics = step_fn(state, batch)
        return jax.lax.with_sharding_constraint(new_state, shardings), metrics

    return jax.jit(sharded_step, donate_argnums=0), jax.jit(make_eval_step(graphdef, n_domains, eval_ex))


def header(rc, mesh, start: int) -> str:
    """What is being trained, in one line."""
    counts, t, d = param_counts(rc.model), rc.train, rc.data
    devices = f"{jax.device_count()} {jax.devices()[0].platform} device" + ("s" if jax.device_count() > 1 else "")
    return (f"training {counts['total'] / 1e6:.2f}M parameters ({counts['active'] / 1e6:.2f}M active per token) "
            f"on {d.name} ({d.task}, {d.seq_len}-token rows, batch {t.batch_size}), steps {start} -> {t.steps}, "
            f"{devices}, mesh {dict((k, v) for k, v in mesh.shape.items() if v > 1) or 'none'}")


def summary(run_dir, step: int, steps: int, seconds: float, tokens: int, last: dict, refs=None) -> str:
    root = run_dir.root
    lines = [f"done: step {step}/{steps} in {duration(seconds)} ({tokens / max(seconds, 1e-9):,.0f} tokens/s incl. "
             f"compile and evaluation)"]
    if "loss" in last:
        lines.append(f"  train loss {last['loss']:.4f}")
    if "val/loss" in last:
        lines.append("  " + gap_line(last["val/loss"], refs))
    outputs = [f"checkpoints/{step}", "metrics.jsonl"] + [p.name + ("/" if p.is_dir() else "")
                                                         for p in (run_dir.loss_curves, run_dir.tensorboard)
                                                         if p.exists()]
    lines.append(f"  outputs in {root}: {', '.join(outputs)}")
    lines.append(f"  next: python -m analysis.routing --workdir {root}")
    return "\n".join(lines)
