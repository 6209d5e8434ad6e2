#!/usr/bin/env bash
# lab/hdf5_string_damage.sh — does storing a trace's string attributes as variable-length UTF-8
# (h5py gives `str`) instead of fixed-length UTF-8 (h5py gives `bytes`) make damaged files more
# dangerous to read with this machine's libhdf5? Two files with the same groups and the same
# attribute texts are written by h5py, one with each kind of string. Every byte of each file is
# damaged in four ways (set to 0x00, to 0xFF, low bit flipped, high bit flipped), one at a time,
# and a small C reader (libhdf5's own API, as lockstep's reader uses it) opens the file and
# reads every string attribute of `/`, `/meta` and `/requests/0`. Each read is classed as ok
# (exit 0), refused (HDF5 reported an error), crashed (a signal) or hung (no exit in 5 s).
# About 4 minutes on 2 cores. The result is the reason docs/trace-format.md gives for keeping
# fixed-length strings.
# usage: bash lab/hdf5_string_damage.sh [WORK_DIR]
set -euo pipefail
W=${1:-$(mktemp -d)}
mkdir -p "$W"
cat >"$W/read_strings.c" <<'C'
#include <hdf5.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static int g_vlen;
static herr_t one(hid_t loc, const char* name, const H5A_info_t* info, void* total) {
  (void)info;
  hid_t a = H5Aopen(loc, name, H5P_DEFAULT);
  if (a < 0) return 0;
  hid_t t = H5Aget_type(a), s = H5Aget_space(a);
  if (t >= 0 && s >= 0 && H5Tget_class(t) == H5T_STRING && H5Sget_simple_extent_npoints(s) == 1) {
    if (g_vlen && H5Tis_variable_str(t) > 0) {
      hid_t mt = H5Tcopy(H5T_C_S1);
      H5Tset_size(mt, H5T_VARIABLE);
      H5Tset_cset(mt, H5T_CSET_UTF8);
      char* v = NULL;
      if (H5Aread(a, mt, &v) >= 0 && v) { *(size_t*)total += strlen(v); H5free_memory(v); }
      H5Tclose(mt);
    } else if (!g_vlen && H5Tis_variable_str(t) == 0 && H5Tget_size(t) < (1u << 20)) {
      char* v = calloc(H5Tget_size(t) + 1, 1);
      if (H5Aread(a, t, v) >= 0) *(size_t*)total += strlen(v);
      free(v);
    }
  }
  if (s >= 0) H5Sclose(s);
  if (t >= 0) H5Tclose(t);
  H5Aclose(a);
  return 0;
}
int main(int argc, char** argv) {
  if (argc != 3) return 2;
  g_vlen = strcmp(argv[1], "vlen") == 0;
  H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
  hid_t f = H5Fopen(argv[2], H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) return 1;
  size_t total = 0;
  const char* objects[] = {"/", "/meta", "/requests/0"};
  for (int i = 0; i < 3; i++) {
    hid_t o = H5Oopen(f, objects[i], H5P_DEFAULT);
    if (o < 0) continue;
    hsize_t idx = 0;
    H5Aiterate2(o, H5_INDEX_NAME, H5_ITER_NATIVE, &idx, one, &total);
    H5Oclose(o);
  }
  H5Fclose(f);
  printf("%zu\n", total);
  return 0;
}
C
cc -O1 -o "$W/read_strings" "$W/read_strings.c" -I/usr/include/hdf5/serial -L/usr/lib/x86_64-linux-gnu/hdf5/serial -lhdf5
/usr/bin/python3 - "$W" <<'PY'
import sys, h5py, numpy as np
w = sys.argv[1]
texts = {"format": "lockstep trace", "version": "1.2"}
meta = {f"k{i}": ("value ü %d " % i) * 5 for i in range(12)}
prompt = "<!DOCTYPE html>\n<html> ünïcode" * 3
for kind in ("vlen", "fixed"):
    enc = (lambda s: s) if kind == "vlen" else \
          (lambda s: np.array(s.encode(), dtype=h5py.string_dtype("utf-8", len(s.encode()))))
    with h5py.File(f"{w}/{kind}.h5", "w") as f:
        for k, v in texts.items(): f.attrs[k] = enc(v)
        m = f.create_group("meta")
        for k, v in meta.items(): m.attrs[k] = enc(v)
        r = f.create_group("requests/0")
        r.attrs["prompt_text"] = enc(prompt)
        r.create_dataset("tokens", data=np.arange(10))
PY
/usr/bin/python3 - "$W" <<'PY'
import os, subprocess, sys
from concurrent.futures import ThreadPoolExecutor
w = sys.argv[1]
def damage(kind, lo, hi, tag):
    base = open(f"{w}/{kind}.h5", "rb").read()
    out = {"ok": 0, "refused": 0, "crashed": 0, "hung": 0}
    path = f"{w}/{kind}.{tag}.h5"
    for off in range(lo, min(hi, len(base))):
        for k in range(4):
            b = bytearray(base)
            b[off] = (0x00, 0xFF, b[off] ^ 0x01, b[off] ^ 0x80)[k]
            if b[off] == base[off]: continue
            open(path, "wb").write(b)
            try:
                rc = subprocess.run([f"{w}/read_strings", kind, path], capture_output=True, timeout=5).returncode
                out["ok" if rc == 0 else "refused" if rc == 1 else "crashed"] += 1
            except subprocess.TimeoutExpired:
                out["hung"] += 1
    return out
for kind in ("fixed", "vlen"):
    n = os.path.getsize(f"{w}/{kind}.h5")
    half = n // 2
    with ThreadPoolExecutor(2) as ex:
        parts = list(ex.map(lambda a: damage(kind, *a), [(0, half, "a"), (half, n, "b")]))
    tot = {k: sum(p[k] for p in parts) for k in parts[0]}
    print(f"{kind:5s} strings: file {n} bytes, {sum(tot.values())} damaged copies: "
          f"ok {tot['ok']}, refused {tot['refused']}, crashed {tot['crashed']}, hung {tot['hung']}")
PY
