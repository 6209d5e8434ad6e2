// traces/row_summary.cc — see row_summary.h.
#include "traces/row_summary.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace lockstep::traces {

uint64_t ContentHash(const void* data, size_t bytes) { return XXH3_64bits_withSeed(data, bytes, kHashSeed); }

float Bf16ToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float Fp8E4m3ToFloat(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 0xF, man = b & 7;
  if (exp == 0xF && man == 7) return std::numeric_limits<float>::quiet_NaN();
  const float mag = exp == 0 ? std::ldexp(static_cast<float>(man), -9)  // subnormal: man/8 · 2^-6
                             : std::ldexp(1.0f + man / 8.0f, exp - 7);
  return sign ? -mag : mag;
}

namespace {

// Accumulates finite values in double; counts the rest.
struct Acc {
  double sumsq = 0, absmax = 0;
  double lo = std::numeric_limits<double>::infinity(), hi = -std::numeric_limits<double>::infinity();
  int64_t finite = 0;
  uint32_t nan = 0, inf = 0;
  void Add(double v) {
    if (std::isnan(v)) {
      ++nan;
    } else if (std::isinf(v)) {
      ++inf;
    } else {
      sumsq += v * v;
      absmax = std::fmax(absmax, std::fabs(v));
      lo = std::fmin(lo, v);
      hi = std::fmax(hi, v);
      ++finite;
    }
  }
};

}  // namespace

void Summarize(DType dtype, const void* row, int64_t cols, SummaryRow* out) {
  const size_t bytes = static_cast<size_t>(cols) * DTypeSize(dtype);
  out->hash = ContentHash(row, bytes);
  Acc a;
  switch (dtype) {
    case DType::kF32: {
      // The hot path (every activation row). Four independent double accumulators and float
      // min/max, no branches: a NaN or ±Inf makes the sum non-finite (a float squared never
      // overflows a double), and only then does the careful loop below run.
      const float* p = static_cast<const float*>(row);
      double s[4] = {0, 0, 0, 0};
      float lo = std::numeric_limits<float>::infinity(), hi = -lo;
      int64_t i = 0;
      for (; i + 4 <= cols; i += 4) {
        for (int k = 0; k < 4; ++k) {
          const float v = p[i + k];
          s[k] += static_cast<double>(v) * v;
          lo = v < lo ? v : lo;
          hi = v > hi ? v : hi;
        }
      }
      for (; i < cols; ++i) {
        s[i & 3] += static_cast<double>(p[i]) * p[i];
        lo = p[i] < lo ? p[i] : lo;
        hi = p[i] > hi ? p[i] : hi;
      }
      const double sumsq = (s[0] + s[1]) + (s[2] + s[3]);
      if (std::isfinite(sumsq) && cols > 0) {
        a.sumsq = sumsq;
        a.lo = lo;
        a.hi = hi;
        a.absmax = std::fmax(std::fabs(lo), std::fabs(hi));
        a.finite = cols;
        break;
      }
      for (int64_t j = 0; j < cols; ++j) a.Add(p[j]);
      break;
    }
    case DType::kI32: {
      const int32_t* p = static_cast<const int32_t*>(row);
      for (int64_t i = 0; i < cols; ++i) a.Add(p[i]);
      break;
    }
    case DType::kBf16: {
      const uint8_t* p = static_cast<const uint8_t*>(row);
      for (int64_t i = 0; i < cols; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        a.Add(Bf16ToFloat(h));
      }
      break;
    }
    case DType::kFp8E4m3: {
      const uint8_t* p = static_cast<const uint8_t*>(row);
      for (int64_t i = 0; i < cols; ++i) a.Add(Fp8E4m3ToFloat(p[i]));
      break;
    }
    case DType::kU8: {
      const uint8_t* p = static_cast<const uint8_t*>(row);
      for (int64_t i = 0; i < cols; ++i) a.Add(p[i]);
      break;
    }
  }
  out->nan_count = a.nan;
  out->inf_count = a.inf;
  if (a.finite > 0) {
    out->rms = static_cast<float>(std::sqrt(a.sumsq / static_cast<double>(a.finite)));
    out->absmax = static_cast<float>(a.absmax);
    out->min = static_cast<float>(a.lo);
    out->max = static_cast<float>(a.hi);
  } else {
    out->rms = out->absmax = out->min = out->max = 0;
  }
}

}  // namespace lockstep::traces
