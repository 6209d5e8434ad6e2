#!/usr/bin/env bash
# bench/load/run.sh — CTest server_load: bench/load/load.mjs against a `lockstep serve` it
# starts itself. Prints "SKIP: …" and exits 0 without Node 18+.
# Usage: run.sh <lockstep binary> [load.mjs options…]
set -euo pipefail
command -v node >/dev/null || { echo "SKIP: node not installed"; exit 0; }
[ "$(node -p 'process.versions.node.split(".")[0]')" -ge 18 ] || { echo "SKIP: node $(node --version) is older than 18"; exit 0; }
bin=$1; shift
exec node "$(dirname "$0")/load.mjs" --bin "$bin" "$@"
