"""What a person sees while training: a progress bar (or, without one, a line every log.every steps), a line at
each evaluation and checkpoint, and a closing summary. Only process 0 prints."""

import time

from tqdm import tqdm


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h {m:02d}m" if h else f"{m}m {s:02d}s" if m else f"{s}s"


class Progress:
    def __init__(self, total: int, start: int, active: bool, bar: bool, log=print):
        self.total, self.start, self.active, self.log = total, start, active, log
        self.want_bar = active and bar
        self.bar = None  # drawn from the first step on: before it, the time is compilation, not steps
        self.t0 = None  # wall time after the first step (its compile would make every rate and ETA wrong)
        self.n0 = start
        self.tps = None  # the last measured tokens/s, shown until the next measurement
        self._last = start

    def line(self, msg: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            self.log(msg)

    def step(self, step: int, loss: float, tokens_per_sec: float | None, every: int) -> None:
        self._last = step
        if not self.active:
            return
        if self.t0 is None:
            self.t0, self.n0 = time.perf_counter(), step
            if self.want_bar:  # the bar's rate and ETA count from the first step done, not from the compile
                self.bar = tqdm(total=self.total, initial=step, desc="train", dynamic_ncols=True, unit="step")
        self.tps = tokens_per_sec or self.tps
        if self.bar is not None:
            post = {"loss": f"{loss:.3f}"}
            if self.tps:
                post["tok/s"] = f"{self.tps:,.0f}"
            self.bar.set_postfix(post, refresh=False)  # before update(), which draws: the bar shows this step
            self.bar.update(step - self.bar.n)
        elif step % every == 0 or step == self.total:
            eta = ""
            if step > self.n0:
                per_step = (time.perf_counter() - self.t0) / (step - self.n0)
                eta = f" | eta {duration(per_step * (self.total - step))}"
            tps = f" | {tokens_per_sec:,.0f} tok/s" if tokens_per_sec else ""
            self.log(f"step {step}/{self.total} | loss {loss:.4f}{tps}{eta}")

    def unpause(self) -> None:
        """Leave the time just spent (compile, evaluation, checkpoint) out of the bar's rate and ETA."""
        if self.bar is not None:
            self.bar.unpause()
        if self.t0 is not None:
            self.t0, self.n0 = time.perf_counter(), self._last

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def eval_line(step: int, ev: dict) -> str:
    domains = {k.split("/", 2)[2]: v for k, v in ev.items() if k.startswith("val/loss/")}
    text = f"step {step}: val loss {ev['val/loss']:.4f}"
    if domains:
        best, worst = min(domains, key=domains.get), max(domains, key=domains.get)
        text += f" (best {best} {domains[best]:.3f}, worst {worst} {domains[worst]:.3f})"
    return text
