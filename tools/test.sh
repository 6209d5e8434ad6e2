#!/usr/bin/env bash
# tools/test.sh — the test command: installs what is missing, builds everything (CUDA code
# too when nvcc is at /usr/local/cuda), runs every CTest. GPU tests skip without a GPU.
# About 6–10 minutes on a fresh 2-core machine (most of it compiling).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
BUILD=${BUILD_DIR:-build}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j"$(nproc)"
cd "$BUILD"
ctest --output-on-failure -j"$(nproc)" --timeout 900
