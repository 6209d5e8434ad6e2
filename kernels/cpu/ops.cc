// kernels/cpu/ops.cc — see ops.h for the determinism contract.
#include "kernels/cpu/ops.h"

#include "kernels/mla_splits.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace lockstep::kernels::cpu {

namespace {
constexpr int kLanes = 16;

// Pairwise fold of one accumulator set: 16 → 8 → 4 → 2 → 1.
inline float Fold(float* acc) {
  for (int w = kLanes / 2; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

// K dot products sharing one operand: out[k] = Dot(a[k], b). Each output's arithmetic is
// exactly Dot's (lane = i mod 16, one fused multiply-add per element, same fold), so blocking
// never changes a bit; it only gives the CPU 2K independent FMA chains and reuses b's loads.
// The AVX2 path and the portable path perform the same IEEE operations in the same order.
template <int K>
inline void DotShared(const float* const* a, const float* b, int64_t n, float* out) {
  alignas(32) float acc[K][kLanes] = {};
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 lo[K], hi[K];
  for (int k = 0; k < K; ++k) lo[k] = hi[k] = _mm256_setzero_ps();
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 b0 = _mm256_loadu_ps(b + i), b1 = _mm256_loadu_ps(b + i + 8);
    for (int k = 0; k < K; ++k) {
      lo[k] = _mm256_fmadd_ps(_mm256_loadu_ps(a[k] + i), b0, lo[k]);
      hi[k] = _mm256_fmadd_ps(_mm256_loadu_ps(a[k] + i + 8), b1, hi[k]);
    }
  }
  for (int k = 0; k < K; ++k) {
    _mm256_store_ps(acc[k], lo[k]);
    _mm256_store_ps(acc[k] + 8, hi[k]);
  }
#else
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < K; ++k) {
      for (int l = 0; l < kLanes; ++l) acc[k][l] = std::fma(a[k][i + l], b[i + l], acc[k][l]);
    }
  }
#endif
  for (int l = 0; i < n; ++i, ++l) {
    for (int k = 0; k < K; ++k) acc[k][l] = std::fma(a[k][i], b[i], acc[k][l]);
  }
  for (int k = 0; k < K; ++k) out[k] = Fold(acc[k]);
}
}  // namespace

float Dot(const float* a, const float* b, int64_t n) {
  float out;
  DotShared<1>(&a, b, n, &out);
  return out;
}

namespace {
// y[r, j] = Dot(x_r, w_j) with w_j's rows from `rows_of`: rows_of(j0, m) returns the first of
// rows j0 … j0 + m − 1 (m ≤ 4), `ldw` elements apart. The one loop nest of every MatMulNT, so
// a product over a WeightView is the product over the same values in memory, bit for bit.
//
// Output columns are split across threads; each weight row is read once and reused for all
// x rows while it sits in L1. Results are independent of the split (see Dot). Threads only
// pay off above ~1 ms of work: a fork/join costs microseconds when cores are idle but can
// cost milliseconds when another process holds them, so small products stay serial.
template <typename RowsOf>
void MatMulNTRows(const float* x, int64_t ldx, int64_t rows, RowsOf rows_of, int64_t ldw, int64_t out, int64_t in,
                  float* y, int64_t ldy) {
  if (rows == 1) {
    // Decode: four weight rows against the one x row at a time (x is the shared operand).
#pragma omp parallel for schedule(static) if (out * in > kParallelMacs)
    for (int64_t j0 = 0; j0 < out; j0 += 4) {
      const int64_t m = std::min<int64_t>(4, out - j0);
      const float* w = rows_of(j0, m);
      const float* ws[4] = {w, w + ldw, w + 2 * ldw, w + 3 * ldw};
      float r[4];
      if (m == 4) {
        DotShared<4>(ws, x, in, r);
      } else {
        for (int64_t k = 0; k < m; ++k) DotShared<1>(&ws[k], x, in, &r[k]);
      }
      for (int64_t k = 0; k < m; ++k) y[j0 + k] = r[k];
    }
    return;
  }
#pragma omp parallel for schedule(static) if (out * rows * in > kParallelMacs)
  for (int64_t j = 0; j < out; ++j) {
    const float* wj = rows_of(j, 1);
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      const float* xs[4] = {x + r * ldx, x + (r + 1) * ldx, x + (r + 2) * ldx, x + (r + 3) * ldx};
      float o[4];
      DotShared<4>(xs, wj, in, o);
      for (int k = 0; k < 4; ++k) y[(r + k) * ldy + j] = o[k];
    }
    for (; r < rows; ++r) {
      const float* xr = x + r * ldx;
      DotShared<1>(&xr, wj, in, &y[r * ldy + j]);
    }
  }
}

// The calling thread's scratch for up to four decoded weight rows (kept between calls: a
// product's rows are decoded into memory that stays in L1).
float* WeightRowScratch(int64_t n) {
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < n) scratch.resize(static_cast<size_t>(n));
  return scratch.data();
}
}  // namespace

void MatMulNTStrided(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t ldw, int64_t out,
                     int64_t in, float* y, int64_t ldy) {
  MatMulNTRows(x, ldx, rows, [w, ldw](int64_t j0, int64_t) { return w + j0 * ldw; }, ldw, out, in, y, ldy);
}

void MatMulNT(const float* x, int64_t rows, const float* w, int64_t out, int64_t in, float* y) {
  MatMulNTStrided(x, in, rows, w, in, out, in, y, out);
}

void MatMulNT(const float* x, int64_t rows, const WeightView& w, WeightRounding round, float* y) {
  const int64_t out = w.rows, in = w.cols;
  if (const float* f = w.f32(); f != nullptr && round == WeightRounding::kAsStored) {
    MatMulNT(x, rows, f, out, in, y);  // fp32 as stored: the rows in place
    return;
  }
  // Each block of weight rows dequantised into this thread's scratch, then multiplied there.
  auto rows_of = [&w, round, in](int64_t j0, int64_t m) {
    float* s = WeightRowScratch(4 * in);
    w.DecodeRows(j0, m, s, round);
    return static_cast<const float*>(s);
  };
  MatMulNTRows(x, in, rows, rows_of, in, out, in, y, out);
}

void MatMulNTCols(const float* x, int64_t rows, const WeightView& w, WeightRounding round, int64_t k0, int64_t k1,
                  float* y, int64_t ldy) {
  const int64_t out = w.rows, in = w.cols, n = k1 - k0;
  if (const float* f = w.f32(); f != nullptr && round == WeightRounding::kAsStored) {
    MatMulNTStrided(x + k0, in, rows, f + k0, in, out, n, y, ldy);
    return;
  }
  auto rows_of = [&w, round, in, k0](int64_t j0, int64_t m) {
    float* s = WeightRowScratch(4 * in);
    w.DecodeRows(j0, m, s, round);
    return static_cast<const float*>(s + k0);
  };
  MatMulNTRows(x + k0, in, rows, rows_of, in, out, n, y, ldy);
}

void RmsNormLanes256(const float* x, const float* weight, int64_t rows, int64_t n, double eps, float* y) {
  constexpr int kLanes = 256, kWarp = 32;
  const float epsf = static_cast<float>(eps);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float lane[kLanes] = {};
    for (int64_t i = 0; i < n; ++i) lane[i % kLanes] = std::fma(xr[i], xr[i], lane[i % kLanes]);
    float warp[kLanes / kWarp];
    for (int w = 0; w < kLanes / kWarp; ++w) {
      float v[kWarp], t[kWarp];
      std::memcpy(v, lane + w * kWarp, sizeof v);
      for (int o = kWarp / 2; o >= 1; o /= 2) {  // every lane adds its partner's value (a butterfly)
        for (int i = 0; i < kWarp; ++i) t[i] = v[i] + v[i ^ o];
        std::memcpy(v, t, sizeof v);
      }
      warp[w] = v[0];
    }
    const float s = ((warp[0] + warp[1]) + (warp[2] + warp[3])) + ((warp[4] + warp[5]) + (warp[6] + warp[7]));
    const float inv = 1.0f / std::sqrt(s / static_cast<float>(n) + epsf);
    float* yr = y + r * n;
    for (int64_t i = 0; i < n; ++i) yr[i] = weight[i] * (xr[i] * inv);
  }
}

void RmsNorm(const float* x, const float* weight, int64_t rows, int64_t n, double eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
    float* yr = y + r * n;
    for (int64_t i = 0; i < n; ++i) yr[i] = weight[i] * (xr[i] * inv);
  }
}

void LayerNorm(const float* x, const float* weight, const float* bias, int64_t rows, int64_t n, double eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    double mean = 0;
    for (int64_t i = 0; i < n; ++i) mean += xr[i];
    mean /= static_cast<double>(n);
    double var = 0;
    for (int64_t i = 0; i < n; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    var /= static_cast<double>(n);
    const double inv = 1.0 / std::sqrt(var + eps);
    float* yr = y + r * n;
    for (int64_t i = 0; i < n; ++i) {
      yr[i] = static_cast<float>((xr[i] - mean) * inv) * weight[i] + bias[i];
    }
  }
}

void Softmax(float* x, int64_t n) {
  if (n <= 0) return;
  float m = x[0];
  for (int64_t i = 1; i < n; ++i) m = std::fmax(m, x[i]);
  if (std::isinf(m) && m < 0) {  // everything masked: uniform zero, not NaN
    for (int64_t i = 0; i < n; ++i) x[i] = 0.0f;
    return;
  }
  double s = 0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = ExpF(x[i] - m);
    s += x[i];
  }
  const float inv = static_cast<float>(1.0 / s);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

static float Silu(float x) { return x / (1.0f + ExpF(-x)); }

void SwiGlu(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = Silu(gate[i]) * up[i];
}

void RopePairsAdjacent(float* x, const float* cos, const float* sin, int64_t dim) {
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * cos[i] - b * sin[i];
    x[2 * i + 1] = b * cos[i] + a * sin[i];
  }
}

void RopePairsToHalves(float* x, const float* cos, const float* sin, int64_t dim) {
  const int64_t h = dim / 2;
  float tmp[1024];
  std::vector<float> big;
  float* t = tmp;
  if (dim > 1024) {
    big.resize(dim);
    t = big.data();
  }
  for (int64_t i = 0; i < h; ++i) {
    const float a = x[2 * i], b = x[2 * i + 1];
    t[i] = a * cos[i] - b * sin[i];
    t[h + i] = b * cos[i] + a * sin[i];
  }
  std::memcpy(x, t, dim * sizeof(float));
}

void RopeHalves(float* x, const float* cos, const float* sin, int64_t dim) {
  const int64_t h = dim / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = x[i], b = x[h + i];
    x[i] = a * cos[i] - b * sin[i];
    x[h + i] = b * cos[i] + a * sin[i];
  }
}

void Hadamard(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2) {
    for (int64_t i = 0; i < n; i += 2 * h) {
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  const float s = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

void Axpy(float a, const float* x, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = std::fma(a, x[i], y[i]);
}

namespace {
// A warp's butterfly over 32 lanes (xor 16, 8, 4, 2, 1), as dev::WarpMax / dev::WarpSum run it:
// every lane ends with the same value (each step combines a pair both lanes share), so lane 0's
// half of the tree is the whole answer — op(v[i], v[i + w]) for i < w, w = 16, 8, 4, 2, 1.
template <typename Op>
float Butterfly32(const float* v, Op op) {
  float a[kMlaTileKeys / 2];
  for (int i = 0; i < kMlaTileKeys / 2; ++i) a[i] = op(v[i], v[i + kMlaTileKeys / 2]);
  for (int w = kMlaTileKeys / 4; w >= 1; w /= 2) {
    for (int i = 0; i < w; ++i) a[i] = op(a[i], a[i + w]);
  }
  return a[0];
}
}  // namespace

float MlaAttend(const float* scores, const float* const* rows, int64_t n, int64_t C, float* out, float* max_out) {
  const int64_t split_keys = MlaSplitKeysOf(n), splits = MlaNumSplits(n);
  // Per-thread scratch (callers run heads in parallel): the splits' o, m, l and merge factors.
  thread_local std::vector<float> scratch;
  scratch.assign(static_cast<size_t>(splits * (C + 3)), 0.0f);
  float* const o_part = scratch.data();
  float* const m_part = o_part + splits * C;
  float* const l_part = m_part + splits;
  float* const f = l_part + splits;
  auto fmax = [](float a, float b) { return std::fmax(a, b); };
  auto add = [](float a, float b) { return a + b; };
  for (int64_t s = 0; s < splits; ++s) {
    const int64_t begin = s * split_keys, end = std::min(n, begin + split_keys);
    float m = -INFINITY, l = 0.0f;
    float* o = &o_part[s * C];
    for (int64_t t0 = begin; t0 < end; t0 += kMlaTileKeys) {
      float sc[kMlaTileKeys], p[kMlaTileKeys];
      for (int t = 0; t < kMlaTileKeys; ++t) {
        const int64_t key = t0 + t;
        sc[t] = key < end && rows[key] != nullptr ? scores[key] : -INFINITY;
      }
      const float m_new = std::fmax(m, Butterfly32(sc, fmax));
      for (int t = 0; t < kMlaTileKeys; ++t) p[t] = sc[t] == -INFINITY ? 0.0f : ExpF(sc[t] - m_new);
      const float alpha = m == -INFINITY ? 0.0f : ExpF(m - m_new);
      l = l * alpha + Butterfly32(p, add);
      m = m_new;
      for (int64_t c = 0; c < C; ++c) o[c] *= alpha;
      for (int t = 0; t < kMlaTileKeys; ++t) {
        const int64_t key = t0 + t;
        const float* row = key < end ? rows[key] : nullptr;
        if (row != nullptr) {
          for (int64_t c = 0; c < C; ++c) o[c] = std::fma(p[t], row[c], o[c]);
        } else {  // fma(0, 0, o): o, with −0 made +0
          for (int64_t c = 0; c < C; ++c) o[c] += 0.0f;
        }
      }
    }
    m_part[s] = m;
    l_part[s] = l;
  }
  float M = -INFINITY;
  for (int64_t s = 0; s < splits; ++s) M = std::fmax(M, m_part[s]);
  float L = 0.0f;
  for (int64_t s = 0; s < splits; ++s) {
    f[s] = m_part[s] == -INFINITY ? 0.0f : ExpF(m_part[s] - M);
    L = L + l_part[s] * f[s];
  }
  // Each column's sum over the splits in ascending order (split-major loops, the same order).
  std::fill(out, out + C, 0.0f);
  for (int64_t s = 0; s < splits; ++s) {
    const float* o = &o_part[s * C];
    for (int64_t c = 0; c < C; ++c) out[c] = std::fma(o[c], f[s], out[c]);
  }
  for (int64_t c = 0; c < C; ++c) out[c] = L == 0.0f ? 0.0f : out[c] / L;
  if (max_out != nullptr) *max_out = M;
  return L;
}

}  // namespace lockstep::kernels::cpu
