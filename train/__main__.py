"""`python -m train [--config configs/NAME.py] [--workdir DIR] [--config.a.b=value ...]`.

With no arguments: configs/default.py into runs/default. Re-running the same command resumes.
Bad input (config value, flag, data file, checkpoint, an unusable --workdir) prints one line and exits 2.
SIGTERM or Ctrl-C saves a checkpoint at the next step and exits (0 for SIGTERM, 130 for Ctrl-C).
"""

from train import signals

if __name__ == "__main__":
    signals.install()  # before any import below: a signal during start-up stops cleanly, not a traceback

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from plumbing.args import ArgParser  # noqa: E402
from plumbing.errors import (  # noqa: E402
    OOM_HINT,
    ConfigError,
    UserError,
    exit_with,
    hide_orbax_tracebacks,
    os_error,
    out_of_memory,
    storage_full,
)
from train.command_line import config_from_argv, print_help  # noqa: E402
from train.preflight import parse  # noqa: E402

DEFAULT_CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "default.py")


def parser() -> ArgParser:
    p = ArgParser(prog="python -m train", add_help=False,
                  description="Train (or resume) a decoder-only MoE language model. Re-running the same command "
                              "resumes from the newest checkpoint; SIGTERM / Ctrl-C save one and exit.",
                  epilog="examples:\n  python -m train\n  python -m train --config configs/tiny.py --workdir "
                         "runs/tiny --config.train.steps=20",
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", default=DEFAULT_CONFIG,
                   help="config file with get_config() (default: configs/default.py)")
    p.add_argument("--config.KEY", metavar="VALUE", dest="_unused",
                   help="override one config key, e.g. --config.train.steps=50 (keys listed below)")
    p.add_argument("--workdir", default="runs/default",
                   help="run directory: checkpoints/, metrics.jsonl, loss_curves.png, tensorboard/ "
                        "(default: runs/default)")
    p.add_argument("-h", "--help", action="store_true", help="show this help and the config keys, then exit")
    return p


def parse_flags(argv):
    """(config, workdir) from argv (argv[0] is the program); --help prints the options and every config key
    (of --config if given) and exits 0."""
    p = parser()
    if _wants_help(argv):
        try:
            config = config_from_argv([a for a in argv[1:] if a not in ("-h", "--help")], DEFAULT_CONFIG)[0]
        except UserError:
            config = None
        print_help(p, config)
        raise SystemExit(0)
    config, _, rest = config_from_argv(list(argv[1:]), DEFAULT_CONFIG)
    return config, p.parse_args(rest).workdir


def _wants_help(argv) -> bool:
    return any(a in ("-h", "--help") for a in argv[1:])


def main(argv=None):
    argv = sys.argv if argv is None else argv
    hide_orbax_tracebacks()

    workdir = None
    try:
        config, workdir = parse_flags(argv)
        rc = parse(config)  # --help, a bad flag or config value: answered before the training stack loads
        from train.loop import (
            run,  # the one boundary: orbax, the data pipeline, TensorBoard load from here on
        )

        result = run(rc, workdir)
    except (UserError, ConfigError) as e:
        exit_with(e)
    except KeyboardInterrupt:
        exit_with(UserError("interrupted before a checkpoint could be saved; re-run the same command to resume "
                            "from the last checkpoint"), 130)
    except BrokenPipeError:
        raise SystemExit(1) from None  # the reader of our output went away (`| head`): nothing to report
    except Exception as e:
        full = storage_full(e)
        if full:
            exit_with(UserError(f"{full[0]} while writing into {workdir} ({type(e).__name__}); {full[1]} and re-run "
                                "the same command to resume from the last complete checkpoint"))
        if isinstance(e, OSError):
            exit_with(os_error(e))
        if out_of_memory(e):
            exit_with(UserError(f"out of memory ({type(e).__name__}); {OOM_HINT}"))
        raise
    if result.get("stopped_by") == "SIGINT":
        raise SystemExit(130)


if __name__ == "__main__":
    main()
