"""The decoder-only study's GPU round in one command: every part at the GPU size, one after another.

    python -m experiments.gpu_round --out runs/gpu_round [--parts study,encdec,head_sweep,mlm] [--seeds 5]
        [--dry_run]

Parts (each is its runner's own command, printed before it starts, with its own report under OUT/<part>/):
  study       experiments.masks_round2, experiments/masks_round2/config_gpu.py: causal, prefix, mixed,
              causal_all and causal_all's equal-targets control causal_half, paired seeds; gate, Holm,
              equivalence (OUT/study/report/)
  encdec      experiments.encdec: the encoder-decoder 2x2 at P and 2P parameters (OUT/encdec/report/)
  head_sweep  experiments.head_sweep: causal vs prefix at d_head 96, 64, 32, 16 (4 / 6 / 12 / 24 heads of the
              384-wide attention; n_in / d_head from 2.7 to 16)
  mlm         experiments.mlm, experiments/mlm/config_gpu.py: mixed vs bidirectional heads on a masked LM
Every runner is resumable (finished runs are skipped), so the same command after a stop goes on where it was;
a part that fails stops the round with its one-line error. --dry_run checks every part's flags and config
and prints the commands without training.
"""

import importlib
import sys

from experiments.encdec import runner as encdec
from experiments.head_sweep import runner as head_sweep
from experiments.masks_round2 import runner as study
from experiments.mlm import runner as mlm
from moe import ConfigError
from plumbing.args import ArgParser
from plumbing.errors import UserError, exit_with
from train.preflight import parse

STUDY_GPU = "experiments/masks_round2/config_gpu.py"
MLM_GPU = "experiments/mlm/config_gpu.py"
PARTS = ("study", "encdec", "head_sweep", "mlm")


def part_argv(part: str, out: str, seeds: int) -> tuple[str, list[str]]:
    """(package, argv after the program name) of one part: its command is python -m PACKAGE ARGV."""
    seeds_out = ["--seeds", str(seeds), "--out", f"{out}/{part}"]
    if part == "study":
        return "experiments.masks_round2", ["--config", STUDY_GPU, "--arms", "causal,prefix,mixed,causal_all,"
                                            "causal_half", "--probe_rows", "64,32,32", *seeds_out]
    if part == "encdec":
        return "experiments.encdec", ["--config", STUDY_GPU, *seeds_out]
    if part == "head_sweep":
        return "experiments.head_sweep", ["--config", STUDY_GPU, "--head_dims", "96,64,32,16", "--probe_rows",
                                          "64,32,32", *seeds_out]
    if part == "mlm":
        return "experiments.mlm", ["--config", MLM_GPU, *seeds_out]
    raise ValueError(part)


def check_part(part: str, argv: list[str]) -> None:
    """The part's own flag and config checks, without training (UserError / ConfigError on bad input)."""
    prog = ["prog", *argv]
    if part == "study":
        config, arms, seeds, steps, *_ = study.parse_flags(prog)
        for a in arms:
            parse(study.arm_config(config, a, 0, steps))
    elif part == "encdec":
        config, args, steps = encdec.parse_flags(prog)
        for cell in args.cells:
            parse(encdec.cell_config(config, cell, 0, steps, args.decoder_mask)[0])
    elif part == "head_sweep":
        config, dims, seeds, steps, *_ = head_sweep.parse_flags(prog)
        for d in dims:
            for a in head_sweep.ARMS:
                parse(study.arm_config(head_sweep.head_config(config, d), a, 0, steps))
    else:
        config, seeds, steps, _ = mlm.parse_flags(prog)
        for arm in mlm.ARMS:
            parse(mlm.arm_config(config, arm, 0, steps))


def run_part(package: str, argv: list[str]) -> None:
    """The part's runner (PACKAGE.runner) main in this process; its one-line error (SystemExit with a non-zero
    code) stops the round."""
    try:
        importlib.import_module(f"{package}.runner").main(["python -m " + package, *argv])
    except SystemExit as e:
        if e.code not in (0, None):
            raise


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = ArgParser(prog="python -m experiments.gpu_round", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/gpu_round", help="root: each part writes OUT/<part>/")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, in order, from {','.join(PARTS)}")
    p.add_argument("--seeds", type=int, default=5, help="paired seeds in every part")
    p.add_argument("--dry_run", action="store_true", help="check every part's flags and config; train nothing")
    try:
        args = p.parse_args(argv)
        parts = [x.strip() for x in args.parts.split(",") if x.strip()]
        if not parts or any(x not in PARTS for x in parts) or len(set(parts)) != len(parts):
            raise UserError(f"--parts takes distinct names from {','.join(PARTS)}, got {args.parts!r}")
        commands = [(part, *part_argv(part, args.out, args.seeds)) for part in parts]
        for part, _, part_args in commands:  # every part checked before the first trains
            check_part(part, part_args)
    except (UserError, ConfigError) as e:
        exit_with(e)
    for part, package, part_args in commands:
        print(f"[{part}] python -m {package} {' '.join(part_args)}", flush=True)
        if not args.dry_run:
            run_part(package, part_args)
