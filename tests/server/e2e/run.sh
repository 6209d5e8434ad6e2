#!/usr/bin/env bash
# tests/server/e2e/run.sh — CTest server_e2e_openai: installs the pinned `openai` client
# (package-lock.json) into <build>/server_e2e with `npm ci`, then runs serve.test.mjs with
# node --test against `lockstep serve`. Prints "SKIP: …" and exits 0 when Node 20+ or npm is
# missing, or the npm registry cannot be reached and nothing is installed yet.
# Usage: run.sh <lockstep binary> <work dir>
set -euo pipefail
bin=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
work=$2
src=$(cd "$(dirname "$0")" && pwd)

command -v node >/dev/null && command -v npm >/dev/null || { echo "SKIP: node/npm not installed"; exit 0; }
major=$(node -p 'process.versions.node.split(".")[0]')
[ "$major" -ge 20 ] || { echo "SKIP: node $(node --version) is older than 20"; exit 0; }

mkdir -p "$work"
cp "$src/package.json" "$src/package-lock.json" "$src"/*.mjs "$work/"
cd "$work"
# npm ci again only when the lock file changed since the last install.
if ! cmp -s package-lock.json node_modules/.lockstep-installed-lock 2>/dev/null; then
  if ! timeout 30 npm ping --cache "$work/.npm-cache" >/dev/null 2>&1; then
    echo "SKIP: the npm registry cannot be reached (npm ping failed); the openai client cannot be installed"
    exit 0
  fi
  timeout 300 npm ci --no-audit --no-fund --cache "$work/.npm-cache"
  cp package-lock.json node_modules/.lockstep-installed-lock
fi
echo "openai $(node -p 'require("./node_modules/openai/package.json").version'), node $(node --version)"
LOCKSTEP_BIN="$bin" exec node --test --test-reporter=spec serve.test.mjs
