#!/usr/bin/env bash
# tests/cli/tp_ranks_cli_test.sh — CTest tp_ranks_cli: `--tp-ranks N` (real tensor parallelism:
# N engines on threads, each computing its shard, engine/rank_group.h) through the CLI as a user
# types it. lockstep-tiny-v32: a trace recorded at --tp-ranks 4 diffs identical to one recorded at
# --emulate-tp 4 (every tensor's content hash and token), with --rank-shards too (each rank
# writing its own shard); it replays
# exactly, verify checks its all-reduce, and bisect names the collective-order fault; `generate
# --tp-ranks 8` prints emulated TP 8's text; a degree the heads do not split, and the CUDA
# backend's rank mode (not built), are refused with one line naming the flag.
# usage: tp_ranks_cli_test.sh LOCKSTEP SRC
set -euo pipefail
L=$1 SRC=$2
M="$SRC/models/lockstep-tiny-v32"
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
printf '%s\n' '{"prompt": "hello there", "max_tokens": 8}' '{"prompt": "the cat", "max_tokens": 6}' > "$W/p.jsonl"
"$L" record -m "$M" --prompts "$W/p.jsonl" -t 0 --ignore-eos --tp-ranks 4 -q -o "$W/ranks.h5"
"$L" record -m "$M" --prompts "$W/p.jsonl" -t 0 --ignore-eos --emulate-tp 4 -q -o "$W/emu.h5"
"$L" diff "$W/emu.h5" "$W/ranks.h5" > "$W/d1.txt" || fail "diff --tp-ranks 4 vs --emulate-tp 4: $(tail -3 "$W/d1.txt")"
grep -q "^identical" "$W/d1.txt" || fail "not identical: $(tail -3 "$W/d1.txt")"
"$L" record -m "$M" --prompts "$W/p.jsonl" -t 0 --ignore-eos --tp-ranks 4 --rank-shards -q -o "$W/shards.h5"
[ -f "$W/shards.h5.rank3" ] || fail "--tp-ranks 4 --rank-shards wrote no rank 3 shard"
"$L" diff "$W/emu.h5" "$W/shards.h5" > "$W/d2.txt" || fail "diff with shards: $(tail -3 "$W/d2.txt")"
grep -q "^identical" "$W/d2.txt" || fail "shards not identical"
# Each rank wrote its own shard (rank r's shard_writer_rank is r), and every stitched row hashes to
# the trace's summary of it.
for r in 0 1 2 3; do
  w=$("$L" inspect --json "$W/shards.h5.rank$r" | sed -n 's/^ *"shard_writer_rank": "\(.*\)",\{0,1\}$/\1/p')
  [ "$w" = "$r" ] || fail "shard $r written by rank '$w'"
done
"$L" inspect "$W/shards.h5" --verify > "$W/iv.txt" 2>&1 || fail "inspect --verify of the ranks' shards: $(tail -3 "$W/iv.txt")"
# The ranks' trace replays exactly (as emulated TP 4: the same bits) and verify checks its
# all-reduce; with the collective-order fault, bisect on it names the all-reduce.
"$L" replay "$W/ranks.h5" --mode exact -q -o "$W/rep.h5" > "$W/rep.txt" 2>&1 || fail "exact replay: $(tail -3 "$W/rep.txt")"
"$L" verify "$W/ranks.h5" > "$W/v.txt" 2>&1 || fail "verify: $(tail -3 "$W/v.txt")"
grep -q "^allreduce .* ok" "$W/v.txt" || fail "verify did not check the all-reduce: $(grep allreduce "$W/v.txt")"
"$L" record -m "$M" --prompts "$W/p.jsonl" -t 0 --ignore-eos --tp-ranks 4 --fault fault_rotate_by_row -q -o "$W/bad.h5"
"$L" bisect "$W/bad.h5" -q --no-swaps --work-dir "$W/bw" > "$W/b.txt" 2>&1 || true
grep -q "^Defect in allreduce (allreduce=fault_rotate_by_row" "$W/b.txt" || fail "bisect: $(head -3 "$W/b.txt")"
a=$("$L" generate -m "$M" --prompt "hello there" -n 12 --ignore-eos --tp-ranks 8 -q)
b=$("$L" generate -m "$M" --prompt "hello there" -n 12 --ignore-eos --emulate-tp 8 -q)
[ "$a" = "$b" ] || fail "generate --tp-ranks 8 printed '$a', --emulate-tp 8 '$b'"
set +e
e=$("$L" generate -m "$M" --prompt hi -n 2 --tp-ranks 3 -q 2>&1); rc=$?
[ $rc -ne 0 ] && [ "$(echo "$e" | wc -l)" -eq 1 ] && [[ $e == *"--tp-ranks 3"*"num_attention_heads"* ]] || fail "--tp-ranks 3: rc $rc: $e"
e=$("$L" generate -m "$M" --prompt hi -n 2 --tp-ranks 2 --backend cuda -q 2>&1); rc=$?
[ $rc -ne 0 ] && [[ $e == *"--backend cuda"* ]] || fail "--backend cuda --tp-ranks 2 (no GPU here): rc $rc: $e"
e=$("$L" generate -m "$M" --prompt hi -n 2 --tp-ranks 2 --emulate-tp 4 -q 2>&1); rc=$?
[ $rc -ne 0 ] && [[ $e == *"give one degree"* ]] || fail "--tp-ranks 2 --emulate-tp 4: rc $rc: $e"
echo "ok: --tp-ranks 4 records emulated TP 4's trace (and its shards), generate --tp-ranks 8 prints its text; refusals name the flag"
