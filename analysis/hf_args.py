"""The flags that let an analysis read a HuggingFace MoE directory instead of a run (compare, paths,
counterfactual, importance), checked before anything heavy loads.

    add_source_flags(parser)     # --workdir | --hf, --text, --seq_len
    check_source_flags(args)     # one-line UserError for a combination that cannot work

With --hf the model comes from analysis.hf_source (moe.hf.load_hf_moe, in memory) and the rows from its token
cache: each --text file one domain, or without --text the bundled corpus's validation split re-tokenized with the
model's tokenizer (analysis/hf_rows.py cuts them into rows of --seq_len).
"""

from plumbing.errors import UserError


def add_source_flags(p, what: str = "run directory with checkpoints/"):
    p.add_argument("--workdir", default=None, help=f"{what} (this or --hf)")
    p.add_argument("--hf", default=None, help="a HuggingFace MoE directory instead of a run (needs --out)")
    p.add_argument("--text", action="append", default=None,
                   help="with --hf: a UTF-8 text file, one domain (repeatable; default: the bundled corpus)")
    p.add_argument("--seq_len", type=int, default=None, help="with --hf: tokens per row (256)")


def check_source_flags(args, step_flags=("step",)) -> None:
    if (args.workdir is None) == (args.hf is None):
        raise UserError("pass one of --workdir (a run) or --hf (a HuggingFace MoE directory)")
    if args.hf is None:
        for flag in ("text", "seq_len"):
            if getattr(args, flag) is not None:
                raise UserError(f"--{flag} goes with --hf (a run directory uses its own data and seq_len)")
        return
    for flag in step_flags:
        if getattr(args, flag, None) is not None:
            raise UserError(f"--{flag} needs --workdir: a HuggingFace directory has one set of weights")
    if args.out is None:
        raise UserError("--out is required with --hf (the model directory is left untouched)")
    if args.seq_len is not None and args.seq_len < 2:
        raise UserError(f"--seq_len must be >= 2, got {args.seq_len}")
    if getattr(args, "split", None) is not None and args.text:
        raise UserError("--text and --split exclude each other: --split picks a split of the bundled corpus")


def open_hf(path, args, batch_size=None):
    """analysis.hf_source.HFSource of --hf / --text / --seq_len (loads the model)."""
    from analysis import hf_source

    return hf_source.open_source(path, args.text, getattr(args, "split", None), args.seq_len or 256,
                                 batch_size or 16)


def open_analysed(args):
    """(the run or analysis.hf_source.HFRun, its HFSource or None, the figures' stamp) of --workdir / --step or
    --hf (loads the model)."""
    from analysis.figures import source_of

    if args.hf is None:
        from rundir import open_run

        run = open_run(args.workdir, args.step)
        return run, None, source_of(args.workdir, run.step)
    src = open_hf(args.hf, args, getattr(args, "batch_size", None))
    return src.run, src, str(args.hf)


def hf_rows_of(src, rows_per_domain=None):
    """A HF source's rows (analysis.hf_rows.cache_rows): rows_per_domain, default its eval.rows_per_domain."""
    from analysis.hf_rows import cache_rows

    return cache_rows(src.cache, src.run.config, rows_per_domain or src.run.config.eval.rows_per_domain)
