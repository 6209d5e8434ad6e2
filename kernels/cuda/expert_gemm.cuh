// kernels/cuda/expert_gemm.cuh — what model_ops.cu, expert_gemm.cu and expert_gemm_stream.cu
// share: the grid limit, two device helpers, the block sizes of ExpertGemm's cp.async and
// streaming shapes, and the streaming shapes' launches that expert_gemm.cu's shape choice calls.
// Internal to kernels/cuda (ops.h is the interface).
#pragma once

#include <cstdint>

#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/ops.h"

namespace lockstep::kernels::cuda {

constexpr int64_t kMaxGrid = 65535;  // grid.y / grid.z limit

__device__ __forceinline__ float QuietNan() { return __uint_as_float(0x7fc00000u); }

// Slot id → the launch's expert (ExpertGemmParams::expert0), and whether an expert outside the
// launch's is another rank's slot (skipped) rather than an error.
__device__ __forceinline__ int LocalExpert(const ExpertGemmParams& p, int32_t id) { return id - p.expert0; }
__device__ __forceinline__ bool ForeignExpert(const ExpertGemmParams& p, int e) {
  return p.skip_foreign && (e < 0 || e >= p.experts);
}

// cpu::SwiGlu's element: (g / (1 + exp(−g))) · u (also ExpertGemm's swiglu epilogue).
__device__ __forceinline__ float SwiGluOf(float g, float u) {
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, dev::ExpF(-g))), u);
}

constexpr int kFwBlk = 256;      // weight elements per row per stage (cp.async shapes) or block (streaming)
constexpr int kSwTileIn = 4096;  // x values the streaming shapes stage at once

// The bulk path's ring for `p`: slots of 512 values (half the copies and barrier waits of 256)
// when the grid then fits on the GPU in one wave, else 256-value slots, whose shallower rings
// fit more CTAs on an SM (routed down at one token: 768 CTAs). `one_wave` tells whether either
// does. Speed only: the slot size changes no arithmetic.
struct BulkShape {
  int blk, stages;
  bool one_wave;
};

// Launches of the streaming per-slot shapes (expert_gemm_stream.cu), for ExpertGemm once it has
// checked `p` and chosen the shape.
BulkShape PickBulkShape(const ExpertGemmParams& p);
Status LaunchExpertGemmStream(const ExpertGemmParams& p, Stream stream);
Status LaunchExpertGemmBulk(const ExpertGemmParams& p, Stream stream);

}  // namespace lockstep::kernels::cuda
