"""When does routing settle? Router saturation, load and routing biases over every checkpoint of a run.

    python -m analysis.dynamics --workdir runs/default
    python -m analysis.dynamics --workdir runs/default --max_tokens 2048 --final_step 400

The same validation tokens (--max_tokens per domain) are routed through every checkpoint of the run and
through the step-0 model (analysis.baselines.init_model, so step 0 needs no checkpoint). Per checkpoint
and MoE layer: router saturation (OLMoE: the share of the final checkpoint's top-k that this checkpoint
already picks; 1 at the final one, K/E for unrelated routers), MaxVio and dead experts on those tokens,
and the routing bias of every expert (read from the checkpoint: the trajectory of aux-loss-free balancing).
From metrics.jsonl, MaxVio and bias range of every logged batch. Writes dynamics.json,
dynamics_saturation.png, dynamics_load.png and dynamics_bias.png into --out (default WORKDIR/analysis).

A run keeps only checkpoint.keep checkpoints (3 by default); for the whole trajectory train with e.g.
--config.checkpoint.keep=100 --config.checkpoint.every=50. Bad input: one line on stderr, exit 2.
"""

import json
from pathlib import Path

import numpy as np

from analysis import baselines, dynamics_plots, routing_stats
from analysis.routing_stats import SaturationAccumulator, plain_json
from moe import router, routing_biases
from plumbing.args import ArgParser, check_out_dir, run_cli
from plumbing.errors import UserError
from rundir import RunDir, open_run
from rundir.checkpoints import steps_in


def parse_args(argv):
    p = ArgParser(prog="python -m analysis.dynamics", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="run directory with checkpoints/ (and metrics.jsonl)")
    p.add_argument("--final_step", type=int, default=None,
                   help="checkpoint that saturation compares against (default: the latest)")
    p.add_argument("--out", default=None, help="output directory (default: WORKDIR/analysis)")
    p.add_argument("--split", default=None, help="data split (default: the run's data.eval_split)")
    p.add_argument("--max_tokens", type=int, default=2048, help="tokens per domain (2048)")
    p.add_argument("--batch_size", type=int, default=None, help="rows per batch (default: eval.batch_size)")
    p.add_argument("--no_step0", action="store_true", help="leave out the step-0 model")
    args = p.parse_args(argv)
    for name in ("max_tokens", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


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
    return {name: routing_stats.read_maxvio_series(path, key_pattern=rf"moe/layer_(\d+)/{name}")
            for name in ("maxvio", "bias_range")}


def run(args, log=print):
    check_out_dir(args.out, Path(args.workdir) / "analysis", create=False)
    traj = trajectory(args.workdir, args.final_step, args.split, args.max_tokens, args.batch_size,
                      step0=not args.no_step0, log=log)
    series = training_series(args.workdir)
    out = check_out_dir(args.out, Path(args.workdir) / "analysis")
    doc = plain_json(dict(traj, workdir=str(args.workdir), split=args.split, max_tokens=args.max_tokens,
                      training={k: {layer: {"steps": s, "values": v} for layer, (s, v) in ser.items()}
                                for k, ser in series.items()}))
    (out / "dynamics.json").write_text(json.dumps(doc, indent=1))
    dynamics_plots.plot_saturation(traj, out / "dynamics_saturation.png")
    dynamics_plots.plot_load(traj, series.get("maxvio", {}), out / "dynamics_load.png")
    dynamics_plots.plot_bias(traj, series.get("bias_range", {}), out / "dynamics_bias.png")
    for i, layer in enumerate(traj["layer_ids"]):
        sat = ", ".join(f"{s}: {v:.3f}" for s, v in zip(traj["steps"], traj["saturation_SxL"][:, i]))
        log(f"layer {layer} saturation vs step {traj['final_step']}: {sat}")
    log(f"wrote dynamics.json, dynamics_saturation.png, dynamics_load.png and dynamics_bias.png to {out}")
    return traj, out


def main(argv=None):
    run_cli(run, parse_args, argv)


if __name__ == "__main__":
    main()
