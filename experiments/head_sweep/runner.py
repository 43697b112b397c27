"""Head-size sweep: does the prefix-LM's loss against the causal decoder move
with n / d_head, as Su's low-rank argument needs? His argument: softmax(Q K^T) over an n x n bidirectional block has
rank at most ~d_head when n >> d_head, while the causal (triangular) one stays full rank; if that bottleneck costs
quality, prefix - causal should rise with n / d_head.

    python -m experiments.head_sweep --out runs/head_sweep [--config experiments/masks_round2/config.py]
        [--head_dims 64,32,16,8] [--seeds 2] [--steps N] [--probe_rows 24,8,8] [--report_only]
        [--config.KEY=VALUE ...]

For each d_head the attention width n_heads * head_dim and the query/kv group ratio stay the config's (d_model
128: 2 heads of 64 ... 16 heads of 8), so every d_head has the same parameters and attention FLOPs. Each d_head is
a two-arm study (causal, prefix) in OUT/d<d_head> by experiments.masks_round2's runner, with its own gate and
report (runs finished there are reused: copy runs/study_masks/{causal,prefix} into OUT/d32 to reuse a mask
round's). Then the trained logits' rank (analysis.rank.logits) of every run is measured and
OUT/head_sweep.{json,md,png} (experiments.head_sweep.report) give, per
n_in / d_head (n_in: the input block, seq_len * prefix_frac), the paired prefix - causal loss difference (one family
with the slope, docs/inference.md), the effective rank of each model's input block under its own mask,
and the slope of the difference on log2(n_in / d_head), one per seed.
"""

import copy
import json
import sys
from pathlib import Path

from analysis.rank.logits import measure_run
from experiments.common.cli import run_cli, seeds_and_steps, study_parser, use_compilation_cache
from experiments.head_sweep.report import ARMS, sweep_rows, write_report
from experiments.masks_round2.runner import DEFAULT_CONFIG, DEFAULT_PROBE_ROWS, probe_sizes, run_study
from plumbing.args import ArgParser
from plumbing.errors import UserError
from rundir import RunDir
from rundir.checkpoints import steps_in
from train.command_line import config_from_argv

HEAD_DIMS = (64, 32, 16, 8)  # with the study's 128-token input block: n_in / d_head = 2, 4, 8, 16


def head_config(base, d_head: int):
    """The base config with heads of d_head at the same attention width and query/kv group ratio."""
    m = base.model
    width, group = m.n_heads * m.head_dim, m.n_heads // m.n_kv_heads
    if d_head < 2 or width % d_head or (width // d_head) % group:
        raise UserError(f"--head_dims: {d_head} must divide the attention width n_heads * head_dim = {width} into a "
                        f"multiple of {group} heads (the config's query/kv group); pick divisors of {width // group}")
    c = copy.deepcopy(base)
    c.model.update(n_heads=width // d_head, n_kv_heads=width // d_head // group, head_dim=d_head)
    return c


def input_erank(workdir, mask: str) -> float | None:
    """Effective rank / n of the trained model's input block under its own mask, mean over layers and rows; None
    for a run kept as result.json alone (a finished run copied without its checkpoint)."""
    if not steps_in(RunDir(Path(workdir)).checkpoints):
        return None
    return measure_run(workdir)[f"{mask}_input"]["erank"]


def run_sweep(base, head_dims, seeds: int, steps: int, out, log=print, run_fn=None, report_only=False,
              sizes=None, rank_fn=input_erank) -> Path:
    out = Path(out)
    n_in = int(base.data.seq_len * base.data.prefix_frac)
    cells = []
    for d in head_dims:
        cell_out = out / f"d{d}"
        log(f"== d_head {d} (n_in / d_head = {n_in / d:g}) -> {cell_out}")
        report = run_study(head_config(base, d), ARMS, seeds, steps, cell_out, log, run_fn, report_only, sizes)
        saved = json.loads((report.parent / "results.json").read_text())
        ranks = {a: [rank_fn(cell_out / a / f"seed{r['seed']}", a) for r in saved["results"] if r["arm"] == a]
                 for a in ARMS}
        ranks = {a: [v for v in vs if v is not None] for a, vs in ranks.items()}
        cells.append({"d_head": d, "n_over_d": n_in / d, "results": saved["results"],
                      "bigram": saved["references"]["bigram"], "ranks": ranks})
    return write_report(sweep_rows(cells), out, steps)


def parser() -> ArgParser:
    dims = (("--head_dims",), {"default": ",".join(map(str, HEAD_DIMS)),
                                "help": f"comma-separated d_head values (default {','.join(map(str, HEAD_DIMS))})"})
    p = study_parser("python -m experiments.head_sweep", __doc__, DEFAULT_CONFIG, "runs/head_sweep", 2,
                     "paired seeds per arm and d_head", extra=(dims,))
    p.add_argument("--probe_rows", default=DEFAULT_PROBE_ROWS, help="as in experiments.masks_round2")
    return p


def parse_flags(argv):
    config, _, rest = config_from_argv(list(argv[1:]), DEFAULT_CONFIG)
    args = parser().parse_args(rest)
    try:
        dims = [int(x) for x in args.head_dims.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--head_dims takes comma-separated integers, got {args.head_dims!r}") from None
    if len(dims) < 2 or len(set(dims)) != len(dims):
        raise UserError(f"--head_dims needs at least 2 distinct values, got {args.head_dims!r}")
    sizes = probe_sizes(args.probe_rows)
    if config.data.task != "prefix":
        raise UserError("the sweep needs input->output rows: set --config.data.task=prefix")
    for d in dims:
        head_config(config, d)
    steps = seeds_and_steps(args, config, min_seeds=2)
    return config, dims, args.seeds, steps, args.out, args.report_only, sizes


def main(argv=None):
    def run(argv):
        config, dims, seeds, steps, out, report_only, sizes = parse_flags(argv)
        use_compilation_cache(out)
        return run_sweep(config, dims, seeds, steps, out, report_only=report_only, sizes=sizes)

    run_cli(sys.argv if argv is None else argv, parser, run, "sweep")
