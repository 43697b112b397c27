"""How the importance scores relate to the zeroing ablation, and which experts' outputs are outliers (NumPy and
SciPy only).

    rho = correlations(stats, zero)     # per MoE layer: Spearman of REAP and of routing share with the loss change
    outlier_ratio(stats["max_act_LxE"]) # each expert's largest activation / the layer's median expert's

A score that predicts what removing an expert costs should rank experts as the ablation does: Spearman's rho over
the experts of a layer, with its p-value (a test against no association: with 8 or 32 experts only a large rho is
told from chance), beside the same for the routing share, the cheaper predictor REAP has to beat.
"""

import numpy as np
from scipy import stats


def spearman(x, y) -> tuple[float, float]:
    """(rho, two-sided p) over the pairs where both are finite; NaN when fewer than 3 or either side is constant."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan"), float("nan")
    r = stats.spearmanr(x, y)
    return float(r[0]), float(r[1])


def zero_delta_LxE(zero, layer_ids, n_experts: int) -> np.ndarray:
    """The ablation's loss change (analysis.ablate.ablation.ablate, mode "zero") as [L, E], NaN where not ablated."""
    out = np.full((len(layer_ids), n_experts), np.nan)
    for (layer, e), d in zip(zero["ablations"], zero["delta_A"]):
        out[list(layer_ids).index(layer), e] = d
    return out


def correlations(stats_, delta_LxE) -> dict:
    """Per MoE layer ("layer L"): Spearman (rho, p) of REAP and of share with the zeroing loss change."""
    out = {}
    for i, layer in enumerate(stats_["layer_ids"]):
        if not np.isfinite(delta_LxE[i]).any():
            continue
        rho_r, p_r = spearman(stats_["reap_LxE"][i], delta_LxE[i])
        rho_s, p_s = spearman(stats_["share_LxE"][i], delta_LxE[i])
        out[f"layer {layer}"] = {"reap_rho": rho_r, "reap_p": p_r, "share_rho": rho_s, "share_p": p_s,
                                 "n_experts": int(np.isfinite(delta_LxE[i]).sum())}
    return out


def outlier_ratio(max_act_LxE) -> np.ndarray:
    """Each expert's largest output activation over its layer's median expert's (NaN for an unused expert)."""
    m = np.asarray(max_act_LxE, float)
    with np.errstate(invalid="ignore", divide="ignore"):
        return m / np.nanmedian(m, axis=-1, keepdims=True)


def super_experts(max_act_LxE, layer_ids, factor: float) -> list[dict]:
    """Experts whose largest activation is more than `factor` x their layer's median expert's."""
    ratio = outlier_ratio(max_act_LxE)
    return [{"layer": int(layer_ids[i]), "expert": int(e), "max_act": float(max_act_LxE[i][e]),
             "ratio": float(ratio[i, e])} for i, e in zip(*np.nonzero(np.nan_to_num(ratio) > factor))]
