"""Expert ablation: mask each expert of the chosen MoE layers out of the selection (tokens go to their next
choice) and report the validation loss change per domain and token class, beside the expert's routing share.

    python -m analysis.ablate --workdir runs/default
    python -m analysis.ablate --workdir runs/default --layer 3 --experts 0 5 --rows_per_domain 16

The loss is the trainer's validation loss (eval.rows_per_domain rows per domain of the validation split;
see analysis/ablation.py for the masking and the group-limited case). Writes ablation.json,
ablation_importance.png and ablation_domains.png into --out (default WORKDIR/analysis) and prints one line
per ablation and the rank correlation of share and loss change per layer. Cost: one validation pass per
(layer, expert). Bad input: one line on stderr, exit 2.
"""

import json
from pathlib import Path

import numpy as np

from analysis import ablation, ablation_plots
from analysis.routing_stats import plain_json
from moe.cli import ArgParser, check_out_dir, run_cli
from moe.errors import UserError
from rundir import open_run


def parse_args(argv):
    p = ArgParser(prog="python -m analysis.ablate", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="run directory with checkpoints/")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--out", default=None, help="output directory (default: WORKDIR/analysis)")
    p.add_argument("--layer", type=int, nargs="+", default=None, help="model layer ids (MoE layers; default all)")
    p.add_argument("--experts", type=int, nargs="+", default=None, help="expert ids (default: every expert)")
    p.add_argument("--rows_per_domain", type=int, default=None,
                   help="validation rows per domain (default: the run's eval.rows_per_domain)")
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


def correlations(result):
    """Per ablated layer the Spearman correlation of routing share and loss change: over experts (overall
    share, overall change) and over (expert, domain) pairs."""
    out = {}
    for layer in sorted({lay for lay, _ in result["ablations"]}):
        rows = [a for a, (lay, _) in enumerate(result["ablations"]) if lay == layer]
        li = list(result["layer_ids"]).index(layer)
        experts = [result["ablations"][a][1] for a in rows]
        share_DxA = np.asarray(result["share_LxDxE"])[li][:, experts]
        out[layer] = {"experts": ablation_plots.spearman(np.asarray(result["share_LxE"])[li][experts],
                                                          np.asarray(result["delta_A"])[rows]),
                      "expert_domain_pairs": ablation_plots.spearman(
                          share_DxA.T.ravel(), np.asarray(result["delta_AxD"])[rows].ravel())}
    return out


def run(args, log=print):
    check_out_dir(args.out, Path(args.workdir) / "analysis", create=False)
    run_ = open_run(args.workdir, args.step)
    check_choice(run_, args.layer, args.experts)
    result = ablation.ablate(run_.model, run_.config, run_.tokenizer, args.layer, args.experts,
                             args.rows_per_domain, log=log)
    corr = correlations(result)
    out = check_out_dir(args.out, Path(args.workdir) / "analysis")
    doc = plain_json(dict(result, workdir=str(args.workdir), step=run_.step, mask_bias=ablation.MASK_BIAS,
                      spearman={f"layer {k}": v for k, v in corr.items()}))
    (out / "ablation.json").write_text(json.dumps(doc, indent=1))
    ablation_plots.plot_importance_vs_share(result, out / "ablation_importance.png")
    ablation_plots.plot_domains(result, out / "ablation_domains.png")
    log(f"base validation loss {float(result['base_loss']):.4f} on {int(np.sum(result['n_DxC']))} tokens")
    for layer, c in corr.items():
        log(f"layer {layer}: Spearman(share, loss change) over experts {c['experts']:.2f}, "
            f"over (expert, domain) pairs {c['expert_domain_pairs']:.2f}")
    log(f"wrote ablation.json, ablation_importance.png and ablation_domains.png to {out}")
    return result, out


def main(argv=None):
    run_cli(run, parse_args, argv)


if __name__ == "__main__":
    main()
