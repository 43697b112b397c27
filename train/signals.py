"""SIGTERM (preemption) and SIGINT (Ctrl-C) ask the run to stop: it saves a checkpoint at the next step
boundary and exits. `python -m train` installs the handlers first thing, before jax is imported, so a signal
during start-up is never a crash; a second Ctrl-C interrupts at once (KeyboardInterrupt)."""

import signal

_requested: list[str] = []  # names of the signals received, oldest first
_installed: dict = {}  # signal -> the handler it replaced


def _handle(signum, frame):
    name = signal.Signals(signum).name
    if name == "SIGINT" and "SIGINT" in _requested:
        raise KeyboardInterrupt
    _requested.append(name)


def install() -> None:
    """Take over SIGTERM and SIGINT (idempotent; main thread only, as Python requires)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        if sig not in _installed:
            _installed[sig] = signal.signal(sig, _handle)


def uninstall() -> None:
    for sig, old in _installed.items():
        signal.signal(sig, old)
    _installed.clear()
    _requested.clear()


def requested() -> str | None:
    """The first stop signal received ("SIGTERM" or "SIGINT"), or None."""
    return _requested[0] if _requested else None


def installed() -> bool:
    return bool(_installed)
