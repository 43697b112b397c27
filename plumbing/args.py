"""The command-line plumbing every command shares: argparse with one-line errors, an output directory, and a
main that turns bad input and OS errors into one line on stderr and exit code 2.

    parser = ArgParser(prog="python -m analysis.rank", description="...")
    run_cli(run, parse_args)          # the command's main
"""

import argparse
import difflib
import sys
from pathlib import Path

from plumbing.errors import UserError, exit_with, os_error


class ArgParser(argparse.ArgumentParser):
    """argparse with its multi-line usage errors turned into one UserError line (the CLIs exit 2 on it)."""

    def error(self, message):
        hint = self._closest_flag(message)
        raise UserError(f"{message}{hint} (see `{self.prog} --help`)")

    def _closest_flag(self, message: str) -> str:
        """'; did you mean --max_new_tokens?' for an unrecognized --max-new-tokens (dashes for underscores, a
        typo), or ''."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        flags = [f for action in self._actions for f in action.option_strings if f.startswith("--")]
        for word in message.split(":", 1)[1].split():
            name = word.split("=", 1)[0]
            if not name.startswith("--"):
                continue
            close = difflib.get_close_matches("--" + name[2:].replace("-", "_"), flags, n=1, cutoff=0.75)
            if close:
                return f"; did you mean {close[0]}?"
        return ""


def check_out_dir(out, default, create: bool = True) -> Path:
    """An analysis CLI's output directory (`default` when --out is not given); a file there is a UserError."""
    path = Path(out) if out else Path(default)
    if path.exists() and not path.is_dir():
        raise UserError(f"--out {path} is a file, not a directory; choose another --out")
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def run_cli(run, parse_args, argv=None):
    """An analysis CLI's main: parse argv (default sys.argv[1:]) and run; bad input or an OS error is one line
    on stderr and exit code 2. Returns what `run` returns."""
    try:
        return run(parse_args(sys.argv[1:] if argv is None else argv))
    except UserError as e:
        exit_with(e)
    except OSError as e:
        exit_with(os_error(e))
    except KeyboardInterrupt:
        exit_with(UserError("interrupted (Ctrl-C); outputs already written are complete, the rest were not "
                            "written"), 130)
