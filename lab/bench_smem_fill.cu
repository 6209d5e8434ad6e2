// lab/bench_smem_fill.cu — how fast CTAs fill shared memory from HBM, and how long a small
// load issued after those requests waits: the two facts behind the decode GEMVs' design
// (kernels/cuda/expert_gemm_stream.cu, "bulk-copy per-slot path"). Two measurements:
//
//   fill    CTAs of 128 threads each copy their own bytes (16 KB, 64 KB or 128 KB, distinct
//           and rotated so the 50 MB L2 never holds them) into shared memory by 16-byte
//           cp.async, 16-byte loads into registers, or bulk copies (4 KB or 16 KB each, one
//           thread issuing), 200 launches in a CUDA graph: µs per launch (an empty kernel's
//           is printed first) and GB/s.
//   behind  each CTA requests 64 KB of weights (cp.async or bulk copies), then loads an
//           8 KB x that sits in L2 (16-byte loads or one bulk copy): SM cycles from the
//           first request until x is in registers and until the weights have landed.
//
//   bench_smem_fill [--reps N]
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "bench/cuda_bench.h"
#include "kernels/cuda/async_copy.cuh"

namespace dev = lockstep::kernels::cuda::dev;

namespace {

constexpr int kThreads = 128;
__device__ unsigned g_sink;

__global__ void Empty() {}

__global__ void __launch_bounds__(kThreads) FillCpAsync(const char* base, unsigned bytes) {
  extern __shared__ __align__(128) unsigned char sm[];
  const char* src = base + static_cast<size_t>(blockIdx.x) * bytes;
  for (unsigned i = threadIdx.x; i < bytes / 16; i += kThreads) dev::CpAsync16(sm + 16 * i, src + 16 * i);
  dev::CpAsyncCommit();
  dev::CpAsyncWait<0>();
  __syncthreads();
  if (reinterpret_cast<unsigned*>(sm)[threadIdx.x] == 0x12345678u) g_sink = 1;
}

__global__ void __launch_bounds__(kThreads) FillLoads(const char* base, unsigned bytes) {
  const uint4* src = reinterpret_cast<const uint4*>(base + static_cast<size_t>(blockIdx.x) * bytes);
  unsigned acc = 0;
#pragma unroll 8
  for (unsigned i = threadIdx.x; i < bytes / 16; i += kThreads) {
    const uint4 v = __ldcs(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) g_sink = acc;
}

template <unsigned kChunk>
__global__ void __launch_bounds__(kThreads) FillBulk(const char* base, unsigned bytes) {
  extern __shared__ __align__(128) unsigned char sm[];
  __shared__ __align__(8) uint64_t bar;
  const char* src = base + static_cast<size_t>(blockIdx.x) * bytes;
  if (threadIdx.x == 0) dev::MbarInit(&bar, 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    dev::MbarArriveExpectTx(&bar, bytes);
    for (unsigned off = 0; off < bytes; off += kChunk) dev::BulkCopyToShared(sm + off, src + off, kChunk, &bar);
  }
  dev::MbarWait(&bar, 0);
  if (reinterpret_cast<unsigned*>(sm)[threadIdx.x] == 0x12345678u) g_sink = 1;
}

// mode bit 0: weights by bulk copies (else cp.async); bit 1: x by a bulk copy (else loads);
// bit 2: no weights (x alone).
__global__ void __launch_bounds__(kThreads) Behind(const char* w, const float* x, int mode, long long* t_x,
                                                    long long* t_w) {
  constexpr unsigned kBytes = 65536;
  extern __shared__ __align__(128) unsigned char sm[];
  __shared__ __align__(8) uint64_t bars[2];
  __shared__ __align__(16) float xs[2048];
  const char* src = w + static_cast<size_t>(blockIdx.x) * kBytes;
  if (threadIdx.x == 0) {
    dev::MbarInit(&bars[0], 1);
    dev::MbarInit(&bars[1], 1);
  }
  __syncthreads();
  const long long t0 = clock64();
  if (mode & 4) {
  } else if (mode & 1) {
    if (threadIdx.x == 0) {
      dev::MbarArriveExpectTx(&bars[0], kBytes);
      for (unsigned off = 0; off < kBytes; off += 4096) dev::BulkCopyToShared(sm + off, src + off, 4096, &bars[0]);
    }
  } else {
    for (unsigned i = threadIdx.x; i < kBytes / 16; i += kThreads) dev::CpAsync16(sm + 16 * i, src + 16 * i);
    dev::CpAsyncCommit();
  }
  float acc = 0.0f;
  if (mode & 2) {
    if (threadIdx.x == 0) {
      dev::MbarArriveExpectTx(&bars[1], sizeof(xs));
      dev::BulkCopyToShared(xs, x, sizeof(xs), &bars[1]);
    }
    dev::MbarWait(&bars[1], 0);
    acc = xs[threadIdx.x];
  } else {
    float4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = reinterpret_cast<const float4*>(x)[threadIdx.x + kThreads * u];
#pragma unroll
    for (int u = 0; u < 4; ++u) acc += v[u].x + v[u].y + v[u].z + v[u].w;
  }
  const long long t1 = clock64();
  if (mode & 4) {
  } else if (mode & 1) {
    dev::MbarWait(&bars[0], 0);
  } else {
    dev::CpAsyncWait<0>();
  }
  __syncthreads();
  const long long t2 = clock64();
  if (acc + reinterpret_cast<float*>(sm)[threadIdx.x] == 1234.5f) g_sink = 1;
  if (threadIdx.x == 0) {
    t_x[blockIdx.x] = t1 - t0;
    t_w[blockIdx.x] = t2 - t0;
  }
}

using FillFn = void (*)(const char*, unsigned);

}  // namespace

int main(int argc, char** argv) {
  int reps = 200;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: bench_smem_fill [--reps N]\n"
                   "  shared-memory fill rates by cp.async, loads and bulk copies, and how long a small\n"
                   "  load waits behind 64 KB of requests (see the file's header)\n");
      return std::strcmp(argv[i], "--help") == 0 ? 0 : 2;
    }
  }
  if (reps < 1) reps = 1;
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  const size_t total = size_t{4} << 30;
  char* buf = nullptr;
  float* x = nullptr;
  long long *t_x = nullptr, *t_w = nullptr;
  CHECK_CUDA(cudaMalloc(&buf, total));
  CHECK_CUDA(cudaMemset(buf, 1, total));
  CHECK_CUDA(cudaMalloc(&x, 8192));
  CHECK_CUDA(cudaMemset(x, 0, 8192));
  CHECK_CUDA(cudaMallocManaged(&t_x, 8 * 1024));
  CHECK_CUDA(cudaMallocManaged(&t_w, 8 * 1024));
  const FillFn fills[] = {FillCpAsync, FillLoads, FillBulk<4096>, FillBulk<16384>};
  const char* names[] = {"cp.async", "loads", "bulk 4K", "bulk 16K"};
  for (FillFn f : fills) CHECK_CUDA(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, 131072));
  CHECK_CUDA(cudaFuncSetAttribute(Behind, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536));
  cudaStream_t st;
  CHECK_CUDA(cudaStreamCreate(&st));
  auto timed = [&](int which, int ctas, unsigned bytes) {
    cudaGraph_t g;
    CHECK_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    const size_t span = static_cast<size_t>(ctas) * bytes;
    for (int r = 0; r < reps; ++r) {
      const char* base = buf + (static_cast<size_t>(r) * span) % (total - span) / 4096 * 4096;
      if (which < 0) {
        Empty<<<ctas, kThreads, 0, st>>>();
      } else {
        fills[which]<<<ctas, kThreads, which == 1 ? 0 : bytes, st>>>(base, bytes);
      }
    }
    CHECK_CUDA(cudaStreamEndCapture(st, &g));
    const double ms = GraphReplayMs(st, g);
    CHECK_CUDA(cudaGraphDestroy(g));
    return 1e3 * ms / reps;
  };
  std::printf("fill: µs per launch (GB/s), %d launches in a graph; an empty kernel: %.2f µs\n", reps,
              timed(-1, 132, 0));
  std::printf("%8s %5s", "bytes", "CTAs");
  for (const char* n : names) std::printf(" %18s", n);
  std::printf("\n");
  for (unsigned bytes : {16384u, 65536u, 131072u}) {
    for (int ctas : {1, 36, 132, 264, 1056}) {
      std::printf("%8u %5d", bytes, ctas);
      for (int k = 0; k < 4; ++k) {
        const float us = timed(k, ctas, bytes);
        std::printf(" %8.2f (%6.0f)", us, ctas * static_cast<double>(bytes) / us / 1e3);
      }
      std::printf("\n");
    }
  }
  std::printf("behind: SM cycles until an 8 KB x (in L2) and 64 KB of weights are in\n");
  const char* modes[] = {"cp.async w, loads x", "bulk w, loads x", "cp.async w, bulk x", "bulk w, bulk x",
                         "x alone, loads"};
  for (int ctas : {36, 132}) {
    for (int mode = 0; mode < 5; ++mode) {
      double sx = 0, sw = 0;
      int n = 0;
      for (int rep = 0; rep < 20; ++rep) {
        const size_t off = static_cast<size_t>(rep) * ctas * 65536 % (total - ctas * size_t{65536});
        Behind<<<ctas, kThreads, 65536>>>(buf + off, x, mode, t_x, t_w);
        CHECK_CUDA(cudaDeviceSynchronize());
        if (rep < 2) continue;  // warm-up
        for (int i = 0; i < ctas; ++i, ++n) sx += t_x[i], sw += t_w[i];
      }
      std::printf("  %4d CTAs  %-20s x %6.0f  weights %6.0f\n", ctas, modes[mode], sx / n, sw / n);
    }
  }
  return 0;
}
