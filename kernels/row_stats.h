// kernels/row_stats.h — the per-row statistics of a trace summary (traces/trace_format.h
// SummaryRow: NaN and Inf counts, rms, absmax, min, max) for fp32, int32, bf16 and FP8 E4M3 rows, as host/device
// code: the GPU twin of traces::Summarize, so a device backend can summarise tap rows where they
// are computed instead of copying them to the host. Together with kernels/xxh3.h (the content
// hash) it is everything a summary-mode trace stores about a row.
//
// The arithmetic is traces::Summarize's, operation for operation, because rms is stored and
// compared bit for bit: for a finite fp32 row, squares are summed in double into four lanes
// (element i into lane i mod 4, in order) and the lanes added as (s0 + s1) + (s2 + s3); min and
// max by `<` / `>` keeping the first zero in row order when the extreme is zero; absmax =
// max(|min|, |max|). A row with NaN or ±Inf (and every int32, bf16 and E4M3 row) takes the careful loop: one
// double accumulator in row order over the finite values, fmin/fmax/fabs in double, the others
// counted. tests/row_stats_test.cc checks equality with traces::Summarize on the host.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/host_device.h"

namespace lockstep::kernels {

struct RowStats {
  uint32_t nan_count = 0, inf_count = 0;
  float rms = 0, absmax = 0, min = 0, max = 0;
};

namespace row_stats_detail {

// The host's std:: functions (so the host path is traces::Summarize's exactly); CUDA's on the
// device. They can differ only in which zero fmin/fmax return for (+0, −0), which only the
// careful loop (rows holding NaN or ±Inf) can meet.
#if defined(__CUDA_ARCH__)
__device__ inline bool IsNan(double v) { return ::isnan(v); }
__device__ inline bool IsInf(double v) { return ::isinf(v); }
__device__ inline bool IsFinite(double v) { return ::isfinite(v); }
__device__ inline double Fmax(double a, double b) { return ::fmax(a, b); }
__device__ inline double Fmin(double a, double b) { return ::fmin(a, b); }
__device__ inline double Fabs(double a) { return ::fabs(a); }
__device__ inline double Sqrt(double a) { return ::sqrt(a); }
#else
inline bool IsNan(double v) { return std::isnan(v); }
inline bool IsInf(double v) { return std::isinf(v); }
inline bool IsFinite(double v) { return std::isfinite(v); }
inline double Fmax(double a, double b) { return std::fmax(a, b); }
inline double Fmin(double a, double b) { return std::fmin(a, b); }
inline double Fabs(double a) { return std::fabs(a); }
inline double Sqrt(double a) { return std::sqrt(a); }
#endif

struct Careful {
  double sumsq = 0, absmax = 0, lo = INFINITY, hi = -INFINITY;
  int64_t finite = 0;
  uint32_t nan = 0, inf = 0;
  LS_HD void Add(double v) {
    if (IsNan(v)) {
      ++nan;
    } else if (IsInf(v)) {
      ++inf;
    } else {
      sumsq += v * v;
      absmax = Fmax(absmax, Fabs(v));
      lo = Fmin(lo, v);
      hi = Fmax(hi, v);
      ++finite;
    }
  }
  LS_HD RowStats Finish() const {
    RowStats r;
    r.nan_count = nan;
    r.inf_count = inf;
    if (finite > 0) {
      r.rms = static_cast<float>(Sqrt(sumsq / static_cast<double>(finite)));
      r.absmax = static_cast<float>(absmax);
      r.min = static_cast<float>(lo);
      r.max = static_cast<float>(hi);
    }
    return r;
  }
};

LS_HD inline float FirstZero(const float* p, int64_t cols) {
  for (int64_t i = 0; i < cols; ++i) {
    if (p[i] == 0.0f) return p[i];
  }
  return 0.0f;
}

}  // namespace row_stats_detail

LS_HD inline RowStats RowStatsF32(const float* p, int64_t cols) {
  double s[4] = {0, 0, 0, 0};
  float lo = INFINITY, hi = -INFINITY;
  for (int64_t i = 0; i < cols; ++i) {
    s[i & 3] += static_cast<double>(p[i]) * p[i];  // a float's square is exact in double
    lo = p[i] < lo ? p[i] : lo;
    hi = p[i] > hi ? p[i] : hi;
  }
  const double sumsq = (s[0] + s[1]) + (s[2] + s[3]);
  row_stats_detail::Careful a;
  if (row_stats_detail::IsFinite(sumsq) && cols > 0) {
    if (lo == 0.0f) lo = row_stats_detail::FirstZero(p, cols);
    if (hi == 0.0f) hi = row_stats_detail::FirstZero(p, cols);
    a.sumsq = sumsq;
    a.lo = lo;
    a.hi = hi;
    a.absmax = row_stats_detail::Fmax(row_stats_detail::Fabs(lo), row_stats_detail::Fabs(hi));
    a.finite = cols;
  } else {
    for (int64_t j = 0; j < cols; ++j) a.Add(p[j]);
  }
  return a.Finish();
}

LS_HD inline RowStats RowStatsI32(const int32_t* p, int64_t cols) {
  row_stats_detail::Careful a;
  for (int64_t i = 0; i < cols; ++i) a.Add(p[i]);
  return a.Finish();
}

// The floats a bf16 and an FP8 E4M3 byte encode (E4M3 without any scale; its one NaN pattern
// per sign a quiet NaN): kernels/cpu/numerics.h's values, bit for bit, on host and device; also
// what traces::Bf16ToFloat and Fp8E4m3ToFloat return.
LS_HD inline float Bf16Value(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
LS_HD inline float Fp8E4m3Value(uint8_t b) {
  const uint32_t sign = b >> 7, exp = (b >> 3) & 0xF, man = b & 7;
  if (exp == 0xF && man == 7) return NAN;
  float mag;
  if (exp == 0) {
    mag = static_cast<float>(man) * 0.001953125f;  // man/8 · 2^-6, exact
  } else {
    const uint32_t u = (exp - 7 + 127) << 23 | man << 20;  // (1 + man/8) · 2^(exp−7)
    memcpy(&mag, &u, 4);
  }
  return sign ? -mag : mag;
}

// bf16 and E4M3 rows (`p` their bytes): the careful loop over the values they encode, as
// traces::Summarize does for them.
LS_HD inline RowStats RowStatsBf16(const uint8_t* p, int64_t cols) {
  row_stats_detail::Careful a;
  for (int64_t i = 0; i < cols; ++i) {
    const uint16_t h = static_cast<uint16_t>(p[2 * i] | p[2 * i + 1] << 8);
    a.Add(Bf16Value(h));
  }
  return a.Finish();
}
LS_HD inline RowStats RowStatsFp8E4m3(const uint8_t* p, int64_t cols) {
  row_stats_detail::Careful a;
  for (int64_t i = 0; i < cols; ++i) a.Add(Fp8E4m3Value(p[i]));
  return a.Finish();
}

}  // namespace lockstep::kernels
