"""lockstep/_format.py — the trace format's names, record types and limits, as
traces/trace_format.h and docs/trace-format.md define them (keep the three in step), and
how h5py finds lockstep's Zstandard filter plugin."""
import os

import numpy as np

FORMAT_MAJOR, FORMAT_MINOR = 1, 3
MAGIC = "lockstep trace"
ZSTD_FILTER_ID = 32015

# The format's limits (trace_format.h): a reader checks them before it allocates.
MAX_CHUNK_ROWS = 4096
MAX_CHUNK_DECODED_BYTES = 64 << 20
MAX_COLS = 1 << 22
MAX_POSITION = 1 << 31
MAX_ROWS = 1 << 40
MAX_READ_BYTES = 8 << 30

# Stored element type of each tensor dtype: bf16 as uint16 (top half of an fp32), fp8 as
# uint8 (OCP E4M3FN). HDF5 custom floats are not used.
STORED = {"f32": np.dtype("<f4"), "i32": np.dtype("<i4"), "bf16": np.dtype("<u2"),
          "fp8_e4m3": np.dtype("u1"), "u8": np.dtype("u1")}

# SummaryRow (48 bytes), SamplingRow (112), StepRow (32): little-endian, no padding.
SUMMARY = np.dtype([("position", "<i8"), ("hash", "<u8"), ("request", "<i4"), ("step", "<i4"),
                    ("nan_count", "<u4"), ("inf_count", "<u4"), ("rms", "<f4"), ("absmax", "<f4"),
                    ("min", "<f4"), ("max", "<f4")])
SAMPLING = np.dtype([("request", "<i4"), ("token", "<i4"), ("token_index", "<i8"), ("step", "<i8"),
                     ("seed", "<u8"), ("counter", "<u8"), ("top_k", "<i8"), ("candidates", "<i8"),
                     ("probability", "<f8"), ("uniform", "<f8"), ("temperature", "<f8"), ("top_p", "<f8"),
                     ("min_p", "<f8"), ("batch_size", "<i4"), ("finished", "<i4"), ("sampled", "<i4"),
                     ("forced", "<i4")])
STEP = np.dtype([("step", "<i8"), ("batch_size", "<i4"), ("tokens", "<i4"), ("wall_ns", "<i8"),
                 ("stall_ns", "<i8")])
assert SUMMARY.itemsize == 48 and SAMPLING.itemsize == 112 and STEP.itemsize == 32

FINISHED = {0: "", 1: "length", 2: "stop", 3: "other"}

_plugin_dirs_added = set()


class TraceError(Exception):
    """Bad input: the message is one line naming the file and the field."""


def plugin_candidates(explicit=None):
    """Folders that may hold libh5zstd_lockstep.so, in the order they are tried."""
    out = []
    if explicit:
        out.append(str(explicit))
    for var in ("LOCKSTEP_HDF5_PLUGIN_DIR", "HDF5_PLUGIN_PATH"):
        out += [p for p in os.environ.get(var, "").split(os.pathsep) if p]
    # A source checkout: python/lockstep/ → ../../build/hdf5-plugins
    here = os.path.dirname(os.path.abspath(__file__))
    out.append(os.path.normpath(os.path.join(here, "..", "..", "build", "hdf5-plugins")))
    return out


def ensure_plugin(explicit=None, required=True):
    """Makes HDF5 (through h5py) able to read and write filter 32015; returns the folder that
    provided it, or raises TraceError saying where it looked (with required=False: returns
    that TraceError instead, for a caller that may not need the filter). HDF5_PLUGIN_PATH set before the
    process started works too; a folder given here is added to HDF5's plugin search path."""
    import h5py
    for d in plugin_candidates(explicit):
        if d in _plugin_dirs_added or not os.path.isdir(d):
            continue
        if not any(n.startswith("libh5zstd") for n in os.listdir(d)):
            continue
        h5py.h5pl.prepend(d.encode())
        _plugin_dirs_added.add(d)
    if h5py.h5z.filter_avail(ZSTD_FILTER_ID):
        return sorted(_plugin_dirs_added)[0] if _plugin_dirs_added else os.environ.get("HDF5_PLUGIN_PATH", "")
    err = TraceError("the Zstandard filter (HDF5 filter 32015) that lockstep traces use is not available: "
                     "build lockstep (it builds build/hdf5-plugins/libh5zstd_lockstep.so) and set "
                     "HDF5_PLUGIN_PATH to that folder or pass plugin_path= (looked in: "
                     + ", ".join(plugin_candidates(explicit)) + ")")
    if required:
        raise err
    return err


def text(v):
    """A string attribute or dataset value: fixed-length UTF-8, which h5py returns as bytes."""
    if isinstance(v, np.ndarray) and v.shape == ():
        v = v[()]
    return v.decode("utf-8", "replace") if isinstance(v, (bytes, np.bytes_)) else str(v)
