"""`python -m train [--config configs/NAME.py] [--workdir DIR] [--config.a.b=value ...]`.

With no arguments: configs/default.py into runs/default. Re-running the same command resumes.
Bad input (config value, flag, data file, checkpoint) prints one line and exits 2.
"""

import sys
from pathlib import Path

from train.errors import UserError, exit_with

DEFAULT_CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "default.py")


def parse_flags(argv):
    """(config, workdir) from argv; a fresh FlagValues per call, so main() can run several times in-process."""
    from absl import flags
    from ml_collections import config_flags

    fv = flags.FlagValues()
    flags.DEFINE_string("workdir", "runs/default", "Run directory: checkpoints, metrics.jsonl, tensorboard/.",
                        flag_values=fv)
    config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Config file (ml_collections get_config()).",
                                    flag_values=fv, lock_config=True, sys_argv=list(argv))
    try:
        fv(argv)
        return fv.config, fv.workdir
    except KeyError as e:
        raise UserError(f"unknown config key {e.args[0]!r} on the command line; configs/base.py lists the keys") from None
    except (flags.Error, AttributeError, ValueError, TypeError, OSError, ImportError) as e:
        raise UserError(f"bad command line: {e}") from None


def main(argv=None):
    argv = sys.argv if argv is None else argv
    from moe import ConfigError

    try:
        config, workdir = parse_flags(argv)
        from train.loop import run

        run(config, workdir)
    except (UserError, ConfigError) as e:
        exit_with(e)
    except KeyboardInterrupt:
        exit_with(UserError("interrupted; re-run the same command to resume from the last checkpoint"), 130)


if __name__ == "__main__":
    main()
