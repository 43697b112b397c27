"""`python -m train` in several git revisions, side by side: tokens/s and the loss curve of each, one command.

    python -m benchmarks.train_revisions --revs 72db605,HEAD               # the whole default run, 2 rounds
    python -m benchmarks.train_revisions --revs 72db605,HEAD,WORKTREE --rounds 3 --steps 40 \
        -- --config.eval.every=1000 --config.checkpoint.every=1000           # a quick look at the first 40 steps

Each revision is exported with `git archive` into a fresh folder under --out (`WORKTREE`: this checkout as it is
on disk, uncommitted changes included) and trained there with its own code (`python -m train` run from that
folder: checked before the first run), into a fresh run directory. Runs alternate (A, B, A, B, ...) so drifting
load on a shared machine hits every revision alike; the speed-up over the first revision is taken within each
round, then its median over rounds is reported. Arguments after `--` go to every `python -m train` (the config is each revision's own
`configs/default.py` unless one names another).

Per run: tokens/s is the median of the loop's logged `tokens_per_sec` windows after the first (the first holds
the compile). Older revisions counted evaluations and checkpoint saves inside their windows, newer ones do not:
the median over a run's windows is robust to those few. `wall s` is the whole process (compiles, data,
evaluations, checkpoints). The loss columns are the train loss at --loss_every steps of the first round: the same
model should give the same curve up to rounding.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import describe, table
from train.errors import UserError, exit_with, os_error

WORKTREE = "WORKTREE"
REPO = Path(__file__).resolve().parents[1]


def export(rev: str, dest: Path, repo: Path = REPO) -> tuple[str, Path]:
    """(label, source tree) of a revision: `git archive` of it extracted into dest (WORKTREE: the checkout)."""
    if rev == WORKTREE:
        return WORKTREE, repo
    got = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", f"{rev}^{{commit}}"], capture_output=True,
                         text=True)
    if got.returncode:
        raise UserError(f"--revs: {rev!r} is not a commit of {repo}; give a hash, tag, branch or {WORKTREE}")
    label = got.stdout.strip()
    tree = dest / f"tree_{label}"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", label], capture_output=True,
                             check=True)
    tar_path = dest / f"tree_{label}.tar"
    tar_path.write_bytes(archive.stdout)
    with tarfile.open(tar_path) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tree, filter="data")
        else:  # Python < 3.11.4: a git archive of this repository holds plain files only
            tar.extractall(tree)
    tar_path.unlink()
    return label, tree


def check_imports_from(tree: Path) -> None:
    """`python -m train` run in `tree` must import that tree's packages, not an installed (editable) copy."""
    code = "import moe, train; print(moe.__file__); print(train.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, env=_env(tree))
    paths = out.stdout.split()
    if out.returncode or len(paths) != 2 or not all(Path(p).resolve().is_relative_to(tree.resolve()) for p in paths):
        raise UserError(f"python in {tree} imports moe/train from {paths or out.stderr.strip()[-200:]}, not from "
                        f"that tree; run from an environment where the package is not installed elsewhere")


def _env(tree: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def train_in(tree: Path, workdir: Path, train_args: list[str]) -> float:
    """Runs `python -m train` in `tree` into `workdir` (log beside it); returns the wall seconds."""
    cmd = [sys.executable, "-m", "train", "--workdir", str(workdir), "--config.log.progress=False", *train_args]
    log = workdir.with_suffix(".log")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=tree, stdout=f, stderr=subprocess.STDOUT, env=_env(tree)).returncode
    if rc:
        raise UserError(f"`python -m train` failed in {tree} (exit {rc}); its output is in {log}")
    return time.perf_counter() - t0


def read_run(metrics_path: Path) -> dict:
    """tokens/s (median of the logged windows after the first) and the train loss by step of one run."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    windows = [r for r in rows if "tokens_per_sec" in r]
    if len(windows) < 2:
        raise UserError(f"{metrics_path} has {len(windows)} logged training windows; the median needs >= 2 "
                        f"(more --steps, or a smaller --config.log.every)")
    return {"tokens/s": float(np.median([r["tokens_per_sec"] for r in windows[1:]])), "windows": len(windows) - 1,
            "loss": {r["step"]: r["loss"] for r in windows}}


def measure(revs: list[str], rounds: int, train_args: list[str], out: Path, log=print, train=train_in):
    """(rows, runs): one row per revision (median tokens/s over rounds, per-round figures, its tokens/s over the
    first revision's within each round) and each revision's per-round figures (`read_run`'s, plus wall seconds)."""
    trees = [export(rev, out) for rev in revs]
    labels = [label for label, _ in trees]
    if len(set(labels)) < len(labels):
        raise UserError(f"--revs {','.join(revs)} name the same commit twice ({', '.join(labels)}); give distinct ones")
    for _, tree in trees:
        if train is train_in:
            check_imports_from(tree)
    runs = [[] for _ in trees]
    for r in range(rounds):
        for i, (label, tree) in enumerate(trees):
            workdir = out / f"run_{label}_{r + 1}"
            log(f"round {r + 1}/{rounds}: python -m train in {label} -> {workdir}")
            wall = train(tree, workdir, train_args)
            runs[i].append({**read_run(workdir / "metrics.jsonl"), "wall s": wall})
    rows = []
    for (label, _), rr in zip(trees, runs):
        speedups = [own["tokens/s"] / first["tokens/s"] for first, own in zip(runs[0], rr)]
        rows.append({"revision": label, "tokens/s (median of rounds)": float(np.median([x["tokens/s"] for x in rr])),
                     "per round": ", ".join(f"{x['tokens/s']:,.0f}" for x in rr),
                     "tokens/s x first (median of rounds)": float(np.median(speedups)),
                     "per round x first": ", ".join(f"{x:.2f}" for x in speedups),
                     "wall s": ", ".join(f"{x['wall s']:.0f}" for x in rr), "windows": rr[0]["windows"]})
    return rows, runs


def loss_rows(labels: list[str], runs: list, every: int) -> list[dict]:
    """The first round's train loss every `every` steps (and at the last logged step), one column per revision."""
    steps = sorted(set.intersection(*(set(rr[0]["loss"]) for rr in runs)))
    shown = [s for s in steps if s % every == 0 or s == steps[-1]]
    return [{"step": s, **{label: f"{rr[0]['loss'][s]:.5f}" for label, rr in zip(labels, runs)}} for s in shown]


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--revs", required=True, help=f"comma-separated git revisions, or {WORKTREE}; the first is the "
                                                  "baseline of the ratios")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=0, help="train.steps of every run; 0: the config's")
    ap.add_argument("--loss_every", type=int, default=100, help="steps between the loss table's rows")
    ap.add_argument("--out", default="", help="where the trees and runs go (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the exported trees and runs")
    a = ap.parse_args(argv)
    try:
        revs = [r.strip() for r in a.revs.split(",") if r.strip()]
        if len(revs) < 2 or len(set(revs)) != len(revs) or a.rounds < 1 or a.steps < 0 or a.loss_every < 1:
            raise UserError("need >= 2 distinct --revs, --rounds >= 1, --steps >= 0 and --loss_every >= 1")
        out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="train_revisions_"))
        if a.out and out.exists() and any(out.iterdir()):
            raise UserError(f"--out {out} is not empty; give a new directory (runs are never written over)")
        out.mkdir(parents=True, exist_ok=True)
        steps = [f"--config.train.steps={a.steps}"] if a.steps else []
        print(describe())
        rows, runs = measure(revs, a.rounds, steps + train_args, out)
        print(table(rows))
        print()
        print(table(loss_rows([r["revision"] for r in rows], runs, a.loss_every)))
        if not a.keep:  # only what this command made: a temporary directory, or what it put in an empty --out
            for made in [out] if not a.out else list(out.iterdir()):
                shutil.rmtree(made, ignore_errors=True)
        else:
            print(f"trees, runs and logs kept in {out}")
    except OSError as e:  # disk full, permissions: one line, not a traceback
        exit_with(os_error(e))
    except UserError as e:
        exit_with(e)


if __name__ == "__main__":
    main()
