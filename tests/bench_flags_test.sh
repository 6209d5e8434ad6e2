#!/usr/bin/env bash
# tests/bench_flags_test.sh BENCH_DECODE — the CPU benchmark's flags: --help teaches, and each
# bad value is one line on stderr naming the flag, exit 2, before any model is loaded.
set -u
bin=$1
fail=0
expect() {  # expect RC PATTERN ARGS...
  local rc=$1 pattern=$2
  shift 2
  local err out got
  err=$(mktemp)
  out=$("$bin" "$@" 2>"$err")
  got=$?
  if [ "$got" != "$rc" ] || ! grep -q -- "$pattern" "$err" <(echo "$out"); then
    echo "FAIL: bench_decode $* -> rc $got (want $rc), stderr: $(cat "$err")"
    fail=1
  elif [ "$rc" = 2 ] && [ "$(wc -l <"$err")" != 1 ]; then
    echo "FAIL: bench_decode $*: $(wc -l <"$err") lines on stderr (want one)"
    fail=1
  fi
  rm -f "$err"
}
expect 0 "--prompt-len N" --help
expect 2 "--tokens needs a value" --tokens
expect 2 "--tokens: expected a whole number in \[2, 16777216\], got 'abc'" --tokens abc
expect 2 "--batch: expected a whole number in \[1, 4096\], got '0'" --batch 0
expect 2 "--prompt-len: expected a whole number" --prompt-len 12x
expect 2 "'fp4' is not one of fp32, bf16, fp8_e4m3" --kv-cache fp4
expect 2 "unknown flag --nope" --nope 1
expect 1 "exceeds max_position_embeddings" --prompt-len 2048 --tokens 256
[ $fail = 0 ] && echo "bench_flags_test: PASS"
exit $fail
