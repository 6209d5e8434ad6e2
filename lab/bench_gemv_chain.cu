// lab/bench_gemv_chain.cu — can a chain of dependent batch-1 GEMVs stream its weights at copy
// speed? The question behind batch-1 decode's 48 % of copy (docs/performance.md): a decode step
// is a chain of GEMVs, each waiting for the one before, and every kernel boundary costs ≥ 2.5 µs
// (bench_kernel_chain) while the engine's kernels can request their weights ahead only as far
// as their own CTAs are resident. Two ways to run the same chain y_{s+1} = W_s · y_s (bf16
// weights, fp32 vectors, batch 1):
//
//   kernels     one ExpertGemm launch a stage (kernels/cuda/ops.h, k = 1: the engine's dense
//               GEMV under gemm=bf16_dot, its automatic shape), programmatic dependent launch
//               as the engine's decode step does, in a CUDA graph
//   streamed    one persistent kernel, a CTA an SM: a producer warp streams the CTA's weight
//               rows of every stage, in order, through a ring of shared memory with bulk copies
//               (mbarriers), never waiting for a vector — only for a free slot; 15 consumer
//               warps wait for stage s's input vector (a counter each CTA bumps after storing
//               its rows, release/acquire), take it into shared memory, and reduce the rows the
//               ring holds. The weights of the next stages keep arriving while a stage waits.
//
// Both runs are checked against a host fp64 evaluation of the chain (relative L2 error of the
// last vector), and timed beside a device-to-device copy and a plain streaming read of all the
// weights measured in the same process. Prints µs per chain, GB/s of weights and % of copy.
//
//   bench_gemv_chain [--dims 2048,3072,2048,2048] [--repeat 27] [--reps 20] [--ring-kb 192]
//                    [--piece-kb 16]
//
// --dims in,out,out,… is one block of the chain (stage i: dims[i] → dims[i+1], dims ≤ 4096 and
// multiples of 8); --repeat chains the block that many times (its last dim must equal its
// first). The default is a V2-Lite layer's attention GEMVs at their sizes (q_proj 2048→3072, a
// 3072→2048 stand-in for the absorptions' 4 MB and kv_a, o_proj 2048→2048), 27 layers: 0.9 GB.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/cuda_bench.h"
#include "bench/cuda_fill.cuh"
#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"

namespace cu = lockstep::kernels::cuda;
namespace dev = lockstep::kernels::cuda::dev;

namespace {

constexpr int kMaxIn = 4096;
constexpr int kConsumerWarps = 15;
constexpr int kThreads = 32 * (kConsumerWarps + 1);
constexpr int kMaxSlots = 32;

// One stage as the persistent kernel sees it.
struct Stage {
  const uint16_t* w;  // [out, in] bf16, row-major
  const float* x;     // [in]
  float* y;           // [out]
  int in, out;
  int rows_per_piece;  // whole rows a ring slot holds at this in
};

struct ChainArgs {
  const Stage* stages;  // device
  int n_stages;
  unsigned* ready;  // [n_stages + 1]: ready[s] counts the CTAs that stored their rows of stages[s].x
  int slots, slot_bytes;
  int what_if;  // 0; 1: no weights streamed (the ring's stale bytes: the chain's latency alone);
                // 2: no waiting for the vectors (the streaming alone); 3: as 2, and no products
                // (the ring's throughput alone); results wrong in each
};

__device__ __forceinline__ void RedRelease(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void MbarArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(dev::SmemAddr(bar)) : "memory");
}
__device__ __forceinline__ void ConsumerSync() {  // the consumer warps only (named barrier 1)
  asm volatile("bar.sync 1, %0;\n" ::"n"(32 * kConsumerWarps) : "memory");
}
// CTA b's rows of a stage with `out` rows: [lo, hi).
__device__ __forceinline__ void RowsOf(int out, int& lo, int& hi) {
  lo = static_cast<int>(static_cast<int64_t>(out) * blockIdx.x / gridDim.x);
  hi = static_cast<int>(static_cast<int64_t>(out) * (blockIdx.x + 1) / gridDim.x);
}

__global__ void __launch_bounds__(kThreads, 1) StreamedChain(ChainArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kMaxSlots;
  float* xs = reinterpret_cast<float*>(smem + 2 * kMaxSlots * sizeof(uint64_t));
  unsigned char* ring = smem + 2 * kMaxSlots * sizeof(uint64_t) + kMaxIn * sizeof(float);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int i = 0; i < a.slots; ++i) {
      dev::MbarInit(&full[i], 1);
      dev::MbarInit(&empty[i], kConsumerWarps);
    }
  }
  __syncthreads();

  if (warp == kConsumerWarps) {  // the producer: every stage's rows of this CTA, in order
    if (lane == 0 && a.what_if != 1) {
      int64_t use = 0;  // ring slot uses so far: slot use % slots, its phase use / slots
      for (int s = 0; s < a.n_stages; ++s) {
        const Stage st = a.stages[s];
        int lo, hi;
        RowsOf(st.out, lo, hi);
        for (int r = lo; r < hi; r += st.rows_per_piece, ++use) {
          const int slot = static_cast<int>(use % a.slots);
          const unsigned phase = static_cast<unsigned>(use / a.slots) & 1u;
          if (use >= a.slots) dev::MbarWait(&empty[slot], phase ^ 1u);
          const int rows = min(st.rows_per_piece, hi - r);
          const unsigned bytes = static_cast<unsigned>(rows) * st.in * 2u;
          dev::MbarArriveExpectTx(&full[slot], bytes);
          dev::BulkCopyToShared(ring + static_cast<size_t>(slot) * a.slot_bytes,
                                st.w + static_cast<int64_t>(r) * st.in, bytes, &full[slot]);
        }
      }
    }
    return;
  }

  // The consumers: each piece of a stage, in order, every warp (its rows of the piece: the
  // stage's row j goes to warp j mod kConsumerWarps), then one arrival each on the slot.
  int64_t use = 0;
  for (int s = 0; s < a.n_stages; ++s) {
    const Stage st = a.stages[s];
    if (threadIdx.x == 0 && s > 0 && a.what_if < 2) {
      while (LoadAcquire(&a.ready[s]) < gridDim.x) {
      }
    }
    ConsumerSync();
    for (int i = threadIdx.x * 4; i < st.in; i += 32 * kConsumerWarps * 4) {
      *reinterpret_cast<float4*>(&xs[i]) = __ldcg(reinterpret_cast<const float4*>(&st.x[i]));
    }
    ConsumerSync();
    int lo, hi;
    RowsOf(st.out, lo, hi);
    const int pieces = (hi - lo + st.rows_per_piece - 1) / st.rows_per_piece;
    for (int p = 0; p < pieces; ++p, ++use) {
      const int slot = static_cast<int>(use % a.slots);
      if (a.what_if != 1) dev::MbarWait(&full[slot], static_cast<unsigned>(use / a.slots) & 1u);
      const unsigned char* piece = ring + static_cast<size_t>(slot) * a.slot_bytes;
      const int j0 = p * st.rows_per_piece, rows = min(st.rows_per_piece, hi - lo - j0);
      // The first row of this piece that is this warp's.
      for (int rr = a.what_if == 3 ? rows : ((warp - j0) % kConsumerWarps + kConsumerWarps) % kConsumerWarps; rr < rows;
           rr += kConsumerWarps) {
        const uint4* wrow = reinterpret_cast<const uint4*>(piece + static_cast<size_t>(rr) * st.in * 2);
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int c = lane; c < st.in / 8; c += 32) {
          const uint4 w8 = wrow[c];
          const float4 x0 = *reinterpret_cast<const float4*>(&xs[8 * c]);
          const float4 x1 = *reinterpret_cast<const float4*>(&xs[8 * c + 4]);
          acc[0] = fmaf(__uint_as_float(w8.x << 16), x0.x, acc[0]);
          acc[1] = fmaf(__uint_as_float(w8.x & 0xffff0000u), x0.y, acc[1]);
          acc[2] = fmaf(__uint_as_float(w8.y << 16), x0.z, acc[2]);
          acc[3] = fmaf(__uint_as_float(w8.y & 0xffff0000u), x0.w, acc[3]);
          acc[0] = fmaf(__uint_as_float(w8.z << 16), x1.x, acc[0]);
          acc[1] = fmaf(__uint_as_float(w8.z & 0xffff0000u), x1.y, acc[1]);
          acc[2] = fmaf(__uint_as_float(w8.w << 16), x1.z, acc[2]);
          acc[3] = fmaf(__uint_as_float(w8.w & 0xffff0000u), x1.w, acc[3]);
        }
        float sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (lane == 0) st.y[lo + j0 + rr] = sum;
      }
      __syncwarp();
      if (lane == 0) MbarArrive(&empty[slot]);  // this warp is done with the slot
    }
    ConsumerSync();  // every row of this CTA stored; the release below orders them (cumulative)
    if (threadIdx.x == 0) RedRelease(&a.ready[s + 1], 1u);
  }
}

// A plain streaming read of n bytes (16-byte loads, xor-folded so it is not optimised away).
__global__ void ReadAll(const uint4* p, int64_t n16, unsigned* sink) {
  uint32_t acc = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n16;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

std::vector<int> ParseDims(const std::string& s) {
  std::vector<int> v;
  size_t at = 0;
  while (at <= s.size()) {
    const size_t comma = s.find(',', at);
    const std::string item = s.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    char* end = nullptr;
    const long d = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || d < 8 || d > kMaxIn || d % 8 != 0) {
      std::fprintf(stderr, "bench_gemv_chain: --dims: '%s' is not a dimension (8 … %d, a multiple of 8)\n",
                   item.c_str(), kMaxIn);
      std::exit(2);
    }
    v.push_back(static_cast<int>(d));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  if (v.size() < 2) {
    std::fprintf(stderr, "bench_gemv_chain: --dims needs at least two dimensions (in,out)\n");
    std::exit(2);
  }
  return v;
}

double RelError(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    if (!std::isfinite(got[i])) return INFINITY;
    num += d * d;
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

float Bf16ToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dims_arg = "2048,3072,2048,2048";
  int repeat = 27, reps = 20, ring_kb = 192, piece_kb = 16;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::printf(
          "bench_gemv_chain: a chain of dependent batch-1 GEMVs (bf16 weights), as one launch a stage\n"
          "(the engine's ExpertGemm with programmatic dependent launch, in a graph) and as one persistent\n"
          "kernel streaming every stage's weights through a shared-memory ring; µs, GB/s and %% of copy.\n\n"
          "  --dims D0,D1,...   one block of the chain: stage i maps dims[i] -> dims[i+1] (default\n"
          "                     2048,3072,2048,2048: a V2-Lite layer's attention GEMVs)\n"
          "  --repeat N         the block chained N times (default 27; last dim = first dim)\n"
          "  --reps N           timed replays (default 20)\n"
          "  --ring-kb K        the persistent kernel's ring of shared memory per SM (default 192)\n"
          "  --piece-kb K       one ring slot: a bulk copy of whole rows (default 16)\n");
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_gemv_chain: %s needs a value (see --help)\n", k.c_str());
      return 2;
    }
    const std::string v = argv[++i];
    if (k == "--dims") dims_arg = v;
    else if (k == "--repeat") repeat = std::atoi(v.c_str());
    else if (k == "--reps") reps = std::atoi(v.c_str());
    else if (k == "--ring-kb") ring_kb = std::atoi(v.c_str());
    else if (k == "--piece-kb") piece_kb = std::atoi(v.c_str());
    else {
      std::fprintf(stderr, "bench_gemv_chain: unknown flag %s (see --help)\n", k.c_str());
      return 2;
    }
  }
  const std::vector<int> block = ParseDims(dims_arg);
  if (repeat < 1 || reps < 1 || piece_kb < 1 || ring_kb < piece_kb || ring_kb > 200) {
    std::fprintf(stderr, "bench_gemv_chain: --repeat, --reps ≥ 1 and 1 ≤ --piece-kb ≤ --ring-kb ≤ 200\n");
    return 2;
  }
  if (repeat > 1 && block.back() != block.front()) {
    std::fprintf(stderr, "bench_gemv_chain: --repeat %d needs the block's last dim (%d) to equal its first (%d)\n",
                 repeat, block.back(), block.front());
    return 2;
  }
  const int slot_bytes = piece_kb * 1024, slots = ring_kb / piece_kb;
  if (slots > kMaxSlots) {
    std::fprintf(stderr, "bench_gemv_chain: %d ring slots, at most %d (raise --piece-kb)\n", slots, kMaxSlots);
    return 2;
  }
  std::vector<int> dims = {block[0]};
  for (int r = 0; r < repeat; ++r) dims.insert(dims.end(), block.begin() + 1, block.end());
  const int S = static_cast<int>(dims.size()) - 1;
  for (int s = 0; s < S; ++s) {
    if (slot_bytes < dims[s] * 2) {
      std::fprintf(stderr, "bench_gemv_chain: --piece-kb %d holds no row of %d bf16 values\n", piece_kb, dims[s]);
      return 2;
    }
  }

  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;

  // Weights (a fresh matrix a stage, so every stage reads DRAM) and vectors.
  std::vector<int64_t> w_off(S + 1, 0), v_off(S + 2, 0);
  for (int s = 0; s < S; ++s) w_off[s + 1] = w_off[s] + static_cast<int64_t>(dims[s]) * dims[s + 1];
  for (int s = 0; s <= S; ++s) v_off[s + 1] = v_off[s] + (dims[s] + 63) / 64 * 64;
  const double weight_bytes = 2.0 * static_cast<double>(w_off[S]);
  uint16_t* w = nullptr;
  float* vec = nullptr;
  CHECK_CUDA(cudaMalloc(&w, w_off[S] * 2));
  CHECK_CUDA(cudaMalloc(&vec, v_off[S + 1] * 4));
  for (int s = 0; s < S; ++s) {
    // |w| in [2^-e, 2^-e+1) with 2^-2e · in ≈ 1/2 … 1: the vectors keep their scale along the chain.
    const int e = static_cast<int>(std::ceil(0.5 * std::log2(static_cast<double>(dims[s]))));
    const int64_t n = w_off[s + 1] - w_off[s];
    FillBf16(w + w_off[s], n, 0x1234u + s, static_cast<uint32_t>(127 - e));
  }
  std::vector<float> x0(dims[0]);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& v : x0) v = nd(rng);
  CHECK_CUDA(cudaMemcpy(vec, x0.data(), x0.size() * 4, cudaMemcpyHostToDevice));

  // The host's fp64 chain.
  std::vector<uint16_t> hw(w_off[S]);
  CHECK_CUDA(cudaMemcpy(hw.data(), w, hw.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<double> ref(x0.begin(), x0.end());
  for (int s = 0; s < S; ++s) {
    std::vector<double> nxt(dims[s + 1]);
    for (int r = 0; r < dims[s + 1]; ++r) {
      const uint16_t* row = hw.data() + w_off[s] + static_cast<int64_t>(r) * dims[s];
      double acc = 0;
      for (int c = 0; c < dims[s]; ++c) acc += static_cast<double>(Bf16ToFloat(row[c])) * ref[c];
      nxt[r] = acc;
    }
    ref.swap(nxt);
  }
  auto last = [&]() {
    std::vector<float> out(dims[S]);
    CHECK_CUDA(cudaMemcpy(out.data(), vec + v_off[S], out.size() * 4, cudaMemcpyDeviceToHost));
    return out;
  };
  auto clear_outputs = [&]() { CHECK_CUDA(cudaMemset(vec + v_off[1], 0, (v_off[S + 1] - v_off[1]) * 4)); };

  cudaStream_t st;
  CHECK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

  // Peers measured in this process: a device-to-device copy, a plain read of every weight.
  auto copy_bps = cu::MeasureCopyBandwidth(10);
  CHECK_OK(copy_bps.status());
  const double copy = *copy_bps / 1e9;  // GB/s
  unsigned* sink = nullptr;
  CHECK_CUDA(cudaMalloc(&sink, 4));
  const double read_ms = MsPerCall(
      [&] { ReadAll<<<sms * 8, 256>>>(reinterpret_cast<const uint4*>(w), w_off[S] * 2 / 16, sink); }, reps);

  // kernels: one ExpertGemm a stage, overlapped launches, one graph.
  int32_t* zero_id = nullptr;
  CHECK_CUDA(cudaMalloc(&zero_id, 4));
  CHECK_CUDA(cudaMemset(zero_id, 0, 4));
  cu::SetOverlappedLaunch(true);
  clear_outputs();
  cudaGraph_t g_kernels;
  CHECK_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int s = 0; s < S; ++s) {
    cu::ExpertGemmParams p;
    p.rows = 1;
    p.k = 1;
    p.experts = 1;
    p.out = dims[s + 1];
    p.in = dims[s];
    p.w = w + w_off[s];
    p.w_bf16 = true;
    p.w_expert_stride = static_cast<int64_t>(dims[s]) * dims[s + 1];
    p.w_row_stride = dims[s];
    p.x = vec + v_off[s];
    p.x_stride = dims[s];
    p.ids = zero_id;
    p.ids_fixed = true;
    p.y = vec + v_off[s + 1];
    p.y_stride = dims[s + 1];
    CHECK_OK(cu::ExpertGemm(p, st));
  }
  CHECK_CUDA(cudaStreamEndCapture(st, &g_kernels));
  const double kernels_ms = GraphReplayMs(st, g_kernels, reps);
  const double kernels_err = RelError(last(), ref);

  // streamed: one persistent kernel.
  std::vector<Stage> hs(S);
  for (int s = 0; s < S; ++s) {
    hs[s].w = w + w_off[s];
    hs[s].x = vec + v_off[s];
    hs[s].y = vec + v_off[s + 1];
    hs[s].in = dims[s];
    hs[s].out = dims[s + 1];
    hs[s].rows_per_piece = slot_bytes / (dims[s] * 2);
  }
  Stage* d_stages = nullptr;
  unsigned* ready = nullptr;
  CHECK_CUDA(cudaMalloc(&d_stages, S * sizeof(Stage)));
  CHECK_CUDA(cudaMemcpy(d_stages, hs.data(), S * sizeof(Stage), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&ready, (S + 1) * sizeof(unsigned)));
  const size_t smem = 2 * kMaxSlots * sizeof(uint64_t) + kMaxIn * sizeof(float) + static_cast<size_t>(slots) * slot_bytes;
  CHECK_CUDA(cudaFuncSetAttribute(StreamedChain, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int per_sm = 0;
  CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, StreamedChain, kThreads, smem));
  if (per_sm < 1) {
    std::fprintf(stderr, "bench_gemv_chain: the persistent kernel does not fit an SM with %zu bytes of shared memory\n",
                 smem);
    return 1;
  }
  auto run_streamed = [&](int what_if) {
    ChainArgs args{d_stages, S, ready, slots, slot_bytes, what_if};
    clear_outputs();
    cudaGraph_t g;
    CHECK_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    CHECK_CUDA(cudaMemsetAsync(ready, 0, (S + 1) * sizeof(unsigned), st));
    StreamedChain<<<sms, kThreads, smem, st>>>(args);  // one CTA an SM: all resident at once
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaStreamEndCapture(st, &g));
    const double ms = GraphReplayMs(st, g, reps);
    CHECK_CUDA(cudaGraphDestroy(g));
    return ms;
  };
  const double streamed_ms = run_streamed(0);
  const double streamed_err = RelError(last(), ref);
  const double latency_ms = run_streamed(1), bandwidth_ms = run_streamed(2), ring_ms = run_streamed(3);

  const double gb = weight_bytes / 1e9;
  std::printf("bench_gemv_chain: %d stages (block %s × %d), %.1f MB of bf16 weights; %s, %d SMs\n", S,
              dims_arg.c_str(), repeat, weight_bytes / 1e6, prop.name, sms);
  std::printf("  copy (device-to-device, same process)      %7.0f GB/s\n", copy);
  std::printf("  plain read of all the weights              %7.1f µs  %7.0f GB/s  %5.1f %% of copy\n", read_ms * 1e3,
              gb / (read_ms * 1e-3), 100.0 * gb / (read_ms * 1e-3) / copy);
  std::printf("  kernels  (ExpertGemm a stage, PDL, graph)  %7.1f µs  %7.0f GB/s  %5.1f %% of copy  %.2f µs a stage  rel. err %.1e\n",
              kernels_ms * 1e3, gb / (kernels_ms * 1e-3), 100.0 * gb / (kernels_ms * 1e-3) / copy,
              kernels_ms * 1e3 / S, kernels_err);
  std::printf("  streamed (one kernel, %d × %d KB ring)     %7.1f µs  %7.0f GB/s  %5.1f %% of copy  %.2f µs a stage  rel. err %.1e\n",
              slots, piece_kb, streamed_ms * 1e3, gb / (streamed_ms * 1e-3),
              100.0 * gb / (streamed_ms * 1e-3) / copy, streamed_ms * 1e3 / S, streamed_err);
  std::printf("    what if (timing only): no weights streamed %7.1f µs (%.2f a stage); no waits for the vectors %7.1f µs (%.2f a stage); nor products %7.1f µs (%.2f a stage)\n",
              latency_ms * 1e3, latency_ms * 1e3 / S, bandwidth_ms * 1e3, bandwidth_ms * 1e3 / S, ring_ms * 1e3,
              ring_ms * 1e3 / S);
  const bool ok = kernels_err < 1e-4 && streamed_err < 1e-4;
  if (!ok) std::fprintf(stderr, "bench_gemv_chain: a chain's result is off the fp64 reference (bound 1e-4)\n");
  return ok ? 0 : 1;
}
