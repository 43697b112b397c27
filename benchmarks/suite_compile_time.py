"""Where the test suite's time goes: a pytest plugin that writes, per test file, its wall seconds and the seconds
JAX spent tracing, lowering and compiling (JAX's duration events), then a summary of what it wrote:

    SUITE_COMPILE_TIME_DIR=/tmp/suite python -m pytest -q -p benchmarks.suite_compile_time
    python -m benchmarks.suite_compile_time /tmp/suite            # totals and the slowest files

With xdist each worker writes its own file; a file's seconds are its worker's wall time (shared cores included).
"""

import argparse
import collections
import os
import time
from pathlib import Path

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace", "/jax/core/compile/jaxpr_to_mlir_module_duration":
          "lower", "/jax/core/compile/backend_compile_duration": "compile"}
_seconds, _count = collections.Counter(), collections.Counter()
_started: dict[str, tuple[float, dict, dict]] = {}


def _on_duration(event: str, duration: float, **_):
    if event in EVENTS:
        _seconds[EVENTS[event]] += duration
        _count[EVENTS[event]] += 1


def pytest_configure(config):
    import jax

    jax.monitoring.register_event_duration_secs_listener(_on_duration)


def pytest_runtest_setup(item):
    _started.setdefault(item.module.__name__, (time.time(), dict(_seconds), dict(_count)))


def pytest_runtest_teardown(item, nextitem):
    name = item.module.__name__
    if nextitem is not None and nextitem.module is item.module:
        return
    t0, seconds, count = _started[name]
    parts = [f"{k}={_seconds[k] - seconds.get(k, 0):.1f}/{_count[k] - count.get(k, 0)}" for k in EVENTS.values()]
    out = Path(os.environ.get("SUITE_COMPILE_TIME_DIR", "/tmp/suite_compile_time"))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}.txt", "a") as f:
        f.write(f"{time.time() - t0:.1f} {name} {' '.join(parts)}\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="SUITE_COMPILE_TIME_DIR of a run")
    ap.add_argument("--top", type=int, default=20, help="slowest files to list")
    a = ap.parse_args(argv)
    rows = [line.split() for f in sorted(Path(a.dir).glob("*.txt")) for line in f.read_text().splitlines()]
    if not rows:
        ap.error(f"no per-file lines in {a.dir}: run pytest with -p benchmarks.suite_compile_time first")
    total = collections.Counter()
    for r in rows:
        total["wall"] += float(r[0])
        for part in r[2:]:
            k, v = part.split("=")
            s, n = v.split("/")
            total[k] += float(s)
            total[k + " programs"] += int(n)
    print(f"{len(rows)} files, {total['wall']:.0f} worker-seconds: trace {total['trace']:.0f} s, lower "
          f"{total['lower']:.0f} s, compile {total['compile']:.0f} s ({total['compile programs']:,} programs)")
    print("| seconds | file | trace / lower / compile: seconds/programs |\n|---|---|---|")
    for r in sorted(rows, key=lambda r: -float(r[0]))[:a.top]:
        print(f"| {r[0]} | {r[1]} | {' '.join(r[2:])} |")


if __name__ == "__main__":
    main()
