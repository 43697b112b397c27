"""What DeepSeek-V3's attention and objective buy at the default's size: GQA vs MLA, and MTP (D = 1) vs
none, each arm at its own learning rate, against parameter- and compute-matched controls, paired by seed.

    python -m experiments.deepseek_parts --out runs/deepseek_parts --seeds 5 --steps 800 \
        [--lr_grid 1.5e-3,3e-3,6e-3] [--rows_per_domain 32] [--report_only] [--config.KEY=VALUE ...]

Arms (every other field is configs/deepseek_mini.py's: its size, data, schedule and DeepSeek-V3 routing):
  gqa       grouped-query attention, configs/default.py's (4 query / 2 kv heads of 48), no MTP
  mla       multi-head latent attention, configs/deepseek_mini.py's, no MTP
  mla_mtp   configs/deepseek_mini.py itself: MLA and one MTP module
  mla_deep  MLA, no MTP, one more layer: the MTP module's parameters spent on the main model (parameter-matched)
  mla_long  MLA, no MTP, trained for steps x F(mla_mtp) / F(mla) (F: training FLOPs per token, moe.accounting):
            the MTP module's compute spent on more steps of the main model (compute-matched)
The family, declared here before any run of this design (docs/inference.md): for each budget (--steps) mla - gqa,
mla_mtp - mla, mla_mtp - gqa, mla_mtp - mla_deep, mla_mtp - mla_long on the validation loss (the main head's: MTP
never enters validation), Holm across every test of every budget a report holds, each gated on its reference arm
(b) against the bigram of the scored targets. With --lr_grid every arm first trains once per rate on a held-out
seed and runs its comparison seeds at the best one (experiments.common.lr_select; rule 10). Measurements beside
them: KV-cache bytes per token, training tokens/s (the median of the logged rows of the run), parameters.

Each run lives in OUT/<arm>/seed<k> (train.loop.run: resumable) and leaves result.json, scored on the first
--rows_per_domain validation rows of every domain (analysis.ablate.ablation.Scorer); OUT/report.md and OUT/results.json
hold the report. Two budgets are two OUTs (e.g. runs/deepseek_parts_800, runs/deepseek_parts_2400); `--report_only
--with OUT2` writes one report over both, Holm across all ten tests.
"""
import copy
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from analysis.ablate.ablation import Scorer
from configs.default import get_config as default_config
from experiments.common import lr_select
from experiments.common.cli import Interrupted, run_cli, seeds_and_steps, study_parser
from experiments.common.runs import fingerprint, read_metrics
from experiments.common.verdicts import cell_gate, decide, family_table, member
from moe import param_counts, train_flops_per_token
from moe.accounting import kv_cache_bytes_per_token
from plumbing.errors import UserError
from rundir import RunDir, open_run
from rundir.atomic import write_text
from rundir.checkpoints import steps_in
from rundir.metrics import read_rows
from rundir.provenance import provenance
from train.command_line import config_from_argv
from train.loop import run as train_run
from train.preflight import parse
from train.references import references

ARMS = ("gqa", "mla", "mla_mtp", "mla_deep", "mla_long")
# a - b, gated on b: every contrast the questions need, declared before the runs
FAMILY = (("mla", "gqa"), ("mla_mtp", "mla"), ("mla_mtp", "gqa"), ("mla_mtp", "mla_deep"), ("mla_mtp", "mla_long"))
GQA = ("n_heads", "n_kv_heads", "head_dim")
DEFAULT_CONFIG = "configs/deepseek_mini.py"


def arm_config(base, arm: str, seed: int, steps: int, lr: float | None = None):
    """The arm's run config: `steps` is the budget (mla_long runs its compute-matched multiple of it); lr: the arm's
    chosen rate (None: train.lr)."""
    c = copy.deepcopy(base)
    c.train.seed, c.train.steps = seed, steps
    if lr is not None:
        c.train.lr = lr
    if arm == "mla_long":
        c.train.steps = long_steps(base, steps)
    if arm != "mla_mtp":
        c.model.mtp_depth = 0
    if arm == "mla_deep":
        c.model.n_layers = base.model.n_layers + 1
    if arm == "gqa":
        d = default_config().model
        c.model.update(attention="gqa", q_lora_rank=0, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0,
                       v_head_dim=0, rope_interleave=False, **{k: d[k] for k in GQA})
    return c


def long_steps(base, steps: int) -> int:
    """The compute-matched budget: steps x (training FLOPs per token with the MTP module / without)."""
    with_mtp = parse(base).model
    seq = int(base.data.seq_len)
    ratio = train_flops_per_token(with_mtp, seq) / train_flops_per_token(with_mtp.replace(mtp_depth=0), seq)
    return round(steps * ratio)


def measure(config, workdir, rows_per_domain: int) -> dict:
    """The run's result: main-head validation loss and its bigram on the same rows, speed, sizes."""
    run = open_run(workdir)
    c = dataclasses.replace(run.config, eval=dataclasses.replace(run.config.eval, rows_per_domain=rows_per_domain))
    ce, n = Scorer(run.model, c, run.tokenizer)(run.model)
    refs = references(c)
    speeds = [r["tokens_per_sec"] for r in read_rows(RunDir(Path(workdir)).metrics) if "tokens_per_sec" in r]
    mcfg = parse(config).model
    _, evals = read_metrics(workdir)
    return {"seed": int(config.train.seed), "steps": int(config.train.steps), "fingerprint": fingerprint(config),
            "val_loss": float(ce.sum() / n.sum()), "targets": int(n.sum()), "bigram": refs["bigram"],
            "unigram": refs["unigram"], "tokens_per_sec": statistics.median(speeds) if speeds else None,
            "kv_bytes_per_token": kv_cache_bytes_per_token(mcfg), **param_counts(mcfg),
            "val_curve": sorted((s, r["val/loss"]) for s, r in evals.items())}


def run_one(config, arm: str, workdir: Path, rows_per_domain: int, log=print, run_fn=None, budget=None) -> dict:
    """The arm's run in workdir, trained unless a finished one with this config is cached there; budget: the
    study's --steps (mla_long trains more)."""
    cache = workdir / "result.json"
    if cache.exists():
        r = json.loads(cache.read_text())
        if r.get("fingerprint") != fingerprint(config) or r.get("rows_per_domain") != rows_per_domain:
            raise UserError(f"{workdir} holds a finished run with a different config; use another --out")
        log(f"{workdir}: cached (val loss {r['val_loss']:.4f})")
        return r
    (run_fn or train_run)(config, workdir, log=log)
    done = steps_in(RunDir(workdir).checkpoints)
    if not done or done[-1] < config.train.steps:
        raise Interrupted(f"{workdir} stopped at step {done[-1] if done else 0} of {config.train.steps}")
    r = {"arm": arm, "rows_per_domain": rows_per_domain, "budget": budget or int(config.train.steps),
         "lr": float(config.train.lr), **measure(config, workdir, rows_per_domain)}
    write_text(cache, json.dumps({**r, "provenance": provenance()}))
    return r


def budget_of(r: dict) -> int:
    """The study budget a result belongs to (results written before budgets existed: its steps)."""
    return int(r.get("budget", r["steps"]))


def report(results: list[dict], out: Path, chosen: dict | None = None) -> Path:
    """The report over every budget the results hold: one table per budget, the family over all of them."""
    budgets = sorted({budget_of(r) for r in results})
    bigram = float(np.mean([r["bigram"] for r in results]))
    members, tables = [], []
    for budget in budgets:
        rs = [r for r in results if budget_of(r) == budget]
        groups = {a: {r["seed"]: r for r in rs if r["arm"] == a} for a in ARMS}
        groups = {a: g for a, g in groups.items() if g}
        tag = f" @{budget}" if len(budgets) > 1 else ""
        members += [member("deepseek_parts", f"{a} - {b}{tag}", None, groups[a], groups[b], bigram, an=a)
                    for a, b in FAMILY if a in groups and b in groups and len(set(groups[a]) & set(groups[b])) >= 2]
        tables += ["", *([f"Budget {budget} steps (mla_long: its compute-matched steps):", ""]
                         if len(budgets) > 1 else []),
                   "| arm | steps | lr | val loss per seed | mean | gate (seeds passing) | stalled | KV bytes / token "
                   "| tokens/s | params (active) |", "|---|---|---|---|---|---|---|---|---|---|"]
        for arm, runs in groups.items():
            rs_arm = [runs[s] for s in sorted(runs)]
            g = cell_gate(runs, bigram)
            speed = [r["tokens_per_sec"] for r in rs_arm if r["tokens_per_sec"]]
            lr = rs_arm[0].get("lr")
            per_seed = ", ".join(f"{r['val_loss']:.4f}" for r in rs_arm)
            tables.append(f"| {arm} | {rs_arm[0]['steps']} | {f'{lr:g}' if lr else '-'} | {per_seed} | "
                          f"{np.mean([r['val_loss'] for r in rs_arm]):.4f} | "
                          f"{'passes' if g['passed'] else 'fails'} ({g['seeds_passing']}) | {g['stall_rate']} | "
                          f"{rs_arm[0]['kv_bytes_per_token']:,} | {f'{np.mean(speed):,.0f}' if speed else '-'} | "
                          f"{rs_arm[0]['total']:,} ({rs_arm[0]['active']:,}) |")
    family = decide(members)
    lines = ["# GQA vs MLA, MTP vs none", "",
             f"Main-head validation loss on {results[0]['targets']:,} targets (bigram {bigram:.4f}, unigram "
             f"{results[0]['unigram']:.4f}); budgets {', '.join(map(str, budgets))} steps.", *tables]
    if chosen:
        lines += ["", "Learning rates, chosen per arm on held-out seed "
                  f"{lr_select.HELD_OUT_SEED} (the grid's edge flagged):",
                  *[f"- {a}: {c['lr']:g}{' (at the edge of the grid)' if c['at_edge'] else ''}"
                    for a, c in chosen.items()]]
    lines += ["", "The family (docs/inference.md), declared in experiments/deepseek_parts/runner.py before any run; "
              "Holm across its tests; negative = a has the lower loss.", "", *family_table(family)]
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "results.json", json.dumps({"results": results, "family": family}, indent=1))
    return write_text(out / "report.md", "\n".join(line for line in lines) + "\n")


def run_study(base, seeds: int, steps: int, out, rows_per_domain: int, log=print, report_only=False,
              run_fn=None, lr_grid=None, arms=ARMS, also=()) -> Path:
    """Train (or reuse) every arm x seed at budget `steps` and write the report (with the finished runs of the
    studies in `also`: other budgets); lr_grid: select each arm's rate on a held-out seed first."""
    out = Path(out)
    for a in arms:
        parse(arm_config(base, a, 0, steps))
    chosen = {}
    if lr_grid:
        def sweep_run(arm, lr, seed, workdir):
            c = arm_config(base, arm, seed, steps, lr)
            if report_only:
                return json.loads((workdir / "result.json").read_text()) if (workdir / "result.json").exists() \
                    else None
            return run_one(c, arm, workdir, rows_per_domain, log, run_fn, steps)
        chosen = lr_select.select(arms, lr_grid, sweep_run, out, log)
    runs = [(a, s) for s in range(seeds) for a in arms]  # seed-major: a cut-short study stays paired
    results = []
    for i, (a, s) in enumerate(runs):
        workdir = out / a / f"seed{s}"
        if report_only:
            if (workdir / "result.json").exists():
                results.append(json.loads((workdir / "result.json").read_text()))
            continue
        log(f"[{i + 1}/{len(runs)}] {a} seed {s}")
        results.append(run_one(arm_config(base, a, s, steps, chosen.get(a, {}).get("lr")), a, workdir,
                               rows_per_domain, log, run_fn, steps))
    for other in also:
        results += [json.loads(f.read_text()) for f in sorted(Path(other).glob("*/seed*/result.json"))]
    if not results:
        raise UserError(f"no finished runs in {out}; run without --report_only first")
    return report(results, out, chosen)


def parser():
    rows = (("--rows_per_domain",), {"type": int, "default": 32,
                                     "help": "validation rows per domain that score each run (default 32)"})
    grid = (("--lr_grid",), {"default": None, "help": "comma-separated learning rates: choose each arm's rate on a "
                                                      f"held-out seed ({lr_select.HELD_OUT_SEED}) first"})
    also = (("--with",), {"dest": "also", "action": "append", "default": [], "metavar": "OUT",
                          "help": "another budget's study directory: its finished runs join the report and family"})
    return study_parser("python -m experiments.deepseek_parts", __doc__, DEFAULT_CONFIG, "runs/deepseek_parts", 5,
                        "paired seeds per arm (train.seed = 0 .. seeds-1)", extra=(rows, grid, also))


def main(argv=None):
    def run(argv):
        config, _, rest = config_from_argv(list(argv[1:]), DEFAULT_CONFIG)
        args = parser().parse_args(rest)
        steps = seeds_and_steps(args, config, min_seeds=2)
        if args.rows_per_domain < 1:
            raise UserError(f"--rows_per_domain must be >= 1, got {args.rows_per_domain}")
        if not config.model.mtp_depth or config.model.attention != "mla":
            raise UserError("the study's base config must be MLA with MTP (configs/deepseek_mini.py); its arms "
                            "take the parts away")
        grid = lr_select.parse_grid(args.lr_grid) if args.lr_grid else None
        return run_study(config, args.seeds, steps, args.out, args.rows_per_domain, report_only=args.report_only,
                         lr_grid=grid, also=args.also)

    run_cli(sys.argv if argv is None else argv, parser, run)
