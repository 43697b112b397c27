"""Routing analysis of a trained run: which experts each domain and token uses, locality, load, saturation.

    python -m analysis.routing --workdir runs/default
    python -m analysis.routing --workdir runs/default --step 400 --compare_step 200 --layer 2 \\
        --token " the" --token "what" --max_tokens 50000 --out /tmp/routing
    python -m analysis.routing --hf path/to/hf_moe_dir --text a.txt --text b.txt --out /tmp/routing

--hf analyses a HuggingFace MoE directory instead of a run (GLM-4.5, Qwen2/3-MoE, OLMoE, Mixtral; see
docs/hf_import.md and analysis/hf_source.py): each --text file is a domain, or the bundled corpus is re-tokenized
with the model's tokenizer.

Routes every domain of --split (default: the run's validation split) through the checkpoint, batched and
jitted, and writes into --out (default WORKDIR/analysis):
  routing.json / routing.npz   shares per layer x domain x expert (top-k, sums to K; gate-weighted), per token
                               distributions (the most frequent ids and every --token), locality, MaxVio,
                               vocabulary specialization, co-activation, saturation, MaxVio over training
  *.png                        the plots of analysis/routing/plots.py
  tokens.html                  sample texts coloured by first-choice expert, one tab per MoE layer
and prints a short summary. Bad input (no checkpoint, unknown step, a non-MoE layer): one line, exit 2.
"""

from pathlib import Path

from analysis import figures, hf_source
from analysis.figures import source_of
from analysis.routing import collect
from analysis.routing.outputs import summary, write_outputs, write_run_outputs
from plumbing.args import ArgParser, check_out_dir, run_cli
from plumbing.errors import UserError
from rundir import open_run


def parse_args(argv):
    p = ArgParser(prog="python -m analysis.routing", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workdir", help="run directory with checkpoints/ (and metrics.jsonl)")
    src.add_argument("--hf", metavar="DIR", help="HuggingFace MoE directory (config.json, safetensors, "
                                                 "tokenizer.json) instead of a run; needs --out")
    p.add_argument("--text", action="append", default=None, metavar="FILE",
                   help="with --hf: a UTF-8 text file, one domain named after it (repeatable; default: the "
                        "bundled corpus)")
    p.add_argument("--seq_len", type=int, default=None, help="with --hf: tokens per row (default 256)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--out", default=None, help="output directory (default: WORKDIR/analysis)")
    p.add_argument("--split", default=None, help="data split (default: the run's data.eval_split)")
    p.add_argument("--max_tokens", type=int, default=None, help="tokens per domain (default: the whole split)")
    p.add_argument("--layer", type=int, default=None,
                   help="model layer index (an MoE layer) for the per-domain bar charts (default: the last)")
    p.add_argument("--token", action="extend", nargs="+", default=None, metavar="TEXT",
                   help=f"token text to track, repeatable (default: {list(collect.DEFAULT_TOKENS)})")
    p.add_argument("--compare_step", type=int, default=None,
                   help="earlier checkpoint for router saturation (same tokens routed by both)")
    p.add_argument("--batch_size", type=int, default=None, help="rows per batch (default: eval.batch_size)")
    p.add_argument("--n_frequent", type=int, default=20, help="most frequent tokens to report")
    p.add_argument("--samples", type=int, default=2, help="sample rows per domain in tokens.html")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("max_tokens", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name} must be >= 1, got {getattr(args, name)}")
    for text in args.token or ():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes the locale could not decode arrive as surrogates
            raise UserError(f"--token {text.encode('utf-8', 'surrogateescape')!r} is not UTF-8 text; pass the "
                            "token as UTF-8") from None
    hf_source.check_args(args)
    return args


def run(args, log=print):
    """Everything the CLI does; returns (Analysis, output directory)."""
    if args.hf is not None:
        return run_hf(args, log)
    check_out_dir(args.out, Path(args.workdir) / "analysis", create=False)
    run_ = open_run(args.workdir, args.step)
    layer = collect.check_layer(run_, args.layer)
    compare = open_run(args.workdir, args.compare_step) if args.compare_step is not None else None
    a = collect.analyse(run_, split=args.split, max_tokens=args.max_tokens,
                        tokens=args.token or collect.DEFAULT_TOKENS, compare_run=compare,
                        batch_size=args.batch_size, n_samples=args.samples, n_frequent=args.n_frequent,
                        progress=not args.no_progress)
    for note in a.token_notes:
        log(note)
    if a.n_tokens == 0:
        raise UserError(f"no tokens to analyse in split {args.split or run_.config.data.eval_split!r}; "
                        "check --split and --max_tokens")
    out = check_out_dir(args.out, Path(args.workdir) / "analysis")
    with figures.source(source_of(args.workdir, run_.step)):
        write_run_outputs(a, out, run_, args.workdir, layer, args.split, args.max_tokens, args.compare_step)
    log(summary(a, layer, run_.step, args.compare_step))
    log(f"wrote routing.json, routing.npz, plots and tokens.html to {out}")
    return a, out


def run_hf(args, log=print):
    """`run` for --hf: the same outputs, over --text files or the bundled corpus (no steps, no training series)."""
    check_out_dir(args.out, None, create=False)
    src = hf_source.open_source(args.hf, args.text, args.split, args.seq_len or 256, args.batch_size or 16)
    layer = collect.check_layer(src.run, args.layer)
    a = collect.analyse(src.run, split=src.split, max_tokens=args.max_tokens,
                        tokens=args.token or collect.DEFAULT_TOKENS, n_samples=args.samples,
                        n_frequent=args.n_frequent, progress=not args.no_progress, cache=src.cache)
    for note in a.token_notes:
        log(note)
    if a.n_tokens == 0:
        raise UserError("no tokens to analyse; check --text / --split and --max_tokens")
    out = check_out_dir(args.out, None)
    meta = {"hf": str(args.hf), "model_type": src.model_type, "text": args.text, "split": src.split,
            "seq_len": src.run.config.data.seq_len, "max_tokens": args.max_tokens,
            "layer": int(a.result["layer_ids_L"][layer])}
    with figures.source(str(args.hf)):
        write_outputs(a, out, meta, {}, layer)
    log(summary(a, layer, None))
    log(f"wrote routing.json, routing.npz, plots and tokens.html to {out}")
    return a, out


def main(argv=None):
    run_cli(run, parse_args, argv)

