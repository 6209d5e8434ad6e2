#!/usr/bin/env bash
# tests/cli/numbers_test.sh — numbers checked as numbers (issue 31): no flag, JSONL field or
# recorded engine option saturates, wraps or overflows into something else. Each out-of-range
# value is refused with one line naming the flag or the file and field and the range; the
# values at the edge of each range are accepted (so the checks are not simply "refuse all");
# what the writer would produce but the reader refuses is refused at record time.
# Usage: numbers_test.sh LOCKSTEP_BINARY SOURCE_DIR
set -u
LS=$1
SRC=$2
MODEL=$SRC/tests/fixtures/models/v32_sparse
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail=0
ok() { echo "ok   $1"; }
bad() { echo "FAIL $1"; fail=1; }
export OMP_NUM_THREADS=1

expect_bad() {  # description, expected substring, command...
  local what=$1 want=$2
  shift 2
  "$@" >"$TMP/o" 2>"$TMP/e"
  local rc=$?
  # One line of error (a model load may print its own progress line before it).
  local lines
  lines=$(grep -c "^lockstep: " "$TMP/e")
  if [ $rc -ne 0 ] && [ $rc -lt 128 ] && grep -qF -- "$want" "$TMP/e" && ! grep -q "terminate called\|runtime error" "$TMP/e" &&
    [ "$(grep -vc '^lockstep: loaded\|^lockstep: sampling defaults' "$TMP/e")" -eq 1 ] && [ "$lines" -ge 1 ]; then
    ok "$what refused: $(grep -v '^lockstep: loaded\|^lockstep: sampling defaults' "$TMP/e")"
  else
    bad "$what (rc $rc): $(cat "$TMP/e")"
  fi
}
expect_ok() {  # description, command...
  local what=$1
  shift
  if "$@" >"$TMP/o" 2>"$TMP/e"; then ok "$what accepted"; else bad "$what (rc $?): $(cat "$TMP/e")"; fi
}
G=("$LS" generate -m "$MODEL" --prompt-ids 5,6,7 -q)

# -n: 2^26 is the most a trace holds; past it, or past 2^63, refused as written (it saturated to
# 2^63 - 1, then prompt + max_new_tokens overflowed).
expect_bad "-n 99999999999999999999" "0 to 2^26" "${G[@]}" -n 99999999999999999999
expect_bad "-n 67108865" "0 to 2^26" "${G[@]}" -n 67108865
expect_bad "-n -1" "0 to 2^26" "${G[@]}" -n -1
expect_bad "-n 1e3" "0 to 2^26" "${G[@]}" -n 1e3
# At the edge it is the model's context that refuses, by name, with the sum computed exactly.
expect_bad "-n 67108864 (the prompt's 3 tokens past the context)" "exceeds max_position_embeddings" "${G[@]}" -n 67108864
expect_ok "-n 0" "${G[@]}" -n 0

# Seeds: 0 to 2^64 - 1, as written (-1 read as 2^64 - 1, 2^64 saturated).
expect_bad "--seed -1" "0 to 2^64 - 1" "${G[@]}" -n 1 --seed -1
expect_bad "--seed 2^64" "0 to 2^64 - 1" "${G[@]}" -n 1 --seed 18446744073709551616
expect_ok "--seed 2^64 - 1" "${G[@]}" -n 1 --seed 18446744073709551615 -t 1
printf '{"prompt_ids": [5]}\n{"prompt_ids": [6]}\n' >"$TMP/two.jsonl"
expect_bad "--seed 2^64 - 1 with a second prompt (seed + 1 wraps)" "passes 2^64 - 1" \
  "$LS" generate -m "$MODEL" --prompts "$TMP/two.jsonl" -n 1 --seed 18446744073709551615 -q
"$LS" --help >/dev/null
"$LS" generate --help | grep -- "--seed" | grep -qF "0 to 2^64 - 1" && ok "--help states the seed range" ||
  bad "generate --help does not state the seed range"

# Other counts and ranges.
expect_bad "--top-k 99999999999999999999" "0 to 2^26" "${G[@]}" -n 1 --top-k 99999999999999999999
expect_bad "--temperature 2e6" "[0, 1e6]" "${G[@]}" -n 1 -t 2e6
expect_bad "--page-size 0" "1 to 2^20" "${G[@]}" -n 1 --page-size 0
expect_bad "--max-prefill-tokens 2^63" "0 to 2^31" "${G[@]}" -n 1 --max-prefill-tokens 9223372036854775808
expect_bad "--kv-cache-tokens 99999999999999999999" "1 to 2^36" "${G[@]}" -n 1 --kv-cache-tokens 99999999999999999999
# A capacity the machine cannot hold: its size, not std::bad_alloc.
expect_bad "--kv-cache-tokens 2^36" "the KV cache would take" "${G[@]}" -n 1 --kv-cache-tokens 68719476736
expect_bad "record --stride 2^40" "1 to 2^31" "$LS" record -m "$MODEL" --prompt-ids 5 -n 1 --stride 1099511627776 -o "$TMP/s.h5"

# What the writer would produce but the reader refuses is refused at record time: a batch wider
# than a trace's step table (it wrote a trace no reader accepted).
expect_bad "record --max-batch 5000" "1 to 4096" "$LS" record -m "$MODEL" --prompt-ids 5 -n 1 --max-batch 5000 -o "$TMP/b.h5"
[ -e "$TMP/b.h5" ] && bad "record --max-batch 5000 left a trace" || ok "record --max-batch 5000 wrote nothing"
expect_ok "record --max-batch 4096" "$LS" record -m "$MODEL" --prompt-ids 5 -n 1 --max-batch 4096 -o "$TMP/b.h5" -q
expect_ok "inspect of the --max-batch 4096 trace" "$LS" inspect "$TMP/b.h5"

# JSONL fields: the same ranges, naming the file, the line and the field.
i=0
for line in '{"prompt_ids": [5], "max_tokens": 1e30}' '{"prompt_ids": [5], "max_tokens": 67108865}' \
  '{"prompt_ids": [5], "seed": -1}' '{"prompt_ids": [5], "seed": 18446744073709551616}' \
  '{"prompt_ids": [5], "top_k": 1e20}' '{"prompt_ids": [5], "temperature": 1e7}' \
  '{"prompt_ids": [18446744073709551615]}' '{"prompt_ids": [5], "max_tokens": 2.5}'; do
  i=$((i + 1))
  printf '%s\n' "$line" >"$TMP/p$i.jsonl"
  field=$(printf '%s' "$line" | sed -E 's/.*"(max_tokens|seed|top_k|temperature)".*/\1/; s/^\{"prompt_ids".*/prompt_ids/')
  expect_bad "JSONL $line" "p$i.jsonl:1: field '$field'" "$LS" generate -m "$MODEL" --prompts "$TMP/p$i.jsonl" -n 1 -q
done
printf '{"prompt_ids": [5], "max_tokens": 2, "seed": 18446744073709551615, "top_k": 67108864}\n' >"$TMP/edge.jsonl"
expect_ok "JSONL fields at the edges of their ranges" "$LS" generate -m "$MODEL" --prompts "$TMP/edge.jsonl" -q

# Recorded engine options are numbers too: a trace whose engine_options hold a 2^60-token cache,
# a 1e300 page size or a negative batch is refused naming meta.engine_options, not run.
"$LS" record -m "$MODEL" --prompt-ids 5,6 -n 2 -o "$TMP/run.h5" -q || bad "record"
for opt in 'kv_cache_tokens 1152921504606846976 the recorded engine options' 'page_size 1e300 page_size' \
  'max_batch -1 max_batch' 'kv_cache_tokens 68719476736 the KV cache would take'; do
  set -- $opt
  key=$1 val=$2
  shift 2
  want="$*"
  cp "$TMP/run.h5" "$TMP/eo.h5"
  HDF5_PLUGIN_PATH="$(dirname "$LS")/hdf5-plugins" /usr/bin/python3 - "$TMP/eo.h5" "$key" "$val" <<'EOF'
import json, sys
import h5py, numpy as np
p, key, val = sys.argv[1:4]
with h5py.File(p, "r+") as f:
    eo = json.loads(f["meta"].attrs["engine_options"])
    eo[key] = float(val) if "e" in val else int(val)
    f["meta"].attrs["engine_options"] = np.bytes_(json.dumps(eo))
EOF
  expect_bad "replay of a trace with engine option $key = $val" "$want" "$LS" replay "$TMP/eo.h5" -o "$TMP/eo.replay.h5" -q
done

exit $fail
