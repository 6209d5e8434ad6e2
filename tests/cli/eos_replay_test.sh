#!/usr/bin/env bash
# tests/cli/eos_replay_test.sh LOCKSTEP SOURCE_DIR — a request that stopped at its end-of-sequence
# token before its token limit replays exactly: the replay runs to the recorded token count but
# keeps the recorded limit, so diff does not call it "sampling parameters differ".
# The tiny model rarely emits its EOS, so a copy of it names a frequent token as EOS.
set -euo pipefail
bin=$1 src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$src/models/lockstep-tiny-v32" "$work/model"
"$bin" record -m "$work/model" -p "<div class=\"container\"><ul><li>" -n 48 -t 0 --capture summary -o "$work/probe.h5" -q
eos=$("$bin" inspect "$work/probe.h5" --json | /usr/bin/python3 -c '
import json, sys, collections
j = json.load(sys.stdin)
gen = j["requests"][0]["generated"]
print(gen[len(gen) // 2])')   # a token greedy decoding emits mid-way: it stops there
/usr/bin/python3 - "$work/model/config.json" "$eos" <<'PY'
import json, sys
p, eos = sys.argv[1], int(sys.argv[2])
c = json.load(open(p)); c["eos_token_id"] = eos; json.dump(c, open(p, "w"))
PY
rm -f "$work/model/generation_config.json"
"$bin" record -m "$work/model" -p "<div class=\"container\"><ul><li>" -n 48 -t 0 -o "$work/run.h5" -q
n=$("$bin" inspect "$work/run.h5" --json | /usr/bin/python3 -c '
import json, sys; r = json.load(sys.stdin)["requests"][0]; print(len(r["generated"]))')
[ "$n" -lt 48 ] || { echo "FAIL: the request did not stop at the EOS token ($n tokens)"; exit 1; }
out=$("$bin" replay "$work/run.h5" -o "$work/rep.h5" -q) || { echo "$out"; echo "FAIL: exact replay of an EOS-stopped request exited $?"; exit 1; }
echo "$out" | grep -q "^deterministic" || { echo "$out"; echo "FAIL: not deterministic"; exit 1; }
"$bin" replay "$work/run.h5" --mode forced -o "$work/forced.h5" -q > /dev/null || { echo "FAIL: forced replay"; exit 1; }
"$bin" diff "$work/run.h5" "$work/forced.h5" > "$work/d.txt" || { cat "$work/d.txt"; echo "FAIL: forced replay differs"; exit 1; }
echo "ok: a request that stopped at EOS after $n of 48 tokens replays exactly and forced"
