"""lockstep — read, write and import lockstep traces from Python (docs/python.md).

    import lockstep
    t = lockstep.open_trace("run.h5")
    t.values("layers.3.attn.out", request=0)

Needs h5py, numpy, xxhash (Debian: python3-h5py python3-numpy python3-xxhash) and lockstep's
Zstandard filter plugin (build/hdf5-plugins; HDF5_PLUGIN_PATH or plugin_path=).
`lockstep.torch` (a recorder for transformers' DeepSeek models) needs torch and transformers.
"""
from ._format import FORMAT_MAJOR, FORMAT_MINOR, TraceError, ensure_plugin
from .dtypes import bf16_to_f32, dequantize_fp8, e4m3_to_f32, f32_to_bf16, row_hash, summarize
from .reader import Request, Tensor, Trace, open_trace
from .writer import TraceWriter

__version__ = "0.1.0"
__all__ = ["open_trace", "Trace", "Request", "Tensor", "TraceWriter", "TraceError", "ensure_plugin",
           "bf16_to_f32", "f32_to_bf16", "e4m3_to_f32", "dequantize_fp8", "row_hash", "summarize",
           "FORMAT_MAJOR", "FORMAT_MINOR"]
