#!/usr/bin/env bash
# DeepSeek-V4's fault zoo (kernels/registry.cc, docs/fault-zoo.md) met the way a bug meets the
# debugger: models/lockstep-tiny-v4 records a 150-token prompt (past the sliding window of 64 and
# the CSA indexer's 32 candidates, m = 4) and 12 greedy tokens with the fault on; `bisect` on that
# trace alone must name the op, and the first (request, layer, position) where the fault acts,
# the kernels naming the fault; the clean trace must give "no defect found". Every sentence
# carries its evidence.
#
# usage: v4_fault_test.sh LOCKSTEP PYTHON SRC FAULT OP LAYER POSITION
set -euo pipefail
L=$1 PY=$2 SRC=$3 FAULT=$4 OP=$5 LAYER=$6 POS=$7
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
M="$SRC/models/lockstep-tiny-v4"
IDS=$("$PY" -c "print(','.join(str((11 * i + 5) % 6000) for i in range(150)))")
"$L" record -m "$M" --prompt-ids "$IDS" -n 12 -t 0 --ignore-eos --fault "$FAULT" -q -o "$W/bad.h5"
"$L" bisect "$W/bad.h5" --json -q --no-swaps --work-dir "$W/bb" > "$W/bad.json"
"$L" record -m "$M" --prompt-ids "$IDS" -n 12 -t 0 --ignore-eos -q -o "$W/good.h5"
"$L" bisect "$W/good.h5" --json -q --no-swaps --work-dir "$W/gb" > "$W/good.json"
"$PY" - "$W/bad.json" "$W/good.json" "$FAULT" "$OP" "$LAYER" "$POS" <<'PYEOF'
import json, sys
bad, good = (json.load(open(p)) for p in sys.argv[1:3])
fault, op, layer, pos = sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
for j, name in ((bad, "faulty run"), (good, "clean run")):
    assert j["evidence"], f"{name}: no sentences"
    for s in j["evidence"]:
        e = s.get("evidence") or {}
        for k in ("run", "measured", "otherwise"):
            assert isinstance(e.get(k), str) and e[k].strip(), f"{name}: sentence without evidence.{k}: {s['text']}"
    assert " ".join(s["text"] for s in j["evidence"]) == j["verdict"], f"{name}: the verdict has sentences without evidence"
assert bad["defects"], "faulty run: no defect found:\n" + bad["verdict"]
d = bad["defects"][0]
f = d["first"]
assert (d["op"], f["request"], f["layer"], f["position"]) == (op, 0, layer, pos), \
    f"faulty run: first defect {d['op']} at r{f['request']} L{f['layer']} p{f['position']}, want {op} r0 L{layer} p{pos}\n" + bad["verdict"]
assert fault in d["kernels"], f"faulty run: the defect's kernels ({d['kernels']}) do not name {fault}"
assert good["no_defect_found"] and good["verdict"].startswith("No defect found"), "clean run:\n" + good["verdict"]
print(f"ok: {fault} named as {op} at layer {layer}, position {pos} ({d['kernels']}); clean run: no defect found")
PYEOF
