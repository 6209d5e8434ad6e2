#!/usr/bin/env bash
# tests/server/serve_docs_test.sh BIN SOURCE_DIR — the `lockstep serve` commands the docs print
# (README.md's serving block, docs/server.md's first block, `lockstep serve --help`'s examples)
# run as printed, in order, in an empty directory: `lockstep`/`build/lockstep` is BIN, every
# `lockstep serve` gets `--port 0 --admin-port 0` and runs in the background (the next lines
# talk to the newest one, localhost:8000/8001 rewritten to its ports; CI may run tests side by
# side, so the fixed ports cannot be promised free). Each other line must exit 0; a curl line
# must answer JSON without "error", an admin capture `"verified":true` and write the trace it
# names, and SIGTERM must stop each server cleanly. Before all that, the documented serve line without its token file must fail at once
# with a one-line error that gives the command making the file (issue 28).
set -uo pipefail
LS=$(realpath "$1")
SRC=$(realpath "$2")
command -v curl >/dev/null || { echo "SKIP: curl is not installed (tools/install-deps.sh installs it)"; exit 0; }
command -v python3 >/dev/null || { echo "SKIP: python3 is not installed"; exit 0; }
TMP=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$TMP"
}
trap cleanup EXIT
fail=0
ok() { echo "ok   $*"; }
bad() { echo "FAIL $*"; fail=1; }

# The blocks. From --help: the indented lines after "Examples"; from the markdown files: the
# lines of the fenced block that holds `lockstep serve --capture-dir`, continuations joined.
help_block() {
  "$LS" serve --help | awk '/^Examples/ {on=1; next} on && /^  / {sub(/^  /, ""); print; next} on {exit}'
}
md_block() {  # FILE: the first ```sh block with a `serve --capture-dir` line
  python3 - "$1" <<'EOF'
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
for block in re.findall(r"```sh\n(.*?)```", text, re.S):
    if "serve --capture-dir" in block:
        print(block.replace("\\\n", " "), end="")
        break
EOF
}
strip_comment() {  # a trailing "   # …" comment (two or more spaces before the #)
  sed -E 's/[[:space:]]{2,}#[[:space:]].*$//' <<<"$1"
}

# A missing token file: the error says how to make one, before any model is loaded.
mkdir -p "$TMP/missing" && cd "$TMP/missing" || exit 1
line=$(md_block "$SRC/README.md" | grep -m1 'serve --capture-dir')
line=$(strip_comment "$line")
cmd="${line/build\/lockstep/$LS} --port 0 --admin-port 0"
err=$(timeout 20 bash -c "$cmd" 2>&1 >/dev/null)
rc=$?
if [[ $rc -ne 0 && $rc -ne 124 && $(wc -l <<<"$err") -eq 1 && "$err" == *"token.txt"* &&
      "$err" == *"head -c 32 /dev/urandom | base64 > token.txt"* ]]; then
  ok "serve without token.txt: $err"
else
  bad "serve without token.txt (exit $rc): $err"
fi
fix=$(sed -E 's/.*create one with: //' <<<"$err")
bash -c "$fix" && [[ -s token.txt ]] && ok "the error's own command makes token.txt" || bad "the error's command: $fix"

run_block() {  # NAME: runs the block on stdin
  local name=$1 api="" admin="" n=0
  local dir="$TMP/$name"
  mkdir -p "$dir" && cd "$dir" || return
  local lines=()
  mapfile -t lines
  for raw in "${lines[@]}"; do
    [[ -z "${raw// /}" || "$raw" =~ ^[[:space:]]*# ]] && continue
    local line
    line=$(strip_comment "$raw")
    n=$((n + 1))
    if [[ "$line" =~ ^(build/)?lockstep\ serve ]]; then
      local cmd="$LS${line#*lockstep} --port 0 --admin-port 0"
      : >"$dir/serve$n.log"
      timeout 120 bash -c "exec $cmd" 2>"$dir/serve$n.log" &
      PIDS+=($!)
      local i
      for i in $(seq 1 200); do
        grep -q "lockstep serve: API on" "$dir/serve$n.log" && break
        kill -0 "${PIDS[-1]}" 2>/dev/null || break
        sleep 0.1
      done
      api=$(grep -o 'API on http://[0-9.]*:[0-9]*' "$dir/serve$n.log" | grep -o '[0-9]*$')
      admin=$(grep -o 'admin on http://[0-9.]*:[0-9]*' "$dir/serve$n.log" | grep -o '[0-9]*$')
      if [[ -n "$api" && -n "$admin" ]]; then ok "$name: $line"; else bad "$name: $line: $(tail -3 "$dir/serve$n.log")"; fi
      continue
    fi
    local cmd=$line
    cmd=${cmd//localhost:8000/127.0.0.1:$api}
    cmd=${cmd//localhost:8001/127.0.0.1:$admin}
    local out rc
    out=$(timeout 120 bash -c "$cmd" 2>&1)
    rc=$?
    if [[ $rc -ne 0 ]]; then
      bad "$name: $line: exit $rc: $out"
      continue
    fi
    if [[ "$line" == curl* ]]; then
      if ! python3 -c '
import json, os, sys
j = json.loads(sys.argv[1])
assert isinstance(j, dict) and "error" not in j, "an error answer"
if "/admin/capture/" in sys.argv[2]:
    assert j.get("verified") is True, "not verified"
    assert os.path.getsize(j["trace"]) > 0, "no trace file"
' "$out" "$line" 2>"$dir/check.err"; then
        bad "$name: $line: $(tail -1 "$dir/check.err"): ${out:0:400}"
        continue
      fi
    fi
    ok "$name: $line"
  done
  # SIGTERM stops each server cleanly within 10 s (`timeout` passes the TERM on to the server
  # and then to its group: the server sees two).
  for p in "${PIDS[@]}"; do
    kill -TERM "$p" 2>/dev/null
    local t
    for t in $(seq 1 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$p" 2>/dev/null; then
      bad "$name: a server did not stop within 10 s of SIGTERM"
      kill -KILL "$p" 2>/dev/null
    fi
    wait "$p" 2>/dev/null
    local rc=$?
    [[ $rc -eq 0 ]] && ok "$name: a server stopped on SIGTERM (exit 0)" || bad "$name: a server's exit on SIGTERM: $rc"
  done
  PIDS=()
}

run_block readme < <(md_block "$SRC/README.md")
run_block server-md < <(md_block "$SRC/docs/server.md")
run_block help < <(help_block)
# Each block must have exercised the admin capture, not only started a server.
for name in readme server-md help; do
  ls "$TMP/$name"/caps/*.h5 >/dev/null 2>&1 && ok "$name: a capture was written" || bad "$name: no capture in caps/"
done
exit $fail
