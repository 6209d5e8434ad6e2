// kernels/cuda/expert_tc.cu — ExpertGemm on tensor cores (ExpertGemmParams::tensor_cores): the
// routed experts of gemm=bf16, the variant whose dense products are cuBLAS's bf16 GEMMs.
//
// Not cpu::Dot's order (that is bf16_dot's ExpertGemm), but one fixed order of its own, so
// deterministic and batch-invariant: y[slot, o] = Σ over the K dimension in 32-element blocks,
// ascending, each block two mma.m16n8k16 (bf16 in, fp32 accumulate) — the same sequence of
// MMAs for a slot whatever else the batch holds; an MMA's output element depends only on its
// own row and column. Rows of W are the MMA's M side (16 a warp), the expert's slots its N side
// (8 an MMA, up to 32 a pass: larger groups loop), so a batch's few tokens an expert read each
// weight once, 16-byte loads, a 256-column chunk of them in flight a warp. (Measured against
// this, H200, V2-Lite gemm=bf16, batch 64 / batch 1: x staged whole with 16 slots a pass and
// double-buffered weights 3480 / 256 tok/s, x read straight from global with 32 slots 2950 /
// 251; this shape 3768 / 269.) The K dimension is permuted inside each 32-block (lane
// quad q loads columns 8q … 8q + 7, which the MMA's fragment layout then spreads over its two
// k16 steps); A and B take the same permutation, so each product pairs the right operands.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/expert_tc.h"
#include "kernels/cuda/launch.cuh"

namespace lockstep::kernels::cuda {
namespace {

constexpr int kTcWarps = 4;
constexpr int kTcRows = 16 * kTcWarps;  // output rows a CTA
constexpr int kTcTokens = 32;           // slots a pass (4 MMA column tiles)
constexpr int kTcChunk = 256;           // K columns a chunk (weights in flight, x staged)
constexpr int kTcBlocks = kTcChunk / 32;
constexpr int kTcXStride = kTcChunk + 8;  // bf16s a staged x row: +16 bytes spread the quads' banks

struct TcShared {
  int slots[kTcTokens];
  int count;
  long long next;
  __align__(16) uint16_t xs[kTcTokens][kTcXStride];
};

__device__ __forceinline__ void Mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A pass: warp 0 gathers the next ≤ kTcTokens slots routed to the CTA's expert (slot order);
// then, 256 columns at a time, each warp requests its 16 weight rows' columns, the CTA stages
// the slots' x columns as bf16 in shared memory, and the warps run the MMAs.
__global__ void __launch_bounds__(kTcWarps * 32) ExpertGemmTcKernel(ExpertGemmParams p) {
  dev::GridDependencySync();
  __shared__ TcShared sm;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
  const int e = static_cast<int>(blockIdx.y);
  const long long S = p.rows * p.k;
  const bool report = blockIdx.x == 0 && blockIdx.y == 0;  // flags (and NaNs) the bad ids
  // This lane's two weight rows (g and g + 8 of the warp's 16).
  const long long ra = static_cast<long long>(blockIdx.x) * kTcRows + warp * 16 + g, rb = ra + 8;
  const bool va = ra < p.out, vb = rb < p.out;
  const uint16_t* W = static_cast<const uint16_t*>(p.w) + static_cast<long long>(e) * p.w_expert_stride;
  const uint16_t* wa = W + (va ? ra : 0) * p.w_row_stride + 8 * q;
  const uint16_t* wb = W + (vb ? rb : 0) * p.w_row_stride + 8 * q;
  long long pos = 0;
  while (true) {
    if (warp == 0) {
      int n = 0;
      long long at = pos;
      while (n < kTcTokens && at < S) {
        const long long s = at + lane;
        const int id = s < S ? p.ids[s] - p.expert0 : -1;  // (ExpertGemmParams::expert0)
        if (report && s < S && (id < 0 || id >= p.experts) && !p.skip_foreign) {
          if (p.error_flag != nullptr) atomicOr(p.error_flag, kErrExpert);
          for (long long o = 0; o < p.out; ++o) p.y[s * p.y_stride + o] = __uint_as_float(0x7fc00000u);
        }
        const bool mine = s < S && id == e;
        const unsigned m = __ballot_sync(0xffffffffu, mine);
        const int avail = __popc(m), take = avail < kTcTokens - n ? avail : kTcTokens - n;
        const int rank = __popc(m & ((1u << lane) - 1u));
        if (mine && rank < take) sm.slots[n + rank] = static_cast<int>(s);
        if (take < avail) {  // resume after the last slot taken
          const unsigned last = __ballot_sync(0xffffffffu, mine && rank == take - 1);
          at += __ffs(last);
        } else {
          at += 32;
        }
        n += take;
      }
      if (lane == 0) {
        sm.count = n;
        sm.next = at < S ? at : S;
      }
    }
    __syncthreads();
    const int cnt = sm.count;
    pos = sm.next;
    if (cnt == 0) break;
    const int tiles = (cnt + 7) / 8;
    float acc[4][4] = {};
    for (long long k0 = 0; k0 < p.in; k0 += kTcChunk) {
      const int kc = static_cast<int>(p.in - k0 < kTcChunk ? p.in - k0 : kTcChunk);  // a multiple of 32
      // The chunk's weights for both rows, every load in flight before x is staged.
      uint4 A[kTcBlocks], B[kTcBlocks];
#pragma unroll
      for (int b = 0; b < kTcBlocks; ++b) {
        const bool in_chunk = b * 32 < kc;
        A[b] = in_chunk && va ? __ldg(reinterpret_cast<const uint4*>(wa + k0 + 32 * b)) : make_uint4(0, 0, 0, 0);
        B[b] = in_chunk && vb ? __ldg(reinterpret_cast<const uint4*>(wb + k0 + 32 * b)) : make_uint4(0, 0, 0, 0);
      }
      __syncthreads();  // the last chunk's reads of xs are done
      // x columns of the pass's slots as bf16 (zeros past cnt, up to the column tiles used).
      const int c4 = kc / 4;
      for (int i = tid; i < tiles * 8 * c4; i += kTcWarps * 32) {
        const int t = i / c4, c = i - t * c4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (t < cnt) {
          const long long s = sm.slots[t];
          const float* xr = p.x + (p.x_per_slot ? s : s / p.k) * p.x_stride + k0;
          v = *reinterpret_cast<const float4*>(xr + 4 * c);
        }
        uint2 packed;
        packed.x = static_cast<uint32_t>(dev::F32ToBf16(v.x)) | static_cast<uint32_t>(dev::F32ToBf16(v.y)) << 16;
        packed.y = static_cast<uint32_t>(dev::F32ToBf16(v.z)) | static_cast<uint32_t>(dev::F32ToBf16(v.w)) << 16;
        *reinterpret_cast<uint2*>(&sm.xs[t][4 * c]) = packed;
      }
      __syncthreads();
#pragma unroll
      for (int b = 0; b < kTcBlocks; ++b) {
        if (b * 32 >= kc) break;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          if (nt >= tiles) break;
          const uint4 xv = *reinterpret_cast<const uint4*>(&sm.xs[nt * 8 + g][32 * b + 8 * q]);
          Mma(acc[nt], A[b].x, B[b].x, A[b].y, B[b].y, xv.x, xv.y);  // columns 8q … 8q + 3
          Mma(acc[nt], A[b].z, B[b].z, A[b].w, B[b].w, xv.z, xv.w);  // columns 8q + 4 … 8q + 7
        }
      }
    }
    // acc[nt]: rows ra (0, 1) and rb (2, 3), slots nt·8 + 2q and + 1.
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int t = nt * 8 + 2 * q + j;
        if (nt < tiles && t < cnt) {
          const long long s = sm.slots[t];
          if (va) p.y[s * p.y_stride + ra] = acc[nt][j];
          if (vb) p.y[s * p.y_stride + rb] = acc[nt][2 + j];
        }
      }
    }
    __syncthreads();  // slots and xs are free for warp 0's next gather
    if (pos >= S) break;
  }
}

}  // namespace

bool ExpertGemmTcFits(const ExpertGemmParams& p) {
  return p.w_bf16 && !p.w_fp8 && p.round_x_bf16 && p.x != nullptr && p.x_partials.o == nullptr &&
         p.swiglu_inter == 0 && p.in % 32 == 0 && p.w_row_stride % 8 == 0 && p.w_expert_stride % 8 == 0 &&
         p.x_stride % 4 == 0 && (reinterpret_cast<uintptr_t>(p.w) & 15) == 0 &&
         (reinterpret_cast<uintptr_t>(p.x) & 15) == 0;
}

Status LaunchExpertGemmTc(const ExpertGemmParams& p, Stream stream) {
  const dim3 grid(static_cast<unsigned>((p.out + kTcRows - 1) / kTcRows), static_cast<unsigned>(p.experts));
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(ExpertGemmTcKernel, grid, kTcWarps * 32, 0, stream, p));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

}  // namespace lockstep::kernels::cuda
