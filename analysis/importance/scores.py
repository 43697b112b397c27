"""Everything `python -m analysis.importance` measures, on the validation rows of the ablation.

    r = importance(run.model, run.config, run.tokenizer, rows_per_domain=4, step0=init_model(run))
    r["stats"]["reap_LxE"], r["zero_delta_LxE"], r["correlations"], r["super_experts"], r["step0"]
"""

import numpy as np

from analysis import hf_rows
from analysis.ablate import ablation
from analysis.importance import reap, relate


def importance(model, config, tokenizer, rows_per_domain=None, layers=None, run_ablation: bool = True,
               step0=None, factor: float = 10.0, log=None, rows=None) -> dict:
    """REAP statistics (reap.expert_stats) of `model` and, with `step0` (the model at initialization), of it on the
    same rows; the zeroing ablation of every expert of `layers` (default every MoE layer) and the correlations.
    `rows` (analysis.hf_rows.Rows) replace the run's validation rows (a HF directory's)."""
    rows = rows or hf_rows.run_rows(config, rows_per_domain)
    batches = rows.batches
    stats = reap.expert_stats(model, batches)
    layer_ids = stats["layer_ids"]
    out = {"stats": stats, "factor": factor,
           "super_experts": relate.super_experts(stats["max_act_LxE"], layer_ids, factor),
           "outlier_ratio_LxE": relate.outlier_ratio(stats["max_act_LxE"])}
    if step0 is not None:
        s0 = reap.expert_stats(step0, batches)
        out["step0"] = {"stats": s0, "outlier_ratio_LxE": relate.outlier_ratio(s0["max_act_LxE"]),
                        "super_experts": relate.super_experts(s0["max_act_LxE"], layer_ids, factor)}
    if run_ablation:
        zero = ablation.ablate(model, config, tokenizer, layers, None, rows_per_domain, log=log, mode="zero",
                               scorer=hf_rows.RowsScorer(model, rows, tokenizer))
        delta = relate.zero_delta_LxE(zero, layer_ids, model.cfg.n_routed_experts)
        out.update(zero_delta_LxE=delta, zero_se_LxE=relate.zero_delta_LxE(
            dict(zero, delta_A=zero["se_A"]), layer_ids, model.cfg.n_routed_experts),
            base_loss=float(zero["base_loss"]), correlations=relate.correlations(stats, delta))
    return out


def summary_lines(r) -> list[str]:
    """The command's printed summary."""
    s, lines = r["stats"], []
    for i, layer in enumerate(s["layer_ids"]):
        ratio = r["outlier_ratio_LxE"][i]
        line = (f"layer {layer}: REAP {np.nanmin(s['reap_LxE'][i]):.4g}..{np.nanmax(s['reap_LxE'][i]):.4g}; "
                f"largest expert activation {np.nanmax(ratio):.1f}x the layer's median expert")
        if "step0" in r:
            line += f" (step 0: {np.nanmax(r['step0']['outlier_ratio_LxE'][i]):.1f}x)"
        c = r.get("correlations", {}).get(f"layer {layer}")
        if c:
            line += (f"; Spearman with the zeroing loss change: REAP {c['reap_rho']:+.2f} (p {c['reap_p']:.2g}), "
                     f"share {c['share_rho']:+.2f} (p {c['share_p']:.2g})")
        lines.append(line)
    ratio_Y = s["resid_max_Y"] / s["resid_median_Y"]
    lines.append("residual stream max / median |x| per block: " + ", ".join(f"{v:.0f}" for v in ratio_Y))
    lines.append(f"super experts (> {r['factor']:g}x the layer's median expert): "
                 + (", ".join(f"layer {x['layer']} expert {x['expert']} ({x['ratio']:.1f}x)" for x in r["super_experts"])
                    or "none"))
    return lines
