// bench/bench_expert_gemm.cu — the grouped expert GEMM (kernels/cuda/ops.h ExpertGemm) at the
// DeepSeek-V2-Lite shapes the CUDA engine runs it at, bf16 weights:
//   moe gate_up  64 experts, 6 per token, out 2816 (gate+up fused), in 2048, x per token
//   moe down     64 experts, 6 per token, out 2048, in 1408, x per slot
//   heads W_UK   16 heads as experts (k = 16), out 512, in 128, x per slot at stride 192
//   heads W_UV   16 heads as experts, out 128, in 512, expert stride 256·512 (rows of kv_b_proj)
//   dense …      one "expert", k = 1: the dense projections under gemm=bf16_dot (q_proj,
//                kv_a_proj, o_proj, the shared experts' gate_up and down, lm_head); copies of
//                the matrix are rotated so that each call reads DRAM, not the L2
// --sweep runs every launch shape ExpertGemm accepts for the operands (the `launch` column;
// 0 = the automatic choice), to check and tune the automatic choice.
// Reports time per call and achieved weight bandwidth (bytes of the distinct experts a call
// touches / time) beside a device-to-device cudaMemcpy measured in the same process. MoE calls
// use one of 32 pre-drawn routings in turn, so consecutive calls touch different experts and
// the 50 MB L2 cannot serve the previous call's weights (the 2 MB of head weights stay in L2:
// for those rows µs/call is the figure, the bandwidth column is not DRAM's).
//
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "bench/cuda_bench.h"
#include "bench/cuda_fill.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"

namespace cu = lockstep::kernels::cuda;


namespace {

constexpr int kRoutings = 32;

struct Shape {
  const char* name;
  int64_t experts, k, out, in;
  int64_t w_expert_stride;  // elements
  bool x_per_slot;
  int64_t x_stride;
  bool heads;  // ids are 0..k-1 in every row (heads as experts)
  int64_t copies = 1;  // dense shapes: copies of the weights, rotated per call
};

double CopyBandwidth(int reps) {
  auto bw = cu::MeasureCopyBandwidth(reps);
  CHECK_OK(bw.status());
  return *bw;
}

double RunShape(const Shape& sh, const uint16_t* w, int64_t rows, int reps, double copy,
                cu::ExpertGemmParams::Launch launch) {
  // kRoutings routings of `rows` tokens: k distinct experts per row, ascending.
  std::mt19937_64 rng(42 + rows);
  std::vector<int32_t> ids(kRoutings * rows * sh.k);
  double distinct = 0;
  for (int t = 0; t < kRoutings; ++t) {
    std::set<int32_t> used;
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<int32_t> all(sh.experts);
      for (int64_t e = 0; e < sh.experts; ++e) all[e] = static_cast<int32_t>(e);
      if (!sh.heads) std::shuffle(all.begin(), all.end(), rng);
      std::sort(all.begin(), all.begin() + sh.k);
      std::copy(all.begin(), all.begin() + sh.k, ids.begin() + (t * rows + r) * sh.k);
      used.insert(all.begin(), all.begin() + sh.k);
    }
    distinct += static_cast<double>(used.size()) / kRoutings;
  }
  const int64_t xrows = sh.x_per_slot ? rows * sh.k : rows;
  int32_t* d_ids = nullptr;
  float *x = nullptr, *y = nullptr;
  CHECK_CUDA(cudaMalloc(&d_ids, ids.size() * 4));
  CHECK_CUDA(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&x, xrows * sh.x_stride * 4));
  CHECK_CUDA(cudaMemset(x, 0, xrows * sh.x_stride * 4));
  CHECK_CUDA(cudaMalloc(&y, rows * sh.k * sh.out * 4));

  cu::ExpertGemmParams p;
  p.rows = rows;
  p.k = sh.k;
  p.experts = sh.experts;
  p.out = sh.out;
  p.in = sh.in;
  p.w = w;
  p.w_bf16 = true;
  p.w_expert_stride = sh.w_expert_stride;
  p.w_row_stride = sh.in;
  p.x = x;
  p.x_stride = sh.x_stride;
  p.x_per_slot = sh.x_per_slot;
  p.round_x_bf16 = true;
  p.y = y;
  p.y_stride = sh.out;
  p.launch = launch;
  const int64_t matrix = sh.experts * sh.w_expert_stride;
  for (int t = 0; t < kRoutings; ++t) {  // warm-up
    p.ids = d_ids + t * rows * sh.k;
    p.w = w + (t % sh.copies) * matrix;
    const lockstep::Status st = cu::ExpertGemm(p);
    if (!st.ok()) {  // a forced shape these operands cannot take
      CHECK_CUDA(cudaFree(d_ids));
      CHECK_CUDA(cudaFree(x));
      CHECK_CUDA(cudaFree(y));
      return 0;
    }
  }
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  CHECK_CUDA(cudaEventRecord(e0));
  for (int i = 0; i < reps; ++i) {
    p.ids = d_ids + (i % kRoutings) * rows * sh.k;
    p.w = w + (i % sh.copies) * matrix;
    CHECK_OK(cu::ExpertGemm(p));
  }
  CHECK_CUDA(cudaEventRecord(e1));
  CHECK_CUDA(cudaEventSynchronize(e1));
  CHECK_OK(cu::Synchronize());
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
  const double sec = ms * 1e-3 / reps;
  const double bytes = distinct * sh.out * sh.in * 2;
  const double flops = 2.0 * rows * sh.k * sh.out * sh.in;
  std::printf("%-15s %6d %6lld %10.1f %12.1f %14.0f %9.0f%% %10.2f\n", sh.name, static_cast<int>(launch),
              static_cast<long long>(rows), sec * 1e6, distinct, bytes / sec * 1e-9, 100.0 * bytes / sec / copy,
              flops / sec * 1e-12);
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
  CHECK_CUDA(cudaFree(d_ids));
  CHECK_CUDA(cudaFree(x));
  CHECK_CUDA(cudaFree(y));
  return sec;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 50;
  bool sweep = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) reps = std::atoi(argv[++i]);
    if (std::strcmp(argv[i], "--sweep") == 0) sweep = true;
  }
  std::printf("%s\n", cu::DeviceDescription().c_str());
  const double copy = CopyBandwidth(10);
  std::printf("device-to-device copy: %.0f GB/s (read + write)\n", copy * 1e-9);
  auto dense = [](const char* name, int64_t out, int64_t in) {
    const int64_t bytes = out * in * 2;
    return Shape{name, 1, 1, out, in, out * in, false, in, false, std::max<int64_t>(1, (int64_t{400} << 20) / bytes)};
  };
  const Shape shapes[] = {
      {"moe gate_up", 64, 6, 2816, 2048, 2816 * 2048, false, 2048, false},
      {"moe down", 64, 6, 2048, 1408, 2048 * 1408, true, 1408, false},
      {"heads W_UK", 16, 16, 512, 128, 512 * 128, true, 192, true},
      {"heads W_UV", 16, 16, 128, 512, 256 * 512, true, 512, true},
      dense("dense q_proj", 3072, 2048),
      dense("dense kv_a", 576, 2048),
      dense("dense o_proj", 2048, 2048),
      dense("dense sh_gate_up", 5632, 2048),
      dense("dense sh_down", 2048, 2816),
      dense("dense lm_head", 102400, 2048),
  };
  using L = cu::ExpertGemmParams::Launch;
  const std::vector<L> launches = sweep ? std::vector<L>{L::kAuto, L::kRegBySlot, L::kRegChunk, L::kFastBySlot4,
                                                         L::kFastChunk4, L::kFastBySlot1, L::kFastChunk1,
                                                         L::kStreamBySlot, L::kBulkBySlot}
                                        : std::vector<L>{L::kAuto};
  std::printf("%-15s %6s %6s %10s %12s %14s %10s %10s\n", "shape", "launch", "rows", "us/call", "experts/call",
              "weight GB/s", "% of copy", "TFLOP/s");
  for (const Shape& sh : shapes) {
    const int64_t w_elems = sh.experts * sh.w_expert_stride * sh.copies;
    uint16_t* w = nullptr;
    CHECK_CUDA(cudaMalloc(&w, w_elems * 2));
    FillBf16(w, w_elems, 0, 0x3d);  // values around ±0.05
    CHECK_CUDA(cudaGetLastError());
    const std::vector<int64_t> row_counts =
        sh.heads  ? std::vector<int64_t>{1, 8, 64, 256}
        : sweep ? std::vector<int64_t>{1, 4, 16, 64}
                : std::vector<int64_t>{1, 2, 4, 8, 16, 64, 256};
    for (int64_t rows : row_counts) {
      for (L launch : launches) RunShape(sh, w, rows, reps, copy, launch);
    }
    CHECK_CUDA(cudaFree(w));
  }
  return 0;
}
