"""Every file `python -m analysis.routing` writes from an `Analysis` (collect.py), and its terminal
summary: routing.json, routing.npz, one PNG per plot of plots.py and tokens.html. The notebook writes the same
files by calling `write_run_outputs`.
"""

import json
from pathlib import Path

import numpy as np

from analysis.routing import plots, stats, step0, tokens_html
from analysis.routing.collect import Analysis
from rundir.provenance import provenance


def _layer_label(result, i):
    return f"layer {int(result['layer_ids_L'][i])}"


def write_json(a: Analysis, path, meta, maxvio_series):
    """routing.json: run metadata, per layer how it routes ("layers": routed_by top_k or hash, its K, the zero
    experts' share of the choices and load), readable per-layer/domain shares (the routed experts', with the
    share the domain's token mix predicts under the token-identity null; beside them the zero experts') and
    per-token distributions, then every small metric array of the accumulator under
    "metrics" (NaN -> null); "locality": per layer each locality measure beside its chance levels, and
    "provenance" (commit, jax, machine)."""
    r = a.result
    L, Z = int(r["n_layers"]), int(r.get("n_zero_experts", 0))  # results saved before these keys: none of either
    hashed_L, k_L = r.get("hash_routed_L", np.zeros(L, bool)), r.get("top_k_L", np.full(L, int(r["top_k"])))
    per_layer, layers = {}, {}
    for i in range(L):
        per_layer[_layer_label(r, i)] = {
            name: {"n_tokens": int(r["n_tokens_D"][d]),
                   "share": r["share_LxDxE"][i, d], "gate_share": r["gate_share_LxDxE"][i, d],
                   "first_choice_share": r["share_top1_LxDxE"][i, d]}
            | ({"token_identity_null_share": r["tokennull_share_LxDxE"][i, d]} if "tokennull_share_LxDxE" in r else {})
            | ({"zero_expert_share": r["zero_share_LxD"][i, d], "zero_expert_gate_share": r["zero_gate_share_LxD"][i, d],
                "zero_expert_first_choice_share": r["zero_first_LxD"][i, d]} if "zero_share_LxD" in r else {})
            for d, name in enumerate(a.domain_names)}
        # How the layer routes: a hash layer's shares are its fixed token-id table's, not a learned routing.
        layers[_layer_label(r, i)] = {"routed_by": "hash" if hashed_L[i] else "top_k", "top_k": int(k_L[i])} | (
            {"zero_expert_frac": r["zero_frac_L"][i], "zero_expert_load": r["zero_load_LxZ"][i]}
            if "zero_frac_L" in r else {})
    tokens = []
    for which, n in (("track", "T"), ("freq", "N")):
        for t, tid in enumerate(r.get(f"{which}_ids_{n}", [])):
            tokens.append({"id": int(tid), "text": a.token_text.get(int(tid)), "kind": which,
                           "n": int(r[f"{which}_n_{n}"][t]), "share_LxE": r[f"{which}_share_{n}xLxE"][t]})
    doc = dict(meta, domains=a.domain_names, layer_ids=r["layer_ids_L"], top_k=int(r["top_k"]),
               n_experts=int(r["n_experts"]), n_zero_experts=Z, layers=layers,
               uniform_share=int(r["top_k"]) / (int(r["n_experts"]) + Z),
               token_notes=a.token_notes, timing={"tokens": a.n_tokens, "seconds": a.seconds,
                                                  "tokens_per_second": a.n_tokens / max(a.seconds, 1e-9)},
               per_layer=per_layer, tokens=tokens, saturation=a.saturation, locality=locality_table(r),
               maxvio_training={str(k): {"steps": s, "maxvio": v} for k, (s, v) in maxvio_series.items()},
               metrics=stats.to_jsonable(r), provenance=provenance())
    with open(path, "w") as f:
        json.dump(_plain(doc), f, indent=1)
    return path


def locality_table(r):
    """{"layer L": {measure: {"trained", "uniform", "load_matched_null", "token_identity_null", "step0"}}} for
    measure in first / any / overlap; a chance level not measured (step 0 of an HF model, the nulls of
    any-overlap, the token-identity null with zero experts or without the token tables) is absent."""
    out = {}
    for i in range(int(r["n_layers"])):
        row = {}
        for m, _ in plots.LOCALITY:
            cell = {"trained": r[f"loc_{m}_L"][i],
                    "uniform": r.get(f"baseline_{m}_L", np.full(int(r["n_layers"]), r[f"baseline_{m}"]))[i]}
            for key, name in ((f"loadmatched_{m}_L", "load_matched_null"), (f"tokennull_{m}_L", "token_identity_null"),
                              (f"step0_loc_{m}_L", "step0")):
                if key in r:
                    cell[name] = r[key][i]
            row[m] = cell
        out[_layer_label(r, i)] = row
    return out


def _plain(x):
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, np.ndarray | np.generic):
        return _plain(stats.to_jsonable({"x": x})["x"])
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def maxvio_series(workdir):
    """{model layer: (steps, maxvio)} from WORKDIR/metrics.jsonl, {} if the run has no metrics file."""
    path = Path(workdir) / "metrics.jsonl"
    return stats.read_maxvio_series(path) if path.is_file() else {}


def write_plots(a: Analysis, out, layer, series, final_step=None, compare_step=None):
    """Every PNG into `out`; returns the paths. Every MoE layer gets its domain_experts_layerL.png (one y scale
    across them); `layer` (the --layer choice) only picks the layer of the terminal summary."""
    del layer  # kept in the signature: run() passes it
    r, out, names = a.result, Path(out), a.domain_names
    labels = plots.layer_labels(r)
    paths = [plots.plot_domain_bars(r, i, out / f"domain_experts_{label.replace(' ', '')}.png", names)
             for i, label in enumerate(labels)]
    paths += [
        plots.plot_domain_heatmaps(r, out / "domain_heatmap.png", names),
        plots.plot_domain_heatmaps(r, out / "domain_specialization_top1.png", names,
                                   key="share_top1_LxDxE"),
        plots.plot_token_experts(r, out / "tokens_tracked.png", a.token_text, which="track"),
        plots.plot_locality(r, out / "locality.png"),
        plots.plot_coactivation(r, out / "coactivation.png"),
        plots.plot_maxvio_global(r, out / "maxvio_global.png"),
    ]
    if "freq_ids_N" in r:
        paths.append(plots.plot_token_experts(r, out / "tokens_frequent.png", a.token_text, which="freq"))
        paths.append(plots.plot_vocab_specialization(r, out / "vocab_specialization.png"))
    if series:
        paths.append(plots.plot_maxvio_series(series, out / "maxvio_training.png"))
    if a.saturation is not None:
        paths.append(plots.plot_saturation(
            {compare_step: a.saturation["saturation_L"]}, out / "saturation.png", final_step=final_step,
            random_baseline=int(r["top_k"]) / int(r["n_experts"]), layer_names=labels))
    return paths


def write_html(a: Analysis, path):
    """tokens.html, coloured by the routed experts (a token whose first choice is a zero expert stays uncoloured:
    no expert computed it; hovering shows its id, n_experts or above)."""
    r = a.result
    n = int(r["n_layers"])
    return tokens_html.render_tokens_html(a.samples, range(n), int(r["n_experts"]), path,
                                          layer_names=[_layer_label(r, i) for i in range(n)])


def write_outputs(a: Analysis, out, meta, series, layer, final_step=None, compare_step=None):
    """Every file of the analysis into `out`: routing.json, routing.npz, the plots (`write_plots`) and
    tokens.html; returns their paths."""
    out = Path(out)
    paths = [write_json(a, out / "routing.json", meta, series), out / "routing.npz"]
    np.savez_compressed(paths[-1], **a.result,
                        **({f"saturation_{k}": v for k, v in a.saturation.items()} if a.saturation else {}))
    paths += write_plots(a, out, layer, series, final_step=final_step, compare_step=compare_step)
    return paths + [write_html(a, out / "tokens.html")]


def write_run_outputs(a: Analysis, out, run_, workdir, layer, split=None, max_tokens=None,
                      compare_step=None):
    """`write_outputs` for a run (`python -m analysis.routing --workdir` and the notebook): its metadata, its
    MaxVio over training from WORKDIR/metrics.jsonl, and the untrained router's locality on the same tokens
    (`step0.locality`: one more routing pass, added to a.result as step0_loc_*_L). `layer`: the MoE-layer index
    of the summary."""
    untrained = step0.locality(run_, split, max_tokens)
    a.result.update({k: v for k, v in untrained.items() if k != "step0_source"})
    meta = {"workdir": str(workdir), "step": run_.step, "compare_step": compare_step,
            "split": split or run_.config.data.eval_split, "max_tokens": max_tokens,
            "layer": int(a.result["layer_ids_L"][layer]), "step0_source": untrained["step0_source"]}
    return write_outputs(a, out, meta, maxvio_series(workdir), layer, final_step=run_.step,
                         compare_step=compare_step)


def summary(a: Analysis, layer, step, compare_step=None):
    lines = [stats.summary_text(a.result, a.domain_names, layer=layer)]
    if a.saturation is not None:
        sat = ", ".join(f"{_layer_label(a.result, i)} {s:.3f}" for i, s in enumerate(a.saturation["saturation_L"]))
        lines.append(f"router saturation of step {compare_step} vs step {step}: {sat} "
                     f"(random {int(a.result['top_k']) / int(a.result['n_experts']):.3f})")
    of = f" through the checkpoint of step {step}" if step is not None else ""
    lines.append(f"routed {a.n_tokens:,} tokens{of} in {a.seconds:.1f}s ({a.n_tokens / max(a.seconds, 1e-9):,.0f} tokens/s)")
    return "\n".join(lines)
