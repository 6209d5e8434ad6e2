// kernels/cuda/norm_row.cuh — one RMSNorm row by one CTA (RmsNorm's arithmetic) and RmsNorm's
// argument checks, shared by the kernels that normalise a row on the way to something else (the
// latent-cache path, the MoE layer's entry and exit).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/ops.h"

namespace lockstep::kernels::cuda {
namespace {

constexpr int kNormThreads = 256;  // part of RMSNorm's reduction order: do not tune without a new variant name

// One CTA per row. The sum of squares: thread t accumulates x[i]² for i ≡ t (mod 256) in
// ascending i by FMA; lanes fold by butterfly (16, 8, 4, 2, 1); every thread then folds the
// 8 warp sums as ((w0+w1)+(w2+w3))+((w4+w5)+(w6+w7)).
// Rows of up to kNormCached · 256 values are read once, x and the weight together, into
// registers (one memory round trip; the step's norms are latency-bound); longer rows loop.
constexpr int kNormCached = 16;
// With p.add, x below is the sum row: each thread adds and stores its own elements before it
// reads them back, so sum may alias x.
// Row r by the CTA's kNormThreads threads (the kernels that call it run exactly that many),
// into y (the row's output) and, with p.add, sum (the row's sum; null only when the row is
// cached, n ≤ kNormCached · kNormThreads: then the sum is not stored).
__device__ __forceinline__ void RmsNormRowTo(const RmsNormParams& p, int64_t r, float* y, float* sum) {
  const float* x = p.add != nullptr ? sum : p.x + r * p.x_stride;
  float acc = 0.0f;
  const bool cached = p.n <= int64_t{kNormCached} * kNormThreads;
  float xv[kNormCached], wv[kNormCached];
  if (cached) {
    const float* a = p.x + r * p.x_stride;
    const float* b = p.add != nullptr ? p.add + r * p.add_stride : nullptr;
    float bv[kNormCached];
#pragma unroll
    for (int m = 0; m < kNormCached; ++m) {
      const int64_t i = threadIdx.x + m * kNormThreads;
      xv[m] = i < p.n ? a[i] : 0.0f;
      bv[m] = i < p.n && b != nullptr ? b[i] : 0.0f;
      wv[m] = i < p.n ? __ldg(p.weight + i) : 0.0f;
    }
    if (b != nullptr) {
#pragma unroll
      for (int m = 0; m < kNormCached; ++m) {
        const int64_t i = threadIdx.x + m * kNormThreads;
        xv[m] = __fadd_rn(xv[m], bv[m]);  // Add's a + b
        if (i < p.n && sum != nullptr) sum[i] = xv[m];
      }
    }
#pragma unroll
    for (int m = 0; m < kNormCached; ++m) {
      if (threadIdx.x + m * kNormThreads < p.n) acc = __fmaf_rn(xv[m], xv[m], acc);
    }
  } else {
    if (p.add != nullptr) {
      const float* a = p.x + r * p.x_stride;
      const float* b = p.add + r * p.add_stride;
      for (int64_t i = threadIdx.x; i < p.n; i += kNormThreads) sum[i] = __fadd_rn(a[i], b[i]);
    }
    for (int64_t i = threadIdx.x; i < p.n; i += kNormThreads) acc = __fmaf_rn(x[i], x[i], acc);
  }
  acc = dev::WarpSum(acc);
  __shared__ float warp_sums[kNormThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  const float* w = warp_sums;
  const float s = __fadd_rn(__fadd_rn(__fadd_rn(w[0], w[1]), __fadd_rn(w[2], w[3])),
                            __fadd_rn(__fadd_rn(w[4], w[5]), __fadd_rn(w[6], w[7])));
  const float mean_of = static_cast<float>(p.fault_mean_n_minus_1 ? p.n - 1 : p.n);  // (hidden fault zoo)
  const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(s, mean_of), p.eps)));
  // y = weight · (x · inv), the CPU's expression order.
  if (cached) {
#pragma unroll
    for (int m = 0; m < kNormCached; ++m) {
      const int64_t i = threadIdx.x + m * kNormThreads;
      if (i < p.n) y[i] = __fmul_rn(wv[m], __fmul_rn(xv[m], inv));
    }
  } else {
    for (int64_t i = threadIdx.x; i < p.n; i += kNormThreads) y[i] = __fmul_rn(p.weight[i], __fmul_rn(x[i], inv));
  }
}
__device__ __forceinline__ void RmsNormRow(const RmsNormParams& p, int64_t r) {
  RmsNormRowTo(p, r, p.y + r * p.y_stride, p.add != nullptr ? p.sum + r * p.sum_stride : nullptr);
}

// RmsNorm's argument checks, shared by every op that normalises rows (RmsNorm, WriteLatentPath,
// NormRoute, MoeCombineNorm).
Status CheckRmsNorm(const RmsNormParams& p, const char* op) {
  LS_CHECK_ARG(p.x != nullptr, op, "x", p.x);
  LS_CHECK_ARG(p.weight != nullptr, op, "weight", p.weight);
  LS_CHECK_ARG(p.y != nullptr, op, "y", p.y);
  LS_CHECK_ARG(p.rows >= 0 && p.rows < (int64_t{1} << 31), op, "rows", p.rows);
  LS_CHECK_ARG(p.n > 0 && p.n < (int64_t{1} << 24), op, "n", p.n);  // n exact in fp32
  LS_CHECK_ARG(p.x_stride >= p.n, op, "x_stride", p.x_stride);
  LS_CHECK_ARG(p.y_stride >= p.n, op, "y_stride", p.y_stride);
  LS_CHECK_ARG(p.x != p.y || p.x_stride == p.y_stride, op, "y_stride (in place needs x_stride)", p.y_stride);
  LS_CHECK_ARG(p.eps >= 0.0f, op, "eps", p.eps);
  LS_CHECK_ARG(p.add == nullptr || p.sum != nullptr, op, "sum (needed with add)", p.sum);
  LS_CHECK_ARG(p.add == nullptr || p.add_stride >= p.n, op, "add_stride", p.add_stride);
  LS_CHECK_ARG(p.add == nullptr || p.sum_stride >= p.n, op, "sum_stride", p.sum_stride);
  LS_CHECK_ARG(p.add == nullptr || p.sum == p.x || p.sum != p.y, op, "sum (must not be y)", p.sum);
  return Status::Ok();
}

}  // namespace
}  // namespace lockstep::kernels::cuda
