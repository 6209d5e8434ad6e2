// engine/gemm.h — the CPU forward passes' products with a stored weight: one place that says
// what each gemm variant does to the activations and the weights (engine-internal).
//
// y = x·wᵀ by cpu::MatMulNT, which dequantises the weight's rows as it goes (any WeightView
// dtype: F32, BF16, F16, FP8 blocks, MXFP4, NVFP4). gemm=fp32 (and every *_dot / *_heuristic
// alias on the CPU): x and the weights as they are. gemm=bf16: x and each dequantised weight
// rounded to bf16, accumulation in fp32 — the precision of a bf16 GPU GEMM, on the reference's
// fixed summation order. act_fp8 (gemm=w8a8_dot's linear layers): each row of x through FP8 per
// 128 values first (Fp8RoundTrip, DeepSeek's act_quant). The weight transforms of fp8_dot and
// the 4-bit variants are made once at load (Model::Fp8Weights / Fp4Weights), not here.
//
// Thread-safety: a Gemm is immutable; calls share nothing.
#pragma once

#include <cassert>
#include <cstdint>
#include <vector>

#include "engine/kv_cache.h"
#include "engine/weights.h"
#include "kernels/cpu/numerics.h"
#include "kernels/cpu/ops.h"
#include "kernels/plan.h"

namespace lockstep::engine {

struct Gemm {
  bool bf16 = false;
  bool act_fp8 = false;
  // The product variant of `plan` (act_fp8 only for the linear layers: `linear`).
  static Gemm Of(const kernels::KernelPlan& plan, bool linear) { return {plan.bf16(), linear && plan.w8a8()}; }
  kernels::WeightRounding weights() const {
    return bf16 ? kernels::WeightRounding::kBf16 : kernels::WeightRounding::kAsStored;
  }
  void operator()(const float* x, int64_t rows, const Matrix& w, float* y) const {
    const int64_t in = w.cols;
    if (!bf16 && !act_fp8) {
      kernels::cpu::MatMulNT(x, rows, w.data, weights(), y);
      return;
    }
    std::vector<float> xr(rows * in);
    if (act_fp8) {
      for (int64_t r = 0; r < rows; ++r) Fp8RoundTrip(x + r * in, in, &xr[r * in]);
    } else {
      for (int64_t i = 0; i < rows * in; ++i) xr[i] = kernels::Bf16ToF32(kernels::F32ToBf16(x[i]));
    }
    kernels::cpu::MatMulNT(xr.data(), rows, w.data, weights(), y);
  }
  // The same, with the shape the caller expects checked (debug builds).
  void operator()(const float* x, int64_t rows, const Matrix& w, int64_t out, int64_t in, float* y) const {
    assert(w.rows == out && w.cols == in);
    (void)out;
    (void)in;
    (*this)(x, rows, w, y);
  }
};

}  // namespace lockstep::engine
