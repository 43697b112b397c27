"""Per-expert ablation of the reference config over seeds: per MoE layer, the single-expert effects (rerouted and
zeroed) beside the layer's and the model's zeroing controls, each a mean with its 95% t-interval over the runs.

    python -m experiments.reference_routing.ablation_seeds \
        experiments/reference_routing/results/ablation_seed{0,1,2}_step2500.json \
        --out experiments/reference_routing/results/ablation_step2500.json

Each input is one run's `python -m analysis.ablate --mode both` (its analysis/ablation.json). Expert ids are not
comparable across seeds (each run learns its own experts), so a run is first reduced to per-layer statistics
(mean and max over the layer's experts, their sum, the rank correlation of share with importance), and only
those are compared across runs.
"""

import json
from pathlib import Path

import numpy as np

from analysis.routing.stats import plain_json
from analysis.specialization.compare import interval
from plumbing.args import ArgParser, run_cli
from plumbing.errors import UserError

# Per layer, from one run; "zeroed" is the expert's output set to zero with routing kept, "rerouted" the expert
# masked out of the selection (its tokens take their next choice).
STATS = {
    "rerouted, mean": "one expert rerouted: mean over the layer's experts",
    "rerouted, max": "one expert rerouted: the largest",
    "zeroed, mean": "one expert's output zeroed: mean over the layer's experts",
    "zeroed, max": "one expert's output zeroed: the largest",
    "zeroed - rerouted, mean": "what rerouting recovers, per expert",
    "zeroed, sum": "sum over the layer's experts, each zeroed alone",
    "layer zeroed at once": "the layer's routed experts zeroed together (control)",
    "sum / at once": "how far the layer's single-expert effects add up",
    "spearman share vs importance": "rank correlation over the layer's experts (zeroed effect vs routing share)",
    "spearman over (expert, domain)": "the same over (expert, domain) pairs",
}


def parse_args(argv):
    p = ArgParser(prog="python -m experiments.reference_routing.ablation_seeds", description=__doc__.split("\n")[0])
    p.add_argument("ablations", nargs="+", help="analysis.ablate --mode both JSON files, one per run")
    p.add_argument("--out", required=True, help="JSON file to write")
    return p.parse_args(argv)


def load(path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not JSON ({e.msg}); pass `analysis.ablate --mode both` results") from None


def per_layer(ab: dict) -> dict:
    """One run's ablation reduced to per-layer statistics (arrays over the MoE layers)."""
    if "zero_output" not in ab or ab.get("mode") != "reroute":
        raise UserError(f"{ab.get('workdir', 'an input')}: not an `analysis.ablate --mode both` result; rerun "
                         "`python -m analysis.ablate --workdir RUN --mode both`")
    layers = ab["layer_ids"]
    which = np.asarray([layer for layer, _ in ab["ablations"]])
    reroute, zero = np.asarray(ab["delta_A"]), np.asarray(ab["zero_output"]["delta_A"])
    ctl = dict(zip(ab["controls"]["names"], ab["controls"]["delta_A"], strict=True))
    out = {k: [] for k in STATS}
    for layer in layers:
        r, z = reroute[which == layer], zero[which == layer]
        at_once = ctl[f"routed experts, layer {layer}"]
        for k, v in (("rerouted, mean", r.mean()), ("rerouted, max", r.max()), ("zeroed, mean", z.mean()),
                     ("zeroed, max", z.max()), ("zeroed - rerouted, mean", (z - r).mean()), ("zeroed, sum", z.sum()),
                     ("layer zeroed at once", at_once), ("sum / at once", z.sum() / at_once),
                     ("spearman share vs importance", ab["spearman"][f"layer {layer}"]["experts"]),
                     ("spearman over (expert, domain)", ab["spearman"][f"layer {layer}"]["expert_domain_pairs"])):
            out[k].append(float(v))
    model = {"all routed experts": ctl["all routed experts"], "shared expert": ctl["shared expert"],
             "layers zeroed one at a time, summed": float(sum(out["layer zeroed at once"]))}
    return {"workdir": ab["workdir"], "step": ab["step"], "layers": layers, "base_loss": ab["base_loss"],
            "per_layer": out, "model": model}


def summarize(runs: list[dict]) -> dict:
    if len({tuple(r["layers"]) for r in runs}) > 1:
        raise UserError("the ablations cover different layers; ablate every run's same layers (default: all)")
    return {"per_layer": {k: interval([r["per_layer"][k] for r in runs]) for k in STATS},
            "model": {k: interval([[r["model"][k]] for r in runs]) for k in runs[0]["model"]}}


def fmt(s: dict, i: int, digits: int = 4) -> str:
    ci = (f" [{s['ci95_low'][i]:+.{digits}f}, {s['ci95_high'][i]:+.{digits}f}]"
          if np.isfinite(s["ci95_low"][i]) else "")
    return f"{s['mean'][i]:+.{digits}f}{ci}"


def table(summary: dict, layers: list[int]) -> list[str]:
    """Markdown: one row per statistic, one column per layer; mean [95% t-interval over runs]."""
    rows = ["| per layer | " + " | ".join(f"layer {layer}" for layer in layers) + " |",
            "|---" * (len(layers) + 1) + "|"]
    for k in STATS:
        digits = 2 if k.startswith(("spearman", "sum /")) else 4
        rows.append(f"| {k} | " + " | ".join(fmt(summary["per_layer"][k], i, digits) for i in range(len(layers)))
                    + " |")
    rows += ["", "| model controls | value |", "|---|---|"]
    rows += [f"| {k} | {fmt(s, 0)} |" for k, s in summary["model"].items()]
    return rows


def run(args, log=print):
    runs = [per_layer(load(f)) for f in args.ablations]
    summary = summarize(runs)
    for line in table(summary, runs[0]["layers"]):
        log(line)
    log(f"{len(runs)} run(s): " + ", ".join(f"{r['workdir']} step {r['step']}" for r in runs))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(plain_json({"runs": runs, "summary": summary}), indent=1))
    log(f"wrote {args.out}")
    return runs, summary


def main(argv=None):
    run_cli(run, parse_args, argv)


if __name__ == "__main__":
    main()
