"""lockstep/writer.py — writes a lockstep trace (format 1.3, docs/trace-format.md) that
lockstep's own TraceReader, `inspect`, `diff` and `replay` accept.

    w = lockstep.TraceWriter("run.h5")
    w.set_meta("source", "transformers 5.17 generate")
    w.add_request(0, prompt=[5, 6, 7], max_new_tokens=4)
    w.define_tensor("taps/embed", "f32", 64)
    w.append("taps/embed", rows, request=0, positions=[0, 1, 2], step=0)   # summaries computed here
    w.append_sampling(request=0, token=9, token_index=0, step=0)
    w.append_step(0, batch=[0], tokens=3)
    w.finish_request(0, [9, 3, 4, 1], "…", "stop")
    w.close()

Unlike the C++ TraceWriter this one is not crash-safe: it keeps the rows in memory and
writes the whole file at close(), as <path>.partial renamed into place, so a file at `path`
is always complete (complete = 1). Summaries are computed with the engine's rules, bit for
bit (dtypes.summarize). Tables are chunked, shuffled and Zstandard-compressed (filter 32015,
lockstep's plugin, found as the reader finds it). Not thread-safe.
"""
import os

import numpy as np

from . import dtypes as _dt
from ._format import (FORMAT_MAJOR, FORMAT_MINOR, MAGIC, MAX_CHUNK_ROWS, MAX_COLS, SAMPLING, STEP, STORED, SUMMARY,
                      TraceError, ZSTD_FILTER_ID, ensure_plugin)


def chunk_rows_for(row_bytes, target=64 << 10):
    """A power of two of rows, about `target` bytes a chunk, 8 ≤ rows ≤ 4096."""
    n = 8
    while n * 2 * row_bytes <= target and n * 2 <= MAX_CHUNK_ROWS:
        n *= 2
    return n


class TraceWriter:
    def __init__(self, path, zstd_level=3, writer="lockstep-python 0.1.0", batch_width=8, plugin_path=None,
                 compress=True):
        self.path = str(path)
        # compress=False writes the tables without filters (lockstep reads them; so does any
        # HDF5 reader without the plugin), for a machine where the plugin cannot be loaded.
        self.compress = bool(compress)
        if self.compress:
            ensure_plugin(plugin_path)
        self.zstd_level = int(zstd_level)
        self.writer = writer
        self.batch_width = int(batch_width)
        self.meta = {}
        self.requests = {}
        self.tensors = {}  # path → dict(dtype, cols, values, attrs, summaries[], rows[])
        self.sampling_rows = []
        self.step_rows = []
        self.step_batch = []
        self.closed = False

    def set_meta(self, key, value):
        self.meta[str(key)] = str(value)

    def add_request(self, rid, prompt, name=None, prompt_text="", max_new_tokens=0, seed=0, temperature=0.0,
                    top_p=1.0, min_p=0.0, top_k=0):
        rid = int(rid)
        if rid in self.requests:
            raise TraceError(f"{self.path}: request {rid} added twice")
        self.requests[rid] = dict(name=str(rid) if name is None else str(name), prompt=np.asarray(prompt, np.int32),
                                  prompt_text=prompt_text, max_new_tokens=int(max_new_tokens), seed=int(seed),
                                  temperature=float(temperature), top_p=float(top_p), min_p=float(min_p),
                                  top_k=int(top_k), final=None)

    def finish_request(self, rid, generated, generated_text="", finish_reason="length"):
        self.requests[int(rid)]["final"] = (np.asarray(generated, np.int32), generated_text, finish_reason)

    def define_tensor(self, path, dtype, cols, values=True, attrs=None):
        if path in self.tensors:
            raise TraceError(f"{self.path}: tensor {path} defined twice")
        if dtype not in STORED or not 0 < int(cols) <= MAX_COLS:
            raise TraceError(f"{self.path}: {path}: dtype {dtype!r} / cols {cols} not allowed")
        self.tensors[path] = dict(dtype=dtype, cols=int(cols), values=bool(values), attrs=dict(attrs or {}),
                                  summaries=[], rows=[])

    def append(self, path, rows, request, positions, step):
        """Rows of a tensor: `rows` [n, cols] in the stored dtype (float input to a bf16 tensor is
        rounded to nearest even); positions[i] is row i's position in `request`."""
        t = self.tensors[path]
        rows = np.asarray(rows)
        if t["dtype"] == "bf16" and rows.dtype.kind == "f":
            rows = _dt.f32_to_bf16(rows)
        rows = np.ascontiguousarray(rows.astype(STORED[t["dtype"]], copy=False).reshape(-1, t["cols"]))
        pos = np.broadcast_to(np.asarray(positions, dtype=np.int64), (rows.shape[0],))
        t["summaries"].append(_dt.summarize(rows, t["dtype"], request, pos, step))
        if t["values"]:
            t["rows"].append(rows)

    def append_summaries(self, path, summaries):
        """Ready-made SummaryRow records (for a tensor that stores no values)."""
        self.tensors[path]["summaries"].append(np.asarray(summaries, dtype=SUMMARY))

    def append_sampling(self, request, token, token_index, step, **fields):
        r = np.zeros(1, dtype=SAMPLING)
        r["request"], r["token"], r["token_index"], r["step"] = request, token, token_index, step
        r["counter"] = token_index
        r["uniform"], r["top_p"], r["sampled"], r["batch_size"] = -1.0, 1.0, token, 1
        for k, v in fields.items():
            r[k] = v
        self.sampling_rows.append(r)

    def append_step(self, step, batch=(), tokens=0, wall_ns=0, stall_ns=0):
        r = np.zeros(1, dtype=STEP)
        r["step"], r["batch_size"], r["tokens"], r["wall_ns"], r["stall_ns"] = step, len(batch), tokens, wall_ns, stall_ns
        self.step_rows.append(r)
        b = np.full(self.batch_width, -1, dtype=np.int64)
        ids = list(batch)[:self.batch_width]
        b[:len(ids)] = ids
        self.step_batch.append(b)

    # -- writing ----------------------------------------------------------------------------
    def close(self):
        if self.closed:
            return
        import h5py
        partial = self.path + ".partial"
        try:
            with h5py.File(partial, "w", libver="earliest") as f:
                self._write(f)
            os.replace(partial, self.path)
        except Exception as e:
            if os.path.exists(partial):
                os.remove(partial)
            raise TraceError(f"{self.path}: cannot write the trace ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *rest):
        if exc_type is None:
            self.close()

    def _write(self, f):
        _str_attr(f, "lockstep_trace", MAGIC)
        f.attrs.create("format_version", np.array([FORMAT_MAJOR, FORMAT_MINOR], dtype="<i4"))
        f.attrs.create("complete", np.uint8(0))
        steps = max([int(r["step"][0]) for r in self.step_rows] + [-1]) + 1
        f.attrs.create("flushed_steps", np.int64(steps))
        _str_attr(f, "writer", self.writer)
        meta = f.create_group("meta")
        for k in sorted(self.meta):
            _str_attr(meta, k, self.meta[k])
        reqs = f.create_group("requests")
        for rid in sorted(self.requests):
            r = self.requests[rid]
            g = reqs.create_group(str(rid))
            _str_attr(g, "name", r["name"])
            for k in ("max_new_tokens", "seed", "top_k"):
                g.attrs.create(k, np.int64(np.uint64(r[k]).astype(np.int64)) if k == "seed" else np.int64(r[k]))
            for k in ("temperature", "top_p", "min_p"):
                g.attrs.create(k, np.float64(r[k]))
            g.create_dataset("prompt", data=r["prompt"].astype("<i4"))
            _str_dataset(g, "prompt_text", r["prompt_text"])
            fin = g.create_group("final")
            if r["final"] is not None:
                gen, gtext, reason = r["final"]
                fin.create_dataset("generated", data=gen.astype("<i4"))
                _str_dataset(fin, "generated_text", gtext)
                _str_attr(fin, "finish_reason", reason)
        self._table(f, "sampling", _cat(self.sampling_rows, SAMPLING))
        self._table(f, "steps", _cat(self.step_rows, STEP))
        sb = np.stack(self.step_batch) if self.step_batch else np.zeros((0, self.batch_width), np.int64)
        self._table(f, "step_batch", sb.astype("<i8"))
        f.create_group("taps")
        f.create_group("kv")
        for path in sorted(self.tensors):
            t = self.tensors[path]
            g = f.require_group(path)
            _str_attr(g, "dtype", t["dtype"])
            g.attrs.create("cols", np.int64(t["cols"]))
            g.attrs.create("has_values", np.uint8(1 if t["values"] else 0))
            for k, v in t["attrs"].items():
                if isinstance(v, str):
                    _str_attr(g, k, v)
                else:
                    g.attrs.create(k, np.int64(v))
            self._table(g, "summary", _cat(t["summaries"], SUMMARY))
            if t["values"]:
                vals = np.concatenate(t["rows"]) if t["rows"] else np.zeros((0, t["cols"]), STORED[t["dtype"]])
                d = self._table(g, "values", vals)
                _str_attr(d, "dtype", t["dtype"])
        f.attrs["complete"] = np.uint8(1)

    def _table(self, parent, name, data):
        row_bytes = data.dtype.itemsize * int(np.prod(data.shape[1:], dtype=np.int64))
        cr = chunk_rows_for(row_bytes)
        filters = dict(shuffle=True, compression=ZSTD_FILTER_ID, compression_opts=(self.zstd_level,)) if self.compress else {}
        d = parent.create_dataset(name, shape=data.shape, maxshape=(None,) + data.shape[1:], dtype=data.dtype,
                                  chunks=(cr,) + data.shape[1:], **filters)
        if len(data):
            d[...] = data
        d.attrs.create("chunk_rows", np.int64(cr))
        return d


def _cat(parts, dtype):
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)


def _str_type(n):
    import h5py
    t = h5py.h5t.C_S1.copy()
    t.set_size(max(n, 1))
    t.set_strpad(h5py.h5t.STR_NULLPAD)
    t.set_cset(h5py.h5t.CSET_UTF8)
    return t


def _str_attr(obj, name, value):
    """A fixed-length UTF-8 string attribute (never variable-length: docs/trace-format.md)."""
    import h5py
    b = value.encode("utf-8")
    t = _str_type(len(b))
    if name in obj.attrs:
        del obj.attrs[name]
    a = h5py.h5a.create(obj.id, name.encode(), t, h5py.h5s.create(h5py.h5s.SCALAR))
    a.write(np.array(b, dtype=f"S{max(len(b), 1)}"), mtype=t)


def _str_dataset(group, name, value):
    import h5py
    b = value.encode("utf-8")
    t = _str_type(len(b))
    d = h5py.h5d.create(group.id, name.encode(), t, h5py.h5s.create(h5py.h5s.SCALAR))
    d.write(h5py.h5s.ALL, h5py.h5s.ALL, np.array(b, dtype=f"S{max(len(b), 1)}"), mtype=t)
