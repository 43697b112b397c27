"""The controls beside any per-expert effect: how much do the routed experts, all of them, and the shared expert
matter to this model at all?

    rows = controls(run.model, run.config, run.tokenizer)
    rows["names"], rows["delta_A"], rows["se_A"]       # loss change of each control, its standard error over rows

A per-expert ablation of 0.002 nats means little without them: when zeroing every routed expert of every layer
costs 0.05 nats, the routed experts barely matter and no single expert can; when it costs 1 nat, a small single
effect says the experts are redundant with each other. Controls (each zeroes down projections, so nothing is
rerouted; analysis.ablate.ablation.edited):
  all routed experts       every routed expert of every MoE layer
  shared expert            the shared expert of every MoE layer (absent when the model has none)
  routed experts, layer L  every routed expert of one MoE layer, for each MoE layer
Same loss, rows and standard errors as analysis.ablate.ablation.ablate.
"""

from analysis.ablate.ablation import Scorer, edited


def control_edits(cfg) -> dict[str, list]:
    """Control name -> its edits, in report order."""
    moe_ids = list(cfg.moe_layer_ids)
    out = {"all routed experts": [("zero_routed", layer, None) for layer in moe_ids]}
    if cfg.n_shared_experts:
        out["shared expert"] = [("zero_shared", layer, None) for layer in moe_ids]
    for layer in moe_ids:
        out[f"routed experts, layer {layer}"] = [("zero_routed", layer, None)]
    return out


def controls(model, config, tokenizer, rows_per_domain=None, log=None, scorer=None):
    """Loss change of each control (control_edits): a dict with names, base_loss, delta_A, se_A, delta_AxD,
    se_AxD, domain_names (one validation pass per control)."""
    scorer = scorer or Scorer(model, config, tokenizer, rows_per_domain)
    base_ce_RxC, n_RxC = scorer(model)
    names, deltas = [], []
    for name, edits in control_edits(model.cfg).items():
        with edited(model, edits):
            ce_RxC, _ = scorer(model)
        names.append(name)
        deltas.append(ce_RxC - base_ce_RxC)
        if log:
            log(f"control: {name} zeroed: loss change {(ce_RxC - base_ce_RxC).sum() / n_RxC.sum():+.4f}")
    s = scorer.summaries(deltas, base_ce_RxC, n_RxC)
    return dict(names=names, base_loss=s["base_loss"], delta_A=s["delta_A"], se_A=s["se_A"],
                delta_AxD=s["delta_AxD"], se_AxD=s["se_AxD"], domain_names=scorer.domain_names)


def control_lines(result) -> list[str]:
    """One printed line per control."""
    return [f"{name} zeroed: {d:+.4f} +- {se:.4f} nats"
            for name, d, se in zip(result["names"], result["delta_A"], result["se_A"], strict=True)]
