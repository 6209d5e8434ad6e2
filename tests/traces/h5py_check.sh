#!/usr/bin/env bash
# tests/traces/h5py_check.sh DRIVER PLUGIN_DIR WORK_DIR SOURCE_DIR — records the v32 fixture
# with each KV-cache format (full capture), once with FP8 indexer keys (indexer=fp8_paged) and
# once as a summary capture, then checks each
# trace with h5py (check_trace.py) through our HDF5 plugin.
set -euo pipefail
driver=$1 plugins=$2 work=$3 src=$4
mkdir -p "$work"
export HDF5_PLUGIN_PATH=$plugins
for kv in fp32 bf16 fp8_e4m3; do
  "$driver" --model "$src/tests/fixtures/models/v32_sparse" --kv "$kv" --out "$work/$kv.h5" --expect "$work/$kv.json"
  /usr/bin/python3 "$src/tests/traces/check_trace.py" "$work/$kv.h5" "$work/$kv.json"
done
# indexer=fp8_paged: the V3.2 keys stored as FP8 rows (values, then scales).
"$driver" --model "$src/tests/fixtures/models/v32_sparse" --kv bf16 --indexer fp8_paged --out "$work/fp8keys.h5" \
  --expect "$work/fp8keys.json"
/usr/bin/python3 "$src/tests/traces/check_trace.py" "$work/fp8keys.h5" "$work/fp8keys.json"
"$driver" --model "$src/tests/fixtures/models/v3_basic" --kv fp32 --capture summary --out "$work/summary.h5" \
  --expect "$work/summary.json"
/usr/bin/python3 "$src/tests/traces/check_trace.py" "$work/summary.h5" "$work/summary.json"
