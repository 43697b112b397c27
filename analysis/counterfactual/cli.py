"""Counterfactual routing: per token, the loss with the router's chosen experts against random routes of equal
compute (the same K, the router's gates renormalized over the random experts), per domain and token frequency.

    python -m analysis.counterfactual --workdir runs/default
    python -m analysis.counterfactual --workdir runs/default --rows_per_domain 16 --draws 8
    python -m analysis.counterfactual --hf path/to/OLMoE --text a.txt --out /tmp/counterfactual

Variants (analysis/counterfactual/informative.py): every MoE layer random, every MoE layer permuted (the chosen
sets permuted across the batch's tokens: load-matched random routing), and each MoE layer random alone. Each
token's change is the mean over --draws draws of (variant loss - chosen loss) on the trainer's validation rows
(--rows_per_domain per domain); positive means the router's choice helps that token. Reported per domain, per
frequency-rank bucket of the routed token (1-10, 11-100, 101-1000, beyond), with the share of tokens the chosen
route beats and the token ids it helps most and least. With --hf (a HuggingFace MoE directory) the rows are its
--text files (one domain each) or the bundled corpus, re-tokenized, in rows of --seq_len. Writes counterfactual.json (with provenance) and
counterfactual.png into --out (default WORKDIR/analysis/counterfactual). Cost: one validation pass per variant
and draw. Bad input: one line on stderr, exit 2.
"""

import json
from pathlib import Path

from analysis.hf_args import add_source_flags, check_source_flags
from plumbing.args import ArgParser, check_out_dir, run_cli
from plumbing.errors import UserError


def parse_args(argv):
    p = ArgParser(prog="python -m analysis.counterfactual", description=__doc__.split("\n")[0])
    add_source_flags(p)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--out", default=None, help="output directory (default: WORKDIR/analysis/counterfactual)")
    p.add_argument("--rows_per_domain", type=int, default=None,
                   help="validation rows per domain (default: the run's eval.rows_per_domain)")
    p.add_argument("--draws", type=int, default=4, help="random draws per variant (4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random routes (0)")
    args = p.parse_args(argv)
    check_source_flags(args)
    for name in ("rows_per_domain", "draws"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def run(args, log=print):
    # The analysis itself: loaded once the flags are read (--help and bad flags answer at once).
    from analysis import figures
    from analysis.counterfactual import informative, plots
    from analysis.hf_args import hf_rows_of, open_analysed
    from analysis.routing.stats import plain_json
    from rundir.atomic import write_text
    from rundir.provenance import provenance

    default_out = Path(args.workdir or ".") / "analysis" / "counterfactual"
    check_out_dir(args.out, default_out, create=False)
    run_, src, stamp = open_analysed(args)
    rows = None if src is None else hf_rows_of(src, args.rows_per_domain)
    result = informative.counterfactual(run_.model, run_.config, run_.tokenizer, args.rows_per_domain, args.draws,
                                        args.seed, log=log, rows=rows)
    out = check_out_dir(args.out, default_out)
    doc = plain_json(dict(result, workdir=str(args.workdir or args.hf), step=run_.step, seed=args.seed,
                          provenance=provenance()))
    write_text(out / "counterfactual.json", json.dumps(doc, indent=1))
    with figures.source(stamp):
        plots.plot_counterfactual(result, out / "counterfactual.png")
    log(f"chosen-route loss {result['base_loss']:.4f} on {result['n_tokens']:,} tokens")
    for name, d, se in zip(result["variants"], result["delta_V"], result["se_V"]):
        log(f"{name}: loss change {d:+.4f} +- {se:.4f} nats per token")
    log(f"wrote counterfactual.json and counterfactual.png to {out}")
    return result, out


def main(argv=None):
    run_cli(run, parse_args, argv)
