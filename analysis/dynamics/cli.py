"""When does routing settle? Router saturation, load and routing biases over every checkpoint of a run.

    python -m analysis.dynamics --workdir runs/default
    python -m analysis.dynamics --workdir runs/default --max_tokens 2048 --final_step 400

The same validation tokens (--max_tokens per domain) are routed through every checkpoint of the run and
through the step-0 model (analysis.specialization.baselines.init_model, so step 0 needs no checkpoint). Per
checkpoint and MoE layer: router saturation (OLMoE: the share of the final checkpoint's top-k that this
checkpoint already picks; 1 at the final one, K/E for unrelated routers), MaxVio and dead experts on those
tokens, and the routing bias of every expert (read from the checkpoint: the trajectory of aux-loss-free
balancing). From metrics.jsonl, MaxVio and bias range of every logged batch (trajectory.py). Writes
dynamics.json, dynamics_saturation.png, dynamics_load.png and dynamics_bias.png into --out (default
WORKDIR/analysis).

A run keeps only checkpoint.keep checkpoints (3 by default); for the whole trajectory train with e.g.
--config.checkpoint.keep=100 --config.checkpoint.every=50. Bad input: one line on stderr, exit 2.
"""

import json
from pathlib import Path

from plumbing.args import ArgParser, check_out_dir, run_cli
from plumbing.errors import UserError


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


def run(args, log=print):
    # The analysis itself: loaded once the flags are read (--help and bad flags answer at once).
    from analysis import figures
    from analysis.dynamics import plots
    from analysis.dynamics.trajectory import training_series, trajectory
    from analysis.routing.stats import plain_json
    from rundir.provenance import provenance

    check_out_dir(args.out, Path(args.workdir) / "analysis", create=False)
    traj = trajectory(args.workdir, args.final_step, args.split, args.max_tokens, args.batch_size,
                      step0=not args.no_step0, log=log)
    series = training_series(args.workdir)
    out = check_out_dir(args.out, Path(args.workdir) / "analysis")
    doc = plain_json(dict(traj, workdir=str(args.workdir), split=args.split, max_tokens=args.max_tokens,
                      training={k: {layer: {"steps": s, "values": v} for layer, (s, v) in ser.items()}
                                for k, ser in series.items()}, provenance=provenance()))
    (out / "dynamics.json").write_text(json.dumps(doc, indent=1))
    with figures.source(f"{args.workdir}, steps {traj['steps'][0]}-{traj['final_step']}"):
        plots.plot_saturation(traj, out / "dynamics_saturation.png")
        plots.plot_load(traj, series.get("maxvio", {}), out / "dynamics_load.png")
        plots.plot_bias(traj, series.get("bias_range", {}), out / "dynamics_bias.png")
    for i, layer in enumerate(traj["layer_ids"]):
        sat = ", ".join(f"{s}: {v:.3f}" for s, v in zip(traj["steps"], traj["saturation_SxL"][:, i]))
        log(f"layer {layer} saturation vs step {traj['final_step']}: {sat}")
    log(f"wrote dynamics.json, dynamics_saturation.png, dynamics_load.png and dynamics_bias.png to {out}")
    return traj, out


def main(argv=None):
    run_cli(run, parse_args, argv)

