"""User-facing errors: one line that names the problem and the fix; the CLIs print it and exit 2."""

import sys


class UserError(Exception):
    """Bad input from the user (config value, flag, data file, checkpoint). Never shown with a traceback."""


def exit_with(err: BaseException, code: int = 2) -> None:
    """Print `err` as one line on stderr and exit with `code`."""
    msg = " ".join(str(err).split())
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(code)
