#!/usr/bin/env bash
# tests/gpu/run_on_gpu.sh — runs the CUDA kernel tests (and optionally the MLA decode
# benchmark and compute-sanitizer) on a machine with a GPU, from a folder of prebuilt
# binaries: a build tree's tests/ + bench/ copied flat, e.g.
#
#   tools/stage-gpu-bin.sh build-gpu .gpu-bin     # builds, strips and copies them (and lockstep)
#   OUT=/tmp/gpu-out tests/gpu/run_on_gpu.sh .gpu-bin --bench --sanitize --cli
#
# The binaries need no build tree (ctest's files hold absolute paths; these do not).
# Logs go to $OUT (default ./gpu-out): gpu.log (tests), bench.log, sanitizer.log, and with --cli
# one log per CLI test and bench_nccl.log.
# Optional steps are skipped once $BUDGET seconds (default 200) have gone.
set -u
BIN=${1:?usage: run_on_gpu.sh <folder of binaries> [--bench] [--sanitize]}
shift
OUT=${OUT:-gpu-out}
BUDGET=${BUDGET:-200}
mkdir -p "$OUT"
bench=0
sanitize=0
cli=0
for a in "$@"; do
  case $a in
    --bench) bench=1 ;;
    --sanitize) sanitize=1 ;;
    --cli) cli=1 ;;
  esac
done
log=$OUT/gpu.log
: >"$log"

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv 2>&1 | tee -a "$log"
# cuBLASLt: the binaries' RUNPATH names the build machine's CUDA; find the library if missing.
if ldd "$BIN/gpu_gemm_test" 2>/dev/null | grep -q "not found"; then
  lib=$(find /usr/local /usr/lib /opt -name 'libcublasLt.so.13*' 2>/dev/null | head -1)
  if [ -n "$lib" ]; then export LD_LIBRARY_PATH=$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi
  echo "cuBLASLt from: ${lib:-NOT FOUND}" | tee -a "$log"
fi

status=0
summary=""
tmp=$(mktemp)
for t in "$BIN"/gpu_*_test; do
  name=$(basename "$t")
  t0=$SECONDS
  timeout 120 "$t" --gtest_color=no >"$tmp" 2>&1
  rc=$?
  cat "$tmp" >>"$log"
  counts=$(grep -E "^\[  (PASSED|FAILED|SKIPPED) *\] [0-9]+ test" "$tmp" | sed 's/, listed below://' | tr -s ' ' | paste -sd ' ')
  failed=$(grep -E "^\[  FAILED  \] Cuda" "$tmp" | sed 's/^\[  FAILED  \] //' | sort -u | paste -sd ' ')
  line="== $name: exit $rc, $((SECONDS - t0)) s: $counts${failed:+ | failed: $failed}"
  echo "$line" | tee -a "$log"
  summary+="$line"$'\n'
  [ $rc -ne 0 ] && status=1
done
rm -f "$tmp"
printf "== summary\n%s" "$summary" | tee -a "$log"

# --cli: the GPU CTests that drive the `lockstep` binary (record/replay, the hidden faults, the
# emulated-TP fault, rank shards) and bench_nccl's bit check, from the repository root.
if [ $cli = 1 ] && [ -x "$BIN/lockstep" ]; then
  src=$(cd "$(dirname "$0")/../.." && pwd)
  export HDF5_PLUGIN_PATH=${HDF5_PLUGIN_PATH:-$BIN/plugins} NCCL_NVLS_ENABLE=0
  for spec in "record_replay_gpu.sh $BIN/lockstep" "hidden_fault_gpu.sh $BIN/lockstep python3 $src" \
              "tp_fault_gpu.sh $BIN/lockstep python3 $src" "rank_shards_gpu.sh $BIN/lockstep $src" \
              "tp_processes_gpu.sh $BIN/lockstep $src"; do
    set -- $spec
    t0=$SECONDS
    timeout 900 bash "$src/tests/gpu/$1" "${@:2}" >"$OUT/${1%.sh}.log" 2>&1
    rc=$?
    echo "== $1: exit $rc, $((SECONDS - t0)) s: $(tail -1 "$OUT/${1%.sh}.log")" | tee -a "$log"
    [ $rc -ne 0 ] && [ $rc -ne 77 ] && status=1
  done
  if [ -x "$BIN/bench_nccl" ]; then
    timeout 300 "$BIN/bench_nccl" --iters 50 >"$OUT/bench_nccl.log" 2>&1
    rc=$?
    echo "== bench_nccl: exit $rc: $(tail -1 "$OUT/bench_nccl.log")" | tee -a "$log"
    [ $rc -ne 0 ] && [ $rc -ne 77 ] && status=1
  fi
fi

if [ $bench = 1 ] && [ $SECONDS -lt $BUDGET ] && [ -x "$BIN/bench_mla_decode" ]; then
  timeout 60 "$BIN/bench_mla_decode" 2>&1 | tee "$OUT/bench.log"
fi

if [ $sanitize = 1 ] && [ $SECONDS -lt $BUDGET ]; then
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  slog=$OUT/sanitizer.log
  if [ -n "$cs" ]; then
    set -f  # the gtest filters below are not shell globs
    for spec in "memcheck gpu_latent_write_test *" "memcheck gpu_norm_rope_test *" \
                "memcheck gpu_mla_decode_test *DeviceContract*:*Sparse*:*Nan*" \
                "memcheck gpu_indexer_test *ScoresBitwise*" "racecheck gpu_mla_decode_test *DeviceContract*" \
                "racecheck gpu_indexer_test *ScoresBitwise*" "memcheck gpu_sampler_test *Deterministic*"; do
      set -- $spec
      [ $SECONDS -ge $BUDGET ] && { echo "sanitizer: budget spent, skipping $*" >>"$slog"; continue; }
      echo "== $1 $2 --gtest_filter=$3" >>"$slog"
      timeout $((BUDGET + 25 - SECONDS)) "$cs" --tool "$1" --error-exitcode 9 "$BIN/$2" --gtest_filter="$3" \
        --gtest_color=no >>"$slog" 2>&1
      echo "== exit $?" >>"$slog"
    done
    set +f
    grep -E "^== |ERROR SUMMARY|RACECHECK SUMMARY" "$slog" | tee -a "$log"
  else
    echo "compute-sanitizer not found" | tee -a "$log"
  fi
fi
exit $status
