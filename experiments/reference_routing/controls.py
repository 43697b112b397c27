"""Does the reference run's routing matter, over seeds? Per run: the validation loss against the unigram and bigram
references on its own targets, and the zeroing controls (analysis/ablate/controls.py); then the mean and the 95%
t-interval over the seeds of each.

    python -m experiments.reference_routing.controls --workdir runs/reference --workdir runs/reference_s1 \
        --workdir runs/reference_s2 --step 1000 --out experiments/reference_routing/results/controls_step1000.json

The runs must be seeds of one config (analysis.specialization.compare.check_same_config). Cost: one validation pass per
control and run.
"""

import json
from pathlib import Path

import numpy as np

from analysis.ablate import controls as ablation_controls
from analysis.routing.stats import plain_json
from analysis.specialization.compare import check_same_config, interval
from plumbing.args import ArgParser, run_cli
from rundir import open_run
from train.references import references


def parse_args(argv):
    p = ArgParser(prog="python -m experiments.reference_routing.controls", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", action="append", required=True, help="run directory; repeat for each seed")
    p.add_argument("--step", type=int, default=None, help="checkpoint step of every run (default: each run's latest)")
    p.add_argument("--out", required=True, help="JSON file to write")
    return p.parse_args(argv)


def measure(run) -> dict:
    refs = references(run.config)
    ctl = ablation_controls.controls(run.model, run.config, run.tokenizer)
    loss = float(ctl["base_loss"])
    return {"workdir": str(run.workdir), "seed": run.config.train.seed, "step": run.step, "val_loss": loss,
            "unigram": refs["unigram"], "bigram": refs["bigram"], "below_bigram": refs["bigram"] - loss,
            "controls": dict(zip(ctl["names"], (float(d) for d in ctl["delta_A"]), strict=True)),
            "controls_se": dict(zip(ctl["names"], (float(s) for s in ctl["se_A"]), strict=True))}


def summarize(per_run: list[dict]) -> dict:
    """Mean, range and 95% t-interval over runs of the loss, its gap below the bigram and every control."""
    rows = {"val_loss": [r["val_loss"] for r in per_run], "below_bigram": [r["below_bigram"] for r in per_run]}
    for name in per_run[0]["controls"]:
        rows[name] = [r["controls"][name] for r in per_run]
    return {k: interval(np.asarray(v)[:, None]) for k, v in rows.items()}


def lines(summary: dict) -> list[str]:
    out = []
    for name, s in summary.items():
        ci = (f" [{s['ci95_low'][0]:+.4f}, {s['ci95_high'][0]:+.4f}]" if np.isfinite(s["ci95_low"][0]) else "")
        out.append(f"{name:>28}: mean {s['mean'][0]:+.4f}{ci}, range [{s['min'][0]:+.4f}, {s['max'][0]:+.4f}], "
                   f"{s['n']} run(s)")
    return out


def run(args, log=print):
    runs = [open_run(w, args.step) for w in args.workdir]
    check_same_config(runs)
    per_run = [measure(r) for r in runs]
    for r in per_run:
        log(f"seed {r['seed']} step {r['step']}: val {r['val_loss']:.4f}, bigram {r['bigram']:.4f} "
            f"({r['below_bigram']:+.4f} below), all routed zeroed {r['controls']['all routed experts']:+.4f}")
    summary = summarize(per_run)
    for line in lines(summary):
        log(line)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(plain_json({"runs": per_run, "summary": summary}), indent=1))
    log(f"wrote {args.out}")
    return per_run, summary


def main(argv=None):
    run_cli(run, parse_args, argv)


if __name__ == "__main__":
    main()
