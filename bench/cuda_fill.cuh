// bench/cuda_fill.cuh — timing inputs for the CUDA benchmarks (one translation unit each, so
// the kernels live in an unnamed namespace): hashed N(0,1)-ish floats, bf16 weights of one
// binade, and index ramps.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "bench/cuda_bench.h"

namespace {

// N(0,1)-ish values from a counter hash (Box–Muller would be overkill for timing inputs).
__global__ void FillKernel(float* x, int64_t n, uint32_t seed) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ seed;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  x[i] = (static_cast<float>(h & 0xffffff) / 16777216.0f - 0.5f) * 3.4f;
}

// bf16 bits of magnitude in [2^(exponent − 127), 2^(exponent − 126)), sign and mantissa from a
// counter hash (exponent 0x3d: values around ±0.05).
__global__ void FillBf16Kernel(uint16_t* w, int64_t n, uint32_t seed, uint32_t exponent) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint32_t h = (static_cast<uint32_t>(i) ^ seed) * 0x9E3779B1u;
  h ^= h >> 15;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  w[i] = static_cast<uint16_t>(((h & 1u) << 15) | ((exponent & 0xffu) << 7) | ((h >> 8) & 0x7fu));
}

__global__ void IotaKernel(int32_t* x, int64_t n, int32_t base) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] = base + static_cast<int32_t>(i);
}

void Fill(float* x, int64_t n, uint32_t seed) {
  FillKernel<<<static_cast<unsigned>((n + 255) / 256), 256>>>(x, n, seed);
  CHECK_CUDA(cudaGetLastError());
}

void FillBf16(uint16_t* w, int64_t n, uint32_t seed, uint32_t exponent) {
  FillBf16Kernel<<<static_cast<unsigned>((n + 255) / 256), 256>>>(w, n, seed, exponent);
  CHECK_CUDA(cudaGetLastError());
}

// x[i] = base + i for i < n.
void Iota(int32_t* x, int64_t n, int32_t base = 0) {
  IotaKernel<<<static_cast<unsigned>((n + 255) / 256), 256>>>(x, n, base);
  CHECK_CUDA(cudaGetLastError());
}

}  // namespace
