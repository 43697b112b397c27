"""How long each command takes to answer --help and a mistyped flag: the wall time of a fresh process, median of
--repeats runs (a command must answer both before its heavy imports; tests/test_cli.py checks which modules load).

    python -m benchmarks.cli_start [--repeats 5]
"""

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "train": ["--config.train.stepz=3"],
    "train.generate": ["--workdir", "x", "--prompt", "p", "--top_p", "2"],
    "train.export": ["--workdir", "x", "--out", "y", "--format", "onnx"],
    "analysis.routing": ["--workdr", "x"],
    "analysis.specialization": ["--workdr", "x"],
    "analysis.ablate": ["--workdr", "x"],
    "analysis.dynamics": ["--workdr", "x"],
    "analysis.rank": ["--workdr", "x"],
    "analysis.rank.logits": ["--workdr", "x"],
    "analysis.loss_curves": ["--workdr", "x"],
}


def seconds(argv: list[str], repeats: int) -> tuple[float, int]:
    """(median wall seconds, exit code) of `python -m argv`."""
    times, code = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        code = subprocess.run([sys.executable, "-m", *argv], capture_output=True).returncode
        times.append(time.perf_counter() - t0)
    return statistics.median(times), code


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.cli_start", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(f"{'command':<26} {'--help':>8} {'bad flag':>9}  (median of {args.repeats}, seconds)")
    for name, bad in COMMANDS.items():
        help_s, help_code = seconds([name, "--help"], args.repeats)
        bad_s, bad_code = seconds([name, *bad], args.repeats)
        flags = "" if (help_code, bad_code) == (0, 2) else f"  exit codes {help_code}, {bad_code} (expected 0, 2)"
        print(f"{name:<26} {help_s:>8.2f} {bad_s:>9.2f}{flags}")


if __name__ == "__main__":
    main()
