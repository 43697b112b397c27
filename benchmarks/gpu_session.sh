#!/usr/bin/env bash
# A GPU lease's measurements in one call, most telling first (see docs/performance.md). A lease is
# 15 minutes of device time, a call at most 10 and a machine's start 1-2, so this runs one ~9-minute call. Each step
# has its own time limit, taken from what is left, so a slow step cannot take the later ones' time. Rows go to
# console.txt as they finish and each step's report is written section by section, so a step cut off still returns
# what it measured.
#
#     bash benchmarks/gpu_wheels.sh                        # here, once: the wheels the device lacks, into .whl/
#     run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)    # the device tool
#
# Steps: (1) the train step of configs/gpu_1b.py at 8 and 64 experts, remat save_moe (MFU, the 8 -> 64 ratio,
# planned and peak memory; ~150 s); (2) the MoE layer against dense and the step's profile (~65 s); (3) slab's
# fallback under skewed routings (~30 s); (4) the GPU-only tests (~200 s); (5) GQA vs MLA decoding, row by row, in
# what is left; (6) speculative decoding's step cost and break-even acceptance. Timings from GPU run 7, whose remat-off rows (no faster than save_moe, 62 GiB at 64 experts) are
# no longer rerun. A step the budget cannot hold is skipped. Reports and the
# console go to $OUT (the device tool's folder), else to ./gpu_session_out. BUDGET_S (default 540) is the whole
# call's limit; `TINY=1` runs the same steps at toy shapes on any backend (a check of the script, not of speed).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_session_out}"
mkdir -p "$out"
budget="${BUDGET_S:-540}"
tiny=()
[[ "${TINY:-0}" == 1 ]] && tiny=(--tiny --attention_impl xla)
# The device's image lacks ml_collections, tokamax and grain: install the carried wheels there (on a GPU machine
# where they do not import; never elsewhere).
if command -v nvidia-smi >/dev/null && ! python3 -c "import ml_collections, tokamax, grain" 2>/dev/null \
    && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "error: installing .whl/ failed" >&2; exit 2; }
  export PYTHONPATH="/tmp/site:$PWD/.whl/stub:$PWD"
fi
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR="$PWD/.jax_cache"
command -v nvidia-smi >/dev/null && nvidia-smi > "$out/nvidia-smi.txt" 2>&1

step() {  # step NAME MAX_SECONDS ARGS...: gpu_report under min(MAX_SECONDS, what is left of the budget)
  local name="$1" max="$2"
  shift 2
  local left=$((budget - SECONDS - 10))
  local limit=$((max < left ? max : left))
  if ((limit < 60)); then
    echo "== $name: skipped, ${left}s left" | tee -a "$out/console.txt"
    return
  fi
  echo "== $name: up to ${limit}s (at ${SECONDS}s)" | tee -a "$out/console.txt"
  timeout --kill-after=10 "$limit" python3 -m benchmarks.gpu_report "${tiny[@]}" --out "$out/$name.md" "$@" 2>&1 \
    | grep --line-buffered -v "Autotuning cache" | tee -a "$out/console.txt"
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS))s" | tee -a "$out/console.txt"
}

step train 200 --sections train --grouped_matmul slab --scan_layers on --remat save_moe
step layer_profile 150 --sections layer,profile --grouped_matmul slab --scan_layers on --no_target_config
step fallback 90 --sections fallback --no_target_config
step tests 220 --sections tests --no_target_config
# GQA vs MLA decoding at 1k / 4k / 16k context (issue 47): last, each row printed as it lands
step decode 120 --sections decode --no_target_config
# speculative decoding's break-even acceptance where a 2-token main call costs about a 1-token one
step speculative 90 --sections speculative --no_target_config
echo "== done in ${SECONDS}s; reports in $out" | tee -a "$out/console.txt"
