#!/usr/bin/env bash
# tools/demo.sh — the main job on the embedded default model (models/lockstep-tiny-v4, a small
# DeepSeek-V4-architecture model; DEMO_MODEL=models/lockstep-tiny-v32 runs the V3.2 one):
# installs what is missing, builds the `lockstep` binary, prints what the model is, generates
# from an HTML prompt at temperature 0.6 and greedily (where the model loops), then debugs the
# loop the way lockstep is meant to be used: degeneration rates per setting, a trace of the
# greedy run with the FP8 KV cache (V4: FlashMLA's MODEL1 layout), an exact replay (is it
# reproducible?), a teacher-forced replay with a BF16 cache and a bisect (which component
# explains it?), whose verdict is the one measured on this run.
# About 11 minutes on a fresh 2-core machine: ~8 to compile `lockstep`, ~3 to run (readme_test: 213 s
# for the demo and the README's other commands on a built tree).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
BUILD=${BUILD_DIR:-build}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j"$(nproc)" --target lockstep
LS="$BUILD/lockstep"
if [ -n "${DEMO_MODEL:-}" ]; then export LOCKSTEP_DEFAULT_MODEL=$(cd "$DEMO_MODEL" && pwd); fi
"$LS" model info
PROMPT=$'<!DOCTYPE html>\n<html>\n<head>\n<title>Counter</title>'
echo; echo "=== temperature 0.6, seed 1 ==="
"$LS" generate --prompt "$PROMPT" --echo --max-tokens 200 --temperature 0.6 --top-p 0.95 --seed 1
echo; echo "=== greedy (temperature 0) ==="
"$LS" generate --prompt "$PROMPT" --echo --max-tokens 200 --temperature 0
OUT=${DEMO_DIR:-$(mktemp -d)}
mkdir -p "$OUT"
echo; echo "=== how often does it degenerate? (lockstep degen) ==="
"$LS" degen --prompt "$PROMPT" --samples 8 --temperatures 0,0.6,1.0 --max-tokens 256 --ignore-eos -q
echo; echo "=== record the greedy run with an FP8 cache, replay it, bisect it (traces in $OUT) ==="
"$LS" record --prompt "$PROMPT" --max-tokens 256 --temperature 0 --ignore-eos --kv-cache fp8_e4m3 -o "$OUT/run.h5"
"$LS" inspect "$OUT/run.h5" | sed -n "1,3p;/^requests/,/^tensors/p"
"$LS" replay "$OUT/run.h5" -o "$OUT/replay.h5" -q
echo; echo "=== does the FP8 cache explain it? (teacher-forced replay with a BF16 cache) ==="
"$LS" replay "$OUT/run.h5" --mode forced --kv-cache bf16 -o "$OUT/bf16.h5" -q --html "$OUT/report.html" >"$OUT/forced.txt"
head -1 "$OUT/forced.txt"
"$LS" bisect "$OUT/run.h5" --work-dir "$OUT/bisect" -q
echo
echo "The traces are in $OUT; the report of the forced replay is $OUT/report.html."
echo "h5py reads the traces with HDF5_PLUGIN_PATH=$(cd "$BUILD" && pwd)/hdf5-plugins (docs/trace-format.md)."
