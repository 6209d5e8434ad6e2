#!/usr/bin/env bash
# tests/gpu/record_replay_gpu.sh — CTest gpu_record_replay (label gpu): the issue-6 workflow
# end to end with the CLI. Record on the GPU (full capture, sampled at T 0.8), replay exactly
# on the GPU (bit-identical: exit 0), then replay teacher-forced on the CPU reference and
# check the two backends agree to fp32 rounding (same tokens, every tensor within rel L2 1e-3);
# and a gemm=bf16_dot GPU trace replayed exactly on the CPU: bit-identical.
# Then the same generation with summary capture, whose tap summaries the GPU computes where the
# tensors live (no values copied out): every summary field of every tap row must equal the
# full capture's (h5py) — computed on the host from the values for prefill rows, on the GPU
# beside the lent values for decode rows (gpu_engine_test checks those against the host's
# traces::Summarize of the values: FullCaptureLendsTheValuesWithTheirSummaries); and the KV
# cache rows' summaries, which summary capture takes from the GPU too (TapHook::WantsKvSummaries).
# Skips (exit 77) when the build has no CUDA or the machine no GPU.
set -uo pipefail
bin=${1:?usage: record_replay_gpu.sh <lockstep binary>}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
probe=$("$bin" generate --backend cuda --prompt hi -n 1 --quiet 2>&1)
if [ $? -ne 0 ]; then
  case $probe in
    *"without CUDA"*|*"no CUDA device"*|*"CUDA driver"*) echo "SKIP: $probe"; exit 77 ;;
  esac
  echo "FAIL: probe: $probe"; exit 1
fi
"$bin" record --backend cuda --prompt "The history of the printing press" -n 24 --temperature 0.8 --seed 3 \
  --capture full -o "$dir/gpu.h5" -q || { echo "FAIL: record"; exit 1; }
"$bin" replay "$dir/gpu.h5" -o "$dir/exact.h5" -q > "$dir/exact.txt" 2>&1
rc=$?
cat "$dir/exact.txt"
[ $rc -eq 0 ] || { echo "FAIL: exact replay on the GPU exited $rc (not bit-identical)"; exit 1; }
"$bin" replay "$dir/gpu.h5" --backend cpu --mode forced --json -o "$dir/cpu.h5" -q > "$dir/cpu.json" 2>"$dir/cpu.err"
rc=$?
[ $rc -eq 0 ] || [ $rc -eq 3 ] || { cat "$dir/cpu.err"; echo "FAIL: replay on the CPU exited $rc"; exit 1; }
python3 - "$dir/cpu.json" <<'PY' || exit 1
import json, sys
j = json.load(open(sys.argv[1]))
assert "backend=cpu" in j["overrides"], j["overrides"]
worst = max(float(t["worst_rel_l2"]) for t in j["tensors"] if t["worst_rel_l2"] is not None)  # null: not measured
print("cpu vs gpu:", j["verdict"], "| worst rel L2 over", len(j["tensors"]), "tensors:", worst)
for r in j["requests"]:
    assert r["first_token_diff"] is None and r["tokens_a"] == r["tokens_b"], r
assert worst <= 1e-3, worst
# The default gemm=fp32 is cuBLAS on the GPU: the verdict says the bits differ as expected, and why.
assert "as expected: gemm=fp32" in j["verdict"], j["verdict"]
PY
# Under the GPU's variants the CPU reference replays a GPU trace exactly: gemm=bf16_dot on the
# GPU; the teacher-forced replay on the CPU carries the resolved kernels (bf16_dot, the
# absorbed prefill, norm=lanes256), and `diff --exact` of the two traces must find every tap,
# cache row and token bit-identical (exit 0; 3 names the first differing tensor).
"$bin" record --backend cuda --kernel gemm=bf16_dot --prompt "The history of the printing press" -n 24 \
  --temperature 0.8 --seed 3 --capture full -o "$dir/gpu_bf16.h5" -q || { echo "FAIL: record gemm=bf16_dot"; exit 1; }
"$bin" replay "$dir/gpu_bf16.h5" --backend cpu --mode forced -o "$dir/cpu_bf16.h5" -q > "$dir/cpu_bf16.txt" 2>&1
rc=$?
[ $rc -eq 0 ] || [ $rc -eq 3 ] || { cat "$dir/cpu_bf16.txt"; echo "FAIL: replay of the bf16_dot trace on the CPU exited $rc"; exit 1; }
grep -q "every captured row is bit-identical across the two backends" "$dir/cpu_bf16.txt" ||
  { cat "$dir/cpu_bf16.txt"; echo "FAIL: the replay's verdict does not report the bits as identical"; exit 1; }
"$bin" diff "$dir/gpu_bf16.h5" "$dir/cpu_bf16.h5" --exact > "$dir/diff_bf16.txt" 2>&1
rc=$?
head -4 "$dir/diff_bf16.txt"
[ $rc -eq 0 ] || { cat "$dir/diff_bf16.txt"; echo "FAIL: a gemm=bf16_dot GPU trace and its CPU replay are not bit-identical (diff exit $rc)"; exit 1; }
"$bin" record --backend cuda --prompt "The history of the printing press" -n 24 --temperature 0.8 --seed 3 \
  --capture summary -o "$dir/gpu_summary.h5" -q || { echo "FAIL: record --capture summary"; exit 1; }
python3 - "$dir/gpu.h5" "$dir/gpu_summary.h5" <<'PY' || exit 1
import sys
import h5py
import numpy as np
full, summ = h5py.File(sys.argv[1], "r"), h5py.File(sys.argv[2], "r")
# Every tap's summaries, the logits' too (summarised on the GPU as well); the logits' top-k
# and logsumexp exist in full capture only.
names = [n for n in full["taps"] if not n.startswith("logits.")]
assert "logits" in names and sorted(names) == sorted(n for n in summ["taps"] if not n.startswith("logits.")), \
    list(summ["taps"])
rows = 0
for n in names:
    a, b = full["taps"][n]["summary"][...], summ["taps"][n]["summary"][...]
    assert "values" not in summ["taps"][n] or summ["taps"][n]["values"].shape[0] == 0, n
    assert a.shape == b.shape, (n, a.shape, b.shape)
    for f in a.dtype.names:
        if f == "step":
            continue
        if a[f].tobytes() != b[f].tobytes():
            i = int(np.nonzero(a[f] != b[f])[0][0])
            sys.exit(f"FAIL: {n} field {f} row {i}: full capture {a[i]} vs summary capture {b[i]}")
    rows += a.shape[0]
print(f"gpu summaries: {rows} rows over {len(names)} taps equal full capture's, field for field")
# The KV cache rows as stored: summarised by the GPU where it stores them in summary capture,
# by the trace writer from the copied-back bytes in full capture.
kv = sorted(full["kv"])
assert kv and kv == sorted(summ["kv"]), (list(full["kv"]), list(summ["kv"]))
rows = 0
for n in kv:
    a, b = full["kv"][n]["summary"][...], summ["kv"][n]["summary"][...]
    assert a.shape == b.shape, (n, a.shape, b.shape)
    for f in a.dtype.names:
        if f != "step" and a[f].tobytes() != b[f].tobytes():
            i = int(np.nonzero(a[f] != b[f])[0][0])
            sys.exit(f"FAIL: kv/{n} field {f} row {i}: full capture {a[i]} vs summary capture {b[i]}")
    rows += a.shape[0]
print(f"gpu kv summaries: {rows} rows over {len(kv)} cache parts ({full['kv'][kv[0]].attrs.get('kv_format')}) "
      "equal full capture's, field for field")
PY
echo "PASS"
