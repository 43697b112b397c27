"""What a run directory holds, how it is recognised, and how training claims one.

    WORKDIR/
      moe-run.json      marker written when the run is created: {"format", "version", "created",
                        "checkpointed" (a checkpoint was completed once)}; nothing else is a run of ours
      .lock             held (flock) by the training process; holds its PID and host
      config.json       the run config as first started
      metrics.jsonl     one JSON row per logged step (rundir.metrics reads and repairs it)
      checkpoints/      orbax: <step>/{state, meta} (rundir.checkpoints)
      tensorboard/      event files
      loss_curves.png   train / validation loss, redrawn at every evaluation
      analysis/, rank/  what the analysis CLIs write by default

Runs written before the marker existed (config.json with model/train/data sections beside checkpoints/ or
metrics.jsonl) are recognised and get the marker on their next training start.
"""

import dataclasses
import datetime
import json
from pathlib import Path

from plumbing.errors import UserError
from rundir import atomic

MARKER = "moe-run.json"
FORMAT = "moe-lm run"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def marker(self) -> Path:
        return self.root / MARKER

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def lock(self) -> Path:
        return self.root / ".lock"

    @property
    def loss_curves(self) -> Path:
        return self.root / "loss_curves.png"

    def read_marker(self) -> dict | None:
        try:
            doc = json.loads(self.marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) and doc.get("format") == FORMAT else None

    def write_marker(self, **fields) -> None:
        doc = self.read_marker() or {"format": FORMAT, "version": VERSION,
                                     "created": datetime.datetime.now(datetime.UTC).isoformat()}
        doc.update(fields)
        atomic.write_text(self.marker, json.dumps(doc, indent=1, sort_keys=True) + "\n")

    def is_empty(self) -> bool:
        """Missing, or holding nothing but a lock file."""
        return not self.root.is_dir() or all(p.name == ".lock" for p in self.root.iterdir())

    def is_run(self) -> bool:
        """A run of ours: the marker, or a run written before the marker existed."""
        return self.read_marker() is not None or self.is_legacy_run()

    def is_legacy_run(self) -> bool:
        try:
            doc = json.loads(self.config.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return (isinstance(doc, dict) and {"model", "train", "data"} <= set(doc)
                and (self.checkpoints.is_dir() or self.metrics.is_file()))


def is_run_dir(path) -> bool:
    return Path(path).is_dir() and RunDir(Path(path)).is_run()


def check_workdir(workdir) -> RunDir:
    """The run directory for training, after refusing (UserError, nothing written) an empty path, a file, and a
    non-empty directory that is not a run: an export, a home directory or a project folder must never receive
    checkpoints or have its config.json replaced."""
    if str(workdir).strip() == "":
        raise UserError("--workdir is empty; pass a run directory, e.g. --workdir runs/my_run")
    root = Path(workdir)
    if root.is_symlink() and not root.exists():
        raise UserError(f"--workdir {root} is a symbolic link that leads nowhere (a loop, or its target is missing); "
                        "remove the link or choose another --workdir")
    if root.exists() and not root.is_dir():
        raise UserError(f"--workdir {root} is a file, not a directory; choose another --workdir")
    run = RunDir(root)
    if not run.is_empty() and not run.is_run():
        raise UserError(f"--workdir {root} is not empty and is not a training run (no {MARKER}); "
                        "choose a new or empty --workdir")
    return run


def create(run: RunDir, config_json: str) -> None:
    """Write config.json and the marker into an empty (or just locked) directory."""
    atomic.write_text(run.config, config_json)
    run.write_marker(checkpointed=False)
