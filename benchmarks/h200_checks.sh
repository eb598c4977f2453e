#!/usr/bin/env bash
# Device calls on an H200 that run what was built without a GPU (multi-token blocks, the CPU
# sidecar, the experts-kernel modes end to end) and the measurements that follow. Each step has its
# own time limit and log under $OUT; a short table of results is printed last.
#
#   bash benchmarks/h200_checks.sh tests      # the GPU tests: fast step, then the kernels (~8 min on a cold machine)
#   bash benchmarks/h200_checks.sh resident   # 30-layer step: fma vs dot_asm experts, a 6-token block (~4 min)
#   bash benchmarks/h200_checks.sh trace      # 30-layer step at 1-64 rows with the per-stage kernel table (~1 min)
#   bash benchmarks/h200_checks.sh overlap    # the 30-layer step with and without the second stream, and its GPU tests (~7 min)
#   bash benchmarks/h200_checks.sh pdl        # the 30-layer step with and without programmatic dependent launch, PDL's GPU tests (~4 min)
#   bash benchmarks/h200_checks.sh tune       # measure and pin attention / mHC configs, then their GPU tests (~5 min)
#   bash benchmarks/h200_checks.sh attn       # attention only: sweep and pin, the few-rows plan at 1-4 rows, its GPU tests (~7 min)
#   bash benchmarks/h200_checks.sh offload    # all 43 layers, 125 GB budget: B, hybrid (skewed), A (uniform, skewed) (~9 min)
#   bash benchmarks/h200_checks.sh cpu_host   # the host's CPU on the CPU expert kernel: cold and cached experts, 1 and 4 threads, perf stat (~4 min, any GPU kind)
#   bash benchmarks/h200_checks.sh cpu_omp    # the CPU expert kernel's thread scaling under OpenMP's placement and wait policy, back to back and sporadic (~4 min, any GPU kind)
#   bash benchmarks/h200_checks.sh offload_a  # the same, recipe A only (~1.5 min)
#   bash benchmarks/h200_checks.sh offload_zc # B zero-copy (its GPU tests first) and B polling, the CPU's share per step, timelines (~8 min)
#   bash benchmarks/h200_checks.sh offload_auto # recipe A with --hbm-budget auto (135 GB if auto fails) (~1.5 min)
#   bash benchmarks/h200_checks.sh moeanat    # the 1-row MoE sublayer under the ring, spread and register gate-up and the early fork: 30 layers, timelines (~4 min)
#   bash benchmarks/h200_checks.sh ringsms    # the 1-row ring gate-up on 96-120 SMs, the rest left to the shared expert: 30 layers, timelines (~3 min)
#   bash benchmarks/h200_checks.sh offload_auto24 # offload_auto for an 80 GB GPU: 24 layers, auto against 60 GB (~3 min)
#   bash benchmarks/h200_checks.sh offload24_gm # recipe A at 24 layers, auto budget, 1 / 6 rows: the defaults against 2026-12-07's start (~5 min)
#   bash benchmarks/h200_checks.sh offload_a16 # offload_a for an 80 GB GPU: 16 layers, 45 GB budget, recipe A (~1 min)
#   bash benchmarks/h200_checks.sh offload_zc16 # offload_zc for an 80 GB GPU: 16 layers, 45 GB budget; B zero-copy, B polling, A (~4 min)
#   bash benchmarks/h200_checks.sh offload_b  # A's timeline, the CPU kernel alone (back to back, sporadic), B zero-copy on all cores but 2, hybrid (~9 min)
#   bash benchmarks/h200_checks.sh ncu        # hardware counters of the slow kernels at batch 1 (~3 min, Firecracker machines)
#   bash benchmarks/h200_checks.sh small_ncu  # the 1-row step's small launches (attention, indexer, q norm + RoPE, mHC, norms): per-instruction stall samples from ncu (~3 min)
#   bash benchmarks/h200_checks.sh stalls     # why the weight-streaming loops stall: every raw counter (warp stall reasons included) of the experts and FP8 linear at batch 1 (~3 min)
#   bash benchmarks/h200_checks.sh floor      # what one decode launch costs (launch_floor.py), the CUDA GEMV against Triton, the experts' Triton and lut kernels (~3 min)
#   bash benchmarks/h200_checks.sh stream     # what one launch can stream (XOR-only reads), L2-prefetched linears, the experts without their decode (~3 min)
#   bash benchmarks/h200_checks.sh shared     # the shared expert's w2 in the experts' combine: its GPU tests, then the step with and without it (~6 min)
#   bash benchmarks/h200_checks.sh timeline   # the device timeline of one graph replay at 1 and 4 rows (--timeline, in the JSON) (~1.5 min)
#   bash benchmarks/h200_checks.sh fork       # the shared expert's side stream forked after the router, with and without it in the combine, A/B/A (~3 min)
#   bash benchmarks/h200_checks.sh route      # the one-launch CUDA routing: its GPU tests, the router alone and the step against router.py's launches, A/B/A (~6 min)
#   bash benchmarks/h200_checks.sh plan       # the step with FastDecoder's MOE_PLAN (the default) against the order before it, A/B/A, with the trace; Triton routing in the plan; the CUDA routing's probes (~6 min)
#   bash benchmarks/h200_checks.sh cold       # the cold-expert recipes' GPU tests alone, with full tracebacks (2 failed at the end of the fourteenth measurement) (~2 min)
#   bash benchmarks/h200_checks.sh spread     # the experts' spread gate-up at 1-2 rows: the lut GPU tests, lut_balance_probe.py, the kernels and the step against whole items, A/B/A/B (~5 min)
#   bash benchmarks/h200_checks.sh lut_ncu    # the experts' lut GPU tests, then their stall reasons per SASS instruction at 1 and 16 rows (ncu) (~4 min)
#   bash benchmarks/h200_checks.sh final      # the bit tests of the step, the lut and CUDA routing GPU tests, the step at 1-64 rows (~7 min)
#   bash benchmarks/h200_checks.sh gm_short   # gm's GPU tests, its step A/B at 1, 16 and 64 rows, 2 rounds (~4.5 min)
#   bash benchmarks/h200_checks.sh gm_ncu     # the group-major gate-up against the pair-major ring: the experts calls alone, their stall reasons and shared-memory wavefronts per instruction (ncu) (~3 min)
#   bash benchmarks/h200_checks.sh ncu1       # the group-major gate-up and down at 1 row (and gate-up at 2): stall reasons and shared-memory wavefronts per instruction (ncu) (~2 min)
#   bash benchmarks/h200_checks.sh gmdown     # the group-major down (the default) against the pair-major: its GPU tests, the experts calls alone, the step A/B at 1-64 rows, the bit tests, 64 skewed (~2 min on an H100 at 16 layers)
#   bash benchmarks/h200_checks.sh down_ncu   # down's stall reasons and shared-memory wavefronts per instruction at 16 and 64 rows (ncu) (~1.5 min)
#   bash benchmarks/h200_checks.sh gmsms      # the group-major even deal at 1-2 rows on 104-132 CTAs against items at 1 row (~2 min)
#   bash benchmarks/h200_checks.sh gm_ab      # gmdefault's A/B alone (~2 min)
#   bash benchmarks/h200_checks.sh downearly  # down's first item's routing before its PDL wait (the default) against after: its GPU tests, the experts calls, the step A/B at 1-64 rows (~2 min on an H100 at 16 layers)
#   bash benchmarks/h200_checks.sh gemv_wg    # the CUDA GEMV's wgmma form (built 2026-12-07 without a device): its GPU test, then the step's FP8 shapes against Triton and the mma form at 1-64 rows (~4 min)
#   bash benchmarks/h200_checks.sh gmfew      # gate-up's task halves on warp pairs at 1 row: the group-major GPU tests, the experts calls, the step's bit tests, the step A/B/C at 1-4 rows, ncu at 1 row (~3 min on an H100 at 16 layers)
#   bash benchmarks/h200_checks.sh gmdefault  # the session's defaults of 2026-12-07 against its start at 1-64 rows, final's bit tests, the table (~9 min)
#   bash benchmarks/h200_checks.sh wobparts   # wo_b's partials and the experts' pairs summed by the next mixes launch (WO_B_PARTS_ROWS, MOE_PAIRS_ROWS): GPU tests, the step at 1-16 rows, 4 arms, 3 rounds, 1-row timelines (~7 min)
#   bash benchmarks/h200_checks.sh steptests  # final's bit tests of the step alone, without the kernels' (~1.5 min)
#   bash benchmarks/h200_checks.sh table      # final's step at 1-64 rows alone, without its bit tests (~3 min)
#   bash benchmarks/h200_checks.sh passes     # the step at 1-64 rows under the default and the skewed routing, with the experts kernels' passes (~2 min)
#   bash benchmarks/h200_checks.sh down4rows  # down in passes of 4 pairs against 2 at 1-64 rows, 3 rounds; 64 rows skewed; its GPU tests (~5 min)
#   bash benchmarks/h200_checks.sh gm         # the group-major gate-up (8 pairs a pass) against the pair-major kernels: its GPU tests, the step A/B at 1-64 rows, 3 rounds, the step's bit tests (~9 min)
#   bash benchmarks/h200_checks.sh csa64      # CSA attention on 64-entry steps (the 2026-12-04 sweep's winner): its plan, bit tests, the step in 3 rounds (~7 min)
#   bash benchmarks/h200_checks.sh pins       # the three winners of 2026-12-05's one / arms2: their bit tests, then the step at 1-64 rows, 3 rounds (~7 min)
#   bash benchmarks/h200_checks.sh slack      # which stages the step waits for: each delayed 5 and 10 us in every layer, 1 and 4 rows, 3 rounds (~8 min)
#   bash benchmarks/h200_checks.sh qtail      # the q norm made by the x group's launch (pinned at 1 row) against its own launch: the step at 1-16 rows, 3 rounds, then its GPU tests (~4 min)
#   bash benchmarks/h200_checks.sh chain      # an HCA sublayer's FP8 weight streams at 1 row in one persistent launch against one launch per layer (chain_probe.py) (~4 min)
#   bash benchmarks/h200_checks.sh tchain     # the same chains in one persistent launch with linear_fp8's own Triton loop (triton_chain.py), its GPU tests (~3 min)
#   bash benchmarks/h200_checks.sh sms        # the experts calls alone at 1 and 16 rows with grids for 132, 100 and 66 SMs (~2 min)
#   bash benchmarks/h200_checks.sh probe      # the experts launches' phases at 1 and 4 rows, stamped by the probe build: without and with PDL, without the loop's loads (~2 min)
#   bash benchmarks/h200_checks.sh ringmix    # the ring gate-up's mixed decode: its GPU tests, the experts calls, the step A/B at 1-64 rows (~5 min)
#   bash benchmarks/h200_checks.sh linsplit   # the FP8 linears' candidates at 1, 4 and 64 rows, half the programs among them (linear_variants.py) (~3 min)
#   bash benchmarks/h200_checks.sh ep_tests   # the EP GPU tests alone, 1 / 4 / 8 rows against one GPU (~6 min, 2+ GPUs)
#   bash benchmarks/h200_checks.sh tp         # the attention's heads split over the GPUs: the EP and split-combine GPU tests, then all 43 layers A/B/A/B (~9 min, 2+ GPUs)
#   bash benchmarks/h200_checks.sh tp_more    # the split's GPU tests with the vocabulary split, then heads / + vocabulary / 256-column sums A/B, block, trace (~9 min, 2+ GPUs)
#   bash benchmarks/h200_checks.sh splits1    # one GPU: the split sums' GPU tests, the gate's timeline at 8 and 16 rows on the rule and pinned (~5 min)
#   bash benchmarks/h200_checks.sh gatefork   # the gate on the rule / pinned, the shared expert forked before / after the router, at 8, 16 and 64 rows, A/B (~5 min)
#   bash benchmarks/h200_checks.sh ep         # EP GPU tests (serve --gpus too), the combine alone, then all 43 layers over the GPUs: p2p vs all-reduce (~9 min, 2+ GPUs)
#                                             # (the server test needs wheels the device lacks: run benchmarks/device_wheels.sh here and carry .whl)
# Logs and JSON are written under $OUT/h200_checks_run, then packed into one archive in $OUT,
# h200_checks-<date>.tgz, with summary.txt (the table printed last): the device brings back only a
# few files of its $OUT (on 2026-11-30 a group's 13 files did not come back).
#
# Compile caches (a call's first step process spent 40-90 s compiling): each call packs the Triton kernels and
# CUDA C++ cubins it compiled or was given into $OUT/device_cache.tgz (benchmarks/kernels/precompile.py --pack:
# without the intermediate IR); copy that file to build/device_cache.tgz here and carry it on the next call
# (`run`'s carry), which unpacks it first. A session's first call can carry one built on the CPU machine:
#   bash benchmarks/h200_checks.sh --precompile PYTHON GROUP...
# runs nothing of the groups: each `bench`, `bench_with` and `ab` step compiles its step's kernels for the
# H200 (precompile.py under PYTHON, a Python 3.12 with the device's triton 3.6.0 and torch: its --batch rows,
# each arm's statements) into build/device_cache.tgz. The last summary line says how many kernels the call
# still compiled.
set -u
PRECOMPILE=
if [ "${1:-}" = "--precompile" ]; then
  PRECOMPILE=$2
  shift 2
fi
FINAL=${OUT:-/tmp/h200_checks}
OUT=$FINAL/h200_checks_run
mkdir -p "$OUT"
export PYTHONPATH=$PWD
[ -z "$PRECOMPILE" ] && { python3 -m pip install -e . --no-deps --no-build-isolation -q >/dev/null 2>&1 || true; }
summary=()

cache_root=$(${PRECOMPILE:-python3} -c "import sys; sys.path.insert(0, 'benchmarks/kernels'); import precompile; \
print(precompile.CACHE_ROOT)")
if [ -z "$PRECOMPILE" ]; then
  # (unpacked where it was built: a Triton cache entry names its files by absolute path)
  rm -rf "$cache_root" && mkdir -p "$cache_root/triton"
  [ -f build/device_cache.tgz ] && tar -xzf build/device_cache.tgz -C "$(dirname "$cache_root")"
  export TRITON_CACHE_DIR=$cache_root/triton
  cuda_cache=$(python3 -c 'from megastep.kernels.cuda_module import cache_dir; print(cache_dir())')
  mkdir -p "$cuda_cache" && cp -n "$cache_root"/cuda/*.cubin "$cuda_cache"/ 2>/dev/null
  carried=$(find "$TRITON_CACHE_DIR" -name '__grp__*' | wc -l)  # (a kernel's entry; a launcher module's has none)
  touch "$cache_root/unpacked"  # (a kernel compiled or found missing after this writes its group file anew)
fi

# One device call runs at most 600 s, and a killed call brings back only a few of its files (not the
# archive), so the steps together stop at 560 s (or at `--deadline SECONDS`, given first, for a call
# with a shorter limit): a step's limit is cut to what is left, a step with under 20 s left is
# skipped, and the archive below is always written.
budget=560
if [ "${1:-}" = "--deadline" ]; then
  budget=$2
  shift 2
fi
DEADLINE=$((SECONDS + budget))
# --layers N (after --deadline): every bench / bench_with / ab step at N layers instead of its own, for a GPU with
# less memory (the 30-layer step holds ~110 GB: an H100's 80 GB takes 16). Its numbers compare only with the same
# call's.
LAYERS=
if [ "${1:-}" = "--layers" ]; then
  LAYERS=$2
  shift 2
fi
relayer() {  # relayer ARGS...: ARGS into the array `args`, with --layers N made --layers $LAYERS when given
  args=()
  while [ $# -gt 0 ]; do
    if [ "$1" = --layers ] && [ -n "$LAYERS" ]; then
      args+=(--layers "$LAYERS")
      shift 2
    else
      args+=("$1")
      shift
    fi
  done
}

last_rc=0  # the last step's exit status (a skipped step: 124)
step() {  # step NAME SECONDS command...
  local name=$1 limit=$2
  shift 2
  if [ -n "$PRECOMPILE" ]; then  # (nothing runs: a test step passes, so that the arms behind it are compiled)
    last_rc=0
    return
  fi
  local t0=$SECONDS left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 20 ]; then
    summary+=("$(printf '%-26s skipped: the call has %ss left' "$name" "$left")")
    last_rc=124
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  last_rc=$rc
  summary+=("$(printf '%-26s rc=%-3s %4ss  ' "$name" "$rc" "$((SECONDS - t0))")$(tail -1 "$OUT/$name.log" | cut -c1-90)")
}

# --precompile: the kernels of a step process's steps, with PRE's statements (an arm) in effect and at its
# --batch rows, and each of its --arm's (ab_step.py); its other arguments are not read (a decoder built
# with other arguments, e.g. --shared-after-router, may launch kernels not compiled here)
precompile() {  # precompile PRE bench-or-ab_step-args...
  local pre=$1 rows=1 arms=()
  shift
  while [ $# -gt 0 ]; do
    case $1 in
      --batch) rows=$2; shift 2 ;;
      --arm) arms+=(--arm "$2"); shift 2 ;;
      *) shift ;;
    esac
  done
  [ -n "$pre" ] && arms+=(--arm "pre=$pre")
  "$PRECOMPILE" benchmarks/kernels/precompile.py --rows "$rows" "${arms[@]}" || exit 1
}

bench() {  # bench NAME SECONDS bench-args...
  local name=$1 limit=$2
  shift 2
  [ -n "$PRECOMPILE" ] && { precompile "" "$@"; return; }
  relayer "$@"
  step "$name" "$limit" python3 -m megastep.cli bench --preset v4-flash --context 4096 --iters 20 \
    --json "$OUT/$name.json" "${args[@]}"
}

# An experiment's arm in the same tree: python statements PRE (module settings, e.g.
# 'import megastep.kernels.moe_lut as m; m.SPREAD_ROWS = ()') run first in the process.
bench_with() {  # bench_with NAME SECONDS PRE bench-args...
  local name=$1 limit=$2 pre=$3
  shift 3
  [ -n "$PRECOMPILE" ] && { precompile "$pre" "$@"; return; }
  relayer "$@"
  step "$name" "$limit" python3 -c "$pre; import sys; from megastep.cli import main; sys.exit(main(sys.argv[1:]))" \
    bench --preset v4-flash --context 4096 --iters 20 --json "$OUT/$name.json" "${args[@]}"
}

# Arms of the step in one process (benchmarks/ab_step.py): the decoder is built once and each arm
# (--arm NAME=STATEMENTS, settings read when a step is captured or a kernel launched) gets fresh
# graphs, rounds interleaved; a few seconds an arm instead of bench_with's 20-36. Its table is the
# log's tail (the step's summary line shows only the last line).
ab() {  # ab NAME SECONDS ab_step-args...
  local name=$1 limit=$2
  shift 2
  [ -n "$PRECOMPILE" ] && { precompile "" "$@"; return; }
  relayer "$@"
  step "$name" "$limit" python3 benchmarks/ab_step.py --preset v4-flash --context 4096 --iters 20 \
    --json "$OUT/$name.json" "${args[@]}"
  tail -n 80 "$OUT/$name.log" | grep -E '^ *[0-9]+ ' >"$OUT/$name.table" && summary+=("$(cat "$OUT/$name.table")")
}

log_lines() {  # log_lines REGEX NAME...: the lines of those steps' logs that match REGEX, into the summary
  local re=$1 name line
  shift
  for name in "$@"; do
    [ -f "$OUT/$name.log" ] || continue
    while IFS= read -r line; do summary+=("$name: $line"); done < <(grep -h -E "$re" "$OUT/$name.log" | cut -c1-400)
  done
}
reads_lines() { log_lines '^(batch [0-9]+: routed experts|HBM budget|device memory)' "$@"; }  # what each batch's rows
# read, the placement and the device's memory (bench)
sidecar_lines() { log_lines '^(CPU sidecar|timeline of)' "$@"; }  # the CPU sidecar's work and the timelines (bench)

# The winners of 2026-12-05's arms (docs/PERFORMANCE.md, twenty-eighth measurement), for `pins`: a CSA layer's
# indexer work first on its streams (IDX_FIRST); HCA's and the window's one-row attention plans with the value columns
# over 8 programs instead of 4 (ATTN_V8: 96 and 128 programs, one wave; Triton 3.6 as the step launches them: HCA 106
# registers and 1077 SASS instructions per KV step against 141 and 1163, the window 72 and 1832 against 96 and 2152:
# benchmarks/kernels/occupancy.py; the same bits, bit-neutral settings; CSA's one-row plan takes 114 registers, two
# programs per SM: one wave already, and over 8 it would take 143, three waves); the router's gate in 8 splits of 256
# columns (GATE8; the rule: 32 of 128)
IDX_FIRST='import megastep.model.fast as f; f.INDEXER_FIRST = True'
ATTN_V8='import dataclasses, megastep.kernels.attention as a; f = a._PINNED_FEW_ROWS; r = dataclasses.replace'
ATTN_V8="$ATTN_V8; f[(64, 161, 512)] = (1, r(f[(64, 161, 512)][1], dv_split=8))"
ATTN_V8="$ATTN_V8; f[(64, 128, 512)] = (1, r(f[(64, 128, 512)][1], dv_split=8))"
GATE8='import megastep.kernels.dense as d; d._PINNED[(256, 4096)] = d.DenseConfig(32, 256, 8, 4, 3)'
# recipe B's job posted and collected without copies (runtime/sidecar.ZERO_COPY), for offload_zc and offload_b
ZC='import megastep.runtime.sidecar as s; s.ZERO_COPY = True'
# the pair-major kernels (moe_lut.GATE_UP_GM and DOWN_GM off: the default before 2026-12-07), and the group-major
# kernels' GPU tests, for gm and gm_short; the session's start on 2026-12-07 07:53 (pair-major kernels, down4 from
# 16 rows) for gmdefault and gm_ab
PAIRS='import megastep.kernels.moe_lut as m; m.GATE_UP_GM = False; m.DOWN_GM = False'
START1207="$PAIRS; m.DOWN4_MIN_ROWS = 16"
gm_tests() { step gm_tests "$1" python3 -m pytest -q -rfE --timeout 100 -m gpu tests/kernels/test_moe.py -k "group_major"; }

# ncu on one experts launch: the engine's (moe_cuda_variants.py) second launch matching the regex, at `rows` rows;
# its stall reasons and shared-memory wavefronts per SASS instruction read by ncu_source.py (gm_ncu, down_ncu)
ncu_experts() {  # ncu_experts NAME KERNEL_REGEX ENGINE ROWS
  local name=$1 kernels=$2 engine=$3 m=$4
  step "ncu_$name" 120 ncu --clock-control none --launch-skip 1 --launch-count 1 --kernel-name "regex:$kernels" \
    --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section SourceCounters \
    --import-source yes --export "$OUT/ncu_$name" \
    python3 benchmarks/kernels/moe_cuda_variants.py --out "$OUT/ncu_out_$name" --ms "$m" --engines "$engine"
  step "ncu_${name}_details" 40 ncu --import "$OUT/ncu_$name.ncu-rep" --csv --page details
  step "ncu_${name}_source" 60 ncu --import "$OUT/ncu_$name.ncu-rep" --csv --page source --print-source sass
  step "ncu_${name}_read" 30 python3 benchmarks/kernels/ncu_source.py "$OUT/ncu_${name}_source.log" \
    --details "$OUT/ncu_${name}_details.log" --top 30
  rm -f "$OUT/ncu_$name.ncu-rep"
  gzip -f "$OUT/ncu_${name}_source.log"
}

zc_tests() {  # the zero-copy sidecar's GPU tests (offload_zc, offload_zc16)
  step zc_tests 150 python3 -m pytest -q -rfE --timeout 120 -m gpu tests/kernels/test_sidecar_zero_copy.py \
    'tests/test_fast_gpu.py::test_polling_sidecar_gives_the_host_functions_bits'
}
final_tests() {  # the bit tests of the fast step, the lut and CUDA routing GPU tests (final, gmdefault)
  step final_tests 380 python3 -m pytest -q -rfE --timeout 120 -m gpu tests/test_fast_gpu.py \
    tests/kernels/test_moe.py tests/kernels/test_route_cuda.py \
    -k "cold_expert or alone or same_input or graph_replay or indexer_beside or lut or route"
}
gm_default_ab() {  # the defaults (since 2026-12-07 10:16: group-major gate-up and down) against the day's start, 1-64
  # rows (gmdefault, gm_ab)
  ab gm_default 200 --layers 30 --batch 1,2,4,8,16,32,64 --rounds 3 --arm "start=$START1207" --arm "now="
}
final_step() {  # the step of the table at the top of docs/PERFORMANCE.md (final, table)
  bench final 170 --layers 30 --batch 1,2,4,8,16,32,64
  reads_lines final
}

all_gpus() {  # the lent machines' NCCL settings; n = the GPUs, gpus = their ids for --gpus
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # required on lent machines
  n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  gpus=$(seq -s, 0 $((n - 1)))
}

for group in "$@"; do
  case $group in
    tests)
      step gpu_tests 330 python3 -m pytest -q --timeout 120 -m gpu tests/test_fast_gpu.py
      step gpu_kernel_tests 220 python3 -m pytest -q --timeout 100 -m gpu tests/kernels/test_linear_fp8.py \
        tests/kernels/test_moe.py tests/kernels/test_mhc.py tests/kernels/test_rope_norm.py tests/kernels/test_attention.py \
        tests/kernels/test_router.py ;;
    resident)
      bench resident_dot_asm 150 --layers 30 --batch 1,4,16,64 --moe-mode dot_asm --trace
      bench resident_fma 120 --layers 30 --batch 1,4,16,64
      bench block6 90 --layers 30 --batch 6 --block 6 ;;
    trace)
      bench trace 150 --layers 30 --batch 1,4,16,64 --trace ;;
    attn)  # attention alone: the sweep (pins rewritten, back under $OUT/pinned/), the few-rows plan, the GPU tests
      step tune_attention 260 python3 benchmarks/kernels/tune.py --only attention --write --json "$OUT/tune.json"
      mkdir -p "$OUT/pinned" && cp megastep/kernels/attention.py "$OUT/pinned/"
      step attn_few_rows 90 python3 benchmarks/kernels/attn_few_rows.py --rows 1,2,4 --json "$OUT/attn_few_rows.json"
      step attn_tests 120 python3 -m pytest -q --timeout 100 -m gpu tests/kernels/test_attention.py ;;
    tune)  # the rewritten kernel modules come back under $OUT/pinned/ to be committed
      step tune 240 python3 benchmarks/kernels/tune.py --write --json "$OUT/tune.json"
      mkdir -p "$OUT/pinned" && cp megastep/kernels/attention.py megastep/kernels/mhc.py megastep/kernels/dense.py \
        "$OUT/pinned/"
      step tuned_tests 200 python3 -m pytest -q --timeout 120 tests/kernels/test_mhc.py tests/kernels/test_attention.py \
        tests/kernels/test_attention_tune.py tests/kernels/test_dense.py tests/test_fast_gpu.py \
        tests/kernels/test_fast_step_triton.py ;;
    overlap)
      bench resident_overlap 150 --layers 30 --batch 1,4,16,64 --trace
      bench resident_one_stream 100 --layers 30 --batch 1,64 --no-overlap
      step overlap_tests 200 python3 -m pytest -q --timeout 120 -m gpu tests/test_fast_gpu.py tests/kernels/test_linear_fp8.py ;;
    pdl)  # PDL against no PDL in the same call, then PDL's GPU tests (bits unchanged)
      bench resident_pdl 120 --layers 30 --batch 1,4,16,64 --pdl on
      bench resident_no_pdl 120 --layers 30 --batch 1,4,16,64 --pdl off
      step pdl_tests 200 python3 -m pytest -q --timeout 150 tests/kernels/test_pdl.py tests/test_fast_gpu.py -k pdl ;;
    offload)  # recipes B and hybrid under skewed routing, A under uniform, then A under skewed (~2.3 min each)
      for path in cpu hybrid; do
        bench "offload_skewed_$path" 150 --batch 1,6 --routing skewed --hbm-budget 125 --cold-path "$path"
      done
      bench offload_uniform_gpu 150 --batch 1,6 --routing uniform --hbm-budget 125 --cold-path gpu
      bench offload_skewed_gpu 150 --batch 1,6 --routing skewed --hbm-budget 125 --cold-path gpu ;;
    offload_zc)  # recipe B's job posted and collected by two kernels through page-locked memory in place
      # (runtime/sidecar.ZERO_COPY, built 2026-12-05 without a device): its GPU tests, then B with it and B as it is
      # (polling), each with what the CPU did per step (the bench's "CPU sidecar" lines: busy jobs, experts, CPU
      # time and its GB/s) and the device timeline of one replay (copies, and the GPU's idle stretches: its waits for
      # the CPU) (~8 min)
      zc_tests
      if [ "$last_rc" = 0 ]; then
        bench_with offload_skewed_cpu_zc 220 "$ZC" --batch 1,6 --routing skewed --hbm-budget 125 --cold-path cpu --timeline
      fi
      bench offload_skewed_cpu 220 --batch 1,6 --routing skewed --hbm-budget 125 --cold-path cpu --timeline
      sidecar_lines offload_skewed_cpu_zc offload_skewed_cpu ;;
    offload_a16)  # offload_a on an 80 GB GPU: 16 layers, 45 GB budget (~30 % of the expert bytes cold, as the 43 layers'
      # 125 GB leave), recipe A with the routed experts each batch's rows read; compare only within the call
      bench offload16_skewed_gpu 110 --layers 16 --batch 1,6 --routing skewed --hbm-budget 45 --cold-path gpu
      reads_lines offload16_skewed_gpu ;;
    offload_zc16)  # offload_zc on an 80 GB GPU: its GPU tests, then 16 layers with a 45 GB budget (~30 % of the
      # expert bytes cold, as the 43 layers' 125 GB leave), B zero-copy, B polling and A; compare only within the call
      zc_tests
      if [ "$last_rc" = 0 ]; then
        bench_with offload16_skewed_cpu_zc 130 "$ZC" --layers 16 --batch 1,6 --routing skewed --hbm-budget 45 \
          --cold-path cpu --timeline
      fi
      bench offload16_skewed_cpu 130 --layers 16 --batch 1,6 --routing skewed --hbm-budget 45 --cold-path cpu --timeline
      bench offload16_skewed_gpu 110 --layers 16 --batch 1,6 --routing skewed --hbm-budget 45 --cold-path gpu
      sidecar_lines offload16_skewed_cpu_zc offload16_skewed_cpu ;;
    offload_b)  # the rest of why B loses: A's timeline at one row; the CPU kernel on this host alone (no GPU), back to
      # back at 1-16 threads and one call now and then beside a spinning process; B zero-copy with 2 cores left to
      # the host's other threads (the team takes torch's thread count otherwise), and hybrid zero-copy (~9 min)
      bench offload_skewed_gpu_tl 150 --batch 1 --routing skewed --hbm-budget 125 --cold-path gpu --timeline
      step cpu_experts 100 python3 benchmarks/cpu_experts.py --threads 1 4 8 15 16 --rows 1 6 --no-torch --reps 3
      step cpu_sporadic 60 python3 benchmarks/cpu_experts.py --sporadic --threads 4 8 14 15 16 --calls 30
      step cpu_sporadic_1500 60 python3 benchmarks/cpu_experts.py --sporadic --threads 8 14 16 --calls 15 --gap-us 1500
      bench_with offload_skewed_cpu_zc_less2 170 "$ZC; import os; s.THREADS = max(1, os.cpu_count() - 2)" --batch 1,6 \
        --routing skewed --hbm-budget 125 --cold-path cpu
      bench_with offload_skewed_hybrid_zc 170 "$ZC" --batch 1,6 --routing skewed --hbm-budget 125 --cold-path hybrid
      sidecar_lines offload_skewed_gpu_tl offload_skewed_cpu_zc_less2 offload_skewed_hybrid_zc ;;
    cpu_host)  # why the GPU host's cores run the CPU expert kernel 4.4-6x slower per thread than the CPU machine's
      # (2026-12-05): the machine (lscpu, cgroup CPU limit, clocks), one thread at M = 1 and 6 on cold experts and on
      # one expert again and again (--pool 1: from the caches, so compute alone), then under perf stat if it is there
      step cpu_host_info 20 bash -c 'lscpu; cat /sys/fs/cgroup/cpu.max 2>/dev/null; grep MHz /proc/cpuinfo | sort | uniq -c'
      step cpu_host_cold 90 python3 benchmarks/cpu_experts.py --threads 1 4 --rows 1 6 --no-torch --reps 3
      step cpu_host_hot 60 python3 benchmarks/cpu_experts.py --threads 1 4 --rows 1 6 --no-torch --reps 3 --pool 1
      if command -v perf >/dev/null; then
        step cpu_host_perf 60 perf stat -e cycles,instructions,task-clock python3 benchmarks/cpu_experts.py \
          --threads 1 --rows 1 --no-torch --reps 3 --isa avx512
      fi ;;
    cpu_omp)  # the CPU expert kernel's thread scaling on the GPU host (2026-12-05: one expert at M = 1 takes 406 us on 16
      # threads, 33 GB/s, where 16 threads' torch.sum reads 90 GB/s; recipe B's job 605 us in the step): OpenMP's
      # placement and wait policy, back to back on 8 / 14 / 16 threads and sporadic as the sidecar calls it, on a pool
      # of 48 experts (642 MB, twice the L3)
      for e in plain bind active bind_active; do
        case $e in
          plain) envs=() ;;
          bind) envs=(OMP_PROC_BIND=close OMP_PLACES=cores) ;;
          active) envs=(OMP_WAIT_POLICY=active) ;;
          bind_active) envs=(OMP_PROC_BIND=close OMP_PLACES=cores OMP_WAIT_POLICY=active) ;;
        esac
        step "cpu_omp_$e" 60 env "${envs[@]}" python3 benchmarks/cpu_experts.py --threads 8 14 16 --rows 1 6 \
          --isa avx512 --no-torch --pool 48 --reps 3
        step "cpu_omp_${e}_sporadic" 60 env "${envs[@]}" python3 benchmarks/cpu_experts.py --sporadic \
          --threads 8 14 16 --pool 48
        summary+=("$e: $(grep -E '^\| [16] \| avx512 ' "$OUT/cpu_omp_$e.log" | tr -s ' ' | tr '\n' ' ')")
        summary+=("$e sporadic: $(grep -E '^\| 1?[0-9] \| [01] \|' "$OUT/cpu_omp_${e}_sporadic.log" | tr -s ' ' | tr '\n' ' ')")
      done ;;
    offload_a)  # recipe A alone (the winner of the offload group)
      bench offload_skewed_gpu 280 --batch 1,6 --routing skewed --hbm-budget 125 --cold-path gpu
      reads_lines offload_skewed_gpu ;;
    offload_auto)  # recipe A with the budget the device leaves (--hbm-budget auto: ~138 GB on an H200 against 125, a
      # third of the cold reads), then at 135 GB in case auto's margin is too thin; compare with offload_a's 125
      bench offload_skewed_gpu_auto 280 --batch 1,6 --routing skewed --hbm-budget auto --cold-path gpu
      [ "$last_rc" != 0 ] && bench offload_skewed_gpu_135 280 --batch 1,6 --routing skewed --hbm-budget 135 --cold-path gpu
      reads_lines offload_skewed_gpu_auto offload_skewed_gpu_135 ;;
    moeanat)  # the 1-row MoE sublayer's anatomy under the three gate-up schedules (all measured before as step times):
      # the ring (default), the spread over every SM (SPREAD_ROWS with 1) and whole items in registers, 2 CTAs an SM
      # (RING_MIN_ROWS None); 30 layers, 2 rounds, each arm's 1-row timeline (benchmarks/timeline_sublayers.py --arm).
      # On one H100 (--layers 16) the sublayer ended at the same time under all three: docs/PERFORMANCE.md, 2026-12-06
      # from 06:36, item 6
      # Arm early: the shared expert's side stream forked before the router (MOE_PLAN's 1-row entry), so that its
      # w1/w3 would run in the ~10 us the gate and the routing leave the SMs idle (twenty-third measurement: +3.4 %;
      # on 2026-12-06 +1.0 %: its w1/w3 still waits for the SMs the ring gate-up holds, which `ringsms` then freed).
      M='import megastep.kernels.moe_lut as m'
      F='import megastep.model.fast as f; f.MOE_PLAN = ((1, "cuda", False, "mhc"),) + f.MOE_PLAN[1:]'
      ab moeanat 260 --layers 30 --batch 1 --rounds 2 --timeline-batch 1 --arm ring= \
        --arm "spread=$M; m.SPREAD_ROWS = (1, 2)" --arm "items=$M; m.RING_MIN_ROWS = None" --arm "early=$F" ;;
    ringsms)  # the 1-row ring gate-up on fewer SMs (moe_lut.RING_ONE_ROW_SMS, 112 since 2026-12-06): its 192 items need
      # 96 CTAs (two halves each); with a CTA on every SM, 72 of them run one item and hold their SM, so the shared
      # expert's w1/w3 (side stream, after the routing) started only when those finished (moeanat's timelines,
      # 2026-12-06). Fewer CTAs leave the other SMs to it from the routing's end; the same bits (every item is the
      # same program; GPU test test_gpu_lut_one_row_ring_on_fewer_sms_gives_the_same_bits). 30 layers, timelines.
      step ringsms_tests 150 python3 -m pytest -q -rfE --timeout 120 -m gpu tests/kernels/test_moe.py \
        tests/test_fast_gpu.py -k "one_row_ring or lut_ring or alone or same_input"
      M='import megastep.kernels.moe_lut as m'
      ab ringsms 240 --layers 30 --batch 1 --rounds 3 --timeline-batch 1 --arm "all=$M; m.RING_ONE_ROW_SMS = None" \
        --arm "c96=$M; m.RING_ONE_ROW_SMS = 96" --arm "c104=$M; m.RING_ONE_ROW_SMS = 104" --arm c112= \
        --arm "c120=$M; m.RING_ONE_ROW_SMS = 120" ;;
    offload24_gm)  # recipe A on an 80 GB GPU (24 layers, --hbm-budget auto, skewed, 1 row and a 6-row block) under the
      # defaults (measured at 2026-12-07 09:00: the group-major gate-up, down4 from 8 rows) and the day's start, one
      # process each
      bench_with offload24_gm_start 150 "$START1207" --layers 24 --batch 1,6 --routing skewed --hbm-budget auto --cold-path gpu
      bench offload24_gm_now 150 --layers 24 --batch 1,6 --routing skewed --hbm-budget auto --cold-path gpu ;;
    offload_auto24)  # offload_auto on an 80 GB GPU: 24 layers (88 GB of weights), --hbm-budget auto (~73 GB there) against
      # 60 GB, recipe A; compare only within the call
      bench offload24_skewed_gpu_auto 200 --layers 24 --batch 1,6 --routing skewed --hbm-budget auto --cold-path gpu
      bench offload24_skewed_gpu_60 200 --layers 24 --batch 1,6 --routing skewed --hbm-budget 60 --cold-path gpu
      reads_lines offload24_skewed_gpu_auto offload24_skewed_gpu_60 ;;
    ncu)  # why the weight-streaming kernels reach 1.1-1.5 TB/s and attention takes 20-30 us at batch 1:
      # throughput, memory, occupancy, warp stalls of each kind's launches in a 4-layer eager step
      step ncu 240 ncu --clock-control none --target-processes all --launch-skip 40 --launch-count 40 \
        --kernel-name 'regex:_sparse_attn_kernel|_linear_fp8_kernel|_moe_gate_up_kernel|_moe_down_kernel|_hc_finish_kernel' \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats --csv --page details \
        python3 -m megastep.cli bench --preset v4-flash --layers 4 --batch 1 --context 4096 --iters 2 ;;
    small_ncu)  # the 1-row layer's small launches take ~64 us of its 160 (seventeenth measurement): attention alone
      # closes 13-16 us for < 1 MB. Where each one's time goes, by SASS instruction (sampled stall reasons), one report
      # (-> .ncu-rep) read out as the details and source pages; a 4-layer step has one layer of each attention kind
      step small_ncu 150 ncu --clock-control none --target-processes all --launch-skip 62 --launch-count 31 \
        --kernel-name 'regex:_sparse_attn_kernel|_indexer_q_kernel|_score_kernel|_select_kernel|_q_norm_rope_kernel|_hc_finish_kernel|_hc_mix_partial_kernel|_rms_norm_kernel' \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SourceCounters \
        --import-source yes --export "$OUT/small_ncu" \
        python3 -m megastep.cli bench --preset v4-flash --layers 4 --batch 1 --context 4096 --iters 2
      step small_ncu_details 40 ncu --import "$OUT/small_ncu.ncu-rep" --csv --page details
      step small_ncu_source 60 bash -c "ncu --import '$OUT/small_ncu.ncu-rep' --csv --page source --print-source sass \
        || ncu --import '$OUT/small_ncu.ncu-rep' --csv --page source"
      rm -f "$OUT/small_ncu.ncu-rep"  # read out above; no ncu here to open it
      gzip -f "$OUT/small_ncu_source.log" ;;
    stalls)  # the raw page carries the per-reason stall counters behind WarpStateStats' summary
      step ncu_stalls 240 ncu --clock-control none --target-processes all --launch-skip 40 --launch-count 12 \
        --kernel-name 'regex:_linear_fp8_kernel|_moe_gate_up_kernel|_moe_down_kernel' \
        --section WarpStateStats --section SchedulerStats --section Occupancy --csv --page raw \
        python3 -m megastep.cli bench --preset v4-flash --layers 4 --batch 1 --context 4096 --iters 2
      gzip -f "$OUT/ncu_stalls.log" ;;
    floor)
      step launch_floor 150 python3 benchmarks/kernels/launch_floor.py --out "$OUT"
      step gemv_variants 200 python3 benchmarks/kernels/gemv_variants.py --out "$OUT" --ms 1,4,64
      step moe_cuda_variants 200 python3 benchmarks/kernels/moe_cuda_variants.py --out "$OUT" ;;
    stream)  # the ceilings of the weight-streaming kernels' access patterns (docs/PERFORMANCE.md, ninth measurement)
      step stream_floor 240 python3 benchmarks/kernels/stream_floor.py --json "$OUT/stream_floor.json"
      step stream_floor_experts 90 python3 benchmarks/kernels/stream_floor.py --experts --json "$OUT/stream_floor_experts.json"
      step l2_prefetch 150 python3 benchmarks/kernels/l2_prefetch.py --json "$OUT/l2_prefetch.json"
      step moe_probe 90 python3 benchmarks/kernels/moe_probe.py --probe none --json "$OUT/moe_probe_none.json"
      step moe_probe_no_decode 90 python3 benchmarks/kernels/moe_probe.py --probe no_decode --json "$OUT/moe_probe_no_decode.json" ;;
    shared)  # built offline on 2026-11-30 (docs/PERFORMANCE.md, eleventh measurement): bits first, then time
      step shared_tests 240 python3 -m pytest -q --timeout 200 -m gpu tests/test_fast_gpu.py tests/kernels/test_moe.py \
        -k "shared or timeline or lut_expert_parallel"
      early=(--router triton --shared-after-router off --shared-w2 residual)  # the order of that day
      bench shared_in_combine 120 --layers 30 --batch 1,4,16,64 "${early[@]}" --shared-w2 combine
      bench shared_after 100 --layers 30 --batch 1,4,16,64 "${early[@]}"
      bench shared_in_combine_b 100 --layers 30 --batch 1,4,16,64 "${early[@]}" --shared-w2 combine ;;
    timeline)
      bench timeline 120 --layers 30 --batch 1,4 --timeline ;;
    fork)  # where the shared expert's side stream forks (FastDecoder.shared_after_router): the same bits, time
      bench fork_before 120 --layers 30 --batch 1,4,16,64 --router triton --shared-after-router off --shared-w2 residual
      bench fork_after 100 --layers 30 --batch 1,4,16,64 --router triton --shared-after-router on --shared-w2 residual --timeline
      bench fork_after_combine 100 --layers 30 --batch 1,4,16,64 --router triton --shared-after-router on --shared-w2 combine
      bench fork_before_b 100 --layers 30 --batch 1,4,16,64 --router triton --shared-after-router off --shared-w2 residual ;;
    route)  # built on 2026-11-30 (docs/PERFORMANCE.md, twelfth measurement): bits first, then time
      step route_tests 200 python3 -m pytest -q --timeout 150 -m gpu tests/kernels/test_route_cuda.py tests/test_fast_gpu.py \
        -k "route_cuda or cuda_routing or pdl or alone"
      bench route_cuda 120 --layers 30 --batch 1,4,16,64 --router cuda --shared-after-router off --shared-w2 residual
      bench route_triton 60 --layers 30 --batch 1,4,16,64 --router triton --shared-after-router off --shared-w2 residual
      bench route_cuda_b 60 --layers 30 --batch 1,4,16,64 --router cuda --shared-after-router off --shared-w2 residual
      step router_variants 60 python3 benchmarks/kernels/router_variants.py --json "$OUT/router_variants.json"
      bench route_cuda_after 50 --layers 30 --batch 1,4 --router cuda --shared-after-router on --shared-w2 residual
      bench route_cuda_combine 50 --layers 30 --batch 1,4 --router cuda --shared-after-router off --shared-w2 combine ;;
    plan)  # FastDecoder's MOE_PLAN (the default) against the order before it, A/B/A
      bench plan 120 --layers 30 --batch 1,4,16,64 --trace
      bench plan_before 60 --layers 30 --batch 1,4,16,64 --router triton --shared-after-router off --shared-w2 residual
      bench plan_b 60 --layers 30 --batch 1,4,16,64
      bench plan_triton 60 --layers 30 --batch 1,4,16,64 --router triton
      step route_probe 120 python3 benchmarks/kernels/route_probe.py --out /tmp/route_probe --json "$OUT/route_probe.json" ;;
    cold)  # first with -x: the first failure's traceback in full
      step cold_tests 150 python3 -m pytest -x -q --tb=long --timeout 120 -m gpu tests/test_fast_gpu.py -k "cold_expert_recipes" ;;
    spread)  # built on 2026-11-30 (docs/PERFORMANCE.md, fifteenth measurement): bits first, then time, A/B/A/B
      step spread_tests 200 python3 -m pytest -q --timeout 150 -m gpu tests/kernels/test_moe.py -k "lut"
      step spread_probe 100 python3 benchmarks/kernels/lut_balance_probe.py --out "$OUT"
      step spread_variants 120 python3 benchmarks/kernels/moe_cuda_variants.py --out "$OUT" --ms 1,2,4 \
        --engines lut,lut_items,lut_spread
      for arm in a b; do
        bench "spread_step_$arm" 100 --layers 30 --batch 1,2
        bench_with "items_step_$arm" 60 'import megastep.kernels.moe_lut as m; m.SPREAD_ROWS = ()' --layers 30 --batch 1,2
      done ;;
    lut_ncu)  # where the experts' loop waits: their GPU tests, then per SASS instruction the sampled stall reasons
      # of gate-up and down at 1 and 16 rows (one report each, read out as the details and source pages)
      step lut_tests 100 python3 -m pytest -q -rfE --timeout 90 -m gpu tests/kernels/test_moe.py -k lut
      for m in 1 16; do
        step "lut_ncu_m$m" 150 ncu --clock-control none --launch-skip 4 --launch-count 2 \
          --kernel-name 'regex:^moe_(gate_up|down)_lut$' --section SpeedOfLight --section Occupancy \
          --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SourceCounters \
          --import-source yes --export "$OUT/lut_ncu_m$m" \
          python3 benchmarks/kernels/moe_cuda_variants.py --out "$OUT/ncu_m$m" --ms "$m" --engines lut
        step "lut_ncu_m${m}_details" 40 ncu --import "$OUT/lut_ncu_m$m.ncu-rep" --csv --page details
        step "lut_ncu_m${m}_source" 60 bash -c "ncu --import '$OUT/lut_ncu_m$m.ncu-rep' --csv --page source \
          --print-source sass || ncu --import '$OUT/lut_ncu_m$m.ncu-rep' --csv --page source"
        step "lut_ncu_m${m}_read" 30 python3 benchmarks/kernels/ncu_source.py "$OUT/lut_ncu_m${m}_source.log" \
          --details "$OUT/lut_ncu_m${m}_details.log" --top 30
        rm -f "$OUT/lut_ncu_m$m.ncu-rep"
        gzip -f "$OUT/lut_ncu_m${m}_source.log"
      done ;;
    final)  # the defaults at the end of a session: the bit tests of the fast step, the lut and CUDA routing GPU tests,
      # then the step at 1-64 rows
      final_tests
      final_step ;;
    down4rows)  # where down's passes of 4 pairs pay (on one H100, 16 layers, 2026-12-07: -1.2 / -3.1 / -5.7 % at
      # 16 / 32 / 64 rows, -7.1 % at 64 skewed; never measured below 16): its GPU tests, then the step with it on every
      # launch against off at 1-8 and 16-64 rows, 3 rounds, and 64 rows skewed
      on4="on=import megastep.kernels.moe_lut as m; m.DOWN4_MIN_ROWS = 1"
      off4="off=import megastep.kernels.moe_lut as m; m.DOWN4_MIN_ROWS = None"
      step down4_tests 100 python3 -m pytest -q -rfE --timeout 120 -m gpu tests/kernels/test_moe.py -k "down_in_passes"
      ab down4_few 150 --layers 30 --batch 1,2,4,8 --rounds 3 --arm "$off4" --arm "$on4"
      ab down4_many 150 --layers 30 --batch 16,32,64 --rounds 3 --arm "$off4" --arm "$on4"
      ab down4_skewed 100 --layers 30 --batch 64 --rounds 3 --routing skewed --arm "$off4" --arm "$on4" ;;
    gm)  # the group-major gate-up (moe_lut.GATE_UP_GM, the default since 2026-12-07: an MMA's 8 columns are 8 pairs,
      # so a pass takes 8 of an expert's pairs where the pair-major kernels take 2): its GPU tests, the step against
      # the pair-major kernels at 1-8 rows (also with items at 2-8 rows and the even deal at 1, GM_SPREAD_ROWS) and
      # 16-64 rows, 3 rounds, the step's bit tests (a row alone against the same row in 16, the same input twice,
      # graph replay against eager), 64 rows skewed
      gm_tests 120
      ab gm_few 170 --layers 30 --batch 1,2,4,8 --rounds 3 --arm "pairs=$PAIRS" --arm "gm=" \
        --arm "gm_swap=import megastep.kernels.moe_lut as m; m.GM_SPREAD_ROWS = (1,)"
      ab gm_many 130 --layers 30 --batch 16,32,64 --rounds 3 --arm "pairs=$PAIRS" --arm "gm="
      step gm_step_tests 150 python3 -m pytest -q -rfE --timeout 120 -m gpu tests/test_fast_gpu.py \
        -k "alone or same_input or graph_replay"
      ab gm_skewed 90 --layers 30 --batch 64 --rounds 3 --routing skewed --arm "pairs=$PAIRS" --arm "gm=" ;;
    gm_short)  # gm's GPU tests and its step A/B at 1, 16 and 64 rows in 2 rounds, for a call with ~5 min left
      gm_tests 100
      ab gm_short 170 --layers 30 --batch 1,16,64 --rounds 2 --arm "pairs=$PAIRS" --arm "gm=" ;;
    gmdown)  # the group-major down (moe_lut.DOWN_GM, the default since 2026-12-07 10:16: passes of 8 pairs, its
      # weights through cp.async slots) against the pair-major down (down4 from 8 rows): its GPU tests, the experts
      # calls alone, the step at 1-64 rows, 3 rounds, the step's bit tests, 64 rows skewed. (Measured at 918749c,
      # where it was off, as arms now= against DOWN_GM = True: the same two states.)
      PMD='import megastep.kernels.moe_lut as m; m.DOWN_GM = False'
      step gmdown_tests 120 python3 -m pytest -q -rfE --timeout 100 -m gpu tests/kernels/test_moe.py \
        -k "group_major_down"
      step gmdown_kernels 120 python3 benchmarks/kernels/moe_cuda_variants.py --out "$OUT/gmdown_kernels" \
        --ms 1,16,64 --engines lut_gm,lut
      ab gmdown 200 --layers 30 --batch 1,2,4,8,16,32,64 --rounds 3 --arm "pairdown=$PMD" --arm "now="
      step gmdown_step_tests 150 python3 -m pytest -q -rfE --timeout 120 -m gpu tests/test_fast_gpu.py \
        -k "alone or same_input or graph_replay"
      ab gmdown_skewed 90 --layers 30 --batch 64 --rounds 3 --routing skewed --arm "pairdown=$PMD" --arm "now=" ;;
    down_ncu)  # what bounds down at 16 and 64 rows (2026-12-07, one H100: ~2.1 TB/s alone, against gate-up's 2.7-2.8):
      # per SASS instruction its stall reasons and shared-memory wavefronts (ncu, the call's second down launch, down4
      # from 8 rows), as gm_ncu did for gate-up
      for m in 16 64; do ncu_experts "down_m$m" '^moe_down_' lut "$m"; done ;;
    ncu1)  # what bounds the group-major kernels at 1 row (2026-12-07, one H100, alone: gate-up 1.99 TB/s, down 1.46,
      # against 3.1 streamed; one item per CTA on 96 SMs): per SASS instruction the stall reasons and shared-memory
      # wavefronts of the gate-up (items) and down launches at 1 row, and the gate-up's at 2 rows (the even deal)
      ncu_experts gmup_m1 '^moe_gate_up_' lut 1
      ncu_experts gmdown_m1 '^moe_down_' lut 1
      ncu_experts gmup_m2 '^moe_gate_up_' lut 2 ;;
    gmsms)  # the group-major gate-up's even deal at 1 row (132 CTAs: faster alone than items, +0.59 % in the step) and
      # at 2 rows capped at 104-120 CTAs, SMs left to the shared expert (an arm's patch of moe_lut._grid: at 1-2 rows the
      # launches of per_sm 1 and >= 1536 tasks are the even deal's); items at 1 row are the default; 3 rounds
      cap='import megastep.kernels.moe_lut as m; m.GM_SPREAD_ROWS = (1, 2, 3, 4, 5, 6, 7, 8); g = m._grid; m._grid = lambda n, d, per=2: (min(n, CAP), 1, 1) if per == 1 and n >= 1536 else g(n, d, per)'
      arms=(--arm now= --arm "sp132=${cap/CAP/132}")
      for c in 104 112 120; do arms+=(--arm "sp$c=${cap/CAP/$c}"); done
      ab gmsms 200 --layers 30 --batch 1,2 --rounds 3 "${arms[@]}" ;;
    gmdefault)  # the session's defaults of 2026-12-07 (the group-major gate-up, down4 from 8 rows) against its start,
      # 1-64 rows, 3 rounds; final's bit tests; the table at the top of docs/PERFORMANCE.md
      gm_default_ab
      final_tests
      final_step ;;
    gmfew)  # gate-up's task halves on warp pairs of 24-warp CTAs at 1 row (moe_lut.GM_FEW_ROWS, built 2026-12-07 from
      # 15:13: at 1 row a launch has about one 16-step task a warp): the group-major GPU tests (every schedule's bits),
      # the experts calls alone at 1 and 2 rows, the step's bit tests (a row alone against a batch of 16 takes both
      # kinds of kernel), the step at 1, 2 and 4 rows without them / the default (1 row) / at 1-2 rows, 3 rounds; ncu
      # at 1 row (down at 1 row in the same form, 32 warps, lost: +0.5-0.8 %, removed, the code at 93a587b)
      M='import megastep.kernels.moe_lut as m'
      gm_tests 150
      step gmfew_kernels 100 python3 benchmarks/kernels/moe_cuda_variants.py --out "$OUT/gmfew_kernels" --ms 1,2 \
        --engines lut_nofew,lut,lut_few2
      step gmfew_step_tests 150 python3 -m pytest -q -rfE --timeout 120 -m gpu tests/test_fast_gpu.py \
        -k "alone or same_input or graph_replay"
      ab gmfew 220 --layers 30 --batch 1,2,4 --rounds 3 --arm "nofew=$M; m.GM_FEW_ROWS = ()" --arm "now=" \
        --arm "few2=$M; m.GM_FEW_ROWS = (1, 2)"
      ncu_experts gmfew_up1 '^moe_gate_up_' lut 1 ;;
    downearly)  # moe_lut.DOWN_GM_EARLY (built 2026-12-07 from 16:40; the default since 18:10, from two H100 calls of
      # this group): the group-major down's GPU tests (its bits against moe_down_gm's), the experts calls alone at 1,
      # 2, 16 and 64 rows (under PDL only in the step: alone the two kernels should match), the step A/B at 1-64 rows,
      # 3 rounds, late (off) against early (the default)
      step downearly_tests 120 python3 -m pytest -q -rfE --timeout 100 -m gpu tests/kernels/test_moe.py \
        -k "group_major_down"
      step downearly_kernels 100 python3 benchmarks/kernels/moe_cuda_variants.py --out "$OUT/downearly_kernels" \
        --ms 1,2,16,64 --engines lut,lut_downlate
      ab downearly 220 --layers 30 --batch 1,2,4,8,16,32,64 --rounds 3 \
        --arm "late=import megastep.kernels.moe_lut as m; m.DOWN_GM_EARLY = False" --arm "early=" ;;
    gemv_wg)  # the CUDA GEMV's wgmma form (gemv_fp8_cuda.py's GemvConfig.wg, built 2026-12-07 without a device):
      # one kernel family for every row count, if it keeps the 1-row gain of the mma form and matches Triton at
      # 4-64 rows; its GPU test first (the ref, run to run, rows alone), then gemv_variants.py (the ref, bits, time).
      # First run (21:12, one H100): correct, the mma form's bits, no faster; again for the prologue's loads 4 at a time
      # and the staged form (x's slice by cp.async in one round trip, "cuda_wgc", 2026-12-08), the wgmma forms gated,
      # and the K splits combined through DSMEM in a cluster ("_cl": how much of a launch's fixed cost is the combine)
      step gemv_wg_tests 200 python3 -m pytest -q -rfE --timeout 150 -m gpu tests/test_cuda_experiments.py \
        -k "wgmma or cluster"
      step gemv_wg 300 python3 benchmarks/kernels/gemv_variants.py --out "$OUT/gemv_wg" --ms 1,4,16,64 ;;
    gm_ab)  # gmdefault's A/B alone (with `table` after it: the H200's 30-layer step without the bit tests, which ran on
      # an H100)
      gm_default_ab ;;
    gm_ncu)  # the group-major gate-up against the pair-major ring (2026-12-07: ncu found the group-major kernel's first
      # layout 1.6x slower at 16 rows, its copies 8x the ideal shared-memory wavefronts): the experts calls alone at
      # 1, 2, 16 and 64 rows, each kernel's time; then per SASS instruction the stall reasons and shared-memory
      # wavefronts of the group-major gate-up at 1 and 16 rows and the pair-major ring's at 16 (ncu: the engine's
      # second gate-up launch, at the call's rows)
      step gm_kernels 150 python3 benchmarks/kernels/moe_cuda_variants.py --out "$OUT/gm_kernels" --ms 1,2,16,64 \
        --engines lut_pairs,lut
      for run in gm_m1:lut:1 gm_m16:lut:16 ring_m16:lut_pairs:16; do
        IFS=: read -r name engine m <<<"$run"
        ncu_experts "$name" '^moe_gate_up_' "$engine" "$m"
      done ;;
    steptests)  # final's bit tests of the step alone (a row alone against the same row in a batch of 16, the same
      # input twice, graph replay against eager), without the kernels' (~1.5 min)
      step step_tests 200 python3 -m pytest -q -rfE --timeout 120 -m gpu tests/test_fast_gpu.py \
        -k "alone or same_input or graph_replay" ;;
    passes)  # why 64 rows read their experts slower than 16 (2026-12-07): the lut kernels stream an expert's rows
      # once per 2 of its pairs, so the reads line's passes per expert read against the step, under the synthetic
      # gates' routing and the skewed one (which puts more pairs on fewer experts)
      bench passes_default 150 --layers 30 --batch 1,16,32,64 --trace
      bench passes_skewed 150 --layers 30 --batch 1,16,32,64 --routing skewed --trace ;;
    table)  # final's step alone (its bit tests already run on the same defaults): the table at the top of PERFORMANCE.md
      final_step ;;
    csa64)  # CSA attention on the 2026-12-04 sweep's winner, h16 n64 c64 w8 (alone 22.4 / 214.2 us at 1 / 64 rows against
      # the pin's 30.7 / 230.3; other sums, so for every batch), with the value split over 4 programs at 1 row (never
      # timed): that plan bit for bit against it and timed at 1-4 rows, the attention and step bit tests under it, then
      # the step against the pin, 3 rounds in one process. The candidate is a module setting (attention._PINNED).
      C='import megastep.kernels.attention as a; C = a.AttnConfig'
      n64="$C; a._PINNED[(64, 640, 512)] = C(16, 64, 64, 2, 8, 2, 4, 128)"
      n64="$n64; a._PINNED_FEW_ROWS[(64, 640, 512)] = (1, C(16, 64, 64, 2, 8, 2, 4, 128, 4))"
      step csa64_few 100 python3 -c "$n64; import runpy, sys; sys.argv = ['attn_few_rows.py', '--rows', '1,2,4', \
        '--json', '$OUT/csa64_few.json']; runpy.run_path('benchmarks/kernels/attn_few_rows.py', run_name='__main__')"
      step csa64_tests 200 python3 -c "$n64; import pytest, sys; sys.exit(pytest.main(['-q', '-rfE', '--timeout', '150', \
        '-m', 'gpu', 'tests/kernels/test_attention.py', 'tests/test_fast_gpu.py', '-k', \
        'pools or few or v4_shapes or same_input or alone or graph_replay']))"
      ab csa64 240 --layers 30 --batch 1,2,4,16,64 --rounds 3 --timeline-batch 1 --arm pin= --arm "n64=$n64" ;;
    pins)  # the winners of 2026-12-05's `one` and `arms2` (1 row: the gate's split 8 -1.2 %, the 8-slab plans -0.3 %;
      # 4-64 rows: the indexer first -0.3 to -0.65 %; the groups, decided, are at c1d9043): the step's and their
      # kernels' bit tests under all three, then the step at 1-64 rows (8 and 32 never measured with them) with each
      # alone and together, 3 rounds in one process. Pinned by the branch pin_defaults once these pass.
      all3="$IDX_FIRST; $ATTN_V8; $GATE8"
      step pins_tests 230 python3 -c "$all3; import pytest, sys; sys.exit(pytest.main(['-q', '-rfE', '--timeout', '100', \
        '-m', 'gpu', 'tests/test_fast_gpu.py', 'tests/kernels/test_dense.py', 'tests/kernels/test_router.py', \
        'tests/kernels/test_attention.py', '-k', 'same_input or alone or graph_replay or indexer or few \
        or value_split or dense or router']))"
      ab pins 260 --layers 30 --batch 1,2,4,8,16,32,64 --rounds 3 --arm off= --arm "gate8=$GATE8" \
        --arm "idx_v8=$IDX_FIRST; $ATTN_V8" --arm "all3=$all3" ;;
    slack)  # which stages the 1- and 4-row step waits for (runtime/trace.DELAY_NS, 2026-12-05, built without a device):
      # each stage name in turn delayed by 5 and by 10 us at its first entry in each layer; the step's growth from the
      # 5 us arm to the 10 us arm, over 5 us x the layers with that stage, is the share of a delay there that the step
      # could not hide (1: the stage starts on the critical path; 0: it has that much slack), 3 rounds in one process;
      # benchmarks/slack_table.py prints the shares
      arms=(--arm off=)
      for st in mhc_pre attn_proj compressor indexer attention out_proj router routed_experts shared_expert; do
        for us in 5 10; do
          arms+=(--arm "${st}_$us=import megastep.runtime.trace as t; t.set_delays('cuda', $st=${us}000)")
        done
      done
      ab slack 500 --layers 30 --batch 1,4 --rounds 3 "${arms[@]}"
      step slack_table 20 python3 benchmarks/slack_table.py "$OUT/slack.json"
      summary+=("$(grep -E '^\|' "$OUT/slack_table.log" 2>/dev/null)") ;;
    wobparts)  # the sublayers' last sums left to the next mixes launch (built 2026-12-08 without a device): wo_b's
      # split-K partials (fast.WO_B_PARTS_ROWS) and the routed experts' per-slot outputs with the shared expert's
      # (fast.MOE_PAIRS_ROWS, steps whose plan adds the shared output in the mHC: up to 16 rows). Their GPU tests (the
      # mHC's sums, the step at 1 and 16 rows against the launches' own combines), then the step at 1-16 rows: off,
      # each alone, both; 3 rounds in one process, the 1-row timeline of every arm
      step wobparts_tests 300 python3 -m pytest -q -rfE --timeout 200 tests/kernels/test_mhc.py \
        tests/kernels/test_fast_step_triton.py tests/test_fast_gpu.py -k 'split_partials or wo_b_partials or pairs'
      ab wobparts 280 --layers 30 --batch 1,2,4,8,16 --rounds 3 --timeline-batch 1 --arm "off=" \
        --arm "wob=import megastep.model.fast as f; f.WO_B_PARTS_ROWS = 16" \
        --arm "pairs=import megastep.model.fast as f; f.MOE_PAIRS_ROWS = 16" \
        --arm "both=import megastep.model.fast as f; f.WO_B_PARTS_ROWS = 16; f.MOE_PAIRS_ROWS = 16" ;;
    qtail)  # the q norm made by the x group's launch (fast.QNORM_TAIL_ROWS, pinned at 1 row from one H100's A/B, 2026-12-05):
      # the step at 1-4 and 16 rows against 0 (the norm's own launch), 3 rounds in one process, then its GPU tests (the
      # normed rows against rms_norm's launch at every row tile; the step at 1 and 16 rows)
      ab qtail 120 --layers 30 --batch 1,2,4,16 --rounds 3 --arm "off=import megastep.model.fast as f; f.QNORM_TAIL_ROWS = 0" \
        --arm tail=
      step qtail_tests 300 python3 -m pytest -q -rfE --timeout 200 tests/kernels/test_rope_norm.py \
        tests/kernels/test_linear_fp8.py tests/kernels/test_fast_step_triton.py tests/test_fast_gpu.py \
        -k 'rms_norm or norm_tail or x_group or q_norm' ;;
    chain)  # what a persistent launch buys a sublayer's chain of weight streams at 1 row (2026-12-05, built without a
      # device): an HCA sublayer's x group -> wq_b -> wo_a -> wo_b (107 MB), the last three, and wo_a -> wo_b, each in one
      # launch of chain_probe.cu against one launch per layer (plain, PDL) and the step's Triton linears, with the
      # stages between them off and on (as waits); each run checks its entries first (the ref, linear_fp8's bits, the
      # same bits every way: an entry that fails is not timed); the GPU test (the same checks on a small chain) last
      for c in hca4 hca wo; do
        step "chain_$c" 150 python3 benchmarks/kernels/chain_probe.py --out "$OUT/chain_$c" --chain "$c"
        summary+=("$(grep -E '^\||FAILED' "$OUT/chain_$c.log" 2>/dev/null)")
      done
      step chain_tests 150 python3 -m pytest -q -rfE --timeout 140 -m gpu tests/test_cuda_experiments.py -k chain ;;
    tchain)  # the same chains with the step's own Triton loop (triton_chain.py, linear_chain.py, 2026-12-06): one
      # persistent launch of 1, 2 and 4 programs per SM against the same kernel a launch a layer and linear_fp8 a launch a
      # layer, the stages off and on; each checks linear_fp8's bits first. Is the ~6 us per launch boundary what a
      # persistent launch takes back, once the loop is Triton's? Answered on one H100 (docs/PERFORMANCE.md, 2026-12-06
      # from 15:58): no. (The group wochain, the chain as the step's wo_a -> wo_b, is read at e55fad6.) Its tests last
      for c in wo hca hca4; do
        step "tchain_$c" 150 python3 benchmarks/kernels/chain_probe.py --out "$OUT/tchain_$c" --chain "$c" --kinds none \
          --tchain 1,2,4
        summary+=("$(grep -E '^\||FAILED' "$OUT/tchain_$c.log" 2>/dev/null)")
      done
      step tchain_tests 120 python3 -m pytest -q -rfE --timeout 100 tests/kernels/test_linear_chain.py ;;
    probe)  # where a 1- and 4-row experts call's launches spend their time: the probe build's stamps (moe_lut_probe.py)
      step lut_probe 60 python3 benchmarks/kernels/moe_lut_probe.py --out "$OUT" --ms 1,4
      step lut_probe_pdl 60 python3 benchmarks/kernels/moe_lut_probe.py --out "$OUT/pdl" --ms 1,4 --pdl
      step lut_probe_noload 60 python3 benchmarks/kernels/moe_lut_probe.py --out "$OUT/noload" --ms 1,4 --no-load ;;
    ringmix)  # the ring gate-up's mixed decode (moe_lut.RING_MIX, 2026-12-01, kept; the groups mix and pipes that led to
      # it are at f48fdb0): its GPU tests, the experts calls alone, then the step A/B at the rows the ring takes (1, 8-64),
      # and at 4 rows with the ring taken there too (RING_MIN_ROWS = 4)
      step ringmix_tests 150 python3 -m pytest -q -rfE --timeout 120 -m gpu tests/kernels/test_moe.py \
        -k "ring_mix or lut_ring or lut_kernels"
      if grep -qiE "failed|error|timeout" "$OUT/ringmix_tests.log"; then
        summary+=("ringmix arms skipped: the tests did not pass")
      else
        step ringmix_kernels 90 python3 benchmarks/kernels/moe_cuda_variants.py --out "$OUT" --ms 1,16,64 \
          --engines lut_table,lut_mix
        m='import megastep.kernels.moe_lut as m'
        for arm in a b; do
          bench_with "ringmix_off_$arm" 120 "$m; m.RING_MIX = False" --layers 30 --batch 1,4,8,16,32,64
          bench_with "ringmix_on_$arm" 90 "$m; m.RING_MIX = True" --layers 30 --batch 1,4,8,16,32,64
          bench_with "ringmix_on4_$arm" 60 "$m; m.RING_MIX = True; m.RING_MIN_ROWS = 4" --layers 30 --batch 4
        done
      fi ;;
    sms)  # is the experts' loop bound per SM? The experts calls alone at 1 and 16 rows with their grids sized for
      # 132 (all), 100 and 66 SMs (moe_lut._sms patched in the process)
      for n in 132 100 66; do
        step "sms_$n" 100 python3 -c "import runpy, sys; sys.argv = ['moe_cuda_variants.py', '--out', '$OUT/sms_$n', \
'--ms', '1,16', '--engines', 'lut']; import megastep.kernels.moe_lut as m; m._sms = lambda i: $n; \
runpy.run_path('benchmarks/kernels/moe_cuda_variants.py', run_name='__main__')"
      done ;;
    linsplit)
      step linear_variants 280 python3 benchmarks/kernels/linear_variants.py --out "$OUT" --ms 1,4,64 ;;
    ep_tests)
      all_gpus
      step ep_gpu_tests 500 python3 -m pytest -q -rfE --timeout 300 tests/test_distributed_gpu.py tests/kernels/test_pair_combine.py ;;
    tp)  # the attention's heads split over the ranks (FastDecoder(attn_split), 2026-12-01): the EP GPU tests (with the
      # split and the one-GPU side streams on the ranks among them), then all 43 layers with the split off / on, A/B/A/B
      all_gpus
      step tp_tests 290 python3 -m pytest -q -rfE --timeout 280 tests/test_distributed_gpu.py \
        tests/kernels/test_split_combine.py tests/kernels/test_pair_combine.py
      if grep -qiE "failed|error|timeout" "$OUT/tp_tests.log"; then
        summary+=("the split's arms skipped: the tests did not pass")
      else
        for arm in a b; do
          bench "tp_off_$arm" 90 --gpus "$gpus" --batch 1,6,16,64 --attn-split off
          bench "tp_on_$arm" 90 --gpus "$gpus" --batch 1,6,16,64 --attn-split on
        done
        # the one-GPU side streams on the ranks too (BESIDE_ON_RANKS), with the split
        bench_with "tp_beside" 90 'import megastep.model.fast as f; f.BESIDE_ON_RANKS = True' --gpus "$gpus" \
          --batch 1,6,16,64 --attn-split on
      fi ;;
    tp_more)  # after `tp`: the split GPU tests with the head's vocabulary split too; the heads split alone, with the
      # vocabulary split, and with the split sum in 256-column programs, A/B; the 6-token block; the trace at 1 row
      all_gpus
      step tp_more_tests 150 python3 -m pytest -q -rfE --timeout 140 tests/test_distributed_gpu.py -k split \
        tests/kernels/test_split_combine.py
      if grep -qiE "failed|error|timeout" "$OUT/tp_more_tests.log"; then
        summary+=("the split's arms skipped: the tests did not pass")
      else
        b='import megastep.kernels.split_combine as b; b.BLOCK_COLS = 256'
        for arm in a b; do
          bench "tp_heads_$arm" 80 --gpus "$gpus" --batch 1,6,16,64 --attn-split on --vocab-split off
          bench "tp_vocab_$arm" 80 --gpus "$gpus" --batch 1,6,16,64 --attn-split on --vocab-split on
          bench_with "tp_cols256_$arm" 80 "$b" --gpus "$gpus" --batch 1,6,16,64 --attn-split on --vocab-split on
        done
        bench "tp_block6" 60 --gpus "$gpus" --batch 6 --block 6 --attn-split on --vocab-split on
        bench "tp_trace" 100 --gpus "$gpus" --batch 1 --attn-split on --vocab-split on --trace
      fi ;;
    splits1)  # one GPU: the split sums' and gathers' GPU tests (tensor parallelism, built 2026-12-01; the 2-GPU
      # tests are in tp / tp_more) and the dense kernel's; then why the gate's pin cost 8-16 rows in the step
      # (twenty-fifth measurement): the device timeline at 8 and 16 rows with the gate on the rule and pinned
      step splits1_tests 150 python3 -m pytest -q -rfE --timeout 140 -m gpu tests/kernels/test_split_combine.py \
        tests/kernels/test_dense.py
      g='import megastep.kernels.dense as d; d._PINNED[(256, 4096)] = d.DenseConfig(32, 256, 16, 4, 3)'
      bench gate_rule 120 --layers 30 --batch 8,16 --timeline
      bench_with gate_pin 120 "$g" --layers 30 --batch 8,16 --timeline ;;
    gatefork)  # splits1's timeline: pinned, the gate is faster (4.3 against 7.0 us) but the shared expert's w1/w3 then
      # starts as it ends and runs beside the routing launch, which doubles (7.6 -> 16.9 us at 8 rows). The shared
      # expert forked after the router instead, with the gate on the rule and pinned, A/B
      g='import megastep.kernels.dense as d; d._PINNED[(256, 4096)] = d.DenseConfig(32, 256, 16, 4, 3)'
      for arm in a b; do
        bench "gf_rule_$arm" 60 --layers 30 --batch 8,16,64
        bench "gf_rule_late_$arm" 60 --layers 30 --batch 8,16,64 --shared-after-router on
        bench_with "gf_pin_$arm" 60 "$g" --layers 30 --batch 8,16,64
        bench_with "gf_pin_late_$arm" 60 "$g" --layers 30 --batch 8,16,64 --shared-after-router on
      done ;;
    ep)
      all_gpus
      if [ -d .whl ]; then  # the server test's packages (benchmarks/device_wheels.sh)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
          && export PYTHONPATH=/tmp/site:$PYTHONPATH
      fi
      step ep_gpu_tests 240 python3 -m pytest -q --timeout 200 tests/test_distributed_gpu.py \
        tests/kernels/test_pair_combine.py tests/server/test_server_gpus.py
      step ep_combine 90 python3 benchmarks/kernels/ep_combine.py --json "$OUT/ep_combine.json"
      bench "ep${n}_43L" 200 --gpus "$gpus" --batch 1,6,64 --trace
      bench "ep${n}_43L_allreduce" 150 --gpus "$gpus" --batch 1,6,64 --ep-combine allreduce
      bench "ep${n}_43L_block6" 150 --gpus "$gpus" --batch 6 --block 6 ;;
    *)
      echo "unknown group $group (the groups are listed at the top of benchmarks/h200_checks.sh)"
      exit 2 ;;
  esac
done
[ -n "$PRECOMPILE" ] && exit 0
key() { python3 -c "import sys; sys.path.insert(0, 'benchmarks/kernels'); import precompile; print(precompile.key())"; }
built=$(cat "$cache_root/triton_key.txt" 2>/dev/null || echo none)
summary+=("compile caches: $carried Triton kernels carried (Triton key: $built built, $(key) here), \
$(find "$TRITON_CACHE_DIR" -name '__grp__*' -newer "$cache_root/unpacked" | wc -l) compiled in this call; \
$(python3 benchmarks/kernels/precompile.py --pack "$FINAL/device_cache.tgz" 2>&1 | tail -1)")
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
tar czf "$FINAL/h200_checks-$(date +%Y%m%d-%H%M%S).tgz" -C "$OUT" . && rm -rf "$OUT"
