#!/usr/bin/env bash
# Builds the MaxText virtual environment that `python -m benchmarks.maxtext_side_by_side` runs as a subprocess
# (MaxText needs Python >= 3.12 and a newer JAX than this project pins, so it lives apart from our venv).
#
#   bash benchmarks/setup_maxtext.sh [VENV_DIR]      # default /work/venv-maxtext; PYTHON=/path/to/python3.12 to pick
#                                                    # the interpreter (else found on PATH or among pyenv's versions)
#
# Installs maxtext (MAXTEXT_VERSION, default 0.2.5) with its `tpu` extra's requirements minus what a CPU or GPU box
# cannot or need not use: libtpu, NVIDIA wheels, linters and type checkers. On a GPU machine, add
# `pip install "jax[cuda12]"` into the venv afterwards. Refuses to touch an existing directory.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/refuse_existing.sh"
VENV="${1:-/work/venv-maxtext}"
VERSION="${MAXTEXT_VERSION:-0.2.5}"
refuse_existing "$VENV"
new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }
# PYTHON if set; else python3.12 / python3.13 on PATH; else an installed pyenv version. (pyenv's shims answer
# "command not found" for a version that is installed but not selected: the interpreter itself is under
# $(pyenv root)/versions.)
PY=""
candidates=("${PYTHON:-}" python3.12 python3.13)
if command -v pyenv >/dev/null; then
  candidates+=($(ls -d "$(pyenv root)"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -V))
fi
for c in "${candidates[@]}"; do
  if [[ -n "$c" ]] && new_enough "$c"; then PY="$c"; break; fi
done
if [[ -z "$PY" ]]; then
  echo "error: MaxText needs Python >= 3.12 and none was found; install one and set PYTHON=/path/to/python3.12" >&2
  exit 2
fi
echo "using $PY ($("$PY" --version 2>&1))"
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
