"""What the study runners' command lines share (analysis.experiments, analysis.study, analysis.encdec_study):
the common flags, their checks, and the compilation cache that lets every seed reuse one compiled program."""

from pathlib import Path

import jax

from train.cli import ArgParser
from train.errors import UserError

EPILOG = "any config key can be overridden with --config.KEY=VALUE (see python -m train --help)"


def study_parser(prog: str, doc: str, default_config: str, out: str, seeds: int, seeds_help: str,
                 out_help: str = "study directory (runs, references, report/)", extra=()) -> ArgParser:
    """--config, the runner's own flags (extra: (args, kwargs) pairs, in order), --seeds, --steps, --out,
    --report_only."""
    p = ArgParser(prog=prog, description=doc.splitlines()[0], epilog=EPILOG)
    p.add_argument("--config", metavar="FILE", default=default_config, help=f"study config (default {default_config})")
    for args, kwargs in extra:
        p.add_argument(*args, **kwargs)
    p.add_argument("--seeds", type=int, default=seeds, help=seeds_help)
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default: train.steps)")
    p.add_argument("--out", default=out, help=out_help)
    p.add_argument("--report_only", action="store_true", help="train nothing: report the finished runs")
    return p


def seeds_and_steps(args, config, min_seeds: int) -> int:
    """Checks --seeds (paired statistics need two pairs) and returns the steps per run (--steps or train.steps)."""
    if args.seeds < min_seeds:
        why = " (paired intervals need two pairs)" if min_seeds == 2 else ""
        raise UserError(f"--seeds must be at least {min_seeds}{why}, got {args.seeds}")
    steps = args.steps if args.steps is not None else int(config.train.steps)
    if steps < 1:
        raise UserError(f"--steps must be a positive integer, got {steps}")
    return steps


def use_compilation_cache(out) -> None:
    """Persist compiled programs under OUT/.jax_cache: the seeds of one arm or cell compile the same program."""
    jax.config.update("jax_compilation_cache_dir", str((Path(out) / ".jax_cache").absolute()))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
