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

#include "kernels/row_stats.h"

namespace lockstep::traces {

uint64_t ContentHash(const void* data, size_t bytes) { return XXH3_64bits_withSeed(data, bytes, kHashSeed); }

// The device summaries' decoders (kernels/row_stats.h), so both sides read the same values.
float Bf16ToFloat(uint16_t bits) { return kernels::Bf16Value(bits); }
float Fp8E4m3ToFloat(uint8_t b) { return kernels::Fp8E4m3Value(b); }

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

// LseExp: e^t from a fixed sequence of IEEE operations (so the same bits on every machine and
// libm): t = k·ln2 + r with k = nearest(t·log2 e) by the 1.5·2^52 shift, r by two fused
// multiply-adds with ln2 split in two, e^r by its Taylor polynomial to r^13 in Horner form (each
// step one fused multiply-add; |r| ≤ 0.35: truncation below 2^-56 relative), times 2^k by its
// bits. Below −708 the result is 0 (e^t < 2^-1021 adds nothing a logits sum can see), above
// 709 +inf (logsumexp's t are ≤ 0); NaN stays NaN. LseExp4 below: the same operations on four.
namespace {
constexpr double kLog2e = 0x1.71547652b82fep0, kShift = 0x1.8p52;
constexpr double kLn2Hi = 0x1.62e42fefa39efp-1, kLn2Lo = 0x1.abc9e3b39803fp-56;
constexpr double kExpLow = -708.0, kExpHigh = 709.0;
// 1/n!, n = 13 … 2 (the Horner order), each the double nearest.
constexpr double kInvFact[12] = {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
                                 1.0 / 362880.0,     1.0 / 40320.0,     1.0 / 5040.0,     1.0 / 720.0,
                                 1.0 / 120.0,        1.0 / 24.0,        1.0 / 6.0,        1.0 / 2.0};

double LseExpInRange(double t) {
  const double z = std::fma(t, kLog2e, kShift);
  const double kd = z - kShift;
  double r = std::fma(-kd, kLn2Hi, t);
  r = std::fma(-kd, kLn2Lo, r);
  double p = kInvFact[0];
  for (int i = 1; i < 12; ++i) p = std::fma(p, r, kInvFact[i]);
  p = std::fma(p, r, 1.0);
  p = std::fma(p, r, 1.0);
  uint64_t zb, sb;
  std::memcpy(&zb, &z, 8);
  const uint64_t shift_bits = 0x4338000000000000ull;  // kShift's
  sb = (zb - shift_bits + 1023) << 52;
  double scale;
  std::memcpy(&scale, &sb, 8);
  return p * scale;
}

#if defined(__AVX2__)
[[gnu::always_inline]] inline __m256d LseExp4(__m256d t) {
  const __m256d z = _mm256_fmadd_pd(t, _mm256_set1_pd(kLog2e), _mm256_set1_pd(kShift));
  const __m256d kd = _mm256_sub_pd(z, _mm256_set1_pd(kShift));
  const __m256d nkd = _mm256_sub_pd(_mm256_setzero_pd(), kd);
  __m256d r = _mm256_fmadd_pd(nkd, _mm256_set1_pd(kLn2Hi), t);
  r = _mm256_fmadd_pd(nkd, _mm256_set1_pd(kLn2Lo), r);
  __m256d p = _mm256_set1_pd(kInvFact[0]);
  for (int i = 1; i < 12; ++i) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(kInvFact[i]));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0));
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0));
  const __m256i zb = _mm256_castpd_si256(z);
  const __m256i sb = _mm256_slli_epi64(
      _mm256_add_epi64(_mm256_sub_epi64(zb, _mm256_set1_epi64x(0x4338000000000000ll)), _mm256_set1_epi64x(1023)), 52);
  __m256d e = _mm256_mul_pd(p, _mm256_castsi256_pd(sb));
  // Out of range: 0 below, +inf above (NaN compares false both ways and stays).
  e = _mm256_blendv_pd(e, _mm256_setzero_pd(), _mm256_cmp_pd(t, _mm256_set1_pd(kExpLow), _CMP_LT_OQ));
  e = _mm256_blendv_pd(e, _mm256_set1_pd(INFINITY), _mm256_cmp_pd(t, _mm256_set1_pd(kExpHigh), _CMP_GT_OQ));
  return e;
}
#endif
}  // namespace

double LseExp(double t) {
  if (t < kExpLow) return 0.0;
  if (t > kExpHigh) return INFINITY;
  return LseExpInRange(t);  // (NaN too: it propagates)
}

// LseLog: ln x from fixed operations: x = 2^e·(1 + u) with 1 + u in [√½, √2), ln(1 + u) =
// 2·atanh(s), s = u/(2 + u), written as u − (u²/2 − s·(u²/2 + R)) with R = Σ 2s^(2n)/(2n + 1)
// (n = 1 … 11, |s| ≤ 0.172) so that the large term u is exact, then e·ln2 added in two parts.
// 0 → −inf, +inf → +inf, negative or NaN → NaN; subnormal x are scaled up first.
double LseLog(double x) {
  if (std::isnan(x) || x < 0) return NAN;
  if (x == 0) return -INFINITY;
  if (std::isinf(x)) return INFINITY;
  int64_t e = 0;
  if (x < 0x1p-1022) {
    x *= 0x1p54;
    e = -54;
  }
  uint64_t b;
  std::memcpy(&b, &x, 8);
  e += static_cast<int64_t>(b >> 52) - 1023;
  b = (b & 0x000fffffffffffffull) | 0x3ff0000000000000ull;  // 1 + u in [1, 2)
  double f;
  std::memcpy(&f, &b, 8);
  if (f > 0x1.6a09e667f3bcdp0) {  // √2: into [√½, √2)
    f *= 0.5;
    ++e;
  }
  const double u = f - 1.0;  // exact
  const double s = u / (2.0 + u), z = s * s;
  double r = 2.0 / 23.0;
  for (int n = 21; n >= 3; n -= 2) r = std::fma(r, z, 2.0 / n);
  r = r * z;
  const double hu2 = 0.5 * u * u;
  const double ed = static_cast<double>(e);
  const double lo = s * (hu2 + r) + ed * kLn2Lo;
  return ed * kLn2Hi + (u - (hu2 - lo));
}

void LogitsTopK(const float* row, int64_t cols, int64_t k, int32_t* ids, float* values, float* logsumexp) {
  auto better = [&](int32_t a, int32_t b) {
    const bool na = std::isnan(row[a]), nb = std::isnan(row[b]);
    if (na || nb) return na != nb ? na : a < b;
    return row[a] > row[b] || (row[a] == row[b] && a < b);
  };
  // One pass keeping the best k in a heap whose front is the worst kept. Once the heap is
  // full only a value above the front's, or a NaN, can enter (every later index loses a tie):
  // blocks of 8 that hold neither are skipped whole.
  std::vector<int32_t> heap;
  heap.reserve(static_cast<size_t>(k));
  auto offer = [&](int32_t i) {
    if (static_cast<int64_t>(heap.size()) < k) {
      heap.push_back(i);
      std::push_heap(heap.begin(), heap.end(), better);
    } else if (k > 0 && better(i, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), better);
      heap.back() = i;
      std::push_heap(heap.begin(), heap.end(), better);
    }
  };
  int32_t i = 0;
  const int32_t n = static_cast<int32_t>(cols);
#if defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    if (static_cast<int64_t>(heap.size()) == k && k > 0) {
      const float front = row[heap.front()];
      if (std::isnan(front)) break;  // a NaN front: nothing later can enter
      const __m256 v = _mm256_loadu_ps(row + i);
      // not (v ≤ front): greater, or NaN
      if (_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(front), _CMP_NLE_UQ)) == 0) continue;
    }
    for (int32_t j = i; j < i + 8; ++j) offer(j);
  }
#endif
  for (; i < n; ++i) offer(i);
  std::sort_heap(heap.begin(), heap.end(), better);
  for (size_t j = 0; j < heap.size(); ++j) {
    ids[j] = heap[j];
    values[j] = row[heap[j]];
  }
  *logsumexp = LogitsLogSumExp(row, cols, 1.0);
}

float LogitsLogSumExp(const float* row, int64_t cols, double temperature) {
  // m the largest non-NaN value (−inf when none); e^((x − m)·inv) by LseExp summed in double
  // in eight lanes (element j into lane j mod 8, in order), the lanes added pairwise
  // ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)); then m·inv + LseLog(sum), rounded to
  // float. inv = 1/T (exactly 1 at T = 1, where every product is exact: LogitsTopK's bits).
  const double inv = 1.0 / temperature;
  float mf = -INFINITY;
  int64_t j = 0;
#if defined(__AVX2__)
  if (cols >= 8) {
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= cols; j += 8) mx = _mm256_max_ps(_mm256_loadu_ps(row + j), mx);  // (a NaN in the row: mx kept)
    alignas(32) float l[8];
    _mm256_store_ps(l, mx);
    for (float v : l) mf = v > mf ? v : mf;
  }
#endif
  for (; j < cols; ++j) mf = row[j] > mf ? row[j] : mf;
  const double m = mf;
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  j = 0;
#if defined(__AVX2__)
  {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    const __m256d mv = _mm256_set1_pd(m), iv = _mm256_set1_pd(inv);
    for (; j + 8 <= cols; j += 8) {
      const __m256 v = _mm256_loadu_ps(row + j);
      a0 = _mm256_add_pd(a0, LseExp4(_mm256_mul_pd(_mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), mv), iv)));
      a1 = _mm256_add_pd(a1, LseExp4(_mm256_mul_pd(_mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), mv), iv)));
    }
    _mm256_storeu_pd(lane, a0);
    _mm256_storeu_pd(lane + 4, a1);
  }
#endif
  for (; j < cols; ++j) lane[j & 7] += LseExp((static_cast<double>(row[j]) - m) * inv);
  const double sum = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  return static_cast<float>(m * inv + LseLog(sum));
}

}  // namespace lockstep::traces
