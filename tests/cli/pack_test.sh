#!/usr/bin/env bash
# tests/cli/pack_test.sh — `lockstep pack` end to end (issue 31): a pack of one request of a
# 4-request trace replays exactly on the receiver's side, and is refused, naming each mismatch on
# its own line, with another model, a modified copy of the model, another recorded version, a
# damaged pack, or no model at all.
#
# The receiver here is the same binary in another directory, with the model copied to another
# folder (the sender's meta.model_dir is moved away first, so nothing of the sender's is used:
# the pack and -m are all the receiver has).
# Usage: pack_test.sh LOCKSTEP_BINARY SOURCE_DIR
set -u
LS=$1
SRC=$2
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail=0
ok() { echo "ok   $1"; }
bad() { echo "FAIL $1"; fail=1; }
export OMP_NUM_THREADS=1
export HDF5_PLUGIN_PATH
HDF5_PLUGIN_PATH="$(dirname "$LS")/hdf5-plugins"

# The sender: the shipped tiny model (it has a tokenizer) in its own folder, 4 requests at batch 4
# (greedy and sampled), a full capture with the KV cache.
mkdir -p "$TMP/sender" "$TMP/receiver"
cp -r "$SRC/models/lockstep-tiny-v32" "$TMP/sender/model"
rm -f "$TMP/sender/model/.lockstep-fingerprint.json"
cat >"$TMP/sender/p.jsonl" <<'EOF'
{"prompt": "Hello there", "id": "a"}
{"prompt": "The quick brown fox", "id": "b", "temperature": 0.7, "seed": 5}
{"prompt_ids": [5, 6, 7, 8, 9], "id": "c", "temperature": 1.0, "seed": 11}
{"prompt": "Once upon a time", "id": "d"}
EOF
(cd "$TMP/sender" && "$LS" record -m model --prompts p.jsonl -n 6 --max-batch 4 -o run.h5 -q) || bad "record"
(cd "$TMP/sender" && "$LS" pack run.h5 --request 2 -o report.h5 >out.txt) && ok "pack: $(head -1 "$TMP/sender/out.txt")" ||
  bad "pack failed: $(cat "$TMP/sender/out.txt")"
# The pack holds exactly request 2's rows of every tensor (renumbered 0), per h5py.
/usr/bin/python3 - "$TMP/sender/run.h5" "$TMP/sender/report.h5" >"$TMP/rows.txt" <<'EOF'
import sys
import h5py
import numpy as np
src, pack = (h5py.File(p, "r") for p in sys.argv[1:3])
bad = 0
for g in ("taps", "kv"):
    for n in src[g]:
        s = src[g][n]["summary"][...]
        mine = s[s["request"] == 2]
        p = pack[g][n]["summary"][...]
        if len(p) != len(mine) or (p["request"] != 0).any() or (p["hash"] != mine["hash"]).any() or \
           (p["position"] != mine["position"]).any():
            bad += 1
            print("differs:", g, n, len(p), len(mine))
        if "values" in src[g][n]:
            v = src[g][n]["values"][...][s["request"] == 2]
            if not np.array_equal(pack[g][n]["values"][...], v):
                bad += 1
                print("values differ:", g, n)
print("requests", list(pack["requests"]), "sampling rows", len(pack["sampling"]),
      "tokenizer", "tokenizer.json" in pack["pack"], "bad", bad)
EOF
grep -q "requests \['0'\] sampling rows 6 tokenizer True bad 0" "$TMP/rows.txt" &&
  ok "pack holds request 2's rows of every tap and KV stream, its 6 sampling rows and the tokenizer (h5py)" ||
  bad "pack contents: $(cat "$TMP/rows.txt")"

# The receiver: the pack and a copy of the model; the sender's folder is gone.
mv "$TMP/sender/report.h5" "$TMP/receiver/"
cp -r "$TMP/sender/model" "$TMP/receiver/model"
mv "$TMP/sender" "$TMP/sender-gone"
cd "$TMP/receiver" || exit 1
"$LS" inspect report.h5 >insp.txt 2>&1
grep -q "^pack: request 2 ('c') of run.h5" insp.txt && grep -q "^pack needs: the model's weights with fingerprint xxh3-64:" insp.txt &&
  grep -q "and lockstep [0-9.]* (" insp.txt && ok "inspect: what the pack holds and needs" || bad "inspect: $(head -5 insp.txt)"
"$LS" inspect --json report.h5 | /usr/bin/python3 -c "
import json, sys
j = json.load(sys.stdin)['pack']
assert j['request'] == '2' and j['needs']['model_fingerprint'].startswith('xxh3-64:') and j['holds']['tokenizer.json'] > 0, j
" && ok "inspect --json: pack.needs, pack.holds" || bad "inspect --json has no pack section"
"$LS" replay report.h5 -m model -o r.h5 >rep.txt 2>&1
rc=$?
[ $rc -eq 0 ] && grep -q "^deterministic: 1 request(s), 6 tokens" rep.txt &&
  ok "replay of the pack on the receiver's side: $(head -1 rep.txt)" || bad "replay of the pack (rc $rc): $(cat rep.txt)"

expect_refused() {  # description, command, expected lines (each must be on a line of its own)...
  local what=$1 cmd=$2
  shift 2
  eval "$cmd" >/dev/null 2>e.txt
  local rc=$? miss=""
  for want in "$@"; do grep -qF -- "$want" e.txt || miss="$miss [$want]"; done
  if [ $rc -ne 0 ] && [ $rc -lt 128 ] && [ -z "$miss" ] && tail -1 e.txt | grep -q "nothing replayed"; then
    ok "$what: refused, $(($(wc -l <e.txt) - 1)) line(s): $(head -c 300 e.txt | tr '\n' '|')"
  else
    bad "$what (rc $rc) missing$miss: $(cat e.txt)"
  fi
}
# Another model altogether.
expect_refused "another model (fixture v32_sparse)" "'$LS' replay report.h5 -m '$SRC/tests/fixtures/models/v32_sparse' -o x.h5" \
  "model fingerprint: " "model config: " "tokenizer: "
# A modified copy: one bit of the weights and one config field.
cp -r model model2
rm -f model2/.lockstep-fingerprint.json
/usr/bin/python3 - <<'EOF'
import json
c = json.load(open("model2/config.json"))
c["rms_norm_eps"] = 1e-5
json.dump(c, open("model2/config.json", "w"))
with open("model2/model.safetensors", "r+b") as f:
    f.seek(-1, 2)
    b = f.read(1)
    f.seek(-1, 2)
    f.write(bytes([b[0] ^ 1]))
EOF
expect_refused "a modified copy of the model" "'$LS' replay report.h5 -m model2 -o x.h5" "model fingerprint: model2 has " \
  "model config: model2/config.json differs from the packed one in rms_norm_eps"
# --allow-model-mismatch lets the model lines pass (and says so), not the rest.
"$LS" replay report.h5 -m model2 --allow-model-mismatch -o x.h5 >/dev/null 2>e.txt
grep -q "(allowed)" e.txt && ok "--allow-model-mismatch: model lines marked allowed" || bad "--allow-model-mismatch: $(cat e.txt)"
# Another recorded version.
cp report.h5 old.h5
/usr/bin/python3 -c "
import h5py, numpy as np
with h5py.File('old.h5', 'r+') as f:
    f['meta'].attrs['recorded_with'] = np.bytes_('lockstep 0.0.9 (0123456789ab)')
"
expect_refused "a pack recorded by another lockstep version" "'$LS' replay old.h5 -m model -o x.h5" \
  "lockstep version: recorded with lockstep 0.0.9 (0123456789ab), this is lockstep "
# A damaged pack: a changed summary hash is named by its manifest entry.
cp report.h5 dmg.h5
/usr/bin/python3 -c "
import h5py, numpy as np
with h5py.File('dmg.h5', 'r+') as f:
    d = f['taps/layers.0.attn.out/summary']
    a = d[...]
    a['hash'][0] ^= np.uint64(1)
    d[...] = a
"
expect_refused "a damaged pack" "'$LS' replay dmg.h5 -m model -o x.h5" "manifest: taps/layers.0.attn.out/summary has xxh3 "
expect_refused "a pack without -m" "'$LS' replay report.h5 -o x.h5" "model: a pack carries no weights; pass the model folder with -m DIR"

# The packer's own refusals.
"$LS" pack report.h5 --request 5 -o y.h5 2>e.txt && bad "pack of a missing request succeeded" ||
  { grep -q "no request 5 (it holds 0)" e.txt && ok "pack --request 5: $(cat e.txt)" || bad "pack --request 5: $(cat e.txt)"; }
"$LS" pack report.h5 --request 0 -o report.h5 2>e.txt && bad "pack -o <its input> succeeded" ||
  { grep -q "is the trace being packed" e.txt && ok "pack -o <its input> refused" || bad "pack -o input: $(cat e.txt)"; }
# A pack of a pack (request 0) replays too, and keeps the first recording's version.
"$LS" pack report.h5 --request 0 -o again.h5 -m model >/dev/null && "$LS" replay again.h5 -m model -o a.replay.h5 -q | grep -q "^deterministic" &&
  ok "a pack of a pack replays" || bad "pack of a pack"

exit $fail
