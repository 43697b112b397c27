"""The mask study, round 1: causal vs prefix-LM vs mixed decoders on input->output rows.

    python -m experiments.masks_round1 compare-masks --config experiments/masks_round1/config.py \
        --masks causal,prefix,mixed --seeds 3 --steps 150 [--nope] [--out runs/compare_masks] \
        [--report_only] [--config.train.batch_size=8 ...]

Trains every (mask, position encoding, seed) with everything else identical: the same config, data order
(train.seed = seed index), initial weights (parameters do not depend on the mask), parameter count, steps and
optimizer. With --nope each mask also trains with model.rope=False. Each run lives in OUT/<mask>[-nope]/seed<k>
and is trained by train.loop.run, which resumes from its last checkpoint; a finished run leaves result.json
(final validation loss, curves, attention-rank summary) and is skipped on the next invocation, so re-running the
same command after an interruption continues the study. The report goes to OUT/report/ (report.md, PNGs,
results.json).
"""

import copy
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from ml_collections import ConfigDict

from analysis.rank.attention import analyse, select_rows
from experiments.common.cli import Interrupted, run_cli, seeds_and_steps, study_parser, use_compilation_cache
from experiments.common.runs import fingerprint, read_metrics
from experiments.masks_round1.report import write_report
from moe import param_counts, train_flops_per_token
from plumbing.args import ArgParser
from plumbing.errors import UserError
from rundir import RunDir, open_run
from rundir.checkpoints import steps_in
from rundir.provenance import provenance
from train.command_line import config_from_argv
from train.inputs import eval_rows
from train.loop import run as train_run
from train.preflight import parse

RANK_SEQUENCES = 8
DEFAULT_CONFIG = "experiments/masks_round1/config.py"


def variant_name(mask: str, rope: bool) -> str:
    return mask if rope else f"{mask}-nope"


def variants(masks, nope: bool):
    """[(mask, rope)] in report order: every mask with RoPE, then (with nope) every mask without."""
    return [(m, True) for m in masks] + ([(m, False) for m in masks] if nope else [])


def run_config(base, mask: str, rope: bool, seed: int, steps: int):
    c = copy.deepcopy(base)
    c.model.mask, c.model.rope = mask, rope
    c.train.seed, c.train.steps = seed, steps
    return c


def attention_cost(config, mcfg) -> dict:
    """Attended (query, key) pairs per validation row, per mask, and the FLOP share they would add if attention
    were computed only where the mask allows it. The model FLOPs counted (moe.train_flops_per_token) are the same
    for every mask; executed FLOPs differ: the einsum path computes the full L x L square for every mask, the
    default blockwise path skips the key blocks above the diagonal for the causal mask only."""
    rows = eval_rows(config)
    n = rows["segment_ids"].sum(-1).astype(np.float64)
    P = rows["prefix_len"].astype(np.float64) if "prefix_len" in rows else np.zeros_like(n)
    causal = n * (n + 1) / 2
    extra = {"causal": 0.0, "mixed": 0.0, "prefix": P * (P - 1) / 2, "bidirectional": n * n - causal}
    per_pair = 6 * 2 * mcfg.n_layers * mcfg.n_heads * mcfg.head_dim  # QK^T and PV, fwd + bwd
    total = train_flops_per_token(mcfg, config.data.seq_len) * n.sum()
    return {m: {"pairs_per_row": float(np.mean(causal + e)), "extra_flop_share": float(np.sum(e) * per_pair / total)}
            for m, e in extra.items()}


def summarize_run(config, workdir, seconds: float) -> dict:
    train, evals = read_metrics(workdir)
    last = evals[max(evals)]
    rank = analyse(open_run(workdir).model, select_rows(eval_rows(config), RANK_SEQUENCES))
    mcfg = parse(config).model
    return {
        "mask": config.model.mask, "rope": bool(config.model.rope), "seed": int(config.train.seed),
        "steps": int(config.train.steps), "fingerprint": fingerprint(config), "train_seconds": seconds,
        "params": param_counts(mcfg), "val_loss": last["val/loss"],
        "val_loss_by_domain": {k.split("/", 2)[2]: v for k, v in last.items() if k.count("/") == 2},
        "train_curve": sorted(train.items()), "val_curve": sorted((s, r["val/loss"]) for s, r in evals.items()),
        "attention": rank["attention"], "collapse": rank["collapse"],
    }


def train_one(config, workdir, log=print, run_fn=None) -> dict:
    """Train (or resume) one run and cache its result; a cached result with the same fingerprint is returned as is."""
    workdir = Path(workdir)
    cache = workdir / "result.json"
    fp = fingerprint(config)
    if cache.exists():
        result = json.loads(cache.read_text())
        if result.get("fingerprint") != fp:
            raise UserError(f"{workdir} holds a finished run with a different config; use another --out or "
                            f"delete {workdir}")
        log(f"{workdir}: cached (val/loss {result['val_loss']:.4f})")
        return result
    started = workdir / "config.json"
    if started.exists():
        if fingerprint(ConfigDict(json.loads(started.read_text()))) != fp:
            raise UserError(f"{workdir} holds an unfinished run with a different config; use another --out or "
                            f"delete {workdir}")
    run_fn = train_run if run_fn is None else run_fn
    t0 = time.perf_counter()
    run_fn(config, workdir, log=log)
    done = steps_in(RunDir(workdir).checkpoints)
    if not done or done[-1] < config.train.steps:
        raise Interrupted(f"{workdir} stopped at step {done[-1] if done else 0} of {config.train.steps}")
    result = summarize_run(config, workdir, time.perf_counter() - t0)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps({**result, "provenance": provenance()}))
    os.replace(tmp, cache)  # atomic: a kill never leaves a half-written cache
    return result


def cached_result(config, workdir):
    """The finished run's result if `workdir` holds one for this config, else None."""
    cache = Path(workdir) / "result.json"
    if not cache.exists():
        return None
    result = json.loads(cache.read_text())
    return result if result.get("fingerprint") == fingerprint(config) else None


def compare_masks(base, masks, seeds: int, steps: int, nope: bool, out, log=print, run_fn=None,
                  report_only: bool = False) -> Path:
    """Train every variant x seed (resuming / skipping finished runs), then write the report. Returns its path.
    report_only: train nothing; report the finished runs (the report lists the missing ones)."""
    out = Path(out)
    # seed-major: a study cut short still has every variant at each completed seed
    runs = [(m, r, s) for s in range(seeds) for m, r in variants(masks, nope)]
    for m, r, s in runs:  # validate every config before training anything
        parse(run_config(base, m, r, s, steps))
    results, missing = [], []
    for i, (m, r, s) in enumerate(runs):
        workdir = out / variant_name(m, r) / f"seed{s}"
        if report_only:
            res = cached_result(run_config(base, m, r, s, steps), workdir)
            (results if res else missing).append(res or f"{variant_name(m, r)} seed {s}")
            continue
        log(f"[{i + 1}/{len(runs)}] {variant_name(m, r)} seed {s}")
        results.append(train_one(run_config(base, m, r, s, steps), workdir, log, run_fn))
    if not results:
        raise UserError(f"no finished runs in {out} for these settings; run without --report_only first")
    if missing:
        log(f"reporting {len(results)} finished runs; not finished: {', '.join(missing)}")

    cost = attention_cost(base, parse(base).model)
    return write_report(results, out / "report", cost, base, missing)


def parser() -> ArgParser:
    extra = ((("command",), {"choices": ["compare-masks"], "help": "the study to run"}),
             (("--masks",), {"default": "causal,prefix,mixed", "help": "comma-separated masks to compare"}))
    p = study_parser("python -m experiments.masks_round1", __doc__, DEFAULT_CONFIG, "runs/compare_masks", 3,
                     "seeds per variant (train.seed = 0 .. seeds-1)", "study directory (runs, caches, report/)",
                     extra=extra)
    p.add_argument("--nope", action="store_true", help="also train every mask without position encoding")
    return p


def parse_flags(argv):
    """argv[0] is the program name."""
    config, _, rest = config_from_argv(list(argv[1:]), DEFAULT_CONFIG)
    args = parser().parse_args(rest)
    masks = [m.strip() for m in args.masks.split(",") if m.strip()]
    bad = [m for m in masks if m not in ("causal", "prefix", "mixed")]
    if not masks or bad or len(set(masks)) != len(masks):
        raise UserError(f"--masks takes distinct names from causal,prefix,mixed (input->output rows need a "
                        f"next-token mask), got {args.masks!r}")
    steps = seeds_and_steps(args, config, min_seeds=1)
    config.data.task = "prefix"
    return config, masks, args.seeds, steps, args.nope, args.out, args.report_only


def main(argv=None):
    def run(argv):
        config, masks, seeds, steps, nope, out, report_only = parse_flags(argv)
        use_compilation_cache(out)  # the same mask's graph is compiled once for all seeds
        return compare_masks(config, masks, seeds, steps, nope, out, report_only=report_only)

    run_cli(sys.argv if argv is None else argv, parser, run)
