"""`python -m train` in several git revisions, side by side: tokens/s and the loss curve of each, one command.

    python -m benchmarks.train_revisions --revs 72db605,HEAD               # the whole default run, 2 rounds
    python -m benchmarks.train_revisions --revs 72db605,HEAD,WORKTREE --rounds 3 --steps 40 \
        -- --config.eval.every=1000 --config.checkpoint.every=1000           # a quick look at the first 40 steps

Each revision is exported with `git archive` into a fresh folder under --out (`WORKTREE`: this checkout as it is
on disk, uncommitted changes included) and trained there with its own code (`python -m train` run from that
folder: checked before the first run), into a fresh run directory under --out. Runs alternate (A, B, A, B, ...)
so drifting load on a shared machine hits every revision alike; the speed-up over the first revision is taken
within each round, then its median over rounds is reported. Arguments after `--` go to every `python -m train`
(the config is each revision's own `configs/default.py` unless one names another; --workdir is this command's).

Per run: tokens/s is the median of the loop's logged `tokens_per_sec` windows after the first (the first holds
the compile). Older revisions counted evaluations and checkpoint saves inside their windows, newer ones do not:
the median over a run's windows is robust to those few. `wall s` is the whole process (compiles, data,
evaluations, checkpoints; the first run may also tokenize the corpus into the shared cache). The loss table is
the train loss at --loss_every steps of the first round: the same model should give the same curve up to rounding.
This process never starts JAX itself, so on a GPU the runs get the whole device.
"""

import argparse
import datetime
import importlib.metadata
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

from benchmarks.common import host_cpu, table
from plumbing.errors import UserError, exit_with, os_error

WORKTREE = "WORKTREE"
REPO = Path(__file__).resolve().parents[1]


def commit_label(rev: str, repo: Path = REPO) -> str:
    """The short hash of a revision (WORKTREE stays WORKTREE)."""
    if rev == WORKTREE:
        return WORKTREE
    got = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", f"{rev}^{{commit}}"], capture_output=True,
                         text=True)
    if got.returncode:
        raise UserError(f"--revs: {rev!r} is not a commit of {repo}; give a hash, tag, branch or {WORKTREE}")
    return got.stdout.strip()


def export(label: str, dest: Path, repo: Path = REPO) -> Path:
    """The source tree of a commit: `git archive` of it extracted into dest/tree_<label> (WORKTREE: the checkout)."""
    if label == WORKTREE:
        return repo
    tree = dest / f"tree_{label}"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", label], capture_output=True)
    if archive.returncode:
        raise UserError(f"git archive {label} failed: {archive.stderr.decode(errors='replace').strip()[-200:]}")
    tar_path = dest / f"tree_{label}.tar"
    tar_path.write_bytes(archive.stdout)
    with tarfile.open(tar_path) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tree, filter="data")
        else:  # Python < 3.11.4: a git archive of this repository holds plain files only
            tar.extractall(tree)
    tar_path.unlink()
    return tree


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
    # Every run compiles: revisions with train.compile_cache_dir would otherwise load their programs from the
    # first round's cache and report a shorter wall time than those without.
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    return env


def train_in(tree: Path, workdir: Path, train_args: list[str]) -> float:
    """Runs `python -m train` in `tree` into `workdir` (an absolute path; log beside it); returns the wall
    seconds."""
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


def resolve(revs: list[str]) -> list[str]:
    """The revisions' labels (`commit_label`), refusing two names of one commit."""
    labels = [commit_label(rev) for rev in revs]
    if len(set(labels)) < len(labels):
        raise UserError(f"--revs {','.join(revs)} name the same commit twice ({', '.join(labels)}); give distinct ones")
    return labels


def measure(labels: list[str], rounds: int, train_args: list[str], out: Path, log=print, train=None,
            made: list | None = None):
    """(rows, runs) for revisions already `resolve`d: one row per revision (median tokens/s over rounds, per-round
    figures, its tokens/s over the first revision's within each round) and each revision's per-round figures
    (`read_run`'s, plus wall seconds). `out` must be absolute (the runs' working directories are the trees); every
    path made is appended to `made`."""
    made = [] if made is None else made
    train = train or train_in
    trees = []
    for label in labels:
        trees.append(export(label, out))
        if label != WORKTREE:
            made.append(trees[-1])
    for tree in trees:
        check_imports_from(tree)
    runs = [[] for _ in trees]
    for r in range(rounds):
        for i, (label, tree) in enumerate(zip(labels, trees)):
            workdir = out / f"run_{label}_{r + 1}"
            made += [workdir, workdir.with_suffix(".log")]
            log(f"round {r + 1}/{rounds}: python -m train in {label} -> {workdir}")
            wall = train(tree, workdir, train_args)
            runs[i].append({**read_run(workdir / "metrics.jsonl"), "wall s": wall})
    rows = []
    for label, rr in zip(labels, runs):
        speedups = [own["tokens/s"] / first["tokens/s"] for first, own in zip(runs[0], rr)]
        median = round(float(np.median([x["tokens/s"] for x in rr])))
        rows.append({"revision": label, "tokens/s (median of rounds)": median,
                     "per round": ", ".join(f"{x['tokens/s']:,.0f}" for x in rr),
                     "tokens/s x first (median of rounds)": float(np.median(speedups)),
                     "per round x first": ", ".join(f"{x:.2f}" for x in speedups),
                     "wall s": ", ".join(f"{x['wall s']:.0f}" for x in rr), "windows": rr[0]["windows"]})
    return rows, runs


def loss_rows(labels: list[str], runs: list, every: int) -> list[dict]:
    """The first round's train loss every `every` steps (and at the last common logged step), one column per
    revision."""
    steps = sorted(set.intersection(*(set(rr[0]["loss"]) for rr in runs)))
    if not steps:
        return []  # the revisions logged at different steps: nothing to put side by side
    shown = [s for s in steps if s % every == 0 or s == steps[-1]]
    return [{"step": s, **{label: f"{rr[0]['loss'][s]:.5f}" for label, rr in zip(labels, runs)}} for s in shown]


def host() -> str:
    """Date, JAX version and host, without starting JAX here (on a GPU that would take the memory the runs need)."""
    return f"{datetime.date.today()} | jax {importlib.metadata.version('jax')} | {host_cpu()}"


def remove(paths) -> None:
    """Deletes exactly these paths (files or folders this command made), nothing beside them."""
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.exists():
            p.unlink()


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--revs", required=True, help=f"comma-separated git revisions, or {WORKTREE}; the first is the "
                                                  "baseline of the speed-ups")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=0, help="train.steps of every run; 0: the config's")
    ap.add_argument("--loss_every", type=int, default=100, help="steps between the loss table's rows")
    ap.add_argument("--out", default="", help="where the trees and runs go (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the exported trees, runs and logs")
    a = ap.parse_args(argv)
    made, out = [], None
    try:
        revs = [r.strip() for r in a.revs.split(",") if r.strip()]
        if len(revs) < 2 or len(set(revs)) != len(revs):
            raise UserError(f"--revs {a.revs!r}: give at least two distinct revisions, comma-separated")
        if a.rounds < 1 or a.steps < 0 or a.loss_every < 1:
            raise UserError("--rounds and --loss_every must be >= 1 and --steps >= 0 (0: the config's)")
        if any(x == "--workdir" or x.startswith("--workdir=") for x in train_args):
            raise UserError("--workdir after `--`: every run gets its own fresh one under --out; leave it out")
        labels = resolve(revs)  # before anything is made
        out = Path(a.out).resolve() if a.out else Path(tempfile.mkdtemp(prefix="train_revisions_"))
        if a.out and out.exists() and any(out.iterdir()):
            raise UserError(f"--out {out} is not empty; give a new directory (runs are never written over)")
        if not out.exists():
            out.mkdir(parents=True)
            made_out = True
        else:
            made_out = not a.out  # the temporary directory is this command's; an existing empty --out is not
        steps = [f"--config.train.steps={a.steps}"] if a.steps else []
        print(host())
        rows, runs = measure(labels, a.rounds, steps + train_args, out, made=made)
        print(table(rows))
        print()
        losses = loss_rows([r["revision"] for r in rows], runs, a.loss_every)
        print(table(losses) if losses else "(the revisions logged no step in common: no loss table)")
        if a.keep:
            print(f"trees, runs and logs kept in {out}")
        else:
            remove(made)
            if made_out and not any(out.iterdir()):
                out.rmdir()
    except KeyboardInterrupt:
        exit_with(UserError(f"interrupted; what ran so far is in {out}" if out else "interrupted"), 130)
    except OSError as e:  # disk full, permissions: one line, not a traceback
        exit_with(os_error(e))
    except UserError as e:
        exit_with(e)


if __name__ == "__main__":
    main()
