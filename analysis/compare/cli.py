"""Two routers on the same tokens: expert-set overlap per token against the chance of each model's load, routing
entropy change per domain, and the gate swap (each model's routers in the other, the loss change).

    python -m analysis.compare --workdir runs/a --other runs/b                     # two runs (e.g. two seeds)
    python -m analysis.compare --workdir runs/a --step 400 --other_step 800        # two checkpoints of one run
    python -m analysis.compare --workdir runs/base --other runs/finetune           # a run and its fine-tune
    python -m analysis.compare --hf DIR_A --other_hf DIR_B --text a.txt --out /tmp/cmp   # two HF MoE directories

A is --workdir at --step, B is --other (default: --workdir) at --other_step (default: the latest). The tokens are
A's data (--split, default its eval split; --max_tokens per domain), routed by both; both runs must share the
tokenizer and the routers' shapes. Per MoE layer: the Jaccard overlap of the two top-k sets per token, beside two
independent uniform routers and the load-matched chance (B's sets permuted across the tokens, --shuffles times:
both loads kept, the token -> expert mapping broken); the routing entropy of each, in bits, per domain. The gate
swap (--no_swap leaves it out) scores A's validation rows (--rows_per_domain) with B's routers in A and A's in B,
all MoE layers and each alone, beside two controls: A's own routers put back (exactly 0) and a random router of
the same scale. With --hf / --other_hf (two HuggingFace MoE directories of one architecture and tokenizer) the
tokens are A's --text files (one domain each) or the bundled corpus re-tokenized, in rows of --seq_len. Writes
compare.json (with provenance) and compare.png into --out (default WORKDIR/analysis/compare). Bad input: one line
on stderr, exit 2.
"""

import json
from pathlib import Path

from analysis.hf_args import add_source_flags, check_source_flags
from plumbing.args import ArgParser, check_out_dir, run_cli
from plumbing.errors import UserError


def parse_args(argv):
    p = ArgParser(prog="python -m analysis.compare", description=__doc__.split("\n")[0])
    add_source_flags(p, "run A: a run directory with checkpoints/")
    p.add_argument("--step", type=int, default=None, help="A's checkpoint step (default: the latest)")
    p.add_argument("--other", default=None, help="run B (default: --workdir, for two checkpoints of one run)")
    p.add_argument("--other_hf", default=None, help="with --hf: model B, a HuggingFace MoE directory")
    p.add_argument("--other_step", type=int, default=None, help="B's checkpoint step (default: the latest)")
    p.add_argument("--out", default=None, help="output directory (default: WORKDIR/analysis/compare)")
    p.add_argument("--split", default=None, help="data split of A's data set (default: its data.eval_split)")
    p.add_argument("--max_tokens", type=int, default=2048, help="tokens per domain (2048)")
    p.add_argument("--batch_size", type=int, default=None, help="rows per batch (default: A's eval.batch_size)")
    p.add_argument("--shuffles", type=int, default=20, help="permutations for the load-matched chance (20)")
    p.add_argument("--rows_per_domain", type=int, default=None,
                   help="validation rows per domain of the gate swap (default: A's eval.rows_per_domain)")
    p.add_argument("--no_swap", action="store_true", help="leave out the gate swap")
    p.add_argument("--seed", type=int, default=0, help="seed of the permutations and the random router (0)")
    args = p.parse_args(argv)
    check_source_flags(args, ("step", "other", "other_step"))
    if (args.hf is None) != (args.other_hf is None):
        raise UserError("--hf and --other_hf go together (two HuggingFace directories); for runs use --other")
    for name in ("max_tokens", "batch_size", "shuffles", "rows_per_domain"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def run(args, log=print):
    # The analysis itself: loaded once the flags are read (--help and bad flags answer at once).
    from analysis import figures
    from analysis.compare import pair, plots
    from analysis.routing.stats import plain_json
    from rundir import open_run
    from rundir.atomic import write_text
    from rundir.provenance import provenance

    default_out = Path(args.workdir or ".") / "analysis" / "compare"
    check_out_dir(args.out, default_out, create=False)
    if args.hf is not None:
        run_a, run_b, kw, split = _open_hf_pair(args, log)
        other = args.other_hf
        label_a, label_b = str(args.hf), str(args.other_hf)
    else:
        other = args.other or args.workdir
        run_a = open_run(args.workdir, args.step)
        run_b = open_run(other, args.other_step)
        if run_a.tokenizer_json != run_b.tokenizer_json:
            raise UserError(f"--workdir {args.workdir} and --other {other} use different tokenizers; the same tokens "
                            "need one tokenizer")
        label_a, label_b = figures.source_of(args.workdir, run_a.step), figures.source_of(other, run_b.step)
        kw, split = {}, args.split or run_a.config.data.eval_split
    log(f"A = {label_a}, B = {label_b}")
    result = pair.compare_pair(run_a.model, run_b.model, run_a.config, run_a.tokenizer, args.split, args.max_tokens,
                               args.batch_size, args.shuffles, args.rows_per_domain, not args.no_swap, args.seed,
                               log=log, **kw)
    out = check_out_dir(args.out, default_out)
    doc = plain_json(dict(result, a={"workdir": str(args.workdir or args.hf), "step": run_a.step},
                          b={"workdir": str(other), "step": run_b.step}, split=split,
                          max_tokens=args.max_tokens, seed=args.seed, provenance=provenance()))
    write_text(out / "compare.json", json.dumps(doc, indent=1))
    with figures.source(f"A: {label_a}; B: {label_b}"):
        plots.plot_compare(result, out / "compare.png", label_a, label_b)
    for name, r in result["layers"].items():
        log(f"{name}: Jaccard {r['jaccard']:.3f} (load-matched chance {r['load_matched_chance']:.3f} "
            f"[{r['load_matched_band'][0]:.3f}, {r['load_matched_band'][1]:.3f}], uniform {r['uniform_chance']:.3f}); "
            f"entropy {r['entropy_a']:.3f} -> {r['entropy_b']:.3f} bits")
    for key, what in (("swap_b_into_a", "B's routers in A"), ("swap_a_into_b", "A's routers in B")):
        if key in result:
            s = result[key]
            log(f"{what}: " + ", ".join(f"{n} {d:+.4f}" for n, d in zip(s["names"], s["delta_A"])))
    log(f"wrote compare.json and compare.png to {out}")
    return result, out


def _open_hf_pair(args, log):
    """(HFRun A, HFRun B, compare_pair's rows arguments, what the rows are) for --hf / --other_hf."""
    import math

    from analysis import hf_rows, hf_source
    from analysis.hf_args import open_hf

    src = open_hf(args.hf, args, args.batch_size)
    model_b, tokenizer_b = hf_source.open_model(args.other_hf)
    if tokenizer_b.to_str() != src.run.tokenizer.to_str():
        raise UserError(f"--hf {args.hf} and --other_hf {args.other_hf} use different tokenizers; the same tokens "
                        "need one tokenizer")
    run_b = hf_source.HFRun(src.run.workdir, model_b, tokenizer_b, src.run.config)
    config = src.run.config
    routing = hf_rows.cache_rows(src.cache, config, math.ceil(args.max_tokens / config.data.seq_len))
    rows = hf_rows.cache_rows(src.cache, config, args.rows_per_domain or config.eval.rows_per_domain)
    log(f"{len(routing.domain_names)} domain(s) of {src.split}, rows of {config.data.seq_len} tokens")
    return src.run, run_b, {"routing_rows": routing, "rows": rows}, src.split


def main(argv=None):
    run_cli(run, parse_args, argv)
