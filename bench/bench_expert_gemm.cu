// bench/bench_expert_gemm.cu — the grouped MoE expert GEMM (kernels/cuda/ops.h ExpertGemm) at
// a DeepSeek-V2-Lite shape: 64 experts, 6 per token, gate+up fused (out 2816), in 2048, bf16
// weights. Reports time per call and achieved weight bandwidth (bytes of the distinct experts
// a call touches / time) beside a device-to-device cudaMemcpy measured in the same process.
// Each call uses one of 32 pre-drawn routings in turn, so consecutive calls touch different
// experts and the 50 MB L2 cannot serve the weights of the previous call.
//
//   bench_expert_gemm [--reps 50]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "kernels/cuda/ops.h"

namespace cu = lockstep::kernels::cuda;

#define CHECK_CUDA(x)                                                                          \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)
#define CHECK_OK(x)                                                                           \
  do {                                                                                        \
    lockstep::Status s_ = (x);                                                                \
    if (!s_.ok()) {                                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, s_.message().c_str()); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

namespace {

constexpr int64_t kExperts = 64, kK = 6, kOut = 2816, kIn = 2048;
constexpr int kRoutings = 32;

__global__ void FillBf16(uint16_t* w, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u;
  h ^= h >> 15;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  // Small values around ±0.05: exponent 0x3d, random sign and mantissa.
  w[i] = static_cast<uint16_t>(((h & 1u) << 15) | (0x3d << 7) | ((h >> 8) & 0x7fu));
}

double CopyBandwidth(int reps) {
  const size_t bytes = size_t{1} << 31;
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  for (int i = 0; i < 2; ++i) CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
  CHECK_CUDA(cudaEventRecord(e0));
  for (int i = 0; i < reps; ++i) CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
  CHECK_CUDA(cudaEventRecord(e1));
  CHECK_CUDA(cudaEventSynchronize(e1));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  return 2.0 * bytes * reps / (ms * 1e-3);  // read + write
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 50;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0) reps = std::atoi(argv[i + 1]);
  }
  std::printf("%s\n", cu::DeviceDescription().c_str());
  const double copy = CopyBandwidth(10);
  std::printf("device-to-device copy: %.0f GB/s (read + write)\n", copy * 1e-9);
  std::printf("ExpertGemm bf16, %lld experts, k=%lld, out %lld, in %lld (weights %.0f MB)\n",
              static_cast<long long>(kExperts), static_cast<long long>(kK), static_cast<long long>(kOut),
              static_cast<long long>(kIn), kExperts * kOut * kIn * 2 * 1e-6);
  std::printf("%6s %10s %12s %14s %10s %10s\n", "rows", "us/call", "experts/call", "weight GB/s", "% of copy",
              "TFLOP/s");

  const int64_t w_elems = kExperts * kOut * kIn;
  uint16_t* w = nullptr;
  CHECK_CUDA(cudaMalloc(&w, w_elems * 2));
  FillBf16<<<static_cast<unsigned>((w_elems + 255) / 256), 256>>>(w, w_elems);
  CHECK_CUDA(cudaGetLastError());

  for (int64_t rows : {1, 2, 3, 4, 16, 64, 256}) {
    // kRoutings routings of `rows` tokens: k distinct experts per row, ascending.
    std::mt19937_64 rng(42 + rows);
    std::vector<int32_t> ids(kRoutings * rows * kK);
    double distinct = 0;
    for (int t = 0; t < kRoutings; ++t) {
      std::set<int32_t> used;
      for (int64_t r = 0; r < rows; ++r) {
        std::vector<int32_t> all(kExperts);
        for (int64_t e = 0; e < kExperts; ++e) all[e] = static_cast<int32_t>(e);
        std::shuffle(all.begin(), all.end(), rng);
        std::sort(all.begin(), all.begin() + kK);
        std::copy(all.begin(), all.begin() + kK, ids.begin() + (t * rows + r) * kK);
        used.insert(all.begin(), all.begin() + kK);
      }
      distinct += static_cast<double>(used.size()) / kRoutings;
    }
    int32_t* d_ids = nullptr;
    float *x = nullptr, *y = nullptr;
    CHECK_CUDA(cudaMalloc(&d_ids, ids.size() * 4));
    CHECK_CUDA(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMalloc(&x, rows * kIn * 4));
    CHECK_CUDA(cudaMemset(x, 0, rows * kIn * 4));
    CHECK_CUDA(cudaMalloc(&y, rows * kK * kOut * 4));

    cu::ExpertGemmParams p;
    p.rows = rows;
    p.k = kK;
    p.experts = kExperts;
    p.out = kOut;
    p.in = kIn;
    p.w = w;
    p.w_bf16 = true;
    p.w_expert_stride = kOut * kIn;
    p.w_row_stride = kIn;
    p.x = x;
    p.x_stride = kIn;
    p.round_x_bf16 = true;
    p.y = y;
    p.y_stride = kOut;
    for (int t = 0; t < kRoutings; ++t) {  // warm-up
      p.ids = d_ids + t * rows * kK;
      CHECK_OK(cu::ExpertGemm(p));
    }
    cudaEvent_t e0, e1;
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    CHECK_CUDA(cudaEventRecord(e0));
    for (int i = 0; i < reps; ++i) {
      p.ids = d_ids + (i % kRoutings) * rows * kK;
      CHECK_OK(cu::ExpertGemm(p));
    }
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    CHECK_OK(cu::Synchronize());
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    const double sec = ms * 1e-3 / reps;
    const double bytes = distinct * kOut * kIn * 2;
    const double flops = 2.0 * rows * kK * kOut * kIn;
    std::printf("%6lld %10.1f %12.1f %14.0f %9.0f%% %10.2f\n", static_cast<long long>(rows), sec * 1e6, distinct,
                bytes / sec * 1e-9, 100.0 * bytes / sec / copy, flops / sec * 1e-12);
    CHECK_CUDA(cudaFree(d_ids));
    CHECK_CUDA(cudaFree(x));
    CHECK_CUDA(cudaFree(y));
  }
  CHECK_CUDA(cudaFree(w));
  return 0;
}
