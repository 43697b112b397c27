"""User-facing errors: one line that names the problem and the fix; the CLIs print it and exit 2."""

import errno
import logging
import sys


class UserError(Exception):
    """Bad input from the user (config value, flag, data file, checkpoint). Never shown with a traceback."""


class ConfigError(ValueError):
    """A config value that is not allowed (model, execution, run): the message names the field and what is
    allowed. Raised by the frozen config objects when they are built; the commands report it as a UserError."""


def warn(message: str) -> None:
    """A diagnostic (a warning, a note): stderr, so that a command's results on stdout stay clean."""
    print(message, file=sys.stderr)


def exit_with(err: BaseException, code: int = 2) -> None:
    """Print `err` as one line on stderr and exit with `code`."""
    msg = " ".join(str(err).split())
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(code)


_HINTS = {
    errno.ENOSPC: "the disk is full; free space and re-run the same command (a run resumes from its last "
                  "checkpoint, which is intact)",
    errno.EDQUOT: "the disk quota is exceeded; free space and re-run the same command",
    errno.EFBIG: "a file reached the file-size limit (`ulimit -f`, or the file system's largest file); raise the "
                 "limit or choose another file system, and re-run the same command",
    errno.EACCES: "permission denied; check the permissions or choose another path",
    errno.EPERM: "permission denied; check the permissions or choose another path",
    errno.EROFS: "the file system is read-only; choose a writable path",
    errno.ENOTDIR: "a part of the path is a file, not a directory; choose another path",
    errno.EISDIR: "the path is a directory where a file was expected; choose another path",
    errno.ENOENT: "no such file or directory; check the path",
}


def os_error(e: OSError) -> UserError:
    """An OSError as one line naming the path and what to do."""
    hint = _HINTS.get(e.errno, "check the path and try again")
    if e.filename:
        return UserError(f"cannot access {e.filename}: {e.strerror or e}; {hint}")
    return UserError(f"input/output error: {e.strerror or e}; {hint}")


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def out_of_memory(e: BaseException) -> bool:
    """Whether an exception is an accelerator or host allocation failure (XLA reports RESOURCE_EXHAUSTED)."""
    return any(isinstance(x, MemoryError) or "Out of memory" in str(x) or "RESOURCE_EXHAUSTED: Out of memory"
               in str(x) for x in _chain(e))


OOM_HINT = ("lower data.seq_len or train.batch_size, raise train.grad_accum, set execution.remat=true or shrink the "
            "model")


# What ran out while writing, and what to do, by errno; the messages orbax and tensorstore give them when they wrap
# the OSError in their own types.
_STORAGE = {errno.ENOSPC: ("the disk is full", "free space", "No space left on device"),
            errno.EDQUOT: ("the disk quota is exceeded", "free space", "RESOURCE_EXHAUSTED: Quota"),
            errno.EFBIG: ("a file reached the file-size limit", "raise the limit (`ulimit -f`) or choose a file "
                          "system that allows larger files", "File too large")}


def storage_full(e: BaseException) -> tuple[str, str] | None:
    """(what ran out, what to do) when an exception is a full disk, an exceeded quota or a file-size limit hit
    while writing; else None."""
    for x in _chain(e):
        for code, (what, fix, text) in _STORAGE.items():
            if (isinstance(x, OSError) and x.errno == code) or text in str(x):
                return what, fix
    return None


class _DropOrbaxErrors(logging.Filter):
    """Orbax logs a full traceback from its background threads before the same error reaches our code, which
    reports it in one line (a full disk, a damaged checkpoint); drop orbax's copy."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:  # but orbax's note that a save waits for the previous one (expected)
            return not ("orbax" in record.pathname and record.getMessage().startswith("Waiting for previous save"))
        # absl records from orbax's modules; asyncio's "Task exception was never retrieved" for orbax's writers
        return "orbax" not in record.pathname and "orbax" not in record.getMessage()


def hide_orbax_tracebacks() -> None:
    """For CLI processes: orbax errors are reported by the CLI's own one-line message."""
    for logger in (logging.getLogger("absl"), logging.getLogger("asyncio")):
        if not any(isinstance(f, _DropOrbaxErrors) for f in logger.filters):
            logger.addFilter(_DropOrbaxErrors())
    if sys.unraisablehook is sys.__unraisablehook__:
        sys.unraisablehook = _unraisable


def _unraisable(args) -> None:
    # After a failed save, tensorstore's write callbacks fire into orbax's already closed event loop; the
    # failure itself is reported once, by the CLI.
    if isinstance(args.exc_value, RuntimeError) and str(args.exc_value) == "Event loop is closed":
        return
    sys.__unraisablehook__(args)
