#!/usr/bin/env bash
# tests/readme_test.sh — README.md's commands, run literally as a new user types them, in a
# fresh clone of this checkout (so every file they write lands there, not in the source tree),
# with `build/` pointing at the build under test. Every ```sh block is read line by line:
#   - commands that need what this machine lacks are listed as skipped, with the reason: a
#     checkpoint the README names as path/to/…, a GPU (--backend cuda, the GPU benchmarks) —
#     tests/gpu/run_on_gpu.sh runs this script on the GPU machine, where those run too —, and
#     `bash tools/test.sh` (this test is part of it);
#   - `lockstep serve` starts in the background and the lines after it talk to it;
#   - every other line runs in one bash process (so `P=…` carries over) and must exit 0
#     (`diff` and `replay` may exit 3, "they differ"); the admin capture must write its trace.
# Usage: readme_test.sh BUILD_DIR SOURCE_DIR
set -u
BUILD=$(cd "$1" && pwd)
SRC=$(cd "$2" && pwd)
TMP=$(mktemp -d)
SERVER_PID=
cleanup() {
  [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  rm -rf "$TMP"
}
trap cleanup EXIT
fail=0
have_gpu=0
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && [ -f "$BUILD/lockstep" ] &&
  "$BUILD/lockstep" kernels --json | grep -q '"backend": "cuda"' && have_gpu=1

# A clean clone of what is committed, plus the uncommitted README (so a README edit is tested
# before it is committed), with build/ = the build under test.
git clone -q --no-hardlinks "$SRC" "$TMP/clone" 2>/dev/null || cp -r "$SRC" "$TMP/clone"
cp "$SRC/README.md" "$TMP/clone/README.md"
rm -rf "$TMP/clone/build"
if [ -f "$BUILD/CMakeCache.txt" ]; then
  ln -s "$BUILD" "$TMP/clone/build"
else
  # A folder of staged binaries (flat): build/ gets the layout a build tree has (bench/ under
  # it), and the default model is this clone's, as the README says (staged binaries carry the
  # build machine's absolute path to it).
  mkdir -p "$TMP/clone/build/bench"
  for f in "$BUILD"/*; do ln -s "$f" "$TMP/clone/build/"; done
  for f in "$BUILD"/bench_*; do [ -e "$f" ] && ln -s "$f" "$TMP/clone/build/bench/"; done
  export LOCKSTEP_DEFAULT_MODEL=$TMP/clone/models/lockstep-tiny-v4
fi
cd "$TMP/clone" || exit 1

# The README's sh blocks, continuation lines joined.
/usr/bin/python3 - README.md >"$TMP/commands" <<'PY'
import sys
lines, block, cur = [], False, ""
for raw in open(sys.argv[1], encoding="utf-8"):
    line = raw.rstrip("\n")
    if line.startswith("```"):
        block = line.strip() == "```sh" if not block else False
        continue
    if not block:
        continue
    if line.endswith("\\"):
        cur += line[:-1] + " "
        continue
    cur += line
    if cur.strip():
        lines.append(cur.strip())
    cur = ""
for l in lines:
    print(l.replace("\n", " "))
PY

run_line() {  # one README line in the shared shell state file
  local line=$1
  printf '%s\n' "$line" >>"$TMP/session.sh"
}
n_run=0
n_skip=0
: >"$TMP/session.sh"
while IFS= read -r line; do
  case "$line" in
    "#"*) continue ;;
  esac
  why=
  case "$line" in
    *"bash tools/test.sh"*) why="the test command itself (CI runs it)" ;;
    *path/to/*) why="needs a checkpoint this machine does not have (path/to/…)" ;;
  esac
  # A folder of staged binaries (the GPU machine's, tools/stage-gpu-bin.sh) is no CMake tree:
  # the lines that build run where the build tree is (CI, a developer's machine).
  if [ -z "$why" ] && [ ! -f "$BUILD/CMakeCache.txt" ]; then
    case "$line" in
      *"tools/demo.sh"* | *"cmake --build"*) why="builds: run where the CMake build tree is" ;;
    esac
  fi
  if [ -z "$why" ] && [ $have_gpu -eq 0 ]; then
    case "$line" in
      *"--backend cuda"* | *gpu.h5* | *gpu16.h5* | *bench_gpu_decode*) why="needs a GPU" ;;
    esac
  fi
  if [ -n "$why" ]; then
    echo "skip $line   [$why]"
    n_skip=$((n_skip + 1))
    continue
  fi
  n_run=$((n_run + 1))
  printf '%s\n' "$line" >>"$TMP/run-list"
done <"$TMP/commands"

# Runs the list in one shell; a serve line is started in the background and waited for.
i=0
: >"$TMP/env.sh"
while IFS= read -r line; do
  i=$((i + 1))
  log="$TMP/cmd$i.log"
  case "$line" in
    *"lockstep serve"*)
      cmd=${line%%#*}
      (source "$TMP/env.sh"; eval "exec $cmd") >"$log" 2>&1 &
      SERVER_PID=$!
      for _ in $(seq 1 300); do
        curl -s -o /dev/null localhost:8000/v1/models && curl -s -o /dev/null localhost:8001/ && break
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 0.2
      done
      if kill -0 "$SERVER_PID" 2>/dev/null; then echo "ok   $line   [serving]"; else
        echo "FAIL $line: the server did not start:"; tail -5 "$log"; fail=1
      fi
      continue
      ;;
  esac
  # Variable assignments carry over to the lines after them.
  case "$line" in
    [A-Za-z_]*=*) printf '%s\n' "$line" >>"$TMP/env.sh" ;;
  esac
  start=$(date +%s)
  case "$line" in
    *"bash tools/demo.sh"*)
      # The first command builds into build/: run it where the build under test was configured.
      (cd "$SRC" && BUILD_DIR="$BUILD" bash tools/demo.sh) >"$log" 2>&1 </dev/null ;;
    *) bash -c "source '$TMP/env.sh'; $line" >"$log" 2>&1 </dev/null ;;
  esac
  rc=$?
  secs=$(($(date +%s) - start))
  allowed=0
  case "$line" in
    *"lockstep diff"* | *"lockstep replay"*) [ $rc -eq 3 ] && allowed=1 ;;
  esac
  if [ $rc -eq 0 ] || [ $allowed -eq 1 ]; then
    echo "ok   $line   [exit $rc, ${secs} s]"
  else
    echo "FAIL $line   [exit $rc]:"
    tail -5 "$log" | sed 's/^/     /'
    fail=1
  fi
  case "$line" in
    *"bash tools/demo.sh"*)
      ls "$BUILD"/hdf5-plugins/*.so >/dev/null 2>&1 && echo "ok   the demo leaves the HDF5 plugin built" ||
        { echo "FAIL no HDF5 plugin in $BUILD/hdf5-plugins after the demo"; fail=1; }
      grep -q "positions changed their most likely token" "$log" ||
        { echo "FAIL the demo's forced replay says nothing about the logits"; fail=1; } ;;
    *"/v1/completions"*)
      grep -q '"choices"' "$log" || { echo "FAIL the completion has no choices: $(head -c 300 "$log")"; fail=1; } ;;
    *"/admin/capture/"*)
      id=${line##*/admin/capture/}
      id=${id%% *}
      grep -q '"error"' "$log" && { echo "FAIL the admin capture answered an error: $(head -c 300 "$log")"; fail=1; }
      [ -s "caps/$id.h5" ] && "$BUILD/lockstep" inspect "caps/$id.h5" >/dev/null &&
        echo "ok   caps/$id.h5 is a trace lockstep opens" || { echo "FAIL no readable caps/$id.h5"; fail=1; }
      # A server capture names the lockstep that wrote it, as every trace does.
      "$BUILD/lockstep" inspect "caps/$id.h5" | head -1 | grep -q "written by lockstep [0-9]" &&
        echo "ok   the capture names its writer's version" || { echo "FAIL the capture names no writer version"; fail=1; } ;;
  esac
done <"$TMP/run-list"

echo "$n_run README commands run, $n_skip skipped"
[ $n_run -ge 10 ] || { echo "FAIL only $n_run commands found in README.md"; fail=1; }
exit $fail
