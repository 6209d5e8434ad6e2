#!/usr/bin/env bash
# tests/cli/taps_doc_test.sh — docs/tap-points.md's table is the tap table (engine/tap.h):
# `lockstep taps --markdown` must print exactly the table the doc holds, and every tap name a
# real trace records must be one the table lists (per layer or model-level), so the doc, the
# engine and the traces cannot drift apart.
# Usage: taps_doc_test.sh LOCKSTEP_BINARY SOURCE_DIR
set -u
LS=$1
SRC=$2
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail=0
sed -n '/^| name | cols/,/^$/p' "$SRC/docs/tap-points.md" | sed '/^$/d' >"$TMP/doc.md"
"$LS" taps --markdown >"$TMP/table.md"
if diff -u "$TMP/doc.md" "$TMP/table.md" >"$TMP/d"; then
  echo "ok   docs/tap-points.md's table is \`lockstep taps --markdown\` ($(wc -l <"$TMP/table.md") lines)"
else
  echo "FAIL docs/tap-points.md and the tap table (engine/tap.h) disagree:"; cat "$TMP/d"; fail=1
fi
# Every tap a V3.2 trace records is in the table.
"$LS" record -m "$SRC/tests/fixtures/models/v32_sparse" --prompt-ids 5,6,7,8,9 -n 3 -o "$TMP/t.h5" -q || fail=1
"$LS" taps --json >"$TMP/taps.json"
"$LS" inspect "$TMP/t.h5" --json | /usr/bin/python3 -c '
import json, re, sys
taps = json.load(open(sys.argv[1]))
known = {t["name"] for t in taps}
trace = json.load(sys.stdin)
names = [t["path"][5:] for t in trace["tensors"] if t["path"].startswith("taps/")]
bad = [n for n in names if re.sub(r"^layers\.\d+\.", "layers.L.", n) not in known and not n.startswith("logits.")]
assert not bad, f"taps the table does not list: {bad}"
assert len(names) > 20, names
print(f"ok   the {len(names)} taps of a V3.2 trace are all in the table")
' "$TMP/taps.json" || fail=1
exit $fail
