"""Expert ablation: remove each expert of the chosen MoE layers and report the validation loss change per domain
and token class, beside the expert's routing share and the controls (every routed expert, the shared expert).

    python -m analysis.ablate --workdir runs/default                       # rerouted and zeroed, with controls
    python -m analysis.ablate --workdir runs/default --layer 3 --experts 0 5 --rows_per_domain 16 --mode reroute

--mode reroute masks the expert out of the selection (tokens go to their next choice), zero sets its output to 0
with routing unchanged, both (the default) does each, so the difference says what rerouting recovers. The controls
(analysis/ablate/controls.py) always run: every routed expert of every MoE layer zeroed, the shared expert
zeroed, and every routed expert of each MoE layer zeroed; they say whether the routed experts matter at all.
The loss is the trainer's validation loss (eval.rows_per_domain rows per domain of the validation split; see
analysis/ablate/ablation.py). Writes ablation.json, ablation_importance.png and ablation_domains.png into
--out (default WORKDIR/analysis) and prints the controls, a line per ablation and the rank correlation of share
and loss change per layer. Cost: one validation pass per (layer, expert, mode) and per control. Bad input: one
line on stderr, exit 2.
"""

import json
from pathlib import Path

from analysis.ablate import MODES
from plumbing.args import ArgParser, check_out_dir, run_cli
from plumbing.errors import UserError


def parse_args(argv):
    p = ArgParser(prog="python -m analysis.ablate", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="run directory with checkpoints/")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--out", default=None, help="output directory (default: WORKDIR/analysis)")
    p.add_argument("--layer", type=int, nargs="+", default=None, help="model layer ids (MoE layers; default all)")
    p.add_argument("--experts", type=int, nargs="+", default=None, help="expert ids (default: every expert)")
    p.add_argument("--rows_per_domain", type=int, default=None,
                   help="validation rows per domain (default: the run's eval.rows_per_domain)")
    p.add_argument("--mode", default="both", choices=("both", *MODES),
                   help="reroute: mask out of the selection; zero: zero the output, routing unchanged; both")
    args = p.parse_args(argv)
    if args.rows_per_domain is not None and args.rows_per_domain < 1:
        raise UserError(f"--rows_per_domain must be >= 1, got {args.rows_per_domain}")
    return args


def check_choice(run, layers, experts):
    moe_ids, n = run.moe_layer_ids, run.model.cfg.n_routed_experts
    for layer in layers or ():
        if layer not in moe_ids:
            raise UserError(f"--layer {layer} is not an MoE layer of this model; valid MoE layers: {moe_ids}")
    for e in experts or ():
        if not 0 <= e < n:
            raise UserError(f"--experts {e} is out of range; this model has experts 0..{n - 1}")


def run(args, log=print):
    # The analysis itself: loaded once the flags are read (--help and bad flags answer at once).
    import numpy as np

    from analysis import figures
    from analysis.ablate import ablation, plots
    from analysis.ablate import controls as ablation_controls
    from analysis.figures import source_of
    from analysis.routing.stats import plain_json
    from rundir import open_run
    from rundir.provenance import provenance

    check_out_dir(args.out, Path(args.workdir) / "analysis", create=False)
    run_ = open_run(args.workdir, args.step)
    check_choice(run_, args.layer, args.experts)
    scorer = ablation.Scorer(run_.model, run_.config, run_.tokenizer, args.rows_per_domain)
    controls = ablation_controls.controls(run_.model, run_.config, run_.tokenizer, scorer=scorer)
    for line in ablation_controls.control_lines(controls):
        log(f"control: {line}")
    modes = MODES if args.mode == "both" else (args.mode,)
    results = {mode: ablation.ablate(run_.model, run_.config, run_.tokenizer, args.layer, args.experts,
                                     args.rows_per_domain, log=log, mode=mode, scorer=scorer) for mode in modes}
    result, zero = results[modes[0]], results.get("zero") if len(modes) > 1 else None
    corr = plots.correlations(result)
    out = check_out_dir(args.out, Path(args.workdir) / "analysis")
    extra = {"controls": controls}
    if zero is not None:
        extra["zero_output"] = {k: zero[k] for k in ("delta_A", "se_A", "delta_AxD", "se_AxD", "delta_AxC")}
    doc = plain_json(dict(result, workdir=str(args.workdir), step=run_.step, mask_bias=ablation.MASK_BIAS,
                          spearman={f"layer {k}": v for k, v in corr.items()}, provenance=provenance(), **extra))
    (out / "ablation.json").write_text(json.dumps(doc, indent=1))
    with figures.source(source_of(args.workdir, run_.step)):
        plots.plot_importance_vs_share(result, out / "ablation_importance.png", zero=zero, controls=controls)
        plots.plot_domains(result, out / "ablation_domains.png")
    log(f"base validation loss {float(result['base_loss']):.4f} on {int(np.sum(result['n_DxC']))} tokens")
    if zero is not None and len(result["delta_A"]):
        gap = np.asarray(zero["delta_A"]) - np.asarray(result["delta_A"])
        log(f"zeroed minus rerouted, per expert: mean {gap.mean():+.5f}, max {gap.max():+.5f} nats "
            "(what rerouting to the next choice recovers)")
    for layer, c in corr.items():
        log(f"layer {layer}: Spearman(share, loss change) over experts {c['experts']:.2f}, "
            f"over (expert, domain) pairs {c['expert_domain_pairs']:.2f}")
    log(f"wrote ablation.json, ablation_importance.png and ablation_domains.png to {out}")
    return result, out


def main(argv=None):
    run_cli(run, parse_args, argv)

