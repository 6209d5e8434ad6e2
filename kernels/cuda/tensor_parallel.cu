// kernels/cuda/tensor_parallel.cu — emulated tensor parallelism's kernels (--emulate-tp N on the
// CUDA backend): the all-reduce of the ranks' partials in a fixed order, expert parallelism's
// per-rank sums of the routed experts, and FP8 weight slices as fp32. Contracts in ops.h; each
// mirrors engine/tensor_parallel.cc or engine/mla_model.cc operation by operation (__f*_rn
// spells every rounding).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.h"

namespace lockstep::kernels::cuda {
namespace {

__global__ void AllReduceKernel(AllReduceParams p) {
  dev::GridDependencySync();
  const int64_t total = p.rows * p.n, chunk = (total + p.ranks - 1) / p.ranks;
  LS_FOR_EACH_ELEMENT(p.rows, p.n) {
    int first = 0;
    if (p.order == ReduceOrder::kRing) first = static_cast<int>(((r * p.n + i) / chunk + 1) % p.ranks);
    if (p.order == ReduceOrder::kRotateByRow) first = static_cast<int>(r % p.ranks);
    const int64_t rank_stride = p.rank_stride != 0 ? p.rank_stride : p.n;
    const int64_t row_stride = p.row_stride != 0 ? p.row_stride : p.ranks * p.n;
    const float* a = p.partials + r * row_stride + i;
    float s = a[first * rank_stride];
    for (int q = 1; q < p.ranks; ++q) {
      int at = first + q;
      if (at >= p.ranks) at -= p.ranks;
      s = __fadd_rn(s, a[at * rank_stride]);
    }
    p.y[r * p.y_stride + i] = s;
  }
}

__global__ void TpExpertPartialsKernel(TpExpertPartialsParams p) {
  dev::GridDependencySync();
  const int64_t width = p.rank >= 0 ? p.n : p.ranks * p.n;  // a row's partials (one rank's: its own)
  LS_FOR_EACH_ELEMENT(p.rows, width) {
    const int64_t q = p.rank >= 0 ? p.rank : i / p.n, c = i % p.n;
    const int64_t lo = p.experts * q / p.ranks, hi = p.experts * (q + 1) / p.ranks;
    float acc = 0.0f;
    for (int64_t j = 0; j < p.k; ++j) {
      const int64_t slot = r * p.k + j;
      const int32_t id = p.ids[slot];
      if (id < lo || id >= hi) continue;
      acc = __fadd_rn(acc, __fmul_rn(p.y[slot * p.y_stride + c], p.weights[slot]));
    }
    if (p.shared != nullptr) acc = __fadd_rn(acc, p.shared[r * width + i]);
    p.out[r * width + i] = acc;
  }
}

__global__ void Fp8SliceKernel(Fp8SliceParams p) {
  dev::GridDependencySync();
  LS_FOR_EACH_ELEMENT(p.rows, p.n) {
    const int64_t col = p.col0 + i;
    p.out[r * p.n + i] =
        __fmul_rn(dev::Fp8E4m3ToF32(p.w[r * p.w_stride + col]), p.scale[r * p.scale_stride + (col >> 7)]);
  }
}

}  // namespace

Status AllReduce(const AllReduceParams& p, Stream stream) {
  constexpr const char* op = "AllReduce";
  LS_CHECK_ARG(p.ranks >= 1, op, "ranks", p.ranks);
  LS_CHECK_ARG(p.rows >= 0 && p.n >= 0, op, "rows", p.rows);
  LS_CHECK_ARG(p.rows == 0 || (p.partials != nullptr && p.y != nullptr), op, "partials / y", p.partials);
  LS_CHECK_ARG(p.y_stride >= p.n, op, "y_stride", p.y_stride);
  LS_CHECK_ARG(p.rank_stride >= 0 && p.row_stride >= 0 && (p.rank_stride == 0) == (p.row_stride == 0), op,
               "rank_stride / row_stride (both set, or both 0)", p.rank_stride);
  LS_CHECK_ARG(p.order == ReduceOrder::kRankOrder || p.order == ReduceOrder::kRing ||
                   p.order == ReduceOrder::kRotateByRow,
               op, "order", static_cast<int>(p.order));
  if (p.rows == 0 || p.n == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(AllReduceKernel, ElementGrid(p.rows, p.n), kElemThreads, 0, stream, p));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status TpExpertPartials(const TpExpertPartialsParams& p, Stream stream) {
  constexpr const char* op = "TpExpertPartials";
  LS_CHECK_ARG(p.ranks >= 1, op, "ranks", p.ranks);
  LS_CHECK_ARG(p.experts >= p.ranks, op, "experts (≥ ranks)", p.experts);
  LS_CHECK_ARG(p.rows >= 0 && p.k > 0 && p.n >= 0, op, "rows / k", p.k);
  LS_CHECK_ARG(p.rows == 0 || (p.y != nullptr && p.weights != nullptr && p.ids != nullptr && p.out != nullptr), op,
               "y / weights / ids / out", p.y);
  LS_CHECK_ARG(p.y_stride >= p.n, op, "y_stride", p.y_stride);
  LS_CHECK_ARG(p.rank >= -1 && p.rank < p.ranks, op, "rank", p.rank);
  if (p.rows == 0 || p.n == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(TpExpertPartialsKernel, ElementGrid(p.rows, p.rank >= 0 ? p.n : p.ranks * p.n),
                                       kElemThreads, 0, stream, p));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status Fp8SliceToF32(const Fp8SliceParams& p, Stream stream) {
  constexpr const char* op = "Fp8SliceToF32";
  LS_CHECK_ARG(p.rows >= 0 && p.n >= 0 && p.col0 >= 0, op, "rows / n / col0", p.n);
  LS_CHECK_ARG(p.rows == 0 || (p.w != nullptr && p.scale != nullptr && p.out != nullptr), op, "w / scale / out", p.w);
  LS_CHECK_ARG(p.w_stride >= p.col0 + p.n, op, "w_stride", p.w_stride);
  LS_CHECK_ARG(p.scale_stride >= (p.col0 + p.n + 127) / 128, op, "scale_stride", p.scale_stride);
  if (p.rows == 0 || p.n == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(Fp8SliceKernel, ElementGrid(p.rows, p.n), kElemThreads, 0, stream, p));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

}  // namespace lockstep::kernels::cuda
