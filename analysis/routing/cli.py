"""Routing analysis of a trained run: which experts each domain and token uses, locality, load, saturation.

    python -m analysis.routing --workdir runs/default
    python -m analysis.routing --workdir runs/default --step 400 --compare_step 200 --layer 2 \\
        --token " the" --token "what" --max_tokens 50000 --out /tmp/routing
    python -m analysis.routing --hf path/to/hf_moe_dir --text a.txt --text b.txt --out /tmp/routing

--hf analyses a HuggingFace MoE directory instead of a run (GLM-4.5, Qwen2/3-MoE, OLMoE, Mixtral; see
docs/hf_import.md and analysis/hf_source.py): each --text file is a domain, or the bundled corpus is re-tokenized
with the model's tokenizer. A model whose fp32 weights do not fit the memory this process may use (--memory_gb,
default what /proc/meminfo and the cgroup allow; analysis/hf_memory.py) is analysed one layer at a time
(analysis/routing/streamed.py: same outputs, resumable in OUT/stream/). --mesh.data/fsdp/expert/tensor import it
sharded over every device of every process, as training shards it (analysis/routing/sharded.py, docs/scaling.md).

Routes every domain of --split (default: the run's validation split) through the checkpoint, batched and
jitted, and writes into --out (default WORKDIR/analysis):
  routing.json / routing.npz   shares per layer x domain x expert (top-k, sums to K; gate-weighted), per token
                               distributions (the most frequent ids and every --token), locality, MaxVio,
                               vocabulary specialization, co-activation, saturation, MaxVio over training
  *.png                        the plots of analysis/routing/plots.py
  tokens.html                  sample texts coloured by first-choice expert, one tab per MoE layer
and prints a short summary. Bad input (no checkpoint, unknown step, a non-MoE layer): one line, exit 2.
"""

from pathlib import Path

from analysis.routing import DEFAULT_TOKENS
from analysis.routing.hf_flags import check_routing_flags
from plumbing.args import ArgParser, check_out_dir, run_cli
from plumbing.errors import UserError

# The analysis itself loads in run() and run_hf(), not when the command reads its flags (--help answers at once).
MESH_AXES = ("data", "fsdp", "expert", "tensor")  # rundir.run_config.MeshConfig's fields


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
                   help=f"token text to track, repeatable (default: {list(DEFAULT_TOKENS)})")
    p.add_argument("--compare_step", type=int, default=None,
                   help="earlier checkpoint for router saturation (same tokens routed by both)")
    p.add_argument("--batch_size", type=int, default=None, help="rows per batch (default: eval.batch_size)")
    p.add_argument("--n_frequent", type=int, default=20, help="most frequent tokens to report")
    p.add_argument("--samples", type=int, default=2, help="sample rows per domain in tokens.html")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument("--mode", choices=("auto", "memory", "stream"), default="auto",
                   help="with --hf: auto (default) streams one layer at a time when the fp32 model does not fit "
                        "--memory_gb; memory or stream to choose yourself")
    p.add_argument("--memory_gb", type=float, default=None,
                   help="with --hf: host memory the analysis may use, GB; a model that does not fit in it is streamed "
                        "one layer at a time (default: what the machine and its cgroup have available)")
    for axis in MESH_AXES:
        p.add_argument(f"--mesh.{axis}", dest=f"mesh_{axis}", type=int, default=None, metavar="N",
                       help=f"with --hf: devices on the mesh's {axis} axis, as training's --config.mesh.{axis} "
                            "(-1: the remaining devices); any --mesh.* imports the model sharded over all devices")
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
    check_routing_flags(args)
    return args


def run(args, log=print):
    """Everything the CLI does; returns (Analysis, output directory)."""
    if args.hf is not None:
        return run_hf(args, log)
    from analysis import figures
    from analysis.figures import source_of
    from analysis.routing import collect
    from analysis.routing.outputs import summary, write_run_outputs
    from rundir import open_run

    check_out_dir(args.out, Path(args.workdir) / "analysis", create=False)
    run_ = open_run(args.workdir, args.step)
    layer = collect.check_layer(run_, args.layer)
    compare = open_run(args.workdir, args.compare_step) if args.compare_step is not None else None
    a = collect.analyse(run_, split=args.split, max_tokens=args.max_tokens,
                        tokens=args.token or DEFAULT_TOKENS, compare_run=compare,
                        batch_size=args.batch_size, n_samples=args.samples, n_frequent=args.n_frequent,
                        progress=not args.no_progress)
    for note in a.token_notes:
        log(note)
    if a.n_tokens == 0:
        raise UserError(f"no tokens to analyse in split {args.split or run_.config.data.eval_split!r}; "
                        "check --split and --max_tokens")
    out = check_out_dir(args.out, Path(args.workdir) / "analysis")
    with figures.source(source_of(args.workdir, run_.step)):
        write_run_outputs(a, out, run_, args.workdir, layer, args.split, args.max_tokens, args.compare_step)
    log(summary(a, layer, run_.step, args.compare_step))
    log(f"wrote routing.json, routing.npz, plots and tokens.html to {out}")
    return a, out


def run_hf(args, log=print):
    """`run` for --hf: the same outputs, over --text files or the bundled corpus (no steps, no training series): in
    memory, layer-streamed when the model does not fit (--memory_gb), or on a mesh (--mesh.*)."""
    from analysis import figures, hf_source
    from analysis.routing import collect
    from analysis.routing.outputs import summary, write_outputs

    check_out_dir(args.out, None, create=False)
    mesh_cfg = _mesh_config(args)
    seq_len, batch_size = args.seq_len or 256, args.batch_size or 16
    if mesh_cfg is not None:
        from analysis.routing import sharded

        mesh = sharded.make_mesh(mesh_cfg)
        src = hf_source.open_source(args.hf, args.text, args.split, seq_len, batch_size,
                                    hf_source.open_model(args.hf, mesh))
        mode = {"mode": "mesh", "mesh": dict(mesh.shape)}
        log(f"on a mesh of {mesh.devices.size} devices {dict(mesh.shape)} (moe.hf.load_hf_moe with mesh)")
    else:
        src = hf_source.open_source(args.hf, args.text, args.split, seq_len, batch_size, hf_source.open_stream(args.hf))
        mode = {"mode": _choose(src, args, log)}
        if mode["mode"] == "memory":
            src.run.model = hf_source.open_model(args.hf)[0]
    layer = collect.check_layer(src.run, args.layer)
    kw = dict(tokens=args.token or DEFAULT_TOKENS, n_samples=args.samples, n_frequent=args.n_frequent,
              progress=not args.no_progress)
    if mode["mode"] == "mesh":
        a = sharded.analyse(src, mesh, src.split, args.max_tokens, **kw)
    elif mode["mode"] == "stream":
        from analysis.routing import streamed

        flags = {"text": args.text, "split": src.split, "seq_len": seq_len, "batch_size": batch_size,
                 "max_tokens": args.max_tokens, "samples": args.samples}
        a, mode["stream"] = streamed.analyse(src, check_out_dir(args.out, None), flags, src.split, args.max_tokens,
                                             log=log, **kw)
        log(streamed.report(mode["stream"]))
    else:
        a = collect.analyse(src.run, split=src.split, max_tokens=args.max_tokens, cache=src.cache, **kw)
    for note in a.token_notes:
        log(note)
    if a.n_tokens == 0:
        raise UserError("no tokens to analyse; check --text / --split and --max_tokens")
    if not _writes():
        return a, None
    out = check_out_dir(args.out, None)
    meta = {"hf": str(args.hf), "model_type": src.model_type, "text": args.text, "split": src.split,
            "seq_len": src.run.config.data.seq_len, "max_tokens": args.max_tokens,
            "layer": int(a.result["layer_ids_L"][layer]), **mode}
    with figures.source(str(args.hf)):
        write_outputs(a, out, meta, {}, layer)
    log(summary(a, layer, None))
    log(f"wrote routing.json, routing.npz, plots and tokens.html to {out}")
    return a, out


def _mesh_config(args):
    """The --mesh.* flags as a MeshConfig (unset axes: MeshConfig's defaults), or None without any."""
    from rundir.run_config import MeshConfig

    given = {a: getattr(args, f"mesh_{a}") for a in MESH_AXES if getattr(args, f"mesh_{a}", None) is not None}
    if not given:
        return None
    try:
        return MeshConfig(**given)
    except ValueError as e:
        raise UserError(str(e)) from None


def _choose(src, args, log) -> str:
    """"memory" or "stream" for the HFSource's LayerStream: --mode, or by its estimated needs and the memory
    budget."""
    from analysis import hf_memory
    from analysis.routing import accumulate

    if args.mode != "auto":
        log(f"{'in memory' if args.mode == 'memory' else 'streamed one layer at a time'} (--mode {args.mode})")
        return args.mode
    batches, _ = accumulate.rows(src.run, src.split, args.max_tokens, src.cache, 0)
    config = src.run.config
    try:
        mode, why = hf_memory.choose_mode(src.run.model, args.memory_gb, len(batches) * config.eval.batch_size,
                                          config.data.seq_len, config.eval.batch_size)
    except ValueError as e:
        raise UserError(str(e)) from None
    log(why)
    return mode


def _writes() -> bool:
    """Only process 0 writes the outputs (several processes route the same rows on one mesh)."""
    import jax

    return jax.process_index() == 0


def main(argv=None):
    run_cli(run, parse_args, argv)

