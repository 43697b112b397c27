"""Per-cell learning-rate selection, fixed before any comparison seed runs (docs/inference.md, rule 10).

Every cell (an arm, a 2x2 cell) trains once per rate of the grid on HELD_OUT_SEED, a seed no comparison uses; the
cell's rate is the one with the lowest final validation loss there. The comparison seeds then all run at their
cell's rate, so a contrast compares each architecture at its own best rate on the grid, never at a rate tuned for
one of them. A best rate at the grid's edge is flagged: the optimum may lie outside the grid.

    select(cells, grid, train, out)     # {cell: {"lr", "losses", "at_edge"}}; OUT/lr_sweep/selection.json
"""

import json
import math
from pathlib import Path

from plumbing.errors import UserError
from rundir.atomic import write_text

HELD_OUT_SEED = 1000  # above any --seeds a study takes, so the selection never sees a comparison seed


def parse_grid(text: str) -> tuple[float, ...]:
    """--lr_grid: at least two distinct positive rates, comma-separated; sorted ascending."""
    try:
        grid = tuple(sorted(float(x) for x in text.split(",") if x.strip()))
    except ValueError:
        grid = ()
    if len(grid) < 2 or len(set(grid)) != len(grid) or not all(math.isfinite(x) and x > 0 for x in grid):
        raise UserError(f"--lr_grid takes two or more distinct positive learning rates, e.g. 1.5e-3,3e-3,6e-3; "
                        f"got {text!r}")
    return grid


def sweep_dir(out, cell: str, lr: float) -> Path:
    return Path(out) / "lr_sweep" / cell / f"lr{lr:g}"


def choose(losses: dict) -> tuple[float, bool]:
    """(the rate with the lowest loss, whether it is the grid's smallest or largest); a diverged run (NaN) loses,
    and a tie goes to the smaller rate."""
    grid = sorted(losses)
    best = min(grid, key=lambda lr: (losses[lr] if math.isfinite(losses[lr]) else math.inf, lr))
    return best, best in (grid[0], grid[-1])


def select(cells, grid, train, out, log=print) -> dict:
    """Train every (cell, rate) on HELD_OUT_SEED through train(cell, lr, seed, workdir) -> result with "val_loss"
    (the study's own cached run function: a finished run is not trained again; None where --report_only found no
    finished run), write OUT/lr_sweep/selection.json and return {cell: {"lr": chosen, "losses": {lr: loss},
    "at_edge": bool}}."""
    chosen = {}
    for i, cell in enumerate(cells):
        losses = {}
        for j, lr in enumerate(grid):
            log(f"[lr sweep {i * len(grid) + j + 1}/{len(cells) * len(grid)}] {cell} lr {lr:g} seed {HELD_OUT_SEED}")
            result = train(cell, lr, HELD_OUT_SEED, sweep_dir(out, cell, lr))
            if result is None:
                raise UserError(f"the learning-rate sweep has no finished run in {sweep_dir(out, cell, lr)}; run "
                                "without --report_only first")
            losses[lr] = float(result["val_loss"])
        lr, edge = choose(losses)
        chosen[cell] = {"lr": lr, "losses": losses, "at_edge": edge}
        log(f"{cell}: lr {lr:g}" + (" (at the grid's edge)" if edge else ""))
    path = Path(out) / "lr_sweep" / "selection.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps({"held_out_seed": HELD_OUT_SEED, "grid": list(grid),
                                 "cells": {c: {**v, "losses": {f"{k:g}": x for k, x in v["losses"].items()}}
                                           for c, v in chosen.items()}}, indent=1))
    return chosen


def report_lines(chosen: dict) -> list[str]:
    """The report's section: every cell's loss at every rate on the held-out seed, and the rate it runs at."""
    if not chosen:
        return []
    grid = sorted({lr for v in chosen.values() for lr in v["losses"]})
    lines = ["## Learning rate per cell", "",
             f"Chosen before the comparison seeds ran: each cell trained at every rate on seed {HELD_OUT_SEED}, "
             "which no comparison uses; it runs at the rate with the lowest validation loss there (in bold). "
             "A choice at the grid's edge is marked: the best rate may lie outside the grid.", "",
             "| cell | " + " | ".join(f"lr {lr:g}" for lr in grid) + " | runs at |", "|---|" + "---|" * (len(grid) + 1)]
    for cell, v in chosen.items():
        vals = [f"**{v['losses'][lr]:.4f}**" if lr == v["lr"] else f"{v['losses'][lr]:.4f}" for lr in grid]
        lines.append(f"| {cell} | " + " | ".join(vals) + f" | {v['lr']:g}{' (edge)' if v['at_edge'] else ''} |")
    return lines + [""]
