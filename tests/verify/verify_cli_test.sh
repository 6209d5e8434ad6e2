#!/usr/bin/env bash
# `lockstep verify` as a user meets it: exit 0 on a clean trace, 3 on a defect, 2 on bad input
# (one line naming the file); --json parses with null for what was not measured; a
# summary-only trace is upgraded by an exact replay with full capture whose hashes must match,
# and `replay --capture full` does the same by hand; --help shows defaults.
# usage: verify_cli_test.sh LOCKSTEP PYTHON
set -euo pipefail
L=$1 PY=$2
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
# lockstep-tiny-v32: the planted fault below (lm_head_drops_last_hidden) lives in the MLA forward.
V32=$(cd "$(dirname "$0")/../../models/lockstep-tiny-v32" && pwd)
printf '{"prompt": "The quick brown fox"}\n{"prompt": "Once upon a time"}\n' > "$W/p.jsonl"

"$L" record -m "$V32" --prompts "$W/p.jsonl" -n 12 --ignore-eos -q -t 0 -o "$W/full.h5"
"$L" verify "$W/full.h5" -q --work-dir "$W/v1" --json > "$W/v1.json" || fail "clean trace: exit $?"
"$PY" - "$W/v1.json" <<'PYEOF'
import json, sys
j = json.load(open(sys.argv[1]))
assert j["clean"] and j["batch_invariance"]["bit_identical"], j
ops = {o["op"]: o for o in j["ops"]}
for op in ("attn_norm", "attention", "router", "experts", "lm_head", "sampler", "kv_cache", "indexer"):
    assert ops[op]["rows"] > 0 and not ops[op]["defect"], (op, ops[op])
    assert ops[op]["first_failure"] is None  # not measured → null, never 0 or a string
PYEOF

# A defect: exit 3, and the text names it.
set +e
LOCKSTEP_TEST_HIDDEN_FAULT=lm_head_drops_last_hidden "$L" record -m "$V32" --prompts "$W/p.jsonl" -n 12 --ignore-eos -q -t 0 -o "$W/bad.h5"
LOCKSTEP_TEST_HIDDEN_FAULT=lm_head_drops_last_hidden "$L" verify "$W/bad.h5" -q --work-dir "$W/v2" > "$W/v2.txt"
rc=$?
set -e
[ "$rc" = 3 ] || fail "defect: exit $rc, want 3"
grep -q "lm_head .*DEFECT" "$W/v2.txt" || fail "defect not named: $(cat "$W/v2.txt")"

# Bad input: exit 2, one line naming the file.
set +e
"$L" verify "$W/missing.h5" -q > "$W/o.txt" 2> "$W/e.txt"; rc=$?
set -e
[ "$rc" = 2 ] || fail "missing file: exit $rc, want 2"
[ "$(wc -l < "$W/e.txt")" = 1 ] && grep -q "missing.h5" "$W/e.txt" || fail "error line: $(cat "$W/e.txt")"
echo "not a trace" > "$W/junk.h5"
set +e
"$L" verify "$W/junk.h5" -q 2> "$W/e2.txt"; rc=$?
set -e
[ "$rc" = 2 ] || fail "junk file: exit $rc, want 2"

# Summary-only: upgraded by an exact replay with full capture, hashes checked.
"$L" record -m "$V32" --prompts "$W/p.jsonl" -n 12 --ignore-eos -q -t 0 --capture summary -o "$W/sum.h5"
"$L" verify "$W/sum.h5" -q --work-dir "$W/v3" --json > "$W/v3.json" || fail "summary trace: exit $?"
"$PY" -c "import json,sys; j=json.load(open(sys.argv[1])); assert j['upgraded_from_summary'] and j['clean'] and j['rows'] > 0, j" "$W/v3.json"
"$L" replay "$W/sum.h5" --capture full -o "$W/up.h5" -q > /dev/null || fail "replay --capture full"
"$L" inspect "$W/up.h5" > "$W/up.txt"
grep -q "capture: full" "$W/up.txt" || fail "replay --capture full did not capture values"

"$L" verify --help > "$W/h1.txt"
grep -q -- "--work-dir" "$W/h1.txt" || fail "help"
"$L" bisect --help > "$W/h2.txt"
grep -q -- "--seeds.*default: 8" "$W/h2.txt" || fail "bisect help shows no default for --seeds"
echo ok
