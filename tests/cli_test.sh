#!/usr/bin/env bash
# tests/cli_test.sh — the lockstep command as a user meets it: bad flags and bad files give
# one line on stderr and a non-zero exit (never a crash); good runs produce what they say.
# Usage: cli_test.sh LOCKSTEP_BINARY SOURCE_DIR
set -u
LS=$1
SRC=$2
FIX=$SRC/tests/fixtures/models
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail=0

# expect_error "description" "substring" cmd...
expect_error() {
  local what=$1 want=$2
  shift 2
  "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  local lines
  lines=$(wc -l <"$TMP/err")
  if [ "$rc" -eq 0 ] || [ "$rc" -ge 128 ]; then
    echo "FAIL $what: exit code $rc (want 1 or 2)"; fail=1
  elif [ "$lines" -ne 1 ]; then
    echo "FAIL $what: $lines lines on stderr (want 1):"; cat "$TMP/err"; fail=1
  elif ! grep -qF -- "$want" "$TMP/err"; then
    echo "FAIL $what: stderr lacks '$want':"; cat "$TMP/err"; fail=1
  else
    echo "ok   $what: $(cat "$TMP/err")"
  fi
}

expect_error "missing model dir" "/nonexistent" "$LS" generate -m /nonexistent --prompt-ids 1
expect_error "no prompt" "no prompt" "$LS" generate -m "$FIX/v3_basic" -q
expect_error "text prompt without tokenizer" "tokenizer.json" "$LS" generate -m "$FIX/v3_basic" -p hello -q
expect_error "bad prompt ids" "not a token id" "$LS" generate -m "$FIX/v3_basic" --prompt-ids 1,x,3 -q
expect_error "token outside vocab" "outside the vocabulary" "$LS" generate -m "$FIX/v3_basic" --prompt-ids 1,99999 -q
expect_error "unknown kernel variant" "attn_decode" "$LS" generate -m "$FIX/v3_basic" --prompt-ids 1 --kernel attn_decode=magic -q
expect_error "bad kernel syntax" "op=variant" "$LS" generate -m "$FIX/v3_basic" --prompt-ids 1 --kernel nonsense -q
expect_error "bad kv cache" "kv-cache" "$LS" generate -m "$FIX/v3_basic" --prompt-ids 1 --kv-cache fp4
expect_error "too long" "max_position_embeddings" "$LS" generate -m "$FIX/v3_basic" --prompt-ids 1 -n 100000 -q
printf '{"prompt_ids":[1,2]}\n{"prompt": 7}\n' >"$TMP/p.jsonl"
expect_error "bad jsonl field" "p.jsonl:2: field 'prompt'" "$LS" generate -m "$FIX/v3_basic" --prompts "$TMP/p.jsonl" -q
for bad in '"max_tokens": -5' '"max_tokens": 1e30' '"temperature": -3' '"top_p": 0' '"seed": -3' '"top_k": 2.5'; do
  printf '{"prompt_ids": [1, 2], %s}\n' "$bad" >"$TMP/r.jsonl"
  expect_error "jsonl $bad" "r.jsonl:1: field '$(printf '%s' "$bad" | cut -d'"' -f2)'" \
    "$LS" generate -m "$FIX/v3_basic" --prompts "$TMP/r.jsonl" -q
done
printf '{"prompt_ids": [1, 2], "seed": 18446744073709551615, "temperature": 0.5, "max_tokens": 2}\n' >"$TMP/r.jsonl"
"$LS" generate -m "$FIX/v3_basic" --prompts "$TMP/r.jsonl" -q >/dev/null 2>&1 && echo "ok   jsonl seed 2^64-1" || { echo "FAIL jsonl seed 2^64-1"; fail=1; }
printf 'not json\n' >"$TMP/q.jsonl"
expect_error "bad jsonl line" "q.jsonl:1" "$LS" generate -m "$FIX/v3_basic" --prompts "$TMP/q.jsonl" -q
mkdir -p "$TMP/m"
cp "$FIX/v3_basic/config.json" "$TMP/m/"
head -c 1000 "$FIX/v3_basic/model.safetensors" >"$TMP/m/model.safetensors"
expect_error "truncated safetensors" "model.safetensors" "$LS" model info "$TMP/m"
sed 's/deepseek_v3/mixtral/' "$FIX/v3_basic/config.json" >"$TMP/m/config.json"
expect_error "unknown model_type" "model_type" "$LS" model info "$TMP/m"
# generation_config.json with fields of other types: greedy defaults, no crash.
mkdir -p "$TMP/g"
ln -s "$FIX/v3_basic/config.json" "$FIX/v3_basic/model.safetensors" "$TMP/g/"
for gc in '{"do_sample": null, "temperature": 0.6}' '{"do_sample": "yes", "temperature": "hot"}' '[1, 2]'; do
  printf '%s' "$gc" >"$TMP/g/generation_config.json"
  if "$LS" generate -m "$TMP/g" --prompt-ids 5,6 -n 2 -q >/dev/null 2>"$TMP/err"; then
    echo "ok   generation_config.json $gc"
  else echo "FAIL generation_config.json $gc:"; cat "$TMP/err"; fail=1; fi
done
printf '{"do_sample": true, "temperature": -1}' >"$TMP/g/generation_config.json"
expect_error "generation_config.json temperature < 0" "generation_config.json: field 'temperature'" \
  "$LS" generate -m "$TMP/g" --prompt-ids 5,6 -n 2 -q
printf '{"do_sample": true, "top_k": 1e30}' >"$TMP/g/generation_config.json"
expect_error "generation_config.json top_k 1e30" "field 'top_k'" "$LS" record -m "$TMP/g" --prompt-ids 5,6 -n 2 -q \
  -o "$TMP/g.h5"
if "$LS" generate -m "$TMP/g" --prompt-ids 5,6 -n 2 -q --top-k 3 >/dev/null 2>&1; then
  echo "ok   --top-k overrides a bad generation_config.json top_k"
else echo "FAIL --top-k did not override generation_config.json"; fail=1; fi
expect_error "unknown subcommand" "" "$LS" frobnicate
expect_error "unknown backend" "--backend" "$LS" generate -m "$FIX/v3_basic" --prompt-ids 1 --backend tpu -q
expect_error "negative prefill budget" "--max-prefill-tokens" "$LS" generate -m "$FIX/v3_basic" --prompt-ids 1 --max-prefill-tokens -1 -q
expect_error "random weights on the cpu" "--random-weights" "$LS" generate -m "$FIX/v3_basic" --prompt-ids 1 --random-weights -q
expect_error "fault on the cuda backend" "" "$LS" generate -m "$FIX/v3_basic" --prompt-ids 1 --backend cuda --fault fault_fp8_no_clamp -q

# Good runs: JSON output parses and greedy tokens equal the transformers reference's first tokens.
out=$("$LS" generate -m "$FIX/v3_basic" --prompts <(printf '{"prompt_ids":[5,6,7],"id":"a"}\n{"prompt_ids":[9],"id":"b","temperature":0.7,"seed":3}\n') -n 5 --json) || { echo "FAIL json run"; fail=1; }
n=$(printf '%s\n' "$out" | grep -c '"completion_tokens":5')
if [ "$n" -ne 2 ]; then echo "FAIL json output: $out"; fail=1; else echo "ok   --json gives one object per request"; fi
"$LS" model info "$FIX/v32_sparse" --json | grep -q '"topk": 16' && echo "ok   model info --json" || { echo "FAIL model info --json"; fail=1; }
"$LS" kernels | grep -q "attn_decode" && echo "ok   kernels" || { echo "FAIL kernels"; fail=1; }
# Which CUDA variants replay on the CPU bit for bit: the *_dot GEMMs do, cuBLAS does not.
"$LS" kernels --json | python3 -c '
import json, sys
v = {(r["op"], r["variant"], r["backend"]): r for r in json.load(sys.stdin)}
assert v[("gemm", "bf16_dot", "cuda")]["cpu_bits"] is True, v[("gemm", "bf16_dot", "cuda")]
assert v[("gemm", "fp32", "cuda")]["cpu_bits"] is False
assert "cpu_bits" not in v[("gemm", "fp32", "cpu")]
' && echo "ok   kernels --json cpu_bits" || { echo "FAIL kernels --json cpu_bits"; fail=1; }
"$LS" generate --help | grep -q -- "--kv-cache" && echo "ok   generate --help" || { echo "FAIL help"; fail=1; }
# degen on the embedded model: greedy on the HTML prompt loops (docs/models.md), and the JSON
# report carries one entry per setting with per-sample verdicts.
out=$("$LS" degen -p $'<!DOCTYPE html>\n<html>\n<head>\n<title>Counter</title>' --samples 2 -n 160 --temperatures 0,1.0 --ignore-eos --json 2>/dev/null)
if printf '%s' "$out" | /usr/bin/python3 -c '
import json, sys
r = json.load(sys.stdin)
s = r["settings"]
assert [x["temperature"] for x in s] == [0.0, 1.0], s
# Greedy decoding gives every seed the same tokens: one sample at T=0, --samples at T>0.
assert s[0]["samples"] == 1 and len(s[0]["per_sample"]) == 1 and s[0]["greedy"], s[0]
assert s[1]["samples"] == 2 and len(s[1]["per_sample"]) == 2 and not s[1]["greedy"], s[1]
assert s[0]["loop_rate"] == 1.0, "greedy decoding of the HTML prompt loops"
'; then echo "ok   degen --json"; else echo "FAIL degen --json: $out" | head -c 2000; fail=1; fi
# record → degen failures → replay → diff, through the binary as a user runs it.
"$LS" degen -p $'<!DOCTYPE html>\n<html>\n<head>\n<title>Counter</title>' --samples 1 -n 200 --temperatures 0 --ignore-eos -q --record-failures "$TMP/fails" >/dev/null 2>&1
if ls "$TMP"/fails/degen-T0-p0-s0.h5 >/dev/null 2>&1; then echo "ok   degen --record-failures wrote a trace"; else echo "FAIL degen --record-failures"; fail=1; fi
if "$LS" replay "$TMP/fails/degen-T0-p0-s0.h5" -o "$TMP/rep.h5" -q | grep -q "^deterministic"; then echo "ok   exact replay of the failure is deterministic"; else echo "FAIL exact replay"; fail=1; fi
"$LS" replay "$TMP/fails/degen-T0-p0-s0.h5" --kv-cache bf16 -q >/dev/null 2>&1
[ $? -eq 2 ] && echo "ok   exact mode refuses overrides" || { echo "FAIL exact mode accepted an override"; fail=1; }
"$LS" replay "$TMP/fails/degen-T0-p0-s0.h5" --mode forced --kv-cache fp8_e4m3 -o "$TMP/fp8.h5" -q --json >"$TMP/rep.json"
if /usr/bin/python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
f = r["first_divergence"]
assert f["tensor"] == "taps/layers.0.attn.heads" and f["position"] == 0, f
' "$TMP/rep.json"; then echo "ok   forced replay with fp8 names layers.0.attn.heads"; else echo "FAIL forced replay json"; fail=1; fi
"$LS" diff "$TMP/fails/degen-T0-p0-s0.h5" "$TMP/rep.h5" >/dev/null; rc1=$?
"$LS" diff "$TMP/fails/degen-T0-p0-s0.h5" "$TMP/fp8.h5" --html "$TMP/report.html" >/dev/null; rc2=$?
if [ $rc1 -eq 0 ] && [ $rc2 -eq 3 ] && grep -q 'id="heatmap-[0-9]' "$TMP/report.html"; then echo "ok   diff exit codes and HTML report"; else echo "FAIL diff rc=$rc1/$rc2"; fail=1; fi
# Chunked prefill through the binary: the same tokens as whole-prompt prefill.
a=$("$LS" generate -m "$FIX/v3_basic" --prompt-ids 5,6,7,8,9,10,11,12,13 -n 6 --temperature 0.8 --seed 4 --json -q)
b=$("$LS" generate -m "$FIX/v3_basic" --prompt-ids 5,6,7,8,9,10,11,12,13 -n 6 --temperature 0.8 --seed 4 --json -q --max-prefill-tokens 2)
if [ -n "$a" ] && [ "$(printf '%s' "$a" | grep -o '"tokens":\[[0-9,]*\]')" = "$(printf '%s' "$b" | grep -o '"tokens":\[[0-9,]*\]')" ]; then
  echo "ok   --max-prefill-tokens gives the same tokens"
else echo "FAIL chunked prefill: $a vs $b"; fail=1; fi
expect_error "diff of a non-trace" "" "$LS" diff "$TMP/fails/degen-T0-p0-s0.h5" "$FIX/v3_basic/config.json"
expect_error "degen bad temperatures" "--temperatures" "$LS" degen -p x --temperatures 0,hot -q
expect_error "a count of 0" "--samples: must be a whole number from 1 to 2^20 (got 0)" "$LS" degen -p x --samples 0 -q
expect_error "serve limit of 0" "--max-prompt-tokens: must be a whole number from 1 to 2^26 (got 0)" "$LS" serve --max-prompt-tokens 0

exit $fail
