"""The default run's figures in README.md and docs/, regenerated from what the README's command printed, never
copied by hand.

    python -m benchmarks.default_run --train                  # runs `python -m train --workdir WORKDIR` (fresh)
    python -m benchmarks.default_run --log LOG --workdir DIR  # or: its console output, saved, and its run dir

Parses the command's summary (the `done:` line with its wall time, the `val loss` line against the n-gram
references), reads the validation curve from the run's metrics.jsonl, writes docs/default_run.json (with the date,
machine, JAX version and commit) and rewrites every span marked `<!-- default-run:NAME -->...<!-- /default-run -->`
in README.md and docs/*.md from that record (tests/test_readme.py checks each span equals its rendering).
"""

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax

from benchmarks.common import host_cpu

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "default_run.json"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DONE = re.compile(r"^done: step (\d+)/(\d+) in (?:(\d+)h )?(?:(\d+)m )?(?:(\d+)s)?")
GAP = re.compile(r"val loss (\d+\.\d+): (\d+\.\d+) (below|ABOVE) the unigram \((\d+\.\d+)\), (\d+\.\d+) (below|ABOVE) "
                 r"the bigram \((\d+\.\d+)\) on the same ([\d,]+) targets")
SPAN = re.compile(r"<!-- default-run:(\w+) -->(.*?)<!-- /default-run -->", re.S)


def parse_summary(text: str) -> dict:
    """{"seconds", "steps", "val_loss", "unigram", "bigram", "targets"} from a run's console output (the summary
    `train.loop.summary` prints); ValueError naming what is missing."""
    done = next((DONE.match(line.strip()) for line in text.splitlines() if DONE.match(line.strip())), None)
    gap = GAP.search(text)
    if done is None or gap is None:
        raise ValueError("no `done:` or `val loss ... the bigram` line: pass the console output of a finished run")
    h, m, s = (int(x or 0) for x in done.group(3, 4, 5))
    return {"steps": int(done.group(1)), "seconds": 3600 * h + 60 * m + s, "val_loss": float(gap.group(1)),
            "unigram": float(gap.group(4)), "bigram": float(gap.group(7)),
            "targets": int(gap.group(8).replace(",", ""))}


def val_curve(workdir) -> list[list]:
    """[[step, validation loss], ...] from the run's metrics.jsonl."""
    rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [[r["step"], round(r["val/loss"], 4)] for r in rows if "val/loss" in r]


def render(name: str, r: dict) -> str:
    """The text of span `name` from record `r`."""
    below = r["bigram"] - r["val_loss"]
    minutes = round(r["seconds"] / 60)
    curve = " / ".join(f"{loss:.4f}" for _, loss in r["val_curve"])
    steps = " / ".join(str(step) for step, _ in r["val_curve"])
    spans = {
        "minutes": f"about {minutes} minutes" + (f" (measured{r['load_note']})" if r["load_note"] else ""),
        "gap": f"{abs(below):.2f} nats {'below' if below >= 0 else 'ABOVE'} a bigram",
        "summary": (f"`val loss {r['val_loss']:.4f}: {r['unigram'] - r['val_loss']:.2f} below the unigram "
                    f"({r['unigram']:.2f}), {abs(below):.2f} {'below' if below >= 0 else 'ABOVE'} the bigram "
                    f"({r['bigram']:.2f})`"),
        "curve": (f"validation loss {curve} at steps {steps} ({r['machine']}, jax {r['jax']}, {r['date']}, "
                  f"commit {r['commit']}; wall {minutes} minutes{r['load_note']})"),
        "ends": (f"ends **{abs(below):.2f} nats {'below' if below >= 0 else 'ABOVE'} its bigram** "
                 f"({r['val_loss']:.4f} against {r['bigram']:.2f}; unigram {r['unigram']:.2f})"),
    }
    return spans[name]


def rewrite(record: dict) -> list[Path]:
    """Every marked span of the docs set from the record; returns the files changed."""
    changed = []
    for path in DOCS:
        text = path.read_text()
        new = SPAN.sub(lambda m: f"<!-- default-run:{m.group(1)} -->{render(m.group(1), record)}<!-- /default-run -->",
                       text)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


def machine() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {"machine": host_cpu(), "jax": jax.__version__, "date": datetime.date.today().isoformat(),
            "commit": commit.stdout.strip() or "unknown"}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.default_run", description=__doc__.splitlines()[0])
    p.add_argument("--train", action="store_true", help="run the README's command now (a fresh --workdir)")
    p.add_argument("--log", help="the console output of `python -m train`, saved")
    p.add_argument("--workdir", help="its run directory (with --log; default with --train: a temporary one)")
    p.add_argument("--load_note", default="", help="e.g. ', with a second process on the cores': said after the "
                                                   "wall time")
    a = p.parse_args(argv)
    if a.train:
        workdir = a.workdir or tempfile.mkdtemp(prefix="default_run_")
        out = subprocess.run([sys.executable, "-m", "train", "--workdir", workdir], cwd=ROOT, capture_output=True,
                             text=True)
        text = out.stdout + out.stderr
    elif a.log and a.workdir:
        workdir, text = a.workdir, Path(a.log).read_text(errors="replace")
    else:
        p.error("pass --train, or --log with --workdir")
    record = {"command": "pip install -e . && python -m train", **parse_summary(text),
              "val_curve": val_curve(workdir), **machine(), "load_note": a.load_note}
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    for path in rewrite(record):
        print(f"rewrote {path.relative_to(ROOT)}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
