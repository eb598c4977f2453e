#!/usr/bin/env bash
# Device calls on an H200 that run what was built without a GPU (multi-token blocks, the CPU
# sidecar, the experts-kernel modes end to end) and the measurements that follow. Each step has its
# own time limit and log under $OUT; a short table of results is printed last.
#
#   bash benchmarks/h200_checks.sh tests      # the GPU tests (~3 min)
#   bash benchmarks/h200_checks.sh resident   # 30-layer step: fma vs dot_asm experts, a 6-token block (~4 min)
#   bash benchmarks/h200_checks.sh offload    # all 43 layers, 125 GB budget, recipes A / B / hybrid (~7 min)
# (one device call runs at most 10 minutes: give each group its own call, or two small ones together)
set -u
OUT=${OUT:-/tmp/h200_checks}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
pip install -e . --no-deps --no-build-isolation -q >/dev/null 2>&1 || true
summary=()

step() {  # step NAME SECONDS command...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-26s rc=%-3s %4ss  ' "$name" "$rc" "$((SECONDS - t0))")$(tail -1 "$OUT/$name.log" | cut -c1-90)")
}

bench() {  # bench NAME SECONDS bench-args...
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" python -m megastep.cli bench --preset v4-flash --context 4096 --iters 20 \
    --json "$OUT/$name.json" "$@"
}

for group in "$@"; do
  case $group in
    tests)
      step gpu_tests 300 python -m pytest -q -x tests/test_fast_gpu.py tests/kernels/test_fast_step_triton.py ;;
    resident)
      bench resident_fma 150 --layers 30 --batch 1,4,16,64 --trace
      bench resident_dot_asm 120 --layers 30 --batch 1,4,16,64 --moe-mode dot_asm
      bench block6 90 --layers 30 --batch 6 --block 6 ;;
    offload)
      for path in gpu cpu hybrid; do
        bench "offload_skewed_$path" 150 --batch 1,6 --routing skewed --hbm-budget 125 --cold-path "$path"
      done ;;
    *)
      echo "unknown group $group (tests | resident | offload)"
      exit 2 ;;
  esac
done
printf '%s\n' "${summary[@]}"
