"""Training throughput at several routed-expert counts, in real training: the train step's 8 -> 64 ratio once the
aux-loss-free bias has balanced the load (benchmarks.train_step times a fresh model, whose routing is not).

    python -m benchmarks.train_experts                                   # configs/default.py, 8 and 64 experts
    python -m benchmarks.train_experts --experts 8,64 --steps 200 --repeats 2 --config configs/default.py

Each run is `python -m train` (train.loop.run) on the config's data with model.n_routed_experts changed (top-k and
expert width fixed, group-limited routing dropped where the groups no longer fit), without evaluation or
checkpoints before the end, in a fresh directory under --out (deleted after unless --keep). Runs alternate
(8, 64, 8, 64, ...) so drifting load hits every count alike. tokens/s: the median of the loop's tokens_per_sec
over the logged windows after --warm_frac of the steps (the bias has balanced by then: MaxVio, the mean over MoE
layers and those windows, is printed beside it); the ratio is against the first expert count.
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import describe, table
from plumbing.errors import UserError, exit_with
from train import host_memory, loop
from train.command_line import config_from_argv


def expert_config(base, n_experts: int, steps: int):
    c = base.copy_and_resolve_references()
    c.model.n_routed_experts = n_experts
    if n_experts % c.model.n_group or c.model.topk_group > c.model.n_group:
        c.model.update(n_group=1, topk_group=1)
    c.train.steps = steps
    c.eval.every = c.checkpoint.every = steps + 1  # neither inside the timed windows
    c.log.update(every=max(1, min(c.log.every, steps // 10)), progress=False, tensorboard=False,
                 peak_flops=c.log.peak_flops or 1e12)  # a fixed peak: no matmul measured at start
    return c


def window_stats(metrics_path: Path, after_step: int) -> dict:
    """Median tokens/s and mean MaxVio (over MoE layers) of the logged windows past `after_step`."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "tokens_per_sec" in r and r["step"] > after_step]
    if not rows:
        raise UserError(f"no logged training windows past step {after_step} in {metrics_path}; raise --steps")
    maxvio = [np.mean([v for k, v in r.items() if k.endswith("/maxvio")]) for r in rows]
    return {"tokens/s": float(np.median([r["tokens_per_sec"] for r in rows])), "MaxVio": float(np.mean(maxvio)),
            "windows": len(rows)}


def measure(base, experts, steps: int, warm_frac: float, repeats: int, out: Path, keep: bool, log=print,
            run=None) -> list:
    run = loop.run if run is None else run
    per = {e: [] for e in experts}
    for rep in range(repeats):
        for e in experts:
            workdir = out / f"e{e}_r{rep}"
            log(f"training {e} routed experts, {steps} steps (repeat {rep + 1}/{repeats})")
            run(expert_config(base, e, steps), workdir, log=lambda *a: None)
            per[e].append(window_stats(workdir / "metrics.jsonl", int(warm_frac * steps)))
            if not keep:
                shutil.rmtree(workdir, ignore_errors=True)
    rows = []
    for e in experts:
        tps = [s["tokens/s"] for s in per[e]]
        rows.append({"routed experts": e, "tokens/s (median of repeats)": float(np.median(tps)),
                     "per repeat": ", ".join(f"{t:,.0f}" for t in tps),
                     "MaxVio": float(np.mean([s["MaxVio"] for s in per[e]])),
                     "windows": per[e][0]["windows"]})
    first = rows[0]["tokens/s (median of repeats)"]
    for r in rows:
        r["step time x first"] = first / r["tokens/s (median of repeats)"]
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/default.py", help="and --config.KEY=VALUE overrides, as for train")
    ap.add_argument("--experts", default="8,64")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warm_frac", type=float, default=0.5, help="windows before this fraction of steps dropped")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="", help="parent of the run directories (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    try:
        base, _, rest = config_from_argv(list(sys.argv[1:] if argv is None else argv), "configs/default.py")
        a = ap.parse_args(rest)
        try:
            experts = [int(e) for e in a.experts.split(",")]
        except ValueError:
            raise UserError(f"--experts takes comma-separated integers, got {a.experts!r}") from None
        if a.steps < 20 or not 0 <= a.warm_frac < 1 or a.repeats < 1 or len(set(experts)) != len(experts):
            raise UserError("need --steps >= 20, 0 <= --warm_frac < 1, --repeats >= 1 and distinct --experts")
        out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="train_experts_"))
        if a.out and out.exists() and any(out.iterdir()):
            raise UserError(f"--out {out} is not empty; give a new directory (runs are never written over)")
        host_memory.keep_freed_memory()  # before describe() starts JAX, as `python -m train` runs
        print(describe())
        rows = measure(base, experts, a.steps, a.warm_frac, a.repeats, out, a.keep)
        if not a.out and not a.keep:
            shutil.rmtree(out, ignore_errors=True)
    except UserError as e:
        exit_with(e)
    print(table(rows))


if __name__ == "__main__":
    main()
