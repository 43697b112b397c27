"""The host side of every train step: the NaN check, metrics every log.every steps (tokens/s and MFU measured on
training alone), evaluation rows, and what a person sees (train/progress.py).

The loop dispatches step N+1 before it pulls step N's metrics to the host (`push`), so the device never waits on
logging; `flush` pulls the pending step before anything that needs it done (an evaluation, a checkpoint).
"""

import math
import time

import jax

from plumbing.errors import UserError
from train.metrics_writer import MetricsWriter, flatten
from train.progress import Progress, eval_line


class StepLog:
    def __init__(self, config, run_dir, start: int, *, tokens_per_step: int, flops_per_step: float, peak: float,
                 moe_layer_ids, last_checkpoint, say=print):
        """last_checkpoint(): the newest saved step (or None), named when a step goes NaN."""
        process0 = jax.process_index() == 0
        self.every, self.steps, self.start = config.log.every, config.train.steps, start
        self.tokens_per_step, self.flops_per_step, self.peak = tokens_per_step, flops_per_step, peak
        self.moe_layer_ids, self.last_checkpoint, self.run_dir = moe_layer_ids, last_checkpoint, run_dir.root
        self.writer = MetricsWriter(run_dir.root, config.log.tensorboard, purge_step=start + 1 if start else None)
        self.progress = Progress(self.steps, start, process0, config.log.progress, say)
        self.last = {}  # the last logged step's metrics, plus any evaluation since: what `run` returns
        self.pending = None  # (step, device metrics) not pulled yet
        self.t_begin = time.perf_counter()
        self.restart_clock(start)

    def push(self, step: int, metrics) -> None:
        """Step `step` is dispatched: pull the previous one, keep this one pending."""
        self.flush()
        self.pending = (step, metrics)

    def flush(self) -> None:
        if self.pending is not None:
            step, metrics = self.pending
            self.pending = None
            self._pull(step, metrics)

    def _pull(self, step: int, metrics) -> None:
        host = jax.device_get(metrics)
        if not all(math.isfinite(float(host[k])) for k in ("loss", "grad_norm", "param_norm")):
            saved = self.last_checkpoint()
            good = f"the last good checkpoint is step {saved}" if saved else "no checkpoint was saved"
            raise UserError(f"loss, gradients or parameters became NaN/Inf at step {step}; stopped, {good} in "
                            f"{self.run_dir}; lower train.lr or raise train.warmup_steps")
        tps = None
        if step % self.every == 0 or step == self.steps:
            now = time.perf_counter()
            tps = (step - self.clock[1]) * self.tokens_per_step / max(now - self.clock[0], 1e-9)
            self.clock = (now, step)
            self.last = flatten(host, self.moe_layer_ids)
            self.last.update(tokens_per_sec=tps, peak_flops=self.peak,
                             mfu=tps / self.tokens_per_step * self.flops_per_step / (self.peak * jax.device_count()))
            self.writer.write(step, self.last)
        self.progress.step(step, float(host["loss"]), tps, self.every)
        if step == self.start + 1:  # compile time is worth knowing (execution.scan_layers cuts it on deep models)
            self.line(f"step {step}: done {time.perf_counter() - self.t_begin:.1f} s into training, compiling the "
                      "train step included")
            self.restart_clock(step)

    def evaluation(self, step: int, ev: dict) -> None:
        self.writer.write(step, ev)
        self.last.update(ev)
        self.line(eval_line(step, ev))

    def line(self, text: str) -> None:
        self.progress.line(text)

    def restart_clock(self, step: int) -> None:
        """tokens/s and the ETA measure training only: not the first step's compile, evaluations or saves."""
        self.clock = (time.perf_counter(), step)
        self.progress.unpause()

    def close(self) -> None:
        self.writer.close()
        self.progress.close()
