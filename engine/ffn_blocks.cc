// engine/ffn_blocks.cc — the shared FFN blocks of the CPU forward passes (engine/ffn_blocks.h).
#include "engine/ffn_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/ops.h"

namespace lockstep::engine {

void SwiGluMlp(const Gemm& gemm, const MlpWeights& m, const float* x, int64_t rows, float* y,
               std::optional<float> clamp) {
  const int64_t inter = m.gate.rows, n = rows * inter;
  std::vector<float> g(n), u(n);
  gemm(x, rows, m.gate, g.data());
  gemm(x, rows, m.up, u.data());
  if (clamp) {
    const float L = *clamp;
    for (int64_t i = 0; i < n; ++i) {
      g[i] = std::min(g[i], L);
      u[i] = std::clamp(u[i], -L, L);
    }
  }
  kernels::cpu::SwiGlu(g.data(), u.data(), n, g.data());
  gemm(g.data(), rows, m.down, y);
}

void DispatchExperts(const int32_t* ids, int64_t R, int64_t k, int64_t E, int64_t H, const float* x,
                     const ExpertFn& expert, float* slot) {
  // Each expert's (row, slot) pairs, in one pass over the ids.
  std::vector<std::vector<int64_t>> of(static_cast<size_t>(E));
  for (int64_t i = 0; i < R * k; ++i) {
    if (ids[i] >= 0 && ids[i] < E) of[ids[i]].push_back(i);
  }
  std::vector<float> xin, yout;
  for (int64_t e = 0; e < E; ++e) {
    const std::vector<int64_t>& rows = of[e];
    if (rows.empty()) continue;
    const int64_t n = static_cast<int64_t>(rows.size());
    xin.resize(n * H);
    yout.resize(n * H);
    for (int64_t i = 0; i < n; ++i) std::memcpy(&xin[i * H], &x[(rows[i] / k) * H], H * sizeof(float));
    expert(e, xin.data(), n, yout.data());
    for (int64_t i = 0; i < n; ++i) std::memcpy(&slot[rows[i] * H], &yout[i * H], H * sizeof(float));
  }
}

void CombineExperts(const float* slot, const float* wts, int64_t R, int64_t k, int64_t H, const float* shared,
                    ExpertCombine how, float* y) {
  for (int64_t r = 0; r < R; ++r) {
    float* yr = &y[r * H];
    std::fill(yr, yr + H, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const float w = wts[r * k + j];
      const float* s = &slot[(r * k + j) * H];
      if (how == ExpertCombine::kFma) {
        kernels::cpu::Axpy(w, s, H, yr);
      } else {
        for (int64_t i = 0; i < H; ++i) yr[i] += s[i] * w;
      }
    }
    for (int64_t i = 0; i < H; ++i) yr[i] += shared[r * H + i];
  }
}

}  // namespace lockstep::engine
