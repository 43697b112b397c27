"""Expert paths across layers: which expert of MoE layer l+1 follows which of layer l, against the product of the
marginals and three nulls.

    python -m analysis.paths --workdir runs/default
    python -m analysis.paths --workdir runs/default --step 400 --max_tokens 4096 --shuffles 50
    python -m analysis.paths --hf path/to/OLMoE --text a.txt --text b.txt --out /tmp/paths

The tokens (--max_tokens per domain of --split, default the eval split) are routed once; for each pair of
consecutive MoE layers, the joint counts of (expert in l, expert in l+1) of the same token, over the top-k pairs
and over first choices, and their mutual information in bits against (--shuffles times each) the shuffled-token
null (layer l+1's sets permuted across tokens: loads kept, the plug-in floor), the load-matched null (each layer's
sets resampled independently) and the same-token-id null (layer l+1's sets permuted among occurrences of one token
id: what token identity alone explains). With --hf (a HuggingFace MoE directory; --text files or the bundled
corpus, rows of --seq_len) the same on its tokens. Writes paths.json (with provenance; the top paths by lift) and paths.png
into --out (default WORKDIR/analysis/paths). Needs a model with two or more MoE layers. Bad input: one line on
stderr, exit 2.
"""

import json
from pathlib import Path

from analysis.hf_args import add_source_flags, check_source_flags
from plumbing.args import ArgParser, check_out_dir, run_cli
from plumbing.errors import UserError


def parse_args(argv):
    p = ArgParser(prog="python -m analysis.paths", description=__doc__.split("\n")[0])
    add_source_flags(p)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--out", default=None, help="output directory (default: WORKDIR/analysis/paths)")
    p.add_argument("--split", default=None, help="data split (default: the run's data.eval_split)")
    p.add_argument("--max_tokens", type=int, default=2048, help="tokens per domain (2048)")
    p.add_argument("--batch_size", type=int, default=None, help="rows per batch (default: eval.batch_size)")
    p.add_argument("--shuffles", type=int, default=20, help="draws of each null (20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the nulls (0)")
    args = p.parse_args(argv)
    check_source_flags(args)
    for name in ("max_tokens", "batch_size", "shuffles"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def run(args, log=print):
    # The analysis itself: loaded once the flags are read (--help and bad flags answer at once).
    import math

    import numpy as np

    from analysis import figures
    from analysis.hf_args import hf_rows_of, open_analysed
    from analysis.paths import plots, trace
    from analysis.routing.stats import plain_json
    from rundir.atomic import write_text
    from rundir.provenance import provenance

    default_out = Path(args.workdir or ".") / "analysis" / "paths"
    check_out_dir(args.out, default_out, create=False)
    run_, src, stamp = open_analysed(args)
    routing_rows = None if src is None else hf_rows_of(src, math.ceil(args.max_tokens / run_.config.data.seq_len))
    result = trace.expert_paths(run_.model, run_.config, args.split, args.max_tokens, args.batch_size,
                                args.shuffles, args.seed, routing_rows=routing_rows)
    out = check_out_dir(args.out, default_out)
    doc = plain_json(dict(result, workdir=str(args.workdir or args.hf), step=run_.step,
                          split=src.split if src else args.split or run_.config.data.eval_split,
                          max_tokens=args.max_tokens, seed=args.seed, provenance=provenance()))
    write_text(out / "paths.json", json.dumps(doc, indent=1))
    with figures.source(stamp):
        plots.plot_paths(result, out / "paths.png")
    for name, r in result["pairs"].items():
        nulls = ", ".join(f"{k} {np.mean(v['topk']):.4f}" for k, v in r["nulls"].items())
        log(f"{name}: I = {r['mi_topk']:.4f} bits over top-k pairs (nulls: {nulls}); first choices "
            f"{r['mi_first']:.4f} (same token id {np.mean(r['nulls']['same token id']['first']):.4f})")
    log(f"wrote paths.json and paths.png to {out}")
    return result, out


def main(argv=None):
    run_cli(run, parse_args, argv)
