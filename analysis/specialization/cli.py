"""Is the routing specialization more than chance? Each headline metric of one or several runs of one config
(seeds), beside the same metric for the model at step 0 and for a random router with the same load.

    python -m analysis.specialization --workdir runs/default
    python -m analysis.specialization --workdir runs/s0 --workdir runs/s1 --workdir runs/s2 --max_tokens 4096

Several --workdir: runs of one config that differ only in train.seed (anything else is an error); each
metric then gets its mean and range over the runs (and a 95% t-interval with 3 or more). Every run routes
the same validation tokens (--max_tokens per domain) through its checkpoint (--step, default the latest),
through its step-0 model (baselines.init_model), and --shuffles times through a random router with its load
(analysis/specialization/baselines.py; the comparison is compare.py). Writes specialization.json and
specialization.png into --out (default: the first WORKDIR/analysis) and prints a table. Bad input: one line
on stderr, exit 2.
"""

import json
from pathlib import Path

from plumbing.args import ArgParser, check_out_dir, run_cli
from plumbing.errors import UserError


def parse_args(argv):
    p = ArgParser(prog="python -m analysis.specialization", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", action="append", required=True,
                   help="run directory; repeat it for several seeds of one config")
    p.add_argument("--step", type=int, default=None, help="checkpoint step of every run (default: each run's latest)")
    p.add_argument("--out", default=None, help="output directory (default: the first WORKDIR/analysis)")
    p.add_argument("--split", default=None, help="data split (default: the run's data.eval_split)")
    p.add_argument("--max_tokens", type=int, default=4096, help="tokens per domain (4096)")
    p.add_argument("--shuffles", type=int, default=20, help="random-router permutations per run (20)")
    p.add_argument("--batch_size", type=int, default=None, help="rows per batch (default: eval.batch_size)")
    args = p.parse_args(argv)
    for name in ("max_tokens", "shuffles", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if len(set(args.workdir)) < len(args.workdir):
        raise UserError("a --workdir is given twice; pass each run once")
    return args


def run(args, log=print):
    # The analysis itself: loaded once the flags are read (--help and bad flags answer at once).
    from analysis import figures
    from analysis.figures import source_of
    from analysis.specialization import plots
    from analysis.specialization.compare import check_same_config, document, measure, table
    from rundir import open_run

    check_out_dir(args.out, Path(args.workdir[0]) / "analysis", create=False)
    runs = [open_run(w, args.step) for w in args.workdir]
    check_same_config(runs)
    per_run = [measure(r, args.split, args.max_tokens, args.shuffles, args.batch_size) for r in runs]
    doc = document(runs, per_run, args.split, args.max_tokens, args.shuffles)
    out = check_out_dir(args.out, Path(args.workdir[0]) / "analysis")
    (out / "specialization.json").write_text(json.dumps(doc, indent=1))
    names = "; ".join(source_of(r.workdir, r.step) for r in runs)
    with figures.source(names if len(runs) < 4 else f"{len(runs)} runs of {runs[0].workdir}, step {runs[0].step}"):
        plots.plot_specialization(doc, out / "specialization.png")
    log(table(doc))
    log(f"wrote specialization.json and specialization.png to {out}")
    return doc, out


def main(argv=None):
    run_cli(run, parse_args, argv)

