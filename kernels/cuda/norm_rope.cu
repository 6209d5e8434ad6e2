// kernels/cuda/norm_rope.cu — RMSNorm, RoPE, the latent-cache write (quantise on write) and the
// indexer's Hadamard rotation.
// See ops.h for the contracts; device_math.cuh for the CPU-exact scalar conversions.
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/norm_row.cuh"
#include "kernels/cuda/ops.h"

namespace lockstep::kernels::cuda {
namespace {

__global__ void __launch_bounds__(kNormThreads) RmsNormKernel(RmsNormParams p) {
  dev::GridDependencySync();
  RmsNormRow(p, blockIdx.x);
}

// Head h of row r by one CTA, thread i owning frequency i (threads past dim/2 only take part in
// the barrier). A position out of range flags kErrPosition and leaves the head as it is.
// `shifted`: the hidden fault zoo's p − 1 (WriteLatentPath's key under fault_pos_minus_1).
__device__ __forceinline__ void RopeHead(const RopeParams& p, int64_t r, int64_t h, bool shifted = false) {
  const int32_t pos = p.positions[r] - (shifted && p.positions[r] > 0 ? 1 : 0);
  if (pos < 0 || pos >= p.max_position) {  // uniform over the CTA
    if (threadIdx.x == 0 && p.error_flag != nullptr) atomicOr(p.error_flag, kErrPosition);
    return;
  }
  const int64_t half = p.dim / 2;
  const int64_t i = threadIdx.x;
  float* x = p.x + r * p.row_stride + h * p.head_stride;
  const bool active = i < half;
  float a = 0.0f, b = 0.0f, cs = 0.0f, sn = 0.0f;
  if (active) {
    cs = p.cos[pos * half + i];
    sn = p.sin[pos * half + i];
    if (p.style == RopeStyle::kHalves) {
      a = x[i];
      b = x[half + i];
    } else {
      a = x[2 * i];
      b = x[2 * i + 1];
    }
  }
  __syncthreads();  // PairsToHalves writes slots that other threads read
  if (!active) return;
  const float o0 = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));  // a·cos − b·sin
  const float o1 = __fadd_rn(__fmul_rn(b, cs), __fmul_rn(a, sn));  // b·cos + a·sin
  switch (p.style) {
    case RopeStyle::kPairsAdjacent:
      x[2 * i] = o0;
      x[2 * i + 1] = o1;
      break;
    case RopeStyle::kPairsToHalves:
    case RopeStyle::kHalves:
      x[i] = o0;
      x[half + i] = o1;
      break;
  }
}

// One CTA per (row, head).
__global__ void RopeKernel(RopeParams p) {
  dev::GridDependencySync();
  RopeHead(p, blockIdx.x / p.heads, blockIdx.x % p.heads);
}

constexpr int kWriteThreads = 128;  // = kFp8TileValues: one value of a tile per thread
constexpr int kMaxWriteThreads = 256;  // LatentPathKernel runs WriteLatentRow with kNormThreads
static_assert(kWriteThreads == kFp8TileValues && kNormThreads <= kMaxWriteThreads);

__device__ __forceinline__ void StoreBytes(uint8_t* dst, const void* src, int n) {
  const uint8_t* s = static_cast<const uint8_t*>(src);
  for (int i = 0; i < n; ++i) dst[i] = s[i];
}

// Row r by one CTA of kWriteThreads or more threads (a multiple of 32, at most 256; a tile's
// value per thread below 128): engine::PagedKvCache::WriteLatent.
__device__ __forceinline__ void WriteLatentRow(const LatentWriteParams& p, int64_t bytes_per_token, int64_t r) {
  const int threads = static_cast<int>(blockDim.x);
  const int64_t slot = p.slots != nullptr ? p.slots[r] : r;
  if (slot == -1) return;
  if (slot < -1 || slot >= p.num_slots) {
    if (threadIdx.x == 0 && p.error_flag != nullptr) atomicOr(p.error_flag, kErrSlot);
    return;
  }
  const float* latent = p.latent + r * p.latent_stride;
  const float* rope = p.rope + r * p.rope_stride;
  uint8_t* b = p.cache + static_cast<int64_t>(slot) * bytes_per_token;
  const int t = threadIdx.x;
  switch (p.format) {
    case LatentFormat::kFp32: {
      float* f = reinterpret_cast<float*>(b);  // 4-byte aligned: bytes_per_token is a multiple of 4
      for (int64_t i = t; i < p.kv_lora; i += threads) f[i] = latent[i];
      for (int64_t i = t; i < p.rope_dim; i += threads) f[p.kv_lora + i] = rope[i];
      break;
    }
    case LatentFormat::kBf16: {
      uint16_t* h = reinterpret_cast<uint16_t*>(b);
      for (int64_t i = t; i < p.kv_lora; i += threads) h[i] = dev::F32ToBf16(latent[i]);
      for (int64_t i = t; i < p.rope_dim; i += threads) h[p.kv_lora + i] = dev::F32ToBf16(rope[i]);
      break;
    }
    case LatentFormat::kFp8E4m3: {
      const int64_t tiles = (p.kv_lora + kFp8TileValues - 1) / kFp8TileValues;
      uint8_t* scales = b + p.kv_lora;
      __shared__ float warp_max[kMaxWriteThreads / 32];
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t lo = tile * kFp8TileValues;
        const int64_t n = min(static_cast<int64_t>(kFp8TileValues), p.kv_lora - lo);
        const float v = t < n ? latent[lo + t] : 0.0f;
        // amax = max |x| with NaN ignored (fmaxf, like the CPU's std::fmax); max is exact, so
        // the reduction order does not matter.
        float m = dev::WarpMax(fabsf(v));
        if ((t & 31) == 0) warp_max[t / 32] = m;
        __syncthreads();
        float amax = warp_max[0];  // warps past the tile's 128 values hold 0, which changes no max
        for (int w = 1; w < threads / 32; ++w) amax = fmaxf(amax, warp_max[w]);
        __syncthreads();  // warp_max is reused by the next tile
        const float s = dev::Fp8ScaleFromAmax(amax);
        if (t == 0) StoreBytes(scales + 4 * tile, &s, 4);
        if (t < n) b[lo + t] = dev::F32ToFp8E4m3(__fdiv_rn(v, s));
      }
      uint8_t* rb = scales + 4 * tiles;  // may be odd-aligned for odd kv_lora: byte stores
      for (int64_t i = t; i < p.rope_dim; i += threads) {
        const uint16_t h = dev::F32ToBf16(rope[i]);
        StoreBytes(rb + 2 * i, &h, 2);
      }
      break;
    }
  }
  if (p.copy != nullptr) {  // the row as stored, read back by the block that wrote it
    __syncthreads();
    uint8_t* c = p.copy + r * bytes_per_token;
    for (int64_t i = t; i < bytes_per_token / 4; i += threads) {
      reinterpret_cast<uint32_t*>(c)[i] = reinterpret_cast<const uint32_t*>(b)[i];
    }
  }
}

__global__ void __launch_bounds__(kWriteThreads) LatentWriteKernel(LatentWriteParams p, int64_t bytes_per_token) {
  dev::GridDependencySync();
  WriteLatentRow(p, bytes_per_token, blockIdx.x);
}

// The latent-cache path of a decode step in one CTA a row (WriteLatentPath): RmsNormRow of the
// latent, RopeHead of the rope key, then WriteLatentRow of both — the three kernels' bits,
// without the two launches and round trips between them.
__global__ void __launch_bounds__(kNormThreads) LatentPathKernel(RmsNormParams n, RopeParams rp, LatentWriteParams w,
                                                                  int64_t bytes_per_token) {
  dev::GridDependencySync();
  const int64_t r = blockIdx.x;
  RmsNormRow(n, r);
  RopeHead(rp, r, 0, rp.fault_pos_minus_1);
  __syncthreads();  // the row's latent and rope key, written by other threads, are read below
  WriteLatentRow(w, bytes_per_token, r);
}

// One CTA per vector, staged in shared memory: stage h pairs element j with j + h for every j
// whose bit h is clear, as cpu::Hadamard's loops do (each pair on its own, so the order of pairs
// within a stage changes nothing).
constexpr int kHadamardThreads = 256;
constexpr int64_t kHadamardMax = 4096;
__global__ void __launch_bounds__(kHadamardThreads) HadamardKernel(float* x, int64_t stride, int64_t rows, int n,
                                                                    float scale) {
  dev::GridDependencySync();
  __shared__ float v[kHadamardMax];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float* row = x + r * stride;
    for (int i = threadIdx.x; i < n; i += kHadamardThreads) v[i] = row[i];
    __syncthreads();
    for (int h = 1; h < n; h *= 2) {
      for (int p = threadIdx.x; p < n / 2; p += kHadamardThreads) {
        const int j = (p / h) * 2 * h + p % h;
        const float a = v[j], b = v[j + h];
        v[j] = __fadd_rn(a, b);
        v[j + h] = __fsub_rn(a, b);
      }
      __syncthreads();
    }
    for (int i = threadIdx.x; i < n; i += kHadamardThreads) row[i] = __fmul_rn(v[i], scale);
    __syncthreads();  // v is refilled for the next row
  }
}

// One CTA of 128 threads a (row, tile): a thread a value; the tile's amax as WriteLatent's fp8
// path takes it (max is exact: any order), then the scale, the e4m3 rounding and back.
constexpr int kRtThreads = static_cast<int>(kFp8TileValues);
__global__ void __launch_bounds__(kRtThreads) Fp8RoundTripKernel(const float* x, int64_t xs, float* y, int64_t ys,
                                                                int64_t n) {
  dev::GridDependencySync();
  const int64_t r = blockIdx.x, i = static_cast<int64_t>(blockIdx.y) * kRtThreads + threadIdx.x;
  const float v = i < n ? x[r * xs + i] : 0.0f;
  __shared__ float warp_max[kRtThreads / 32];
  const float m = dev::WarpMax(fabsf(v));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  const float amax = fmaxf(fmaxf(warp_max[0], warp_max[1]), fmaxf(warp_max[2], warp_max[3]));
  const float s = dev::Fp8ScaleFromAmax(amax);
  if (i < n) y[r * ys + i] = __fmul_rn(dev::Fp8E4m3ToF32(dev::F32ToFp8E4m3(__fdiv_rn(v, s))), s);
}
static_assert(kRtThreads == 128, "Fp8RoundTripKernel: four warps a tile");

// Argument checks, shared by each op's launcher and WriteLatentPath (CheckRmsNorm: norm_row.cuh).
Status CheckRope(const RopeParams& p, const char* op) {
  LS_CHECK_ARG(p.x != nullptr, op, "x", p.x);
  LS_CHECK_ARG(p.positions != nullptr, op, "positions", p.positions);
  LS_CHECK_ARG(p.cos != nullptr, op, "cos", p.cos);
  LS_CHECK_ARG(p.sin != nullptr, op, "sin", p.sin);
  LS_CHECK_ARG(p.rows >= 0, op, "rows", p.rows);
  LS_CHECK_ARG(p.heads > 0, op, "heads", p.heads);
  LS_CHECK_ARG(p.rows * p.heads < (int64_t{1} << 31), op, "rows·heads", p.rows * p.heads);
  LS_CHECK_ARG(p.dim > 0 && p.dim % 2 == 0 && p.dim <= 2048, op, "dim", p.dim);
  LS_CHECK_ARG(p.head_stride >= p.dim, op, "head_stride", p.head_stride);
  LS_CHECK_ARG(p.row_stride >= (p.heads - 1) * p.head_stride + p.dim, op, "row_stride", p.row_stride);
  LS_CHECK_ARG(p.max_position > 0 && p.max_position < (int64_t{1} << 31), op, "max_position", p.max_position);
  LS_CHECK_ARG(p.style == RopeStyle::kPairsAdjacent || p.style == RopeStyle::kPairsToHalves ||
                   p.style == RopeStyle::kHalves,
               op, "style", static_cast<int>(p.style));
  return Status::Ok();
}

Status CheckWriteLatent(const LatentWriteParams& p, const char* op) {
  LS_CHECK_ARG(p.latent != nullptr, op, "latent", p.latent);
  LS_CHECK_ARG(p.rope != nullptr || p.rope_dim == 0, op, "rope", p.rope);
  LS_CHECK_ARG(p.cache != nullptr, op, "cache", p.cache);
  LS_CHECK_ARG(p.slots != nullptr || p.rows <= p.num_slots, op, "rows (more than num_slots without slots)", p.rows);
  LS_CHECK_ARG(p.rows >= 0 && p.rows < (int64_t{1} << 31), op, "rows", p.rows);
  LS_CHECK_ARG(p.kv_lora > 0, op, "kv_lora", p.kv_lora);
  LS_CHECK_ARG(p.rope_dim >= 0, op, "rope_dim", p.rope_dim);
  LS_CHECK_ARG(p.latent_stride >= p.kv_lora, op, "latent_stride", p.latent_stride);
  LS_CHECK_ARG(p.rope_stride >= p.rope_dim, op, "rope_stride", p.rope_stride);
  LS_CHECK_ARG(p.num_slots > 0 && p.num_slots <= (int64_t{1} << 31), op, "num_slots", p.num_slots);
  LS_CHECK_ARG(p.format == LatentFormat::kFp32 || p.format == LatentFormat::kBf16 ||
                   p.format == LatentFormat::kFp8E4m3,
               op, "format", static_cast<int>(p.format));
  const int64_t bpt = LatentBytesPerToken(p.format, p.kv_lora, p.rope_dim);
  LS_CHECK_ARG(p.copy == nullptr || (bpt % 4 == 0 && reinterpret_cast<uintptr_t>(p.copy) % 4 == 0), op,
               "copy (needs 4-byte rows and alignment)", bpt);
  return Status::Ok();
}

}  // namespace

Status RmsNorm(const RmsNormParams& p, Stream stream) {
  LS_RETURN_IF_ERROR(CheckRmsNorm(p, "RmsNorm"));
  if (p.rows == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(RmsNormKernel, static_cast<unsigned>(p.rows), kNormThreads, 0, stream, p));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status Rope(const RopeParams& p, Stream stream) {
  LS_RETURN_IF_ERROR(CheckRope(p, "Rope"));
  if (p.rows == 0) return Status::Ok();
  const int threads = static_cast<int>((p.dim / 2 + 31) / 32 * 32);
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(RopeKernel, static_cast<unsigned>(p.rows * p.heads), threads, 0, stream, p));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status WriteLatent(const LatentWriteParams& p, Stream stream) {
  LS_RETURN_IF_ERROR(CheckWriteLatent(p, "WriteLatent"));
  if (p.rows == 0) return Status::Ok();
  const int64_t bpt = LatentBytesPerToken(p.format, p.kv_lora, p.rope_dim);
  LS_CUDA_RETURN_IF_ERROR(
      LaunchKernel(LatentWriteKernel, static_cast<unsigned>(p.rows), kWriteThreads, 0, stream, p, bpt));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status WriteLatentPath(const RmsNormParams& n, const RopeParams& r, const LatentWriteParams& w, Stream stream) {
  constexpr const char* op = "WriteLatentPath";
  LS_RETURN_IF_ERROR(CheckRmsNorm(n, op));
  LS_RETURN_IF_ERROR(CheckRope(r, op));
  LS_RETURN_IF_ERROR(CheckWriteLatent(w, op));
  LS_CHECK_ARG(n.add == nullptr, op, "norm.add (no residual add here)", n.add);
  LS_CHECK_ARG(r.heads == 1, op, "rope.heads (one rope key a row)", r.heads);
  LS_CHECK_ARG(r.dim <= 2 * kNormThreads, op, "rope.dim (a frequency a thread: at most 512)", r.dim);
  LS_CHECK_ARG(n.rows == w.rows && r.rows == w.rows, op, "rows (norm, rope and write differ)", w.rows);
  LS_CHECK_ARG(n.n == w.kv_lora, op, "norm.n (must be write.kv_lora)", n.n);
  LS_CHECK_ARG(w.latent == n.y && w.latent_stride == n.y_stride, op, "write.latent (must be norm.y)", w.latent);
  LS_CHECK_ARG(w.rope == r.x && w.rope_stride == r.row_stride && w.rope_dim == r.dim, op,
               "write.rope (must be rope.x)", w.rope);
  if (w.rows == 0) return Status::Ok();
  const int64_t bpt = LatentBytesPerToken(w.format, w.kv_lora, w.rope_dim);
  LS_CUDA_RETURN_IF_ERROR(
      LaunchKernel(LatentPathKernel, static_cast<unsigned>(w.rows), kNormThreads, 0, stream, n, r, w, bpt));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status Fp8RoundTrip(const float* x, int64_t x_stride, float* y, int64_t y_stride, int64_t rows, int64_t n,
                    Stream stream) {
  constexpr const char* op = "Fp8RoundTrip";
  LS_CHECK_ARG(x != nullptr, op, "x", x);
  LS_CHECK_ARG(y != nullptr, op, "y", y);
  LS_CHECK_ARG(rows >= 0 && rows < (int64_t{1} << 31), op, "rows", rows);
  LS_CHECK_ARG(n >= 0 && n <= 65535 * int64_t{kRtThreads}, op, "n", n);
  LS_CHECK_ARG(x_stride >= n, op, "x_stride", x_stride);
  LS_CHECK_ARG(y_stride >= n, op, "y_stride", y_stride);
  LS_CHECK_ARG(x != y || x_stride == y_stride, op, "y_stride (in place needs x_stride)", y_stride);
  if (rows == 0 || n == 0) return Status::Ok();
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>((n + kRtThreads - 1) / kRtThreads));
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(Fp8RoundTripKernel, grid, kRtThreads, 0, stream, x, x_stride, y, y_stride, n));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status Hadamard(float* x, int64_t stride, int64_t rows, int64_t n, Stream stream) {
  constexpr const char* op = "Hadamard";
  LS_CHECK_ARG(x != nullptr, op, "x", x);
  LS_CHECK_ARG(n > 0 && n <= kHadamardMax && (n & (n - 1)) == 0, op, "n (a power of two ≤ 4096)", n);
  LS_CHECK_ARG(stride >= n, op, "stride", stride);
  LS_CHECK_ARG(rows >= 0, op, "rows", rows);
  if (rows == 0) return Status::Ok();
  // The CPU's scale: 1/√n in double, rounded once to float.
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  const unsigned grid = static_cast<unsigned>(rows < 65535 ? rows : 65535);
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(HadamardKernel, grid, kHadamardThreads, 0, stream, x, stride, rows,
                                       static_cast<int>(n), scale));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

}  // namespace lockstep::kernels::cuda
