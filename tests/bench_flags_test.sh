#!/usr/bin/env bash
# tests/bench_flags_test.sh BENCH_DIR — the benchmarks' flags (bench_decode, bench_record,
# bench_sampler; bench_gpu_sampler where CUDA was built): --help teaches, and each bad value is
# one line on stderr naming the flag, exit 2, before any model is loaded or GPU looked for.
set -u
dir=$1
fail=0
bin=
expect() {  # expect RC PATTERN ARGS... (runs $bin)
  local rc=$1 pattern=$2
  shift 2
  local err out got
  err=$(mktemp)
  out=$("$bin" "$@" 2>"$err")
  got=$?
  if [ "$got" != "$rc" ] || ! grep -q -- "$pattern" "$err" <(echo "$out"); then
    echo "FAIL: $(basename "$bin") $* -> rc $got (want $rc), stderr: $(cat "$err")"
    fail=1
  elif [ "$rc" = 2 ] && [ "$(wc -l <"$err")" != 1 ]; then
    echo "FAIL: $(basename "$bin") $*: $(wc -l <"$err") lines on stderr (want one)"
    fail=1
  fi
  rm -f "$err"
}
bin=$dir/bench_decode
expect 0 "--prompt-len N" --help
expect 2 "--tokens needs a value" --tokens
expect 2 "--tokens: expected a whole number in \[2, 16777216\], got 'abc'" --tokens abc
expect 2 "--batch: expected a whole number in \[1, 4096\], got '0'" --batch 0
expect 2 "--prompt-len: expected a whole number" --prompt-len 12x
expect 2 "'fp4' is not one of fp32, bf16, fp8_e4m3" --kv-cache fp4
expect 2 "unknown flag --nope" --nope 1
expect 1 "exceeds max_position_embeddings" --prompt-len 2048 --tokens 256
bin=$dir/bench_record
expect 0 "--zstd-level N" --help
expect 2 "--tokens: expected a whole number in \[2, 16777216\], got 'abc'" --tokens abc
expect 2 "--zstd-level: expected a whole number in \[1, 22\], got '99'" --zstd-level 99
expect 2 "--flush-interval: expected a number" --flush-interval soon
expect 2 "--repeat: expected a whole number in \[1, 1000\], got '0'" --repeat 0
bin=$dir/bench_sampler
expect 0 "--iters N" --help
expect 2 "--iters: expected a whole number in \[1, 1000000\], got 'x'" --iters x
expect 2 "unknown flag --foo" --foo
if [ -x "$dir/bench_gpu_sampler" ]; then  # CUDA builds: its flags are read before it looks for a GPU
  bin=$dir/bench_gpu_sampler
  expect 0 "--vocab N" --help
  expect 2 "--reps: expected a whole number in \[1, 100000\], got '0'" --reps 0
  expect 2 "--vocab needs a value" --vocab
  expect 2 "unknown flag --foo" --foo 1
fi
[ $fail = 0 ] && echo "bench_flags_test: PASS"
exit $fail
