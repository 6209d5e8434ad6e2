"""lockstep/dtypes.py — decoding stored rows to float32, and the row statistics a summary
holds (docs/trace-format.md, "Tensors, dtypes" and "Summaries and the content hash").

bf16 is stored as uint16: the top 16 bits of an IEEE float32. fp8 is OCP E4M3FN as uint8:
bias 7, no infinities, 0x7F/0xFF NaN, max 448. The KV cache's fp8 tiles carry one fp32
scale per 128 values (docs/kv-cache.md): value = e4m3(q) × scale.
"""
import numpy as np
import xxhash


def bf16_to_f32(u16):
    return (np.asarray(u16, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """Round to nearest, ties to even (the engine's fp32 → bf16); NaN stays a quiet NaN."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    r[nan] = ((b[nan] >> 16) | 0x40).astype(np.uint16)
    return r


def _e4m3_table():
    t = np.zeros(256, dtype=np.float32)
    for q in range(256):
        s = -1.0 if q & 0x80 else 1.0
        e, m = (q >> 3) & 0xF, q & 0x7
        if e == 0xF and m == 0x7:
            t[q] = np.nan
        elif e == 0:
            t[q] = s * (m / 8.0) * 2.0 ** -6  # subnormal
        else:
            t[q] = s * (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return t


E4M3 = _e4m3_table()


def e4m3_to_f32(u8):
    return E4M3[np.asarray(u8, dtype=np.uint8)]


def decode(rows, dtype):
    """Stored rows → numbers: bf16/fp8 to float32 (fp8 without its scale), others as stored."""
    if dtype == "bf16":
        return bf16_to_f32(rows)
    if dtype == "fp8_e4m3":
        return e4m3_to_f32(rows)
    return np.asarray(rows)


def dequantize_fp8(q, scales, tile=128):
    """[rows, n] e4m3 bytes and [rows, ceil(n/tile)] fp32 scales → [rows, n] float32."""
    q = np.asarray(q)
    x = e4m3_to_f32(q)
    n = q.shape[-1]
    s = np.repeat(np.asarray(scales, dtype=np.float32), tile, axis=-1)[..., :n]
    return x * s


def row_hash(row):
    """XXH3-64, seed 0, of the row's stored bytes (little-endian, row-major)."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(row).tobytes())


def summarize(stored, dtype, request, positions, step):
    """SummaryRow records of rows `stored` ([rows, cols] as stored) — bit for bit what the
    engine's traces::Summarize writes: the hash of the stored bytes; statistics in double over
    the finite values (0 when none), rounded to float32. The sum of squares keeps the engine's
    order (it is compared bit for bit): for float32 rows without NaN/Inf four lanes, lane k
    adding elements k, k+4, … in order, then (s0 + s1) + (s2 + s3); otherwise one running sum
    in row order over the finite values."""
    from ._format import SUMMARY
    stored = np.ascontiguousarray(stored)
    rows = stored.shape[0]
    out = np.zeros(rows, dtype=SUMMARY)
    out["request"] = request
    out["step"] = step
    out["position"] = positions
    for i in range(rows):
        out["hash"][i] = row_hash(stored[i])
    if rows == 0:
        return out
    x = decode(stored, dtype).astype(np.float64).reshape(rows, -1)
    cols = x.shape[1]
    finite = np.isfinite(x)
    out["nan_count"] = np.count_nonzero(np.isnan(x), axis=1)
    out["inf_count"] = np.count_nonzero(np.isinf(x), axis=1)
    sq = np.where(finite, x * x, 0.0)  # adding +0 leaves a running sum of squares unchanged
    seq = np.cumsum(sq, axis=1)[:, -1] if cols else np.zeros(rows)
    if dtype == "f32" and cols:
        pad = (-cols) % 4
        lanes = np.concatenate([sq, np.zeros((rows, pad))], axis=1).reshape(rows, -1, 4)
        s = np.cumsum(lanes, axis=1)[:, -1, :]
        four = (s[:, 0] + s[:, 1]) + (s[:, 2] + s[:, 3])
        sumsq = np.where(finite.all(axis=1), four, seq)
    else:
        sumsq = seq
    n = finite.sum(axis=1)
    has = n > 0
    big = np.where(finite, x, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        out["rms"] = np.where(has, np.sqrt(sumsq / np.maximum(n, 1)), 0).astype(np.float32)
        lo = np.where(has, np.nanmin(np.where(has[:, None], big, 0), axis=1), 0)
        hi = np.where(has, np.nanmax(np.where(has[:, None], big, 0), axis=1), 0)
    out["min"] = lo.astype(np.float32)
    out["max"] = hi.astype(np.float32)
    out["absmax"] = np.maximum(np.abs(lo), np.abs(hi)).astype(np.float32)
    for i in np.nonzero((lo == 0) | (hi == 0))[0]:  # which zero: the first in row order
        z = x[i][x[i] == 0]
        if len(z):
            if lo[i] == 0:
                out["min"][i] = np.float32(z[0])
            if hi[i] == 0:
                out["max"][i] = np.float32(z[0])
    return out
