"""Routing analysis of a trained run: which experts each domain and token uses, locality, load, saturation.

    python -m analysis.routing --workdir runs/default
    python -m analysis.routing --workdir runs/default --step 400 --compare_step 200 --layer 2 \\
        --token " the" --token "what" --max_tokens 50000 --out /tmp/routing
    python -m analysis.routing --hf path/to/hf_moe_dir --text a.txt --text b.txt --out /tmp/routing

--hf analyses a HuggingFace MoE directory instead of a run (GLM-4.5, Qwen2/3-MoE, OLMoE, Mixtral; see
docs/hf_import.md and analysis/hf_source.py): each --text file is a domain, or the bundled corpus is re-tokenized
with the model's tokenizer.

Routes every domain of --split (default: the run's validation split) through the checkpoint, batched and
jitted, and writes into --out (default WORKDIR/analysis):
  routing.json / routing.npz   shares per layer x domain x expert (top-k, sums to K; gate-weighted), per token
                               distributions (the most frequent ids and every --token), locality, MaxVio,
                               vocabulary specialization, co-activation, saturation, MaxVio over training
  *.png                        the plots of analysis/routing_plots.py
  tokens.html                  sample texts coloured by first-choice expert, one tab per MoE layer
and prints a short summary. Bad input (no checkpoint, unknown step, a non-MoE layer): one line, exit 2.
"""

import json
from pathlib import Path

import numpy as np

from analysis import hf_source, routing_html, routing_plots, routing_run, routing_stats
from plumbing.args import ArgParser, check_out_dir, run_cli
from plumbing.errors import UserError
from rundir import open_run


def parse_args(argv):
    p = ArgParser(prog="python -m analysis.routing", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workdir", help="run directory with checkpoints/ (and metrics.jsonl)")
    src.add_argument("--hf", metavar="DIR", help="HuggingFace MoE directory (config.json, safetensors, "
                                                 "tokenizer.json) instead of a run; needs --out")
    p.add_argument("--text", action="append", default=None, metavar="FILE",
                   help="with --hf: a UTF-8 text file, one domain named after it (repeatable; default: the "
                        "bundled corpus)")
    p.add_argument("--seq_len", type=int, default=None, help="with --hf: tokens per row (default 256)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--out", default=None, help="output directory (default: WORKDIR/analysis)")
    p.add_argument("--split", default=None, help="data split (default: the run's data.eval_split)")
    p.add_argument("--max_tokens", type=int, default=None, help="tokens per domain (default: the whole split)")
    p.add_argument("--layer", type=int, default=None,
                   help="model layer index (an MoE layer) for the per-domain bar charts (default: the last)")
    p.add_argument("--token", action="extend", nargs="+", default=None, metavar="TEXT",
                   help=f"token text to track, repeatable (default: {list(routing_run.DEFAULT_TOKENS)})")
    p.add_argument("--compare_step", type=int, default=None,
                   help="earlier checkpoint for router saturation (same tokens routed by both)")
    p.add_argument("--batch_size", type=int, default=None, help="rows per batch (default: eval.batch_size)")
    p.add_argument("--n_frequent", type=int, default=20, help="most frequent tokens to report")
    p.add_argument("--samples", type=int, default=2, help="sample rows per domain in tokens.html")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("max_tokens", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name} must be >= 1, got {getattr(args, name)}")
    for text in args.token or ():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes the locale could not decode arrive as surrogates
            raise UserError(f"--token {text.encode('utf-8', 'surrogateescape')!r} is not UTF-8 text; pass the "
                            "token as UTF-8") from None
    hf_source.check_args(args)
    return args


def _layer_label(result, i):
    return f"layer {int(result['layer_ids_L'][i])}"


def write_json(a: routing_run.Analysis, path, meta, maxvio_series):
    """routing.json: run metadata, readable per-layer/domain shares and per-token distributions, then every
    small metric array of the accumulator under "metrics" (NaN -> null)."""
    r = a.result
    per_layer = {}
    for i in range(int(r["n_layers"])):
        per_layer[_layer_label(r, i)] = {
            name: {"n_tokens": int(r["n_tokens_D"][d]),
                   "share": r["share_LxDxE"][i, d], "gate_share": r["gate_share_LxDxE"][i, d],
                   "first_choice_share": r["share_top1_LxDxE"][i, d]}
            for d, name in enumerate(a.domain_names)}
    tokens = []
    for which, n in (("track", "T"), ("freq", "N")):
        for t, tid in enumerate(r.get(f"{which}_ids_{n}", [])):
            tokens.append({"id": int(tid), "text": a.token_text.get(int(tid)), "kind": which,
                           "n": int(r[f"{which}_n_{n}"][t]), "share_LxE": r[f"{which}_share_{n}xLxE"][t]})
    doc = dict(meta, domains=a.domain_names, layer_ids=r["layer_ids_L"], top_k=int(r["top_k"]),
               n_experts=int(r["n_experts"]), uniform_share=int(r["top_k"]) / int(r["n_experts"]),
               token_notes=a.token_notes, timing={"tokens": a.n_tokens, "seconds": a.seconds,
                                                  "tokens_per_second": a.n_tokens / max(a.seconds, 1e-9)},
               per_layer=per_layer, tokens=tokens, saturation=a.saturation,
               maxvio_training={str(k): {"steps": s, "maxvio": v} for k, (s, v) in maxvio_series.items()},
               metrics=routing_stats.to_jsonable(r))
    with open(path, "w") as f:
        json.dump(_plain(doc), f, indent=1)
    return path


def _plain(x):
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, np.ndarray | np.generic):
        return _plain(routing_stats.to_jsonable({"x": x})["x"])
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def maxvio_series(workdir):
    """{model layer: (steps, maxvio)} from WORKDIR/metrics.jsonl, {} if the run has no metrics file."""
    path = Path(workdir) / "metrics.jsonl"
    return routing_stats.read_maxvio_series(path) if path.is_file() else {}


def write_plots(a: routing_run.Analysis, out, layer, series, final_step=None, compare_step=None):
    """Every PNG into `out`; returns the paths. Every MoE layer gets its domain_experts_layerL.png (one y scale
    across them); `layer` (the --layer choice) only picks the layer of the terminal summary."""
    del layer  # kept in the signature: run() passes it
    r, out, names = a.result, Path(out), a.domain_names
    labels = routing_plots.layer_labels(r)
    paths = [routing_plots.plot_domain_bars(r, i, out / f"domain_experts_{label.replace(' ', '')}.png", names)
             for i, label in enumerate(labels)]
    paths += [
        routing_plots.plot_domain_heatmaps(r, out / "domain_heatmap.png", names),
        routing_plots.plot_domain_heatmaps(r, out / "domain_specialization_top1.png", names,
                                           key="share_top1_LxDxE"),
        routing_plots.plot_token_experts(r, out / "tokens_tracked.png", a.token_text, which="track"),
        routing_plots.plot_locality(r, out / "locality.png"),
        routing_plots.plot_coactivation(r, out / "coactivation.png"),
        routing_plots.plot_maxvio_global(r, out / "maxvio_global.png"),
    ]
    if "freq_ids_N" in r:
        paths.append(routing_plots.plot_token_experts(r, out / "tokens_frequent.png", a.token_text, which="freq"))
        paths.append(routing_plots.plot_vocab_specialization(r, out / "vocab_specialization.png"))
    if series:
        paths.append(routing_plots.plot_maxvio_series(series, out / "maxvio_training.png"))
    if a.saturation is not None:
        paths.append(routing_plots.plot_saturation(
            {compare_step: a.saturation["saturation_L"]}, out / "saturation.png", final_step=final_step,
            random_baseline=int(r["top_k"]) / int(r["n_experts"]), layer_names=labels))
    return paths


def write_html(a: routing_run.Analysis, path):
    r = a.result
    n = int(r["n_layers"])
    return routing_html.render_tokens_html(a.samples, range(n), int(r["n_experts"]), path,
                                           layer_names=[_layer_label(r, i) for i in range(n)])


def write_outputs(a: routing_run.Analysis, out, meta, series, layer, final_step=None, compare_step=None):
    """Every file of the analysis into `out`: routing.json, routing.npz, the plots (`write_plots`) and
    tokens.html; returns their paths."""
    out = Path(out)
    paths = [write_json(a, out / "routing.json", meta, series), out / "routing.npz"]
    np.savez_compressed(paths[-1], **a.result,
                        **({f"saturation_{k}": v for k, v in a.saturation.items()} if a.saturation else {}))
    paths += write_plots(a, out, layer, series, final_step=final_step, compare_step=compare_step)
    return paths + [write_html(a, out / "tokens.html")]


def write_run_outputs(a: routing_run.Analysis, out, run_, workdir, layer, split=None, max_tokens=None,
                      compare_step=None):
    """`write_outputs` for a run (`python -m analysis.routing --workdir` and the notebook): its metadata and
    its MaxVio over training from WORKDIR/metrics.jsonl. `layer`: the MoE-layer index of the summary."""
    meta = {"workdir": str(workdir), "step": run_.step, "compare_step": compare_step,
            "split": split or run_.config.data.eval_split, "max_tokens": max_tokens,
            "layer": int(a.result["layer_ids_L"][layer])}
    return write_outputs(a, out, meta, maxvio_series(workdir), layer, final_step=run_.step,
                         compare_step=compare_step)


def summary(a: routing_run.Analysis, layer, step, compare_step=None):
    lines = [routing_stats.summary_text(a.result, a.domain_names, layer=layer)]
    if a.saturation is not None:
        sat = ", ".join(f"{_layer_label(a.result, i)} {s:.3f}" for i, s in enumerate(a.saturation["saturation_L"]))
        lines.append(f"router saturation of step {compare_step} vs step {step}: {sat} "
                     f"(random {int(a.result['top_k']) / int(a.result['n_experts']):.3f})")
    lines.append(f"routed {a.n_tokens} tokens in {a.seconds:.1f}s ({a.n_tokens / max(a.seconds, 1e-9):,.0f} tokens/s)")
    return "\n".join(lines)


def run(args, log=print):
    """Everything the CLI does; returns (Analysis, output directory)."""
    if args.hf is not None:
        return run_hf(args, log)
    check_out_dir(args.out, Path(args.workdir) / "analysis", create=False)
    run_ = open_run(args.workdir, args.step)
    layer = routing_run.check_layer(run_, args.layer)
    compare = open_run(args.workdir, args.compare_step) if args.compare_step is not None else None
    a = routing_run.analyse(run_, split=args.split, max_tokens=args.max_tokens,
                            tokens=args.token or routing_run.DEFAULT_TOKENS, compare_run=compare,
                            batch_size=args.batch_size, n_samples=args.samples, n_frequent=args.n_frequent,
                            progress=not args.no_progress)
    for note in a.token_notes:
        log(note)
    if a.n_tokens == 0:
        raise UserError(f"no tokens to analyse in split {args.split or run_.config.data.eval_split!r}; "
                        "check --split and --max_tokens")
    out = check_out_dir(args.out, Path(args.workdir) / "analysis")
    write_run_outputs(a, out, run_, args.workdir, layer, args.split, args.max_tokens, args.compare_step)
    log(summary(a, layer, run_.step, args.compare_step))
    log(f"wrote routing.json, routing.npz, plots and tokens.html to {out}")
    return a, out


def run_hf(args, log=print):
    """`run` for --hf: the same outputs, over --text files or the bundled corpus (no steps, no training series)."""
    check_out_dir(args.out, None, create=False)
    src = hf_source.open_source(args.hf, args.text, args.split, args.seq_len or 256, args.batch_size or 16)
    layer = routing_run.check_layer(src.run, args.layer)
    a = routing_run.analyse(src.run, split=src.split, max_tokens=args.max_tokens,
                            tokens=args.token or routing_run.DEFAULT_TOKENS, n_samples=args.samples,
                            n_frequent=args.n_frequent, progress=not args.no_progress, cache=src.cache)
    for note in a.token_notes:
        log(note)
    if a.n_tokens == 0:
        raise UserError("no tokens to analyse; check --text / --split and --max_tokens")
    out = check_out_dir(args.out, None)
    meta = {"hf": str(args.hf), "model_type": src.model_type, "text": args.text, "split": src.split,
            "seq_len": src.run.config.data.seq_len, "max_tokens": args.max_tokens,
            "layer": int(a.result["layer_ids_L"][layer])}
    write_outputs(a, out, meta, {}, layer)
    log(summary(a, layer, None))
    log(f"wrote routing.json, routing.npz, plots and tokens.html to {out}")
    return a, out


def main(argv=None):
    run_cli(run, parse_args, argv)


if __name__ == "__main__":
    main()
