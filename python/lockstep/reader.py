"""lockstep/reader.py — opens a lockstep trace (docs/trace-format.md) with h5py.

    import lockstep
    t = lockstep.open_trace("run.h5")                 # finds the zstd plugin, checks the format
    t.requests[0].prompt, t.requests[0].generated     # int32 arrays
    t.values("layers.3.attn.out", request=0)          # [rows, cols] float32, position order
    t.summary("layers.3.attn.out", request=0)         # SummaryRow records
    t.verify()                                        # every stored row against its XXH3-64
    t.kv(3, request=0)                                # the latent cache rows, dequantised

Every problem with the file is one TraceError whose message names the file and the field.
An incomplete trace (complete = 0, a recorder that died) is read as lockstep's TraceReader
reads it: each table's leading readable chunks, or the chunk directory's when the index is
torn, then the sidecar's tail (<trace>.tails).

Not thread-safe; a Trace holds the file open until close() (or `with`).
"""
import os

import numpy as np

from . import dtypes as _dt
from ._format import (FINISHED, FORMAT_MAJOR, MAGIC, MAX_CHUNK_DECODED_BYTES, MAX_CHUNK_ROWS, MAX_COLS,
                      MAX_POSITION, MAX_READ_BYTES, MAX_ROWS, SAMPLING, STEP, STORED, SUMMARY, TraceError,
                      ensure_plugin, text)

_CHUNK_RECORD = np.dtype([("table", "<u8"), ("index", "<i8"), ("address", "<u8"), ("size", "<u8"),
                          ("filter_mask", "<u4"), ("check", "<u4")])


class Request:
    """One request: `id` (the engine's), `name`, `prompt` and `generated` (int32 arrays),
    `prompt_text`, `generated_text`, `finish_reason` and the sampling defaults."""

    def __repr__(self):
        return (f"Request(id={self.id}, name={self.name!r}, prompt={len(self.prompt)} tokens, "
                f"generated={len(self.generated)} tokens, finish_reason={self.finish_reason!r})")


class Tensor:
    """A tap or KV tensor: `name` (without taps/ or kv/), `path`, `dtype`, `cols`,
    `has_values`, `attrs` (the group's other attributes), `rows`."""

    def __repr__(self):
        return f"Tensor({self.path!r}, {self.dtype}, {self.rows} x {self.cols}, values={self.has_values})"


class Trace:
    def __init__(self, path, plugin_path=None):
        import h5py
        self.path = str(path)
        self._h5 = h5py
        # Tables are zstd-compressed unless a writer was told not to (TraceWriter(compress=False)):
        # without the plugin the first read of a compressed table raises this error.
        found = ensure_plugin(plugin_path, required=False)
        self._plugin_error = found if isinstance(found, TraceError) else None
        self.plugin_dir = None if self._plugin_error else found
        if not os.path.exists(self.path):
            raise TraceError(f"{self.path}: no such file")
        with open(self.path, "rb") as fh:
            head = fh.read(8)
        if head != b"\x89HDF\r\n\x1a\n":
            raise TraceError(f"{self.path}: not an HDF5 file (no HDF5 signature), so not a lockstep trace")
        try:
            self._f = h5py.File(self.path, "r")
        except Exception as e:
            raise TraceError(f"{self.path}: cannot open (truncated, damaged, or still being written?): {_why(e)}")
        self._side = None
        self._cache = {}
        self._shard_rows = {}  # a sharded tensor's rows every shard holds (None: not readable)
        try:
            self._load()
        except TraceError:
            self.close()
            raise
        except Exception as e:  # h5py/HDF5 errors on a damaged file: one line, never a traceback
            self.close()
            raise TraceError(f"{self.path}: {_why(e)}")

    # -- opening ----------------------------------------------------------------------------
    def _err(self, field, why):
        return TraceError(f"{self.path}: {field}: {why}")

    def _attr(self, obj, name, where):
        if name not in obj.attrs:
            raise self._err(f"{where}attribute '{name}'", "missing")
        try:
            return obj.attrs[name]
        except Exception as e:
            raise self._err(f"{where}attribute '{name}'", f"unreadable ({_why(e)})")

    def _int_attr(self, obj, name, where=""):
        v = np.asarray(self._attr(obj, name, where))
        if v.shape != () or v.dtype.kind not in "iu":
            raise self._err(f"{where}attribute '{name}'", "not an integer")
        return int(v)

    def _num_attr(self, obj, name, where, lo, hi, whole=False):
        v = np.asarray(self._attr(obj, name, where))
        if v.shape != () or v.dtype.kind not in "iuf":
            raise self._err(f"{where}attribute '{name}'", "not a number")
        x = float(v)
        if not (lo <= x <= hi) or (whole and x != np.floor(x)):
            raise self._err(f"{where}attribute '{name}'", f"{x} is not {'a whole number ' if whole else ''}in [{lo}, {hi}]")
        return int(x) if whole else x

    def _str_attr(self, obj, name, where=""):
        v = self._attr(obj, name, where)
        if not isinstance(v, (bytes, np.bytes_, str)):
            raise self._err(f"{where}attribute '{name}'", "not a string")
        return text(v)

    def _load(self):
        f = self._f
        if "lockstep_trace" not in f.attrs:
            raise TraceError(f"{self.path}: not a lockstep trace (root attribute 'lockstep_trace' missing)")
        if self._str_attr(f, "lockstep_trace") != MAGIC:
            raise self._err("root attribute 'lockstep_trace'", f"is not '{MAGIC}'")
        v = np.asarray(self._attr(f, "format_version", "root "))
        if v.shape != (2,) or v.dtype.kind not in "iu":
            raise self._err("root attribute 'format_version'", "must be [major, minor] integers")
        self.format_version = (int(v[0]), int(v[1]))
        if self.format_version[0] > FORMAT_MAJOR:
            raise TraceError(f"{self.path}: trace format {self.format_version[0]}.{self.format_version[1]} is newer "
                             f"than this reader reads ({FORMAT_MAJOR}.x); open it with a newer lockstep")
        if self.format_version[0] < 1:
            raise self._err("root attribute 'format_version'", f"{self.format_version[0]} was never written")
        self.complete = self._int_attr(f, "complete", "root ") == 1
        self.flushed_steps = self._int_attr(f, "flushed_steps", "root ")
        self.writer = self._str_attr(f, "writer", "root ")
        if not self.complete and os.path.exists(self.path + ".tails"):
            try:
                self._side = self._h5.File(self.path + ".tails", "r")
            except Exception as e:
                raise TraceError(f"{self.path}.tails: cannot open ({_why(e)})")
        for g in ("meta", "requests", "taps"):
            if g not in f or not isinstance(f[g], self._h5.Group):
                raise self._err(f"group '/{g}'", "missing")
        self.meta = {k: self._str_attr(f["meta"], k, "meta ") for k in f["meta"].attrs}
        self._check_table("sampling", SAMPLING)
        self._check_table("steps", STEP)
        self.tensors = {}
        for group in ("taps", "kv"):
            if group in f:
                for name in f[group]:
                    t = self._load_tensor(group, name)
                    self.tensors[t.path] = t
        self.requests = self._load_requests()

    def _check_table(self, path, dtype, cols=None):
        if path not in self._f:
            raise self._err(f"dataset '{path}'", "missing")
        d = self._f[path]
        if not isinstance(d, self._h5.Dataset):
            raise self._err(f"'{path}'", "is not a dataset")
        if d.dtype != dtype:
            raise self._err(f"'{path}'", f"element type {d.dtype.str if d.dtype.names is None else 'a compound'} is not the one this format stores")
        want_rank = 1 if cols is None else 2
        if d.ndim != want_rank or (cols is not None and d.shape[1] != cols):
            raise self._err(f"'{path}'", f"shape {d.shape} does not match " + ("[rows]" if cols is None else f"[rows, {cols}]"))
        if d.chunks is None or any(c != s for c, s in zip(d.chunks[1:], d.shape[1:])):
            raise self._err(f"'{path}'", "not chunked along rows")
        cr = d.chunks[0]
        if cr > MAX_CHUNK_ROWS or cr * d.dtype.itemsize * (1 if cols is None else cols) > MAX_CHUNK_DECODED_BYTES:
            raise self._err(f"'{path}'", f"chunks of {cr} rows are larger than the format allows")
        if "chunk_rows" in d.attrs and self._int_attr(d, "chunk_rows", f"'{path}' ") != cr:
            raise self._err(f"'{path}' attribute 'chunk_rows'", f"does not match the chunks of {cr} rows")
        if d.shape[0] > MAX_ROWS:
            raise self._err(f"'{path}'", f"claims {d.shape[0]} rows, more than any trace holds")
        if self.complete:
            try:
                stored = d.id.get_num_chunks()
            except Exception as e:
                raise self._err(f"'{path}'", f"chunk index unreadable ({_why(e)})")
            if d.shape[0] > stored * cr:
                raise self._err(f"'{path}'", f"claims {d.shape[0]} rows but stores {stored} chunks of {cr}")
        return d

    def _load_tensor(self, group, name):
        where = f"{group}/{name}"
        g = self._f[where]
        if not isinstance(g, self._h5.Group):
            raise self._err(f"'{where}'", "is not a group")
        if name.startswith("layers."):
            num = name.split(".")[1]
            if not num.isdigit() or int(num) >= 1 << 16:
                raise self._err(f"'{where}'", f"layer index '{num}' is not a number below 65536")
        t = Tensor()
        t.name, t.path, t.group = name, where, group
        t.dtype = self._str_attr(g, "dtype", f"'{where}' ")
        if t.dtype not in STORED:
            raise self._err(f"'{where}' attribute 'dtype'", f"'{t.dtype}' is not one of {', '.join(STORED)}")
        t.cols = self._int_attr(g, "cols", f"'{where}' ")
        if not 0 < t.cols <= MAX_COLS:
            raise self._err(f"'{where}' attribute 'cols'", "out of range")
        t.has_values = self._int_attr(g, "has_values", f"'{where}' ") == 1
        t.attrs = {}
        for a in g.attrs:
            if a in ("dtype", "cols", "has_values"):
                continue
            v = g.attrs[a]
            t.attrs[a] = text(v) if isinstance(v, (bytes, np.bytes_, str)) else v.item() if hasattr(v, "item") else v
        self._check_table(where + "/summary", SUMMARY)
        t.shards = 0
        if "shards" in t.attrs:
            self._bind_shards(t, where)
        elif t.has_values:
            self._check_table(where + "/values", STORED[t.dtype], t.cols)
        t.rows = len(self._summary_all(t))
        return t

    def _bind_shards(self, t, where):
        """Format 1.3: the values lie in rank shards (docs/trace-format.md "Rank shards"), read
        through `values`, a virtual dataset; every mapping must name the shard /meta names, a
        plain file beside the trace. A missing shard, or a trace that did not close (its shards'
        unfinished rows are in their own sidecars), leaves the tensor without values."""
        n = t.attrs.pop("shards")
        files = [self.meta.get(f"shard_file_{r}") for r in range(int(n))] if isinstance(n, int) else []
        if not isinstance(n, int) or not 2 <= n <= 64 or t.cols % n or t.has_values or self.meta.get("shard_ranks") != str(n):
            raise self._err(f"'{where}' attribute 'shards'", f"{n} does not match /meta's shards and the tensor's columns")
        for r, fn in enumerate(files):
            if not fn or fn in (".", "..") or "/" in fn or "\\" in fn or len(fn) > 255 or any(ord(c) < 32 for c in fn):
                raise self._err(f"meta 'shard_file_{r}'", f"{fn!r} is not a file name beside the trace")
        d = self._f[where + "/values"] if "values" in self._f[where] else None
        if d is None or not d.is_virtual or len(d.virtual_sources()) != n:
            raise self._err(f"'{where}/values'", f"not a virtual dataset of its {n} shards")
        for r, src in enumerate(d.virtual_sources()):
            if src.file_name != files[r] or src.dset_name != where + "/values":
                raise self._err(f"'{where}/values'", f"mapping {r} reads {src.file_name!r}:{src.dset_name!r}, not the "
                                f"shard /meta names ({files[r]!r})")
        t.shards = n
        folder = os.path.dirname(os.path.abspath(self.path))
        paths = [os.path.join(folder, fn) for fn in files]
        self._shard_rows[where] = None
        if self.complete and all(os.path.isfile(p) for p in paths):
            rows = []
            for p in paths:
                with self._h5.File(p, "r") as sf:
                    if sf["meta"].attrs.get("shard_run_id") is None or text(sf["meta"].attrs["shard_run_id"]) != self.meta.get("shard_run_id"):
                        raise TraceError(f"{p}: not a shard of {self.path} (its shard_run_id differs)")
                    rows.append(sf[where + "/values"].shape[0])
            self._shard_rows[where] = min(rows)
            t.has_values = True

    def _load_requests(self):
        out = []
        for n in self._f["requests"]:
            p = f"requests/{n}"
            try:
                out.append(self._load_request(n, p))
            except TraceError:
                if self.complete:
                    raise
        out.sort(key=lambda r: r.id)
        return out

    def _load_request(self, n, p):
        if not n.isdigit() or int(n) > 2**31 - 1:
            raise self._err(f"'{p}'", "not a request id")
        g = self._f[p]
        r = Request()
        r.id = int(n)
        w = f"'{p}' "
        r.name = self._str_attr(g, "name", w)
        r.max_new_tokens = self._num_attr(g, "max_new_tokens", w, 0, 1 << 26, True)
        r.temperature = self._num_attr(g, "temperature", w, 0, 1e6)
        r.top_k = self._num_attr(g, "top_k", w, 0, 1 << 26, True)
        r.top_p = self._num_attr(g, "top_p", w, 0, 1)
        r.min_p = self._num_attr(g, "min_p", w, 0, 1)
        r.seed = self._int_attr(g, "seed", w) & (2**64 - 1)
        r.prompt = self._tokens(p + "/prompt")
        r.prompt_text = self._string_dataset(p + "/prompt_text")
        fp = p + "/final" if "final" in g else p
        fin = self._f[fp]
        r.generated, r.generated_text, r.finish_reason = None, "", ""
        if "generated" in fin and "finish_reason" in fin.attrs:
            r.generated = self._tokens(fp + "/generated")
            r.finish_reason = self._str_attr(fin, "finish_reason", f"'{fp}' ")
            if "generated_text" in fin:
                r.generated_text = self._string_dataset(fp + "/generated_text")
        if r.generated is None:  # not finished when the trace was last flushed: /sampling has them
            s = self.sampling()
            mine = s[s["request"] == r.id]
            mine = mine[np.argsort(mine["token_index"], kind="stable")]
            r.generated = mine["token"].astype(np.int32)
            fin_rows = mine[mine["finished"] != 0]
            r.finish_reason = FINISHED.get(int(fin_rows["finished"][-1]), "other") if len(fin_rows) else ""
        return r

    def _tokens(self, path):
        if path not in self._f:
            raise self._err(f"dataset '{path}'", "missing")
        d = self._f[path]
        if not isinstance(d, self._h5.Dataset) or d.ndim != 1 or d.dtype.kind not in "iu":
            raise self._err(f"'{path}'", "expected a 1-D token list")
        if d.shape[0] > 1 << 26:
            raise self._err(f"'{path}'", f"claims {d.shape[0]} tokens")
        return np.asarray(d[...], dtype=np.int32)

    def _string_dataset(self, path):
        if path not in self._f:
            raise self._err(f"dataset '{path}'", "missing")
        d = self._f[path]
        if not isinstance(d, self._h5.Dataset) or d.shape != () or d.dtype.kind != "S":
            raise self._err(f"'{path}'", "not a scalar fixed-length string")
        if d.dtype.itemsize > 1 << 30 or d.id.get_storage_size() < d.dtype.itemsize:
            raise self._err(f"'{path}'", "declared size is not stored in the file")
        return text(d[()])

    # -- tables -----------------------------------------------------------------------------
    def _read_table(self, path):
        """All rows of a table, the incomplete-trace rule applied (docs/trace-format.md)."""
        if path in self._cache:
            return self._cache[path]
        d = self._f[path]
        nbytes = d.shape[0] * d.dtype.itemsize * int(np.prod(d.shape[1:], dtype=np.int64))
        if nbytes > MAX_READ_BYTES:
            raise self._err(f"'{path}'", f"a read of {nbytes} bytes, more than 8 GiB at once")
        try:
            rows = d[...] if self.complete else self._read_incomplete(d, path)
        except TraceError:
            raise
        except Exception as e:
            if self._plugin_error is not None and _uses_zstd(d):
                raise TraceError(f"{self.path}: '{path}': {self._plugin_error}")
            raise self._err(f"'{path}'", f"unreadable ({_why(e)})")
        self._cache[path] = rows
        return rows

    def _read_incomplete(self, d, path):
        cr = d.chunks[0]
        try:
            backed = d.id.get_num_chunks() * cr
        except Exception:
            backed = None
        if backed is None:
            main = self._read_directory(d, path)
        else:
            parts, n = [], min(len(d), backed)
            for start in range(0, n, cr):
                try:
                    parts.append(d[start:min(n, start + cr)])
                except OSError:
                    break
            main = np.concatenate(parts) if parts else d[0:0]
        if self._side is None or "tails" not in self._side:
            return main
        for tail in self._side["tails"].values():
            if "count" not in tail.attrs or text(tail.attrs.get("target", b"")) != path:
                continue
            base, count = int(tail.attrs["base"]), int(tail.attrs["count"])
            if count > cr or count > len(tail) or tail.dtype != d.dtype:
                raise TraceError(f"{self.path}.tails: tail of {path} does not match the table")
            if base <= len(main) < base + count:
                return np.concatenate([main, tail[len(main) - base:count]])
        return main

    def _read_directory(self, d, path):
        """The leading chunks <trace>.chunks lists for `path`, decoded by HDF5 itself: written
        with write_direct_chunk into an in-memory dataset with the table's creation
        properties, then read back."""
        import xxhash
        h5py = self._h5
        empty = d[0:0]
        try:
            raw = open(self.path + ".chunks", "rb").read()
        except OSError:
            return empty
        if raw[:8] != b"lschunk1":
            return empty
        n = (len(raw) - 8) // _CHUNK_RECORD.itemsize
        recs = np.frombuffer(raw, dtype=_CHUNK_RECORD, count=n, offset=8)
        want = xxhash.xxh3_64_intdigest(path.encode())
        chunks = {}
        for i, r in enumerate(recs):
            at = 8 + i * _CHUNK_RECORD.itemsize
            if int(r["check"]) == xxhash.xxh3_64_intdigest(raw[at:at + 36]) & 0xFFFFFFFF and int(r["table"]) == want:
                chunks[int(r["index"])] = r
        size = os.path.getsize(self.path)
        lead = []
        while len(lead) in chunks:
            r = chunks[len(lead)]
            if int(r["filter_mask"]) != 0 or int(r["address"]) + int(r["size"]) > size:
                break
            lead.append(r)
        if not lead:
            return empty
        cr = d.chunks[0]
        shape = (len(lead) * cr,) + d.shape[1:]
        mem = h5py.File(f"lockstep-recovered-{id(d)}", "w", driver="core", backing_store=False)
        m = h5py.h5d.create(mem.id, b"t", d.id.get_type(), h5py.h5s.create_simple(shape, shape),
                            dcpl=d.id.get_create_plist())
        with open(self.path, "rb") as fh:
            for r in lead:
                fh.seek(int(r["address"]))
                m.write_direct_chunk((int(r["index"]) * cr,) + (0,) * (len(shape) - 1), fh.read(int(r["size"])), 0)
        out = mem["t"][...]
        mem.close()
        return out

    def _summary_all(self, t):
        s = self._read_table(t.path + "/summary")
        if len(s) and (s["position"].min() < 0 or s["position"].max() >= MAX_POSITION or s["request"].min() < 0):
            raise self._err(f"'{t.path}/summary'", "a row's position or request id is out of range")
        if t.has_values and getattr(t, "shards", 0):
            n = min(len(s), self._shard_rows[t.path])
            if self.complete and n != len(s):
                raise self._err(f"'{t.path}'", f"{len(s)} summary rows but {n} value rows in its shards")
            s = s[:n]
        elif t.has_values:
            # The tensor's rows are those both its summary and its values hold.
            n = min(len(s), len(self._read_table(t.path + "/values")))
            if self.complete and n != len(s):
                raise self._err(f"'{t.path}'", f"{len(s)} summary rows but {len(self._read_table(t.path + '/values'))} value rows")
            s = s[:n]
        return s

    def tensor(self, name):
        """A Tensor by name: 'layers.3.attn.out', 'taps/logits', 'kv/layers.0.latent'."""
        for key in (name, "taps/" + name, "kv/" + name):
            if key in self.tensors:
                return self.tensors[key]
        raise KeyError(f"{self.path}: no tensor '{name}' (it has {len(self.tensors)}: "
                       + ", ".join(sorted(self.tensors)[:8]) + ("…" if len(self.tensors) > 8 else "") + ")")

    def _select(self, t, request):
        s = self._summary_all(t)
        if request is None:
            return np.arange(len(s)), s
        idx = np.nonzero(s["request"] == int(request))[0]
        idx = idx[np.argsort(s["position"][idx], kind="stable")]
        return idx, s[idx]

    def summary(self, name, request=None):
        """SummaryRow records of a tensor: all rows in file order, or one request's by position."""
        return self._select(self.tensor(name), request)[1]

    def stored(self, name, request=None):
        """Rows as stored (uint16 for bf16, uint8 for fp8), aligned with summary(name, request)."""
        t = self.tensor(name)
        if not t.has_values and getattr(t, "shards", 0):
            raise TraceError(f"{self.path}: {t.path}: its values lie in {t.shards} rank shards, which are not all "
                             "beside the trace (or the trace did not close: read it with lockstep)")
        if not t.has_values:
            raise TraceError(f"{self.path}: {t.path}: only summaries were captured (has_values = 0)")
        idx, _ = self._select(t, request)
        if getattr(t, "shards", 0):  # through the virtual dataset, the rows every shard holds
            rows = self._shard_rows[t.path]
            return self._f[t.path + "/values"][:rows][idx]
        return self._read_table(t.path + "/values")[idx]

    def values(self, name, request=None):
        """Rows as numbers: float32 for f32/bf16/fp8 (fp8 without its scale: see kv()), int32."""
        t = self.tensor(name)
        return _dt.decode(self.stored(name, request), t.dtype)

    def positions(self, name, request):
        return self.summary(name, request)["position"]

    def sampling(self):
        return self._read_table("sampling")

    def steps(self):
        return self._read_table("steps")

    def request(self, rid):
        for r in self.requests:
            if r.id == rid or r.name == rid:
                return r
        raise KeyError(f"{self.path}: no request {rid!r}")

    # -- checks and derived views -----------------------------------------------------------
    def verify(self, names=None):
        """Checks every stored row's XXH3-64 against its summary (and the summary's statistics
        against the row); returns the number of rows checked, raises TraceError at the first
        that differs."""
        checked = 0
        for t in self.tensors.values():
            if names is not None and t.name not in names and t.path not in names:
                continue
            if not t.has_values:
                continue
            s = self._summary_all(t)
            v = self._read_table(t.path + "/values")[:len(s)]
            mine = _dt.summarize(v, t.dtype, s["request"], s["position"], s["step"])
            bad = np.nonzero(mine["hash"] != s["hash"])[0]
            if len(bad):
                i = int(bad[0])
                raise TraceError(f"{self.path}: {t.path} row {i} (request {s['request'][i]}, position "
                                 f"{s['position'][i]}): values hash to {mine['hash'][i]:#x}, the summary says {s['hash'][i]:#x}")
            for f in ("nan_count", "inf_count", "min", "max"):
                diff = np.nonzero(mine[f].view(np.uint32) != s[f].view(np.uint32))[0] if mine[f].dtype.itemsize == 4 else []
                if len(diff):
                    i = int(diff[0])
                    raise TraceError(f"{self.path}: {t.path} row {i}: summary {f} {s[f][i]} but the values give {mine[f][i]}")
            checked += len(s)
        return checked

    def kv(self, layer, stream="latent", request=None):
        """The KV cache rows of one layer and stream, dequantised to float32 as attention read
        them: fp32 as stored; bf16 decoded; fp8_e4m3 e4m3 × its 128-value tile's scale, then
        the bf16 RoPE part (latent) — [rows, kv_lora + rope] or [rows, index_head_dim];
        DeepSeek-V4's MODEL1 rows (stream 'window' / 'compressed') e4m3 × the ue8m0 scale of
        each 64 values, then the bf16 rope part — [rows, head_dim]."""
        base = f"kv/layers.{layer}.{stream}"
        t = self.tensor(base)
        v = self.stored(base, request)
        if t.dtype != "fp8_e4m3":
            return _dt.decode(v, t.dtype).astype(np.float32)
        scales = self.stored(base + ".scales", request)
        if self.tensor(base + ".scales").dtype == "u8":
            # DeepSeek-V4's MODEL1 rows: e4m3 × 2^(ue8m0 − 127) per 64 values (0xFF: NaN).
            exps = np.asarray(scales, dtype=np.int64)
            s = np.where(exps == 0xFF, np.float32(np.nan), np.ldexp(np.float32(1), exps - 127)).astype(np.float32)
            out = _dt.dequantize_fp8(v, s, tile=64)
        else:
            out = _dt.dequantize_fp8(v, scales)
        if base + ".rope" in self.tensors:
            out = np.concatenate([out, _dt.bf16_to_f32(self.stored(base + ".rope", request))], axis=1)
        return out

    def logits(self, request):
        """One request's logits rows by position: {'positions', 'values'} for full logits, or
        {'positions', 'ids', 'values', 'logsumexp'} where only the top-k was stored, with
        'logsumexp_t' (the logsumexp at the request's sampling temperature) where it was sampled."""
        t = self.tensors.get("taps/logits")
        if t is not None and t.has_values:
            return {"positions": self.positions("logits", request), "values": self.values("logits", request)}
        if "taps/logits.topk_ids" not in self.tensors:
            raise TraceError(f"{self.path}: no logits values stored (taps/logits has summaries only)")
        out = {"positions": self.positions("logits.topk_ids", request), "ids": self.values("logits.topk_ids", request),
               "values": self.values("logits.topk_values", request),
               "logsumexp": self.values("logits.logsumexp", request)[:, 0]}
        if "taps/logits.logsumexp_t" in self.tensors:
            lt = self.values("logits.logsumexp_t", request)
            if len(lt):
                out["logsumexp_t"] = lt[:, 0]
        return out

    def close(self):
        for h in (getattr(self, "_f", None), getattr(self, "_side", None)):
            if h is not None:
                try:
                    h.close()
                except Exception:
                    pass
        self._f = self._side = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _uses_zstd(d):
    try:
        plist = d.id.get_create_plist()
        return any(plist.get_filter(i)[0] == 32015 for i in range(plist.get_nfilters()))
    except Exception:
        return False


def _why(e):
    msg = str(e).strip().splitlines()
    return msg[0] if msg else type(e).__name__


def open_trace(path, plugin_path=None):
    """Opens a lockstep trace; raises TraceError (file and field named) for bad input."""
    return Trace(path, plugin_path)
