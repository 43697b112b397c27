"""Expert importance without ablating: REAP's gate x output norm per expert against the zeroing ablation's loss
change (Spearman per layer, beside the routing share), and the massive-activation / super-expert scan.

    python -m analysis.importance --workdir runs/default
    python -m analysis.importance --workdir runs/default --rows_per_domain 16 --layer 3 --factor 20
    python -m analysis.importance --hf path/to/OLMoE --text a.txt --out /tmp/importance

On the trainer's validation rows (--rows_per_domain per domain), one pass gives per expert REAP's score (mean over
the tokens routed to it of gate x ||expert output||), its routing share and its largest output activation, and per
block the residual stream's largest activation over its median magnitude. The zeroing ablation
(analysis.ablate.ablation, mode zero: one validation pass per expert of --layer, default every MoE layer;
--no_ablation leaves it out) gives each expert's loss change; Spearman's rho of REAP and of the share with it, per
layer, with p-values. Experts whose largest activation exceeds --factor x their layer's median expert's are
flagged; the same scan on the step-0 model (--no_step0 leaves it out) is the control. Writes importance.json (with
provenance), importance.png and super_experts.png into --out (default WORKDIR/analysis/importance). Bad input:
one line on stderr, exit 2. With --hf (a HuggingFace MoE directory; --text files or the bundled corpus, rows of
--seq_len) the same on its rows, a random initialization of its architecture standing in for step 0.
"""

import json
from pathlib import Path

from analysis.hf_args import add_source_flags, check_source_flags
from plumbing.args import ArgParser, check_out_dir, run_cli
from plumbing.errors import UserError


def parse_args(argv):
    p = ArgParser(prog="python -m analysis.importance", description=__doc__.split("\n")[0])
    add_source_flags(p)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--out", default=None, help="output directory (default: WORKDIR/analysis/importance)")
    p.add_argument("--rows_per_domain", type=int, default=None,
                   help="validation rows per domain (default: the run's eval.rows_per_domain)")
    p.add_argument("--layer", type=int, nargs="+", default=None, help="MoE layers to ablate (default: all)")
    p.add_argument("--factor", type=float, default=10.0,
                   help="flag an expert whose largest activation exceeds this x its layer's median expert's (10)")
    p.add_argument("--no_ablation", action="store_true", help="leave out the zeroing ablation")
    p.add_argument("--no_step0", action="store_true", help="leave out the step-0 scan")
    args = p.parse_args(argv)
    check_source_flags(args)
    if args.rows_per_domain is not None and args.rows_per_domain < 1:
        raise UserError(f"--rows_per_domain must be >= 1, got {args.rows_per_domain}")
    if not args.factor > 1:
        raise UserError(f"--factor must be > 1, got {args.factor}")
    return args


def run(args, log=print):
    # The analysis itself: loaded once the flags are read (--help and bad flags answer at once).
    from analysis import figures
    from analysis.ablate.cli import check_choice
    from analysis.hf_args import hf_rows_of, open_analysed
    from analysis.importance import plots, scores
    from analysis.routing.stats import plain_json
    from analysis.specialization.baselines import init_model
    from rundir.atomic import write_text
    from rundir.provenance import provenance

    default_out = Path(args.workdir or ".") / "analysis" / "importance"
    check_out_dir(args.out, default_out, create=False)
    run_, src, stamp = open_analysed(args)
    check_choice(run_, args.layer, None)
    rows = None if src is None else hf_rows_of(src, args.rows_per_domain)
    r = scores.importance(run_.model, run_.config, run_.tokenizer, args.rows_per_domain, args.layer,
                          not args.no_ablation, None if args.no_step0 else init_model(run_), args.factor, log=log,
                          rows=rows)
    out = check_out_dir(args.out, default_out)
    # A HF directory has no step 0: its control is a random initialization of the architecture (train seed 0).
    if "step0" in r:
        r["step0"]["source"] = "the run's initializer and seed" if src is None else "random init, seed 0"
    doc = plain_json(dict(r, workdir=str(args.workdir or args.hf), step=run_.step, provenance=provenance()))
    write_text(out / "importance.json", json.dumps(doc, indent=1))
    with figures.source(stamp):
        plots.plot_importance(r, out / "importance.png")
        plots.plot_super_experts(r, out / "super_experts.png")
    for line in scores.summary_lines(r):
        log(line)
    log(f"wrote importance.json, importance.png and super_experts.png to {out}")
    return r, out


def main(argv=None):
    run_cli(run, parse_args, argv)
