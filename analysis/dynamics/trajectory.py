"""Routing over every checkpoint of a run: the same validation tokens routed through each checkpoint and the
step-0 model (saturation against the final checkpoint, load, MaxVio, dead experts, routing biases), and the
per-batch MaxVio and bias range the trainer logged to metrics.jsonl.

    traj = trajectory("runs/default", max_tokens=2048)     # dynamics.json's arrays, one row per step
    series = training_series("runs/default")               # {"maxvio": {layer: (steps, values)}, "bias_range": ...}
"""

from pathlib import Path

import numpy as np

from analysis.routing import stats
from analysis.routing.stats import SaturationAccumulator
from analysis.specialization import baselines
from moe import router, routing_biases
from plumbing.errors import UserError
from rundir import RunDir, open_run
from rundir.checkpoints import steps_in


def saturation(early, final) -> np.ndarray:
    """Per MoE layer, the share of `final`'s top-k that `early` also picks (two RoutingRecords of the same
    tokens; SaturationAccumulator)."""
    acc = SaturationAccumulator(len(final.batches[0]["ids"]))
    for e, f in zip(early.batches, final.batches, strict=True):
        acc.update(e["ids"], f["ids"], f["valid"])
    return acc.finalize()["saturation_L"]


def load(record) -> np.ndarray:
    """Top-k assignments per MoE layer and expert [L, E] of the record's valid tokens."""
    n_layers = len(record.batches[0]["ids"])
    load_LxE = np.zeros((n_layers, record.n_experts), np.int64)
    for b in record.batches:
        for layer, ids in enumerate(b["ids"]):
            load_LxE[layer] += np.bincount(ids[b["valid"]].ravel().astype(np.int64), minlength=record.n_experts)
    return load_LxE


def trajectory(workdir, final_step=None, split=None, max_tokens=2048, batch_size=None, step0=True, log=print):
    """Per checkpoint step (ascending; 0 = the step-0 model): saturation vs the final checkpoint, load,
    MaxVio, dead experts and routing biases. Returns a dict of lists / arrays (see dynamics.json)."""
    steps = steps_in(RunDir(Path(workdir)).checkpoints)
    final = open_run(workdir, final_step)
    steps = [s for s in steps if s <= final.step]
    final_rec = baselines.route_record(final.model, final.config, split, max_tokens, batch_size)
    if not final_rec.batches:
        raise UserError(f"no tokens to analyse in split {split or final.config.data.eval_split!r}; check --split")
    out = {"steps": [], "saturation_SxL": [], "load_SxLxE": [], "bias_SxLxE": []}

    def add(step, model, record):
        out["steps"].append(step)
        out["saturation_SxL"].append(saturation(record, final_rec))
        out["load_SxLxE"].append(load(record))
        out["bias_SxLxE"].append(np.stack([np.asarray(b, np.float64) for b in routing_biases(model)]))

    if step0 and 0 not in steps:
        init = baselines.init_model(final)
        add(0, init, baselines.route_record(init, final.config, split, max_tokens, batch_size))
    for step in steps:
        if step == final.step:
            add(step, final.model, final_rec)
            continue
        try:
            run = open_run(workdir, step, log=lambda *a: None)
        except UserError as e:  # a damaged checkpoint: skip it, say so
            log(f"skipping checkpoint {step}: {e}")
            continue
        log(f"routing checkpoint {step}")
        add(step, run.model, baselines.route_record(run.model, run.config, split, max_tokens, batch_size))
    load_SxLxE = np.asarray(out["load_SxLxE"])
    return dict(
        {k: np.asarray(v) for k, v in out.items()},
        maxvio_SxL=np.asarray(router.max_violation(load_SxLxE), np.float64),
        dead_SxL=(load_SxLxE == 0).sum(-1), final_step=final.step, layer_ids=final.moe_layer_ids,
        top_k=final.model.cfg.top_k, n_experts=final.model.cfg.n_routed_experts,
        n_tokens=int(sum(int(b["valid"].sum()) for b in final_rec.batches)),
        bias_update_rate=float(final.config.train.bias_update_rate))


def training_series(workdir):
    """{"maxvio": {layer: (steps, values)}, "bias_range": {...}} from WORKDIR/metrics.jsonl ({} without it)."""
    path = RunDir(Path(workdir)).metrics
    if not path.is_file():
        return {}
    return {name: stats.read_maxvio_series(path, key_pattern=rf"moe/layer_(\d+)/{name}")
            for name in ("maxvio", "bias_range")}
