#!/usr/bin/env bash
# tests/cli/tp_processes_cli_test.sh — CTest tp_processes_cli: `--tp-ranks N --tp-launch
# processes` (ranks 1 … N − 1 are the same command started again, one process each, meeting in
# shared memory on the cpu backend; cli/rank_launch.h) as a user types it, on lockstep-tiny-v32:
# the trace diffs identical to --emulate-tp 4's (and to the threads' rank mode), with --rank-shards
# each rank process writes its own shard (a shard that cannot be written, or a rank killed while
# it writes, ends the run with one line and a trace that says it stopped), generate prints
# emulated TP 2's text; ranks given other work (prompts read from stdin, which a started rank
# does not have) fail with one line naming the rank; a rank killed mid-run ends the run with an
# error naming it and its signal instead of a hang; no shared-memory object is left behind; the
# flags' misuses are refused by name.
# usage: tp_processes_cli_test.sh LOCKSTEP SRC
set -euo pipefail
L=$1 SRC=$2
M="$SRC/models/lockstep-tiny-v32"
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
export TMPDIR="$W"  # the started ranks' logs
fail() { echo "FAIL: $*"; exit 1; }
# The pid of rank 1 under rank 0's pid $1, once started (empty after 30 s).
rank1_of() {
  for _ in $(seq 1 600); do
    for p in $(pgrep -P "$1" 2>/dev/null); do
      if tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -q '^LOCKSTEP_TP_RANK=1$'; then echo "$p"; return; fi
    done
    sleep 0.05
  done
}
shm_before=$(ls /dev/shm | grep -c '^lockstep-tp-' || true)
printf '%s\n' '{"prompt": "hello there", "max_tokens": 8}' '{"prompt": "the cat", "max_tokens": 6}' > "$W/p.jsonl"
"$L" record -m "$M" --prompts "$W/p.jsonl" -t 0 --ignore-eos --tp-ranks 4 --tp-launch processes -q -o "$W/proc.h5" \
  2> "$W/rec.err" || fail "record --tp-launch processes: $(tail -3 "$W/rec.err")"
"$L" record -m "$M" --prompts "$W/p.jsonl" -t 0 --ignore-eos --emulate-tp 4 -q -o "$W/emu.h5"
"$L" diff "$W/emu.h5" "$W/proc.h5" > "$W/d1.txt" || fail "diff processes vs --emulate-tp 4: $(tail -3 "$W/d1.txt")"
grep -q "^identical" "$W/d1.txt" || fail "not identical: $(tail -3 "$W/d1.txt")"

# --rank-shards: each rank process writes its own shard (its pid in the shard's /meta); the
# trace diffs identical to --emulate-tp 4's, and every stitched row hashes to the trace's summary.
"$L" record -m "$M" --prompts "$W/p.jsonl" -t 0 --ignore-eos --tp-ranks 4 --tp-launch processes --rank-shards -q \
  -o "$W/shards.h5" 2> "$W/sh.err" || fail "record --rank-shards over processes: $(tail -3 "$W/sh.err")"
"$L" diff "$W/emu.h5" "$W/shards.h5" > "$W/d2.txt" || fail "diff shards vs --emulate-tp 4: $(tail -3 "$W/d2.txt")"
grep -q "^identical" "$W/d2.txt" || fail "shards not identical: $(tail -3 "$W/d2.txt")"
"$L" inspect "$W/shards.h5" --verify > "$W/iv.txt" 2>&1 || fail "inspect --verify of the ranks' shards: $(tail -3 "$W/iv.txt")"
meta() { "$L" inspect --json "$1" | sed -n "s/^ *\"$2\": \"\(.*\)\",\{0,1\}$/\1/p"; }
pids=""
for r in 0 1 2 3; do
  [ "$(meta "$W/shards.h5.rank$r" shard_writer_rank)" = "$r" ] || fail "shard $r written by rank '$(meta "$W/shards.h5.rank$r" shard_writer_rank)'"
  pids="$pids $(meta "$W/shards.h5.rank$r" shard_writer_pid)"
done
[ "$(echo $pids | tr ' ' '\n' | sort -u | wc -l)" -eq 4 ] || fail "the 4 shards were not written by 4 processes: pids$pids"

a=$("$L" generate -m "$M" --prompt "hello there" -n 12 --ignore-eos --tp-ranks 2 --tp-launch processes -q)
b=$("$L" generate -m "$M" --prompt "hello there" -n 12 --ignore-eos --emulate-tp 2 -q)
[ "$a" = "$b" ] || fail "generate --tp-launch processes printed '$a', --emulate-tp 2 '$b'"
set +e
# Other work: rank 0 reads the prompts from stdin; the ranks it starts have /dev/null there.
e=$(printf '%s\n' '{"prompt": "hi", "max_tokens": 2}' |
    "$L" generate -m "$M" --prompts /dev/stdin --tp-ranks 2 --tp-launch processes -q 2>&1); rc=$?
[ $rc -ne 0 ] && [[ $e == *"rank 1"* ]] || fail "ranks with other prompts: rc $rc: $e"
# A rank killed mid-run: rank 0 stops with its signal, naming it, instead of waiting forever.
for i in $(seq 1 32); do echo '{"prompt": "hello there", "max_tokens": 1500}'; done > "$W/long.jsonl"
"$L" generate -m "$M" --prompts "$W/long.jsonl" --ignore-eos --tp-ranks 2 --tp-launch processes -q \
  > /dev/null 2> "$W/kill.err" &
parent=$!
child=$(rank1_of "$parent")
[ -n "$child" ] || { kill "$parent"; fail "no rank 1 process under $parent"; }
sleep 2  # well into its run
kill -9 "$child"
wait "$parent"; rc=$?
e=$(cat "$W/kill.err")
[ $rc -ne 0 ] && [[ $e == *"rank 1 (pid $child) was killed by signal"* ]] || fail "killed rank: rc $rc: $e"
[ "$(echo "$e" | wc -l)" -eq 1 ] || fail "killed rank: more than one line: $e"
# A rank whose shard cannot be written (a folder in its place): one line naming the rank and the
# file; the trace says it stopped.
mkdir -p "$W/bad.h5.rank1/x"
e=$("$L" record -m "$M" --prompts "$W/p.jsonl" -t 0 --ignore-eos --tp-ranks 2 --tp-launch processes --rank-shards -q \
    -o "$W/bad.h5" 2>&1); rc=$?
[ $rc -ne 0 ] && [[ $e == *"rank 1"*"bad.h5.rank1"* ]] && [ "$(echo "$e" | wc -l)" -eq 1 ] || fail "unwritable shard: rc $rc: $e"
"$L" inspect "$W/bad.h5" > "$W/bi.txt" 2>&1
grep -q "^STOPPED: .*rank 1" "$W/bi.txt" || fail "the stopped trace does not say so: $(head -3 "$W/bi.txt")"
# A rank killed while it writes its shard: one line; the trace and the shards keep what they
# flushed, and the trace says why it ends.
"$L" record -m "$M" --prompts "$W/long.jsonl" --ignore-eos --tp-ranks 2 --tp-launch processes --rank-shards \
  --flush-interval 0.2 -q -o "$W/k.h5" 2> "$W/kr.err" &
parent=$!
child=$(rank1_of "$parent")
[ -n "$child" ] || { kill "$parent"; fail "no rank 1 process under $parent (record)"; }
sleep 3
kill -9 "$child"
wait "$parent"; rc=$?
e=$(cat "$W/kr.err")
[ $rc -ne 0 ] && [[ $e == *"rank 1 (pid $child) was killed by signal"* ]] && [ "$(echo "$e" | wc -l)" -eq 1 ] ||
  fail "rank killed while recording shards: rc $rc: $e"
"$L" inspect "$W/k.h5" > "$W/ki.txt" 2>&1 || fail "inspect of the stopped trace: $(tail -3 "$W/ki.txt")"
grep -q "^STOPPED: .*rank 1 (pid $child) was killed" "$W/ki.txt" || fail "stopped trace: $(head -3 "$W/ki.txt")"
[ -f "$W/k.h5.rank1" ] || fail "the killed rank's shard lost what it flushed"
"$L" diff "$W/k.h5" "$W/k.h5" > "$W/kd.txt" 2>&1
grep -q "^note: .*k.h5: the recording stopped on an error: rank 1" "$W/kd.txt" || fail "diff of a stopped trace: $(head -3 "$W/kd.txt")"
e=$("$L" generate -m "$M" --prompt hi -n 2 --tp-launch processes -q 2>&1); rc=$?
[ $rc -ne 0 ] && [[ $e == *"--tp-launch processes"*"N ≥ 2"* ]] || fail "--tp-launch processes alone: rc $rc: $e"
e=$("$L" generate -m "$M" --prompt hi -n 2 --tp-ranks 2 --tp-launch processes --tp-transport nccl -q 2>&1); rc=$?
[ $rc -ne 0 ] && [[ $e == *"--tp-transport nccl"* ]] || fail "--tp-transport nccl on the cpu: rc $rc: $e"
e=$("$L" generate -m "$M" --prompt hi -n 2 --tp-ranks 2 --tp-transport shm -q 2>&1); rc=$?
[ $rc -ne 0 ] && [[ $e == *"--tp-transport shm"*"--tp-launch processes"* ]] || fail "--tp-transport without processes: rc $rc: $e"
# A rank's variables left in a user's shell: the typed command says which variable to unset.
e=$(LOCKSTEP_TP_RANK=1 LOCKSTEP_TP_RANKS=2 LOCKSTEP_TP_GROUP=shm:/lockstep-tp-1-0 \
    "$L" generate -m "$M" --prompt hi -n 2 --tp-ranks 2 --tp-launch processes -q 2>&1); rc=$?
[ $rc -ne 0 ] && [[ $e == *"unset it"* ]] && [ "$(echo "$e" | wc -l)" -eq 1 ] || fail "stray LOCKSTEP_TP_RANK: rc $rc: $e"
# Commands that run one engine refuse the rank flags instead of ignoring them.
for cmd in degen serve; do
  e=$("$L" $cmd -m "$M" --tp-ranks 2 2>&1 < /dev/null); rc=$?
  [ $rc -ne 0 ] && [[ $e == *"$cmd --tp-ranks"*"--emulate-tp 2"* ]] || fail "$cmd --tp-ranks 2: rc $rc: $e"
done
set -e
shm_after=$(ls /dev/shm | grep -c '^lockstep-tp-' || true)
[ "$shm_after" -le "$shm_before" ] || fail "shared-memory groups left in /dev/shm: $(ls /dev/shm | grep lockstep-tp-)"
echo "ok: --tp-launch processes records emulated TP 4's trace and prints TP 2's text; other work, a killed rank and misused flags end with one line naming them"
