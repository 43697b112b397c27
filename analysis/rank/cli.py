"""Attention rank and rank collapse of a trained run.

    python -m analysis.rank --workdir runs/compare_masks/causal/seed0 [--out DIR] [--sequences 16] [--step N]

Analyses up to --sequences validation rows (train.inputs.eval_rows, spread over the validation set) of the
checkpoint: the rank of every layer's and head's attention probabilities and the rank collapse of four paths
through the same weights (attention.py says which measures). Writes OUT/rank.json and OUT/rank_heads.png,
OUT/rank_spectrum.png, OUT/rank_collapse.png (OUT = WORKDIR/rank).
"""

import json
import sys
from pathlib import Path

import numpy as np

from plumbing.args import ArgParser, check_out_dir
from plumbing.errors import UserError, exit_with, os_error


def run_rank(workdir, sequences: int = 16, step=None, out=None, plots: bool = True) -> dict:
    # The analysis itself: loaded here, not when the command reads its flags (--help answers at once).
    from analysis import figures
    from analysis.figures import source_of
    from analysis.rank.attention import analyse, select_rows
    from analysis.rank.plots import plot_all
    from rundir import open_run
    from rundir.provenance import provenance
    from train.inputs import eval_rows

    run = open_run(workdir, step)
    result = analyse(run.model, select_rows(eval_rows(run.config), sequences))
    result.update(workdir=str(workdir), step=run.step, provenance=provenance())
    if out is not None:
        out = check_out_dir(out, out)
        (out / "rank.json").write_text(json.dumps(result, indent=1))
        if plots:
            with figures.source(source_of(workdir, run.step)):
                plot_all(result, out)
    return result


def main(argv=None):
    ap = ArgParser(prog="python -m analysis.rank", description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True, help="a trained run directory (with checkpoints/)")
    ap.add_argument("--out", default=None, help="output directory (default WORKDIR/rank)")
    ap.add_argument("--sequences", type=int, default=16, help="validation rows to analyse (default 16); packed "
                                                             "rows count each document separately")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default the newest readable one)")
    try:
        args = ap.parse_args(sys.argv[1:] if argv is None else argv)
        if args.sequences <= 0:
            raise UserError(f"--sequences must be a positive integer, got {args.sequences}")
        out = check_out_dir(args.out, Path(args.workdir) / "rank", create=False)
        r = run_rank(args.workdir, args.sequences, args.step, out)
    except UserError as e:
        exit_with(e)
    except OSError as e:
        exit_with(os_error(e))
    print_summary(r, out)


def print_summary(r, out=None, file=sys.stdout):
    print(f"mask={r['mask']} rope={r['rope']} sequences={r['sequences']} documents={r.get('documents')}", file=file)
    for blk, s in r["attention"].items():
        for layer, (rk, er, ld) in enumerate(zip(s["rank_frac"], s["erank_frac"], s["logdet_per_token"])):
            print(f"  {blk:6s} layer {layer}: rank/n {np.round(rk, 3).tolist()} erank/n {np.round(er, 3).tolist()} "
                  f"logdet/n {np.round(ld, 2).tolist()}", file=file)
    for p, c in r["collapse"].items():
        print(f"  collapse {p:9s} (l1/linf): {np.round(c['l1linf'], 3).tolist()}", file=file)
    if out is not None:
        print(f"wrote {out}/rank.json and plots", file=file)

