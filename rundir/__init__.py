"""Everything a training run leaves on disk, owned in one place.

    from rundir import open_run
    run = open_run("runs/default")            # newest readable checkpoint: run.model, run.config, run.tokenizer
    rows = run.metrics()                      # metrics.jsonl rows, torn lines skipped

Training checks and creates a directory (`layout.check_workdir`, `layout.create`), holds its lock (`lock.RunLock`),
repairs metrics on resume (`metrics.truncate_after`) and saves / restores checkpoints (`checkpoints`); a run's
config is `run_config.RunConfig`. See docs/reliability.md. The names below load their module on first use, so a
command that only checks its config never loads orbax.
"""

import importlib

_EXPORTS = {"MARKER": "rundir.layout", "RunDir": "rundir.layout", "check_workdir": "rundir.layout",
            "create": "rundir.layout", "is_run_dir": "rundir.layout", "RunLock": "rundir.lock",
            "Run": "rundir.reading", "open_run": "rundir.reading"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rundir' has no attribute {name!r}")
