#!/usr/bin/env bash
# The CUDA PJRT plugin of the lent GPU machine's JAX (0.11.2), installed into a directory of its own for
# benchmarks/gpu_compile.py: XLA:GPU compiles here, on a machine without a GPU ("deviceless" AOT). ~200 MB.
#
#   bash benchmarks/jax011_venv.sh                    # the Python 3.12 / jax 0.11.2 venv, if not there yet
#   bash benchmarks/gpu_compile_setup.sh [DIR]        # default /tmp/jax-cuda-site
#   PYTHONPATH=/tmp/jax-cuda-site /tmp/venv-jax011/bin/python -m benchmarks.gpu_compile
#
# Only on PYTHONPATH when asked for: with the plugin importable, every JAX process here tries CUDA first (and
# logs that it found no driver). Refuses to touch an existing directory; builds beside it, renames at the end.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/refuse_existing.sh"
DIR="$(realpath -m "${1:-/tmp/jax-cuda-site}")"
PY="${PYTHON:-/tmp/venv-jax011/bin/python}"
refuse_existing "$DIR"
if ! "$PY" -c 'import sys, jax; sys.exit(sys.version_info[:2] != (3, 12) or jax.__version__ != "0.11.2")' 2>/dev/null; then
  echo "error: $PY is not Python 3.12 with jax 0.11.2; run bash benchmarks/jax011_venv.sh or set PYTHON=" >&2
  exit 2
fi
if ! command -v ptxas >/dev/null; then
  echo "warning: no ptxas on PATH; XLA:GPU needs it (a CUDA toolkit, or pip install nvidia-cuda-nvcc-cu12)" >&2
fi
"$PY" -m pip install -q --no-deps --target "$DIR.partial" jax-cuda12-plugin==0.11.2 jax-cuda12-pjrt==0.11.2
mv "$DIR.partial" "$DIR"
echo "ready: PYTHONPATH=$DIR $PY -m benchmarks.gpu_compile"
