#!/usr/bin/env bash
# tools/demo.sh — the main job on the embedded default model: installs what is missing,
# builds the `lockstep` binary, prints what the model is, then generates from an HTML prompt
# at temperature 0.6 and greedily (where small models tend to loop). About 3–5 minutes on a
# fresh 2-core machine, nearly all of it compiling.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
BUILD=${BUILD_DIR:-build}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j"$(nproc)" --target lockstep
LS="$BUILD/lockstep"
"$LS" model info
PROMPT=$'<!DOCTYPE html>\n<html>\n<head>\n<title>Counter</title>'
echo; echo "=== temperature 0.6, seed 1 ==="
"$LS" generate --prompt "$PROMPT" --echo --max-tokens 200 --temperature 0.6 --top-p 0.95 --seed 1
echo; echo "=== greedy (temperature 0) ==="
"$LS" generate --prompt "$PROMPT" --echo --max-tokens 200 --temperature 0
