"""The mask study, round 2: four arms x paired seeds on input->output windows, with a gate.

    python -m experiments.masks_round2 --out runs/study_masks [--config experiments/masks_round2/config.py]
        [--seeds 4] [--steps 60] [--arms causal,prefix,mixed,causal_all] [--probe_rows 24,8,8] [--report_only]
        [--lr_grid 1.5e-3,3e-3,6e-3] [--config.KEY=VALUE ...]

Arms (ARMS): causal (GPT, loss on the output half), prefix (UniLM: bidirectional input), mixed (Su's
triangular heads), causal_all (causal, loss on every token: the decoder-only model's practical advantage); opt-in
causal_half (causal_all's equal-targets control: a random half of every token's targets, so as many per step as
causal), causal_nope and prefix_nope (no position encoding; compared with their RoPE twin, and by the input-order
gap).
Every arm is validated on the output half of every validation window (eval.output_only) every eval.every steps.
For seed k every arm has the same data order and initial weights (train.seed = k), so arms compare paired by seed.
With --lr_grid every arm first trains once per rate on a held-out seed and runs its comparison seeds at the best one
(experiments.common.lr_select, docs/inference.md rule 10; OUT/lr_sweep/<arm>/lr<rate>); without it, at train.lr.

Each run lives in OUT/<arm>/seed<k> (train.loop.run: resumable); a finished run leaves result.json (curves,
per-domain losses, the input-replacement, input-shuffle and input-order gaps, 4-way continuation choice) and is
skipped when the same command runs again (probes added since are computed then from its checkpoint, if kept).
OUT/references.json holds the unigram / bigram references of the scored targets. The report
(experiments.masks_round2.report) goes to OUT/report/.
"""

import copy
import json
import sys
import time
from pathlib import Path

import numpy as np

from experiments.common import lr_select
from experiments.common.cli import Interrupted, run_cli, seeds_and_steps, study_parser, use_compilation_cache
from experiments.common.probes import continuation_choice, replace_inputs, row_losses, shuffle_inputs
from experiments.common.refs import study_references
from experiments.common.rows import all_rows, first_rows_per_domain, token_weighted
from experiments.common.runs import fingerprint, read_metrics
from experiments.masks_round2.report import write_report
from plumbing.args import ArgParser
from plumbing.errors import UserError
from rundir import RunDir, open_run
from rundir.atomic import write_text
from rundir.checkpoints import steps_in
from rundir.provenance import provenance
from train.command_line import config_from_argv
from train.inputs import task_cache
from train.loop import run as train_run
from train.preflight import parse

DEFAULT_CONFIG = "experiments/masks_round2/config.py"
# arm: (model.mask, train.prefix_loss, model.rope, train.equal_targets); the NoPE arms (item 7) are opt-in and
# are compared with their RoPE twin by the input-shuffle gap: a prefix-LM without positions is exactly invariant to
# shuffling its input. causal_half (opt-in) is causal_all's equal-targets control: loss on a random half of every
# window's targets, as many per step as causal, spread over input and output like causal_all's.
ARMS = {"causal": ("causal", False, True, False), "prefix": ("prefix", False, True, False),
        "mixed": ("mixed", False, True, False), "causal_all": ("causal", True, True, False),
        "causal_half": ("causal", True, True, True), "causal_nope": ("causal", False, False, False),
        "prefix_nope": ("prefix", False, False, False)}
DEFAULT_ARMS = ("causal", "prefix", "mixed", "causal_all")
# Sized by the pilot (experiments/masks_round2/README.md): one pass over all 1,148 validation windows costs ~30 s on the shared
# 2-core CPU, so the final loss uses all of them and the probes fixed per-domain subsets (the first rows of each).
GAP_ROWS_PER_DOMAIN = 24  # input-replacement gap (the gate)
SHUFFLE_ROWS_PER_DOMAIN = 8  # input-shuffle gap
CHOICE_ROWS_PER_DOMAIN = 8  # 4-way continuation choice (x4 candidate rows)
DEFAULT_PROBE_ROWS = f"{GAP_ROWS_PER_DOMAIN},{SHUFFLE_ROWS_PER_DOMAIN},{CHOICE_ROWS_PER_DOMAIN}"


def arm_config(base, arm: str, seed: int, steps: int, lr: float | None = None):
    """One run's config; lr: the arm's learning rate (default train.lr)."""
    c = copy.deepcopy(base)
    c.model.mask, c.train.prefix_loss, c.model.rope, c.train.equal_targets = ARMS[arm]
    c.train.seed, c.train.steps = seed, steps
    if lr is not None:
        c.train.lr = lr
    return c


def probes(model, rows, seed: int = 0, sizes=None) -> dict:
    """Measurements of a finished model on validation rows (experiments.common.probes): the loss on every row, the
    input-replacement and input-shuffle gaps and 4-way continuation choice on fixed per-domain subsets
    (sizes: rows per domain for (gap, shuffle, choice); default the CPU sizes above)."""
    n_gap, n_shuffle, n_choice = sizes or (GAP_ROWS_PER_DOMAIN, SHUFFLE_ROWS_PER_DOMAIN, CHOICE_ROWS_PER_DOMAIN)
    own = row_losses(model, rows, 64)
    loss, by_dom = token_weighted(own, rows)
    idx = np.arange(len(own))
    gap_idx = first_rows_per_domain({"i": idx, "domains": rows["domains"]}, n_gap)["i"]
    gap_rows = {k: v[gap_idx] for k, v in rows.items()}
    replaced = row_losses(model, replace_inputs(gap_rows, seed), 64)
    shuf_rows = first_rows_per_domain(rows, n_shuffle)
    shuffled = row_losses(model, shuffle_inputs(shuf_rows, seed), 64)
    shuf_own = own[first_rows_per_domain({"i": idx, "domains": rows["domains"]}, n_shuffle)["i"]]
    order = order_gap(model, shuf_rows, shuf_own, seed)
    choice = continuation_choice(model, first_rows_per_domain(rows, n_choice), seed=seed,
                                 batch_size=64)
    return {"val_loss_all": loss, "val_loss_all_by_domain": by_dom, "n_val_rows": len(own),
            "input_replacement_gap": float(np.nanmean(replaced - own[gap_idx])), "n_gap_rows": len(gap_idx),
            "input_shuffle_gap": float(np.nanmean(shuffled - shuf_own)), "n_shuffle_rows": len(shuf_own),
            "input_order_gap": order,
            "choice_accuracy": choice["accuracy"], "choice_chance": choice["chance"], "choice_n": choice["n"],
            "choice_correct": choice["correct"]}


def order_gap(model, shuf_rows, own, seed: int) -> float:
    """Loss change when the input is shuffled but its last token kept (probes.shuffle_inputs keep_last): the use
    of the input's order alone; exactly 0 for a prefix-LM without positions. `own`: the rows' losses."""
    return float(np.nanmean(row_losses(model, shuffle_inputs(shuf_rows, seed, keep_last=True), 64) - own))


def reprobe(config, workdir, sizes=None, log=print) -> bool:
    """Add the probes a finished run's result.json predates (input_order_gap), from its checkpoint; False when
    there is nothing to add or no checkpoint (a run kept as result.json alone). Rewrites result.json atomically."""
    cache = Path(workdir) / "result.json"
    result = json.loads(cache.read_text())
    if "input_order_gap" in result or not steps_in(RunDir(Path(workdir)).checkpoints):
        return False
    model = open_run(workdir).model
    n_shuffle = (sizes or (GAP_ROWS_PER_DOMAIN, SHUFFLE_ROWS_PER_DOMAIN, CHOICE_ROWS_PER_DOMAIN))[1]
    shuf_rows = first_rows_per_domain(all_rows(config), n_shuffle)
    result["input_order_gap"] = order_gap(model, shuf_rows, row_losses(model, shuf_rows, 64),
                                          int(config.train.seed))
    write_text(cache, json.dumps({**result, "provenance": provenance()}))
    log(f"{workdir}: input_order_gap {result['input_order_gap']:+.4f}")
    return True


def summarize(config, arm: str, workdir, seconds: float, sizes=None) -> dict:
    """The run's result: curves from metrics.jsonl (the in-training subset), final numbers on every window."""
    train, evals = read_metrics(workdir)
    model = open_run(workdir).model
    p = probes(model, all_rows(config), seed=int(config.train.seed), sizes=sizes)
    names = task_cache(config.data, config.data.eval_split).domain_names
    return {"arm": arm, "mask": config.model.mask, "prefix_loss": bool(config.train.prefix_loss),
            "equal_targets": bool(config.train.get("equal_targets", False)),
            "seed": int(config.train.seed), "steps": int(config.train.steps), "lr": float(config.train.lr),
            "fingerprint": fingerprint(config),
            "train_seconds": seconds, "tokens_seen": int(config.train.steps * config.train.batch_size
                                                           * config.data.seq_len),
            "val_loss": p.pop("val_loss_all"),
            "val_loss_by_domain": {names[d]: v for d, v in p.pop("val_loss_all_by_domain").items()},
            "train_curve": sorted(train.items()), "val_curve": sorted((s, r["val/loss"]) for s, r in evals.items()),
            **p}


def train_one(config, arm: str, workdir, log=print, run_fn=None, sizes=None) -> dict:
    """Train (or resume) one run and cache its result (written atomically); a finished run is returned as is."""
    workdir = Path(workdir)
    cache = workdir / "result.json"
    fp = fingerprint(config)
    if cache.exists():
        result = json.loads(cache.read_text())
        if result.get("fingerprint") != fp:
            raise UserError(f"{workdir} holds a finished run with a different config; use another --out")
        log(f"{workdir}: cached (val/loss {result['val_loss']:.4f})")
        if reprobe(config, workdir, sizes, log):  # a result from before a probe was added
            result = json.loads(cache.read_text())
        return result
    run_fn = train_run if run_fn is None else run_fn
    t0 = time.perf_counter()
    run_fn(config, workdir, log=log)
    done = steps_in(RunDir(workdir).checkpoints)
    if not done or done[-1] < config.train.steps:
        raise Interrupted(f"{workdir} stopped at step {done[-1] if done else 0} of {config.train.steps}")
    result = summarize(config, arm, workdir, time.perf_counter() - t0, sizes)
    write_text(cache, json.dumps({**result, "provenance": provenance()}))
    return result


def cached_result(config, workdir) -> dict | None:
    """The finished run's result when it was made with this config, else None (--report_only trains nothing)."""
    cache = Path(workdir) / "result.json"
    res = json.loads(cache.read_text()) if cache.exists() else None
    return res if res is not None and res.get("fingerprint") == fingerprint(config) else None


def run_study(base, arms, seeds: int, steps: int, out, log=print, run_fn=None, report_only=False,
              sizes=None, lr_grid=None) -> Path:
    """Train (or reuse) every arm x seed and write the report; lr_grid: select each arm's rate first."""
    out = Path(out)
    for a in arms:
        for lr in lr_grid or (None,):
            parse(arm_config(base, a, 0, steps, lr))
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "study.json", json.dumps({"arms": list(arms), "seeds": seeds, "steps": steps,
                                               "lr_grid": list(lr_grid) if lr_grid else None,
                                               "config": base.to_dict()}, indent=1))
    refs = study_references(arm_config(base, "causal", 0, steps), out, log)
    chosen = {}
    if lr_grid:
        def sweep_run(arm, lr, seed, workdir):
            c = arm_config(base, arm, seed, steps, lr)
            return cached_result(c, workdir) if report_only else train_one(c, arm, workdir, log, run_fn, sizes)
        chosen = lr_select.select(arms, lr_grid, sweep_run, out, log)
    runs = [(a, s) for s in range(seeds) for a in arms]  # seed-major: a cut-short study stays paired
    results, missing = [], []
    for i, (a, s) in enumerate(runs):
        workdir, config = out / a / f"seed{s}", arm_config(base, a, s, steps, chosen.get(a, {}).get("lr"))
        if report_only:
            res = cached_result(config, workdir)
            (results if res is not None else missing).append(res if res is not None else f"{a} seed {s}")
            continue
        log(f"[{i + 1}/{len(runs)}] {a} seed {s}")
        results.append(train_one(config, a, workdir, log, run_fn, sizes))
    if not results:
        raise UserError(f"no finished runs in {out} for these settings; run without --report_only first")
    return write_report(results, refs, out / "report", base, missing, chosen)


def parser() -> ArgParser:
    arms = (("--arms",), {"default": ",".join(DEFAULT_ARMS), "help": f"comma-separated arms from {','.join(ARMS)} "
                                                                    f"(default {','.join(DEFAULT_ARMS)})"})
    p = study_parser("python -m experiments.masks_round2", __doc__, DEFAULT_CONFIG, "runs/study_masks", 4,
                     "paired seeds per arm (train.seed = 0 .. seeds-1)", extra=(arms,))
    p.add_argument("--lr_grid", default=None, help="comma-separated learning rates: choose each arm's rate on a "
                                                    f"held-out seed ({lr_select.HELD_OUT_SEED}) first")
    p.add_argument("--probe_rows", default=DEFAULT_PROBE_ROWS,
                   help="validation windows per domain for the input-replacement gap, the input-shuffle gap and "
                        "continuation choice (default: the CPU round's)")
    return p


def parse_flags(argv):
    config, _, rest = config_from_argv(list(argv[1:]), DEFAULT_CONFIG)
    args = parser().parse_args(rest)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ARMS for a in arms) or len(set(arms)) != len(arms) or "causal" not in arms:
        raise UserError(f"--arms takes distinct names from {','.join(ARMS)} including causal (the gate and every "
                        f"contrast need it), got {args.arms!r}")
    steps = seeds_and_steps(args, config, min_seeds=2)
    if config.data.task != "prefix":
        raise UserError("the study needs input->output rows: set --config.data.task=prefix")
    grid = lr_select.parse_grid(args.lr_grid) if args.lr_grid is not None else None
    return config, arms, args.seeds, steps, args.out, args.report_only, probe_sizes(args.probe_rows), grid


def probe_sizes(text: str) -> tuple[int, int, int]:
    """--probe_rows: validation windows per domain for (gap, shuffle, choice)."""
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if len(sizes) != 3 or min(sizes) < 2:
        raise UserError(f"--probe_rows takes three integers >= 2 (gap,shuffle,choice), got {text!r}")
    return sizes


def main(argv=None):
    def run(argv):
        config, arms, seeds, steps, out, report_only, sizes, grid = parse_flags(argv)
        use_compilation_cache(out)
        return run_study(config, arms, seeds, steps, out, report_only=report_only, sizes=sizes, lr_grid=grid)

    run_cli(sys.argv if argv is None else argv, parser, run)
