"""Everything a training run leaves on disk, owned in one place.

    from rundir import open_run
    run = open_run("runs/default")            # newest readable checkpoint: run.model, run.config, run.tokenizer
    rows = run.metrics()                      # metrics.jsonl rows, torn lines skipped

Training checks and creates a directory (`layout.check_workdir`, `layout.create`), holds its lock (`lock.RunLock`), repairs metrics on
resume (`metrics.truncate_after`) and saves / restores checkpoints (`checkpoints`). See docs/reliability.md.
"""

from rundir.layout import MARKER, RunDir, check_workdir, create, is_run_dir
from rundir.lock import RunLock
from rundir.reading import Run, open_run

__all__ = ["MARKER", "Run", "RunDir", "RunLock", "check_workdir", "create", "is_run_dir", "open_run"]
