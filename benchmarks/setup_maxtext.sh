#!/usr/bin/env bash
# Builds the MaxText virtual environment that `python -m benchmarks.maxtext_side_by_side` runs as a subprocess
# (MaxText needs Python >= 3.12 and a newer JAX than this project pins, so it lives apart from our venv).
#
#   bash benchmarks/setup_maxtext.sh [VENV_DIR]      # default /work/venv-maxtext; PYTHON=python3.12 to pick the interpreter
#
# Installs maxtext (MAXTEXT_VERSION, default 0.2.5) with its `tpu` extra's requirements minus what a CPU or GPU box
# cannot or need not use: libtpu, NVIDIA wheels, linters and type checkers. On a GPU machine, add
# `pip install "jax[cuda12]"` into the venv afterwards. Refuses to touch an existing directory.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/refuse_existing.sh"
VENV="${1:-/work/venv-maxtext}"
PY="${PYTHON:-python3.12}"
VERSION="${MAXTEXT_VERSION:-0.2.5}"
refuse_existing "$VENV"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
  echo "error: MaxText needs Python >= 3.12; set PYTHON=/path/to/python3.12" >&2
  exit 2
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# Built beside the destination and renamed at the end: an interrupted run leaves no half-built $VENV.
# (Console-script shebangs keep the .partial path: call `$VENV/bin/python -m ...`, as the benchmark does.)
"$PY" -m venv "$VENV.partial"
py="$VENV.partial/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip download -q --no-deps -d "$work/wheel" "maxtext==$VERSION"
# MaxText's `tpu` extra (its tested dependency set) minus TPU/NVIDIA runtimes and dev tools.
"$py" "$(dirname "$0")/maxtext_requirements.py" "$work"/wheel/maxtext-*.whl > "$work/requirements.txt"
"$py" -m pip install -q -r "$work/requirements.txt"
"$py" -m pip install -q --no-deps "$work"/wheel/maxtext-*.whl
"$py" -c "import maxtext, jax; print('maxtext $VERSION, jax', jax.__version__)"
mv "$VENV.partial" "$VENV"
echo "MaxText venv ready: python -m benchmarks.maxtext_side_by_side --maxtext_python $VENV/bin/python"
