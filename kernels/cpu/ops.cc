// kernels/cpu/ops.cc — see ops.h for the determinism contract.
#include "kernels/cpu/ops.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace lockstep::kernels::cpu {

float Dot(const float* a, const float* b, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] = std::fma(a[i + l], b[i + l], acc[l]);
  }
  for (int l = 0; i < n; ++i, ++l) acc[l] = std::fma(a[i], b[i], acc[l]);
  // Fixed pairwise fold: 16 → 8 → 4 → 2 → 1.
  for (int w = kLanes / 2; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

void MatMulNT(const float* x, int64_t rows, const float* w, int64_t out, int64_t in, float* y) {
  // Output columns are split across threads; each weight row is read once and reused for all
  // x rows while it sits in L1. Results are independent of the split (see Dot). Threads only
  // pay off above ~1 ms of work: a fork/join costs microseconds when cores are idle but can
  // cost milliseconds when another process holds them, so small products stay serial.
#pragma omp parallel for schedule(static) if (out * rows * in > kParallelMacs)
  for (int64_t j = 0; j < out; ++j) {
    const float* wj = w + j * in;
    for (int64_t r = 0; r < rows; ++r) y[r * out + j] = Dot(x + r * in, wj, in);
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
    x[i] = std::exp(x[i] - m);
    s += x[i];
  }
  const float inv = static_cast<float>(1.0 / s);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

static float Silu(float x) { return x / (1.0f + std::exp(-x)); }

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

}  // namespace lockstep::kernels::cpu
