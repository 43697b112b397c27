"""What the study runners' command lines share (experiments.masks_round1, experiments.masks_round2,
experiments.encdec, experiments.head_sweep): the common flags, their checks, the compilation cache that lets every
seed reuse one compiled program, and the main that turns bad input and interruptions into one-line errors."""

from pathlib import Path

import jax

from moe import ConfigError
from plumbing.args import ArgParser
from plumbing.errors import UserError, exit_with, os_error


class Interrupted(Exception):
    """A run stopped before its last step (SIGTERM / preemption); its checkpoint is kept for resuming."""


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


def run_cli(argv, parser, run, noun: str = "study") -> None:
    """A runner's main: --help, else run(argv) -> the report's path, printed. Bad input is a one-line error (exit
    2); a run stopped early or Ctrl-C says how to resume (exit 130)."""
    if any(a in ("-h", "--help") for a in argv[1:]):
        parser().print_help()
        raise SystemExit(0)
    try:
        report = run(argv)
    except (UserError, ConfigError) as e:
        exit_with(e)
    except Interrupted as e:
        exit_with(UserError(f"{e}; re-run the same command to resume the {noun}"), 130)
    except KeyboardInterrupt:
        exit_with(UserError(f"interrupted; re-run the same command to resume the {noun}"), 130)
    except OSError as e:
        exit_with(os_error(e))
    print(f"wrote {report}")
