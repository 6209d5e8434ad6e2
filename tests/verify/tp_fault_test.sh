#!/usr/bin/env bash
# Emulated tensor parallelism (--emulate-tp, engine/tensor_parallel.h) met the way a bug meets the
# debugger: models/lockstep-tiny-v32 (8 heads, 8 experts) records three requests batched at
# emulated TP 8 with the collective-order fault allreduce=fault_rotate_by_row on (row i of a step
# summed from rank i mod 8: rows past a step's first change bits); `bisect` on that trace alone
# must name the all-reduce, as parallelism, at layer 0 of request 0 — the first row a rotated
# order reaches — and its batch check the same op. The clean TP 8 trace: no defect found, and
# `replay --emulate-tp 1` on it (the reduction order only) gives the same tokens with the logits
# moved by fp32 rounding alone.
#
# usage: tp_fault_test.sh LOCKSTEP PYTHON SRC [RECORD FLAGS...]   (e.g. --backend cuda: CTest
# gpu_tp_fault_rotate_by_row records on the GPU; bisect's twins still run on the CPU)
set -euo pipefail
L=$1 PY=$2 SRC=$3
shift 3
EXTRA=("$@")
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
M="$SRC/models/lockstep-tiny-v32"
"$PY" -c "
import json
for r in range(3):
    print(json.dumps({'prompt_ids': [(7 * i + 13 * r + 3) % 6000 for i in range(10 + 3 * r)], 'max_tokens': 6}))
" > "$W/prompts.jsonl"
rec() { "$L" record -m "$M" --prompts "$W/prompts.jsonl" -t 0 --ignore-eos --emulate-tp 8 -q ${EXTRA[@]+"${EXTRA[@]}"} "$@"; }
rec --fault fault_rotate_by_row -o "$W/bad.h5"
"$L" bisect "$W/bad.h5" --json -q --no-swaps --work-dir "$W/bb" > "$W/bad.json"
rec -o "$W/good.h5"
"$L" bisect "$W/good.h5" --json -q --no-swaps --work-dir "$W/gb" > "$W/good.json"
"$L" replay "$W/good.h5" --mode forced --emulate-tp 1 --json -q -o "$W/tp1.h5" > "$W/tp1.json"
"$PY" - "$W/bad.json" "$W/good.json" "$W/tp1.json" <<'PYEOF'
import json, sys
bad, good, tp1 = (json.load(open(p)) for p in sys.argv[1:4])
for j, name in ((bad, "faulty run"), (good, "clean run")):
    for s in j["evidence"]:
        e = s.get("evidence") or {}
        for k in ("run", "measured", "otherwise"):
            assert isinstance(e.get(k), str) and e[k].strip(), f"{name}: sentence without evidence.{k}: {s['text']}"
assert bad["defects"], "faulty run: no defect found:\n" + bad["verdict"]
d = bad["defects"][0]
f = d["first"]
assert d["op"] == "allreduce" and f["layer"] == 0 and f["request"] == 0 and f["position"] >= 1, \
    f"faulty run: first defect {d['op']} r{f['request']} L{f['layer']} p{f['position']}\n" + bad["verdict"]
assert "fault_rotate_by_row" in d["kernels"] and "parallelism" in d["kernels"], d["kernels"]
assert "parallelism" in bad["verdict"], bad["verdict"]
batch = [x for x in bad["defects"] if x["op"] == "batch_invariance"]
assert batch and "allreduce=fault_rotate_by_row" in batch[0]["kernels"], \
    f"faulty run: the batch check does not name the all-reduce: {[x['kernels'] for x in batch]}"
assert good["no_defect_found"] and good["verdict"].startswith("No defect found"), "clean run:\n" + good["verdict"]
assert "allreduce (" in good["verdict"], "clean run: the all-reduce was not verified:\n" + good["verdict"]
d1 = tp1.get("diff", tp1)
ls = d1["logit_summary"]
assert all(r["first_token_diff"] is None for r in d1["requests"]), "TP 1 replay: tokens changed"
assert ls["top1_flips"] == 0 and ls["max_kl"] < 1e-6, f"TP 1 replay: logits moved past fp32 rounding: {ls}"
print(f"ok: fault_rotate_by_row named as {d['op']} at r{f['request']} L{f['layer']} p{f['position']} ({d['kernels']}); "
      f"batch check: {batch[0]['kernels']}; clean TP 8: no defect; TP 8 → 1 replay: max KL {ls['max_kl']:.3g}, "
      f"identical rows {d1.get('identical')}")
PYEOF
