#!/usr/bin/env bash
# tests/fuzz/bounded_trace_reader.sh — the CI run of fuzz_trace_reader (CTest
# fuzz_trace_reader_bounded, label fuzz). Byte-level mutations of a trace find crashes inside
# libhdf5 1.10.8's own object-header decoding within seconds to minutes
# (tests/fuzz/regressions/hdf5-1.10/README.md), so this run forks (-fork=1 -ignore_crashes=1),
# then replays every input that crashed and fails when any crash's first frame past the
# allocator is not in libhdf5 — a crash in lockstep's code, a UBSan report, a leak of ours.
# Usage: bounded_trace_reader.sh FUZZER SECONDS SCRATCH_DIR CORPUS_DIR
set -u
FUZZER=$1 SECS=$2 SCRATCH=$3 CORPUS=$4
ART=$SCRATCH/artifacts
rm -rf "$ART"
mkdir -p "$SCRATCH/corpus" "$ART"
"$FUZZER" -fork=1 -ignore_crashes=1 -max_total_time="$SECS" -seed=1 -rss_limit_mb=2048 -timeout=30 \
  -artifact_prefix="$ART/" "$SCRATCH/corpus" "$CORPUS" >"$SCRATCH/fuzz.log" 2>&1
echo "fuzz_trace_reader: $(grep -E '^#[0-9]+' "$SCRATCH/fuzz.log" | tail -1)"
fail=0
hdf5=0
for f in "$ART"/*; do
  [ -e "$f" ] || continue
  out=$(timeout 60 "$FUZZER" "$f" 2>&1)
  if ! grep -q "ERROR: \|runtime error" <<<"$out"; then continue; fi
  first=$(grep -E '^ +#[0-9]+ ' <<<"$out" | grep -v 'interceptor\|malloc\|calloc\|realloc\|operator new\|libc.so\|sysdeps/\|__mem' | head -1)
  if grep -q libhdf5 <<<"$first" && ! grep -q "runtime error" <<<"$out"; then
    hdf5=$((hdf5 + 1))
  else
    echo "FAIL $(basename "$f"): $(grep -m1 'ERROR: \|runtime error' <<<"$out")"
    echo "  $first"
    fail=1
  fi
done
echo "$hdf5 crash(es) inside libhdf5 itself (known, not lockstep's); $([ $fail = 0 ] && echo none || echo some) in lockstep"
exit $fail
