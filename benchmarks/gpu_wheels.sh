#!/usr/bin/env bash
# Wheels the lent GPU machine lacks, for `python -m benchmarks.gpu_report` there (see docs/performance.md).
# The machine has no network; its image holds jax 0.11.2, flax 0.12.10, optax, orbax, einops, absl,
# tokenizers, but not ml_collections, tokamax or the data stack (TFDS without TensorFlow: grain, array_record),
# which the tests' conftest imports through train.loop. Do not carry flax: 0.12.8 (the newest for Python 3.11) fails
# to import under jax 0.11.2. tokamax imports xprof (32 MB, cloud dependencies) only for its own profiling: a stub
# stands in. Run from the repository root; .whl/ is git-ignored through .git/info/exclude. `--maxtext` adds
# MaxText 0.2.5 and what its train run imports beyond the image (~20 MB), for
# `python3 -m benchmarks.maxtext_side_by_side --shape gpu --maxtext_python python3` there.
set -euo pipefail
for arg in "$@"; do
  [[ "$arg" == "--maxtext" ]] || { echo "error: unknown flag $arg (--maxtext)" >&2; exit 2; }
done
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo /.whl/ >> .git/info/exclude; }
mkdir -p .whl/stub/xprof/cli
download() {  # wheels for the device's Python 3.12 on x86-64 Linux, into .whl/
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$@"
}
download \
  ml_collections==1.1.0 tokamax==0.0.17 einshape==1.0 pydantic==2.14.4 pydantic_core==2.50.5 \
  annotated_types==0.8.0 typing_inspection==0.4.5 qwix==0.1.8 immutabledict==4.3.1 tensorboardx==2.6.5
# The data stack (~11 MB; promise ships no wheel: built here). GPU run 7 (2026-11-28) ran the GPU-only tests with it.
download \
  tensorflow-datasets==4.9.10 grain==0.2.18 array-record==0.8.6 dm-tree==0.1.10 simple_parsing==0.1.9 \
  docstring_parser==0.18.0 tensorflow-metadata==1.21.0 googleapis-common-protos==1.76.0 termcolor==3.3.0 \
  toml==0.10.2 portpicker==1.6.0
python3 -m pip wheel -q --no-deps promise==2.3 -w .whl
if [[ " $* " == *" --maxtext "* ]]; then
  # Found by running MaxText's train (synthetic data; dense and ragged_dot MoE) on CPU in a Python 3.12 venv of the
  # image's packages at its versions (jax 0.11.2, flax 0.12.10, ...), adding each module it failed to import, at
  # the versions of MaxText's own tested set (benchmarks/setup_maxtext.sh); then installed from these wheels alone,
  # as on the device. Not yet tried there (its GPU paths: tokamax's grouped matmul, cuDNN attention).
  download \
    maxtext==0.2.5 aqtp==0.9.0 drjax==0.2.1 fastapi==0.165.0 fire==0.7.1 omegaconf==2.4.0 \
    opentelemetry-api==1.45.2 pathwaysutils==0.1.13 starlette==1.10.0 uvicorn==0.54.0  # + the data stack above
fi
touch .whl/stub/xprof/__init__.py .whl/stub/xprof/cli/__init__.py
cat > .whl/stub/xprof/cli/tools.py <<'PY'
def get_kernel_stats_tool(*args, **kwargs):  # tokamax's own xprof-timed benchmarking; unused here
    raise NotImplementedError("xprof is stubbed on this machine")
PY
cat <<'MSG'
.whl ready. On the device (run with carry [".whl"]):
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD/.whl/stub:$PWD PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=$PWD/.jax_cache \
  || exit; timeout 440 python3 -m benchmarks.gpu_report --out $OUT/gpu_report.md 2>&1 | grep -v "Autotuning cache"
(add --sections and --grouped_matmul to fit the lease: see python3 -m benchmarks.gpu_report --help)
With --maxtext, MaxText side by side instead of the report (MaxText's subprocess inherits PYTHONPATH):
  timeout 500 python3 -m benchmarks.maxtext_side_by_side --shape gpu --scan_layers on --maxtext_python python3 --timeout 400
JAX_COMPILATION_CACHE_DIR: compiled programs and XLA's per-fusion autotuning results, kept on a warm machine
between calls (an ignored path): a rerun of a section cut off by the time limit does not autotune again.
MSG
