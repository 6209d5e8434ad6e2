#!/usr/bin/env bash
# A hidden fault met the way a real bug meets the debugger: the faulty build (the switch on for
# every command) records 4 requests × 40 tokens, and `bisect` — given that trace alone, no
# known-good one — must name the op and the first (request, layer, position) where the fault
# acts; the same requests recorded by the clean build must give "no defect found". Both
# verdicts are read sentence by sentence: each must carry its evidence.
#
# usage: hidden_fault_test.sh LOCKSTEP PYTHON SRC CLEAN_DIR FAULT OP REQUEST LAYER POSITION [record flags…]
#        hidden_fault_test.sh --clean LOCKSTEP CLEAN_DIR [record flags…]
#   OP is bisect's first defect's op (batch_invariance:<op> for a batch-dependence finding),
#   LAYER "-" for model-level ops. The clean build's verdict does not depend on the fault: the
#   --clean form (a CTest fixture, one per set of record flags) writes it to CLEAN_DIR/good.json
#   once for every fault recorded with those flags.
set -euo pipefail
prompts() {
  cat > "$1" <<'P'
{"prompt": "The quick brown fox"}
{"prompt": "Once upon a time"}
{"prompt": "def main():"}
{"prompt": "<html><body>"}
P
}
if [ "$1" = --clean ]; then
  L=$2 C=$3
  shift 3
  rm -rf "$C" && mkdir -p "$C"
  prompts "$C/p.jsonl"
  "$L" record --prompts "$C/p.jsonl" -n 40 --ignore-eos -q -o "$C/good.h5" "$@"
  "$L" bisect "$C/good.h5" --json -q --no-swaps --work-dir "$C/gb" > "$C/good.json.tmp"
  mv "$C/good.json.tmp" "$C/good.json"
  rm -rf "$C/gb" "$C/good.h5"
  exit 0
fi
L=$1 PY=$2 SRC=$3 C=$4 FAULT=${5%%@*} OP=$6 REQ=$7 LAYER=$8 POS=$9  # FAULT@LABEL: the label names the test only
shift 9
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
prompts "$W/p.jsonl"
run() { LOCKSTEP_TEST_HIDDEN_FAULT=$FAULT "$@"; }

# The trace names the defaults only: the switch is recorded nowhere.
run "$L" record --prompts "$W/p.jsonl" -n 40 --ignore-eos -q -o "$W/bad.h5" "$@"
if grep -a -q "$FAULT" "$W/bad.h5"; then echo "FAIL: the trace names the hidden fault"; exit 1; fi
run "$L" bisect "$W/bad.h5" --json -q --no-swaps --work-dir "$W/bb" > "$W/bad.json"
"$PY" - "$W/bad.json" "$C/good.json" "$OP" "$REQ" "$LAYER" "$POS" <<'PYEOF'
import json, sys
bad, good = (json.load(open(p)) for p in sys.argv[1:3])
op, req, layer, pos = sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
def evidence_ok(j, name):
    # Every sentence has its experiment, and the verdict is exactly those sentences.
    ev = j["evidence"]
    assert ev, f"{name}: no sentences"
    for s in ev:
        e = s.get("evidence") or {}
        for k in ("run", "measured", "otherwise"):
            assert isinstance(e.get(k), str) and e[k].strip(), f"{name}: sentence without evidence.{k}: {s['text']}"
    assert " ".join(s["text"] for s in ev) == j["verdict"], f"{name}: the verdict has sentences without evidence"
evidence_ok(bad, "faulty build")
evidence_ok(good, "clean build")
assert bad["defects"], "faulty build: no defect found:\n" + bad["verdict"]
d = bad["defects"][0]
got = d["op"] if d["op"] != "batch_invariance" else "batch_invariance:" + d["kernels"]
f = d["first"]
want_layer = None if layer == "-" else int(layer)
assert (got, f["request"], f["layer"], f["position"]) == (op, req, want_layer, pos), \
    f"faulty build: first defect {got} at r{f['request']} L{f['layer']} p{f['position']}, want {op} r{req} L{want_layer} p{pos}\n" + bad["verdict"]
assert "Defect" in bad["verdict"] or "Batch dependence" in bad["verdict"], bad["verdict"]
assert good["no_defect_found"] and good["verdict"].startswith("No defect found"), "clean build:\n" + good["verdict"]
print(f"ok: {got} at request {req}, layer {layer}, position {pos}; clean build: no defect found")
PYEOF
