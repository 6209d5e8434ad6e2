#!/usr/bin/env bash
# tools/test.sh — the test command: installs what is missing, builds everything (CUDA code
# too when nvcc is at /usr/local/cuda), runs every CTest. GPU tests skip without a GPU.
# About 17 minutes on a fresh 2-core machine (the 2-core dev VM, 2026-12-03: the build with
# CUDA code 7 min, the 558 CTests 6 min); then, where clang is installed, the fuzz build
# (ASan + UBSan + libFuzzer, build-fuzz/, ~3 min to compile the six targets) and its bounded
# runs, CTest label `fuzz` (~1 min). FUZZ=0 skips that part.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
bash tools/install-deps.sh
BUILD=${BUILD_DIR:-build}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j"$(nproc)"
cd "$BUILD"
ctest --output-on-failure -j"$(nproc)" --timeout 900
cd "$ROOT"
CLANG=$(command -v clang++-14 || command -v clang++ || true)
if [ "${FUZZ:-1}" != 0 ] && [ -n "$CLANG" ]; then
  FB=${FUZZ_BUILD_DIR:-build-fuzz}
  cmake -S . -B "$FB" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOCKSTEP_FUZZ=ON -DLOCKSTEP_CUDA=OFF \
    -DCMAKE_CXX_COMPILER="$CLANG" -DCMAKE_C_COMPILER="${CLANG/clang++/clang}" >/dev/null
  cmake --build "$FB" -j"$(nproc)" --target fuzz_safetensors fuzz_config fuzz_tokenizer fuzz_openai_request \
    fuzz_trace_reader fuzz_trace_edits
  (cd "$FB" && ctest -L fuzz --output-on-failure)
fi
