// traces/row_summary.cc — see row_summary.h.
#include "traces/row_summary.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

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

// The sum of squares, minimum and maximum of a float row, exactly as this loop computes them:
//
//   double s[4] = {0};  float lo = +inf, hi = -inf;
//   for (i = 0; i < cols; ++i) { s[i % 4] += (double)p[i] * p[i];
//                                lo = p[i] < lo ? p[i] : lo;  hi = p[i] > hi ? p[i] : hi; }
//   sumsq = (s[0] + s[1]) + (s[2] + s[3]);
//
// That order is part of the trace format (rms is stored and compared bit for bit), so the
// vector version keeps it: one 4-lane double accumulator whose lane k adds elements k, k+4,
// k+8, … in order (a float product is exact in double, so multiply-then-add and FMA agree).
// The minimum and maximum do not depend on the order, except for which zero (+0 or −0) the
// loop keeps when the extreme is zero: the first one in row order, which is looked up then.
// Only meaningful when the row holds no NaN or ±Inf (then sumsq is not finite either).
struct F32Fast {
  double sumsq;
  float lo, hi;
};

float FirstZero(const float* p, int64_t cols) {
  for (int64_t i = 0; i < cols; ++i) {
    if (p[i] == 0.0f) return p[i];
  }
  return 0.0f;
}

F32Fast SummarizeF32Fast(const float* p, int64_t cols) {
  int64_t i = 0;
  double s[4] = {0, 0, 0, 0};
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
#if defined(__AVX2__)
  if (cols >= 8) {
    __m256d acc = _mm256_setzero_pd();
    __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    for (; i + 8 <= cols; i += 8) {
      const __m256 v = _mm256_loadu_ps(p + i);
      const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
      const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
      acc = _mm256_add_pd(acc, _mm256_mul_pd(a, a));  // elements i..i+3 into lanes 0..3
      acc = _mm256_add_pd(acc, _mm256_mul_pd(b, b));  // then i+4..i+7, in the same lanes
      vlo = _mm256_min_ps(v, vlo);
      vhi = _mm256_max_ps(v, vhi);
    }
    _mm256_storeu_pd(s, acc);
    alignas(32) float l[8], h[8];
    _mm256_store_ps(l, vlo);
    _mm256_store_ps(h, vhi);
    for (int k = 0; k < 8; ++k) {
      lo = l[k] < lo ? l[k] : lo;
      hi = h[k] > hi ? h[k] : hi;
    }
  }
#endif
  for (; i < cols; ++i) {
    s[i & 3] += static_cast<double>(p[i]) * p[i];
    lo = p[i] < lo ? p[i] : lo;
    hi = p[i] > hi ? p[i] : hi;
  }
  if (lo == 0.0f) lo = FirstZero(p, cols);
  if (hi == 0.0f) hi = FirstZero(p, cols);
  return {(s[0] + s[1]) + (s[2] + s[3]), lo, hi};
}

}  // namespace

void Summarize(DType dtype, const void* row, int64_t cols, SummaryRow* out) {
  const size_t bytes = static_cast<size_t>(cols) * DTypeSize(dtype);
  out->hash = ContentHash(row, bytes);
  Acc a;
  switch (dtype) {
    case DType::kF32: {
      // The hot path (every activation row). A NaN or ±Inf makes the sum of squares
      // non-finite (a float squared never overflows a double), and only then does the
      // careful loop below run.
      const float* p = static_cast<const float*>(row);
      const F32Fast f = SummarizeF32Fast(p, cols);
      if (std::isfinite(f.sumsq) && cols > 0) {
        a.sumsq = f.sumsq;
        a.lo = f.lo;
        a.hi = f.hi;
        a.absmax = std::fmax(std::fabs(f.lo), std::fabs(f.hi));
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

void LogitsTopK(const float* row, int64_t cols, int64_t k, int32_t* ids, float* values, float* logsumexp) {
  auto better = [&](int32_t a, int32_t b) {
    const bool na = std::isnan(row[a]), nb = std::isnan(row[b]);
    if (na || nb) return na != nb ? na : a < b;
    return row[a] > row[b] || (row[a] == row[b] && a < b);
  };
  // One pass keeping the best k in a heap whose front is the worst kept.
  std::vector<int32_t> heap;
  heap.reserve(static_cast<size_t>(k));
  for (int32_t i = 0; i < static_cast<int32_t>(cols); ++i) {
    if (static_cast<int64_t>(heap.size()) < k) {
      heap.push_back(i);
      std::push_heap(heap.begin(), heap.end(), better);
    } else if (k > 0 && better(i, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), better);
      heap.back() = i;
      std::push_heap(heap.begin(), heap.end(), better);
    }
  }
  std::sort_heap(heap.begin(), heap.end(), better);
  for (size_t j = 0; j < heap.size(); ++j) {
    ids[j] = heap[j];
    values[j] = row[heap[j]];
  }
  double m = -INFINITY;
  for (int64_t i = 0; i < cols; ++i) m = std::fmax(m, row[i]);
  double sum = 0;
  for (int64_t i = 0; i < cols; ++i) sum += std::exp(static_cast<double>(row[i]) - m);
  *logsumexp = static_cast<float>(m + std::log(sum));
}

}  // namespace lockstep::traces
