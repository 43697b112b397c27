"""The training loop, top to bottom: set up, resume, step, log, evaluate, checkpoint, stop cleanly.

`run(config, workdir)` is what `python -m train` calls; experiments call it too.
"""

import math
import os
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from moe import param_counts, router, train_flops_per_token
from moe.sharding import use_mesh
from train import checkpoint, inputs, optim
from train import mesh as mesh_lib
from train.config import check, to_json
from train.data.packing import iterate
from train.errors import UserError
from train.flops import measure_peak_flops
from train.metrics import MetricsWriter, flatten
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


class Preemption:
    """SIGTERM sets a flag; the loop saves a checkpoint at the next step boundary and exits 0."""

    def __init__(self):
        self.requested = False
        self._old = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def close(self):
        signal.signal(signal.SIGTERM, self._old)


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
        result[f"moe/layer_{layer}/maxvio_global"] = float(router.max_violation(jnp.asarray(load_E)))
    return result


def run(config, workdir, log=print) -> dict:
    """Train (or resume) the run in `workdir`. Returns the last logged metrics plus the last eval."""
    mcfg = check(config)
    maybe_init_distributed()
    t, workdir = config.train, Path(workdir)
    mesh = mesh_lib.make_mesh(config.mesh)
    dp = mesh_lib.data_parallel_size(mesh)
    if dp % jax.process_count():
        raise UserError(f"mesh.data x mesh.fsdp ({dp}) must be a multiple of the {jax.process_count()} processes: "
                        "each process feeds its own batch rows; keep mesh.expert/tensor within a host")
    if t.batch_size % (dp * t.grad_accum):
        raise UserError(f"train.batch_size ({t.batch_size}) must be divisible by the data-parallel size "
                        f"(mesh.data x mesh.fsdp = {dp}) times train.grad_accum ({t.grad_accum})")
    inputs.check_vocab(config.data, mcfg.vocab_size)
    sampler, domain_names = inputs.sampler(config)
    pi, pc = jax.process_index(), jax.process_count()
    val_batches = inputs.eval_batches(config, pi, pc)

    lr_schedule = optim.schedule(t)
    tx = optim.optimizer(t)
    graphdef, state, shardings = init_state(mcfg, tx, t.seed, mesh)
    mngr = checkpoint.manager(workdir, config.checkpoint.keep, config.checkpoint.async_save)
    restored, meta = checkpoint.restore_latest(mngr, abstract_state(state), mcfg, log)
    start = 0
    if restored is not None:
        state, start = restored, int(meta["data_position"])
        log(f"resuming {workdir} from step {start}")
    elif pi == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.json").write_text(to_json(config))
    tok_path = inputs.tokenizer_path(config.data)

    step_fn = make_train_step(graphdef, tx, lr_schedule, t)

    def sharded_step(state, batch):  # the new state keeps the layout of the old one (and of checkpoints)
        new_state, metrics = step_fn(state, batch)
        return jax.lax.with_sharding_constraint(new_state, shardings), metrics

    train_step = jax.jit(sharded_step, donate_argnums=0)
    eval_step = jax.jit(make_eval_step(graphdef, len(domain_names)))

    moe_layer_ids = [i for i in range(mcfg.n_layers) if mcfg.is_moe_layer(i)]
    counts = param_counts(mcfg)
    tokens_per_step = t.batch_size * config.data.seq_len
    flops_per_step = train_flops_per_token(mcfg, config.data.seq_len) * tokens_per_step
    peak = config.log.peak_flops or measure_peak_flops()
    log(f"model: {counts['total'] / 1e6:.2f}M params, {counts['active'] / 1e6:.2f}M active | mesh "
        f"{dict(mesh.shape)} | batch {t.batch_size} x {config.data.seq_len} | steps {start}->{t.steps}")

    writer = MetricsWriter(workdir, config.log.tensorboard)
    preempt = Preemption()
    bar = None
    if config.log.progress and pi == 0:
        from tqdm import tqdm

        bar = tqdm(total=t.steps, initial=start, desc="train", dynamic_ncols=True)
    last, pending = {}, None
    last_saved = start if restored is not None else None
    timer = (time.perf_counter(), start)

    def pull(step, metrics):
        """Host side of step `step`: NaN check every step; log every log.every steps."""
        nonlocal last, timer
        host = jax.device_get(metrics)
        if not all(math.isfinite(float(host[k])) for k in ("loss", "grad_norm", "param_norm")):
            good = f"the last good checkpoint is step {last_saved}" if last_saved else "no checkpoint was saved"
            raise UserError(f"loss, gradients or parameters became NaN/Inf at step {step}; stopped, {good} in {workdir}; "
                            "lower train.lr or raise train.warmup_steps")
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{float(host['loss']):.3f}")
        if step % config.log.every == 0 or step == t.steps:
            now = time.perf_counter()
            elapsed, n = now - timer[0], step - timer[1]
            timer = (now, step)
            tps = n * tokens_per_step / max(elapsed, 1e-9)
            last = flatten(host, moe_layer_ids)
            last.update(tokens_per_sec=tps, mfu=tps / tokens_per_step * flops_per_step / (peak * jax.device_count()))
            writer.write(step, last)

    try:
        with use_mesh(mesh):
            data = iterate(sampler, start, t.batch_size, pi, pc)
            for step in range(start + 1, t.steps + 1):
                _, batch = next(data)
                state, metrics = train_step(state, _to_global(batch, mesh))
                if pending is not None:  # step N-1's metrics, pulled after step N is dispatched
                    pull(*pending)
                pending = (step, metrics)
                boundary = step == t.steps or preempt.requested
                if step % config.eval.every == 0 or step == t.steps:
                    pull(*pending)
                    pending = None
                    ev = evaluate(eval_step, state, val_batches, mesh, domain_names, moe_layer_ids)
                    writer.write(step, ev)
                    last.update(ev)
                if step % config.checkpoint.every == 0 or boundary:
                    if pending is not None:
                        pull(*pending)  # never save a state whose step went NaN
                        pending = None
                    checkpoint.save(mngr, step, state, config, mcfg, tok_path)
                    last_saved = step
                if preempt.requested:
                    log(f"SIGTERM: saved a checkpoint at step {step}; exiting")
                    break
            if pending is not None:
                pull(*pending)
    finally:
        mngr.wait_until_finished()
        mngr.close()
        writer.close()
        preempt.close()
        if bar is not None:
            bar.close()
    return last
