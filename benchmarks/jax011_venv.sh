#!/usr/bin/env bash
# A CPU venv with the lent GPU machine's JAX stack (Python 3.12, jax/jaxlib 0.11.2, flax 0.12.10; its image, see
# benchmarks/gpu_wheels.sh) and this project installed editable, to run the test suite and the benchmarks under
# that JAX before a lease (CI and the default venv run jax 0.10.x):
#
#   bash benchmarks/jax011_venv.sh [VENV_DIR]        # default /tmp/venv-jax011; PYTHON=python3.12 to pick it
#   /tmp/venv-jax011/bin/python -m pytest -q         # torch is left out: the HF-parity tests skip
#
# JAX_VERSION=0.12.0.1 builds the same venv with the newest jax that pyproject.toml admits (what a fresh Python
# 3.12 install resolves to), to run the suite under it too.
#
# Refuses to touch an existing directory; builds beside it and renames at the end (console scripts keep the
# .partial path in their shebangs: call `$VENV/bin/python -m ...`). tokamax is pinned to the version
# benchmarks/gpu_wheels.sh carries to the device.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/refuse_existing.sh"
VENV="$(realpath -m "${1:-/tmp/venv-jax011}")"  # before the cd: a relative path is the caller's
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.12}"
refuse_existing "$VENV"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
  echo "error: the GPU machine runs Python 3.12; set PYTHON=/path/to/python3.12" >&2
  exit 2
fi
"$PY" -m venv "$VENV.partial"
py="$VENV.partial/bin/python"
"$py" -m pip install -q --upgrade pip
pins="$(mktemp)"
trap 'rm -f "$pins"' EXIT
JAX_VERSION="${JAX_VERSION:-0.11.2}"
printf 'jax==%s\njaxlib==%s\nflax==0.12.10\ntokamax==0.0.17\n' "$JAX_VERSION" "$JAX_VERSION" > "$pins"
"$py" -m pip install -q -c "$pins" -e ".[kernels]" "pytest>=8,<10" "pytest-xdist>=3.5,<4" "papermill>=2.6,<3" \
  "nbclient>=0.10,<1" "ipykernel>=6.29,<8"
"$py" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)"
mv "$VENV.partial" "$VENV"
echo "ready: $VENV/bin/python -m pytest -q"
