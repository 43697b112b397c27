"""Su's mixed heads where he proposed them: mixed vs bidirectional attention on a masked-LM
(encoder) task, paired by seed.

    python -m experiments.mlm --out runs/mlm [--config experiments/mlm/config.py] [--seeds 4] [--steps N]

Both arms train the same model on train.inputs.MLMSampler rows (15% of the tokens replaced by [MASK] and predicted
in place); `bidirectional` lets every head see the whole row, `mixed` makes half the heads lower- and half
upper-triangular. Each run lives in OUT/<arm>/seed<k> (train.loop.run: resumable; a finished run's result.json
is reused). The final loss is on the masked tokens of every validation window (the in-training curve: the first
eval.rows_per_domain windows of each domain). Under docs/inference.md's rules: the bidirectional arm must beat the
strongest cheap baseline of those masked targets (experiments.mlm.neighbour_bigram: the bigram of both visible
neighbours) by 0.3 nats, else the verdict is "not interpretable"; then mixed - bidirectional as a family of one:
paired t-interval, Wilcoxon and Hodges-Lehmann, stall rates, TOST within a tenth of the gate's margin.
OUT/report.md holds the result, OUT/curves.png every seed's curve with the baselines.
"""

import copy
import json
import sys
import time
from pathlib import Path

from experiments.common import plots
from experiments.common.cli import Interrupted
from experiments.common.probes import row_losses
from experiments.common.rows import all_rows, token_weighted
from experiments.common.runs import fingerprint, read_metrics
from experiments.common.stats import GATE_BIGRAM_MARGIN
from experiments.common.verdicts import decide, member
from experiments.mlm.neighbour_bigram import baselines as cheap_baselines
from moe import ConfigError
from plumbing.args import ArgParser
from plumbing.errors import UserError, exit_with, os_error
from rundir import RunDir
from rundir.atomic import write_text
from rundir.checkpoints import steps_in
from rundir.provenance import provenance
from rundir.reading import open_run
from train.command_line import config_from_argv
from train.inputs import task_cache
from train.loop import run as train_run

DEFAULT_CONFIG = "experiments/mlm/config.py"
ARMS = ("bidirectional", "mixed")


def verdict(bidir: dict, mixed: dict, baselines: dict) -> dict:
    """mixed - bidirectional ({seed: result} each) as a family of one, gated on the bidirectional arm against the
    strongest of `baselines` (experiments.mlm.neighbour_bigram.baselines)."""
    name = baselines["strongest"]
    (m,) = decide([member("mlm", "mixed - bidirectional", None, mixed, bidir, baselines[name], an="mixed")])
    return {**m, "baseline_name": name, "baselines": baselines}


def final_losses(config, workdir) -> tuple[float, dict]:
    """(loss, {domain name: loss}) of the run's final checkpoint (step train.steps) on the masked tokens of every
    validation window."""
    model = open_run(workdir, int(config.train.steps), log=lambda *a: None).model
    rows = all_rows(config)
    loss, by_dom = token_weighted(row_losses(model, rows, 64), rows)
    names = task_cache(config.data, config.data.eval_split).domain_names
    return loss, {names[d]: v for d, v in by_dom.items()}


def run_one(config, workdir, log=print) -> dict:
    workdir = Path(workdir)
    cache = workdir / "result.json"
    if cache.exists():
        r = json.loads(cache.read_text())
        if r.get("fingerprint") != fingerprint(config):
            raise UserError(f"{workdir} holds a finished run with a different config; use another --out")
        if "val_loss_by_domain" not in r:  # finished before the final loss was taken on every window: rescore
            r["val_loss"], r["val_loss_by_domain"] = final_losses(config, workdir)
            write_text(cache, json.dumps({**r, "provenance": provenance()}))
        return r
    t0 = time.perf_counter()
    train_run(config, workdir, log=log)
    seconds = time.perf_counter() - t0
    done = steps_in(RunDir(workdir).checkpoints)
    if not done or done[-1] < config.train.steps:
        raise Interrupted(f"{workdir} stopped at step {done[-1] if done else 0} of {config.train.steps}")
    _, evals = read_metrics(workdir)
    loss, by_domain = final_losses(config, workdir)
    r = {"mask": config.model.mask, "seed": int(config.train.seed), "fingerprint": fingerprint(config),
         "steps": int(config.train.steps), "train_seconds": seconds,
         "tokens_seen": int(config.train.steps * config.train.batch_size * config.data.seq_len),
         "val_loss": loss, "val_loss_by_domain": by_domain,
         "val_curve": sorted((s, e["val/loss"]) for s, e in evals.items())}
    write_text(cache, json.dumps({**r, "provenance": provenance()}))
    return r


def arm_config(base, arm: str, seed: int, steps: int):
    c = copy.deepcopy(base)
    c.model.mask, c.train.seed, c.train.steps = arm, seed, steps
    return c


def compare(base, seeds: int, steps: int, out, log=print) -> Path:
    out = Path(out)
    res = {}
    for s in range(seeds):
        for arm in ARMS:
            log(f"{arm} seed {s}")
            res[arm, s] = run_one(arm_config(base, arm, s, steps), out / arm / f"seed{s}", log)
    groups = {arm: {s: res[arm, s] for s in range(seeds)} for arm in ARMS}
    v = verdict(groups["bidirectional"], groups["mixed"], cheap_baselines(base))
    g, bl = v["gate"], v["baselines"]
    lines = ["# Mixed vs bidirectional heads on a masked LM", "",
             f"{seeds} paired seeds x {steps} steps ({steps * base.train.batch_size * base.data.seq_len:,} tokens "
             f"per run); final validation loss on the masked tokens of every validation window ({bl['targets']:,}).",
             "", "Cheap baselines of those targets: " + ", ".join(
                 f"{k.replace('_', ' ')} {bl[k]:.4f}" for k in ("unigram", "left_bigram", "right_bigram",
                                                                 "neighbour_bigram")) + ".", "",
             f"Gate (docs/inference.md rule 3): bidirectional must beat the strongest ({v['baseline_name'].replace('_', ' ')}, "
             f"{g['baseline']:.4f}) by >= {GATE_BIGRAM_MARGIN}: beats it by {g['beats_baseline_by']:+.4f}, seeds "
             f"passing alone {g['seeds_passing']}, stalled {g['stall_rate']} -> "
             f"**{'passes' if g['passed'] else 'fails'}**.", "",
             "| seed | bidirectional | mixed | mixed - bidirectional | train s (bidirectional, mixed) |",
             "|---|---|---|---|---|"]
    for s in range(seeds):
        b, m = res["bidirectional", s], res["mixed", s]
        secs = ", ".join(f"{r['train_seconds']:.0f}" if "train_seconds" in r else "-" for r in (b, m))
        lines.append(f"| {s} | {b['val_loss']:.4f} | {m['val_loss']:.4f} | {m['val_loss'] - b['val_loss']:+.4f} | "
                     f"{secs} |")
    margin = f"+-{v['margin']:.4f}" if v["margin"] else "none (the gate's reference learned nothing)"
    lines += ["", f"mixed - bidirectional (a family of one): {v['mean']:+.4f} [{v['lo']:+.4f}, {v['hi']:+.4f}] "
              f"(95% paired t), mixed lower in {v['wins']} / {seeds} seeds, t p {v['p']:.4f}, Wilcoxon p "
              f"{v['wilcoxon_p']:.3f}, Hodges-Lehmann {v['hodges_lehmann']:+.4f}; equivalence margin {margin}, "
              f"TOST p {v['p_equiv']:.3f}."]
    lines += ["", f"Verdict: **{v['verdict']}**", "", "Every seed's validation curve (the first "
              f"{base.eval.rows_per_domain} windows of each domain) with the baselines (all windows):", "",
              "![validation curves](curves.png)", ""]
    plots.plot_curves(groups, {"unigram": bl["unigram"], "bigram": bl["neighbour_bigram"],
                                "bigram_name": "neighbour bigram"}, out / "curves.png",
                      "Masked-LM validation loss per seed during training (masked tokens)",
                      "validation loss, masked tokens (nats)")
    write_text(out / "result.json", json.dumps({**v, "provenance": provenance()}))
    return write_text(out / "report.md", "\n".join(lines))


def parse_flags(argv):
    """(config, seeds, steps, out) from the command line (argv[0] is the program)."""
    p = ArgParser(prog="python -m experiments.mlm", description=__doc__.splitlines()[0])
    p.add_argument("--config", metavar="FILE", default=DEFAULT_CONFIG)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out", default="runs/mlm")
    config, _, rest = config_from_argv(list(argv[1:]), DEFAULT_CONFIG)
    args = p.parse_args(rest)
    steps = args.steps if args.steps is not None else int(config.train.steps)
    if args.seeds < 2 or steps < 1:
        raise UserError(f"--seeds must be >= 2 and --steps >= 1, got {args.seeds}, {steps}")
    if config.data.task != "mlm":
        raise UserError("the comparison needs masked-LM rows: set --config.data.task=mlm")
    return config, args.seeds, steps, args.out


def main(argv=None):
    argv = sys.argv if argv is None else argv
    try:
        report = compare(*parse_flags(argv))
    except (UserError, ConfigError) as e:
        exit_with(e)
    except Interrupted as e:
        exit_with(UserError(f"{e}; re-run the same command to resume"), 130)
    except OSError as e:
        exit_with(os_error(e))
    print(f"wrote {report}")
