"""metrics.jsonl: one JSON object per line, one training row per step.

A killed run can leave a torn last line (no newline, half an object) and rows for steps after its last
checkpoint, which the resumed run logs again. `truncate_after` fixes both before a run appends; `read_rows`
skips whatever it cannot parse, so every reader (analysis, export, experiments) sees the same clean rows.
"""

import json
import os
from pathlib import Path

from rundir import atomic


def parse_line(line: str) -> dict | None:
    """The row on one line, or None for a torn, empty or non-object line."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def read_rows(path) -> list[dict]:
    """Every parsable row in file order ([] if the file is missing); a step may appear in a train row and an
    eval row."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    return [row for row in map(parse_line, text.splitlines()) if row is not None]


def last_step(path) -> int:
    return max((row["step"] for row in read_rows(path)), default=0)


def truncate_after(path, step: int) -> int:
    """Keep only parsable rows with row["step"] <= step, atomically; returns how many lines were dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    keep = [line for line in lines if (row := parse_line(line)) is not None and row["step"] <= step]
    if len(keep) == len(lines) and _ends_with_newline(path):
        return 0
    atomic.write_text(path, "".join(line + "\n" for line in keep))
    return len(lines) - len(keep)


def _ends_with_newline(path: Path) -> bool:
    if path.stat().st_size == 0:
        return True
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
