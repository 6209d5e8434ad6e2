// lab/bench_l2_read.cu — how fast the SMs read data that sits in the L2 against data in HBM,
// and whether `cp.async.bulk.prefetch.L2` leaves data there: the fact that decides whether
// weights fetched into the L2 ahead of their product (while batch-1 decode's latency-bound
// attention leaves the HBM idle) can make the product faster (docs/performance.md, GPU decode).
//
// For each size, the state of the data before one timed read of all of it:
//   hbm         the L2 flushed (512 MB read elsewhere)
//   l2          read once just before (as much of it as the L2 keeps)
//   <prefetch>  the L2 flushed, then the bytes requested into it by a small kernel (16 CTAs of
//               64 threads, as a side-stream kernel would take) in one of five ways —
//               cp.async.bulk.prefetch.L2 in 32 KB or 4 KB pieces, prefetch.global.L2 a line at
//               a time (with and without evict_last), or plain loads whose values are dropped
// with --wait-us spent (a spinning kernel) before the read in every state. Two readers: `ld`
// (every SM × 8 CTAs of 256 threads, 16-byte non-coherent loads, grid stride) and `bulk` (every
// SM × 4 CTAs of 128 threads, each its contiguous share through a ring of two 32 KB bulk copies
// into shared memory — the weight path of the GEMVs, kernels/cuda/expert_gemm_stream.cu). Medians over
// --reps, each timed read one launch between two events; the rates come from what the largest
// size takes over the smallest (launch and ramp cancel). Each trial's data are the next of 16
// distinct 64 MB regions, so no read finds an earlier trial's.
//
//   bench_l2_read [--sizes 8,16,24,32] [--reps 9] [--wait-us 40] [--json]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/cuda_bench.h"

namespace {

constexpr int kLdThreads = 256, kBulkThreads = 128;
constexpr unsigned kBulkPiece = 32u << 10;
constexpr size_t kRegion = size_t{64} << 20, kRegions = 16, kFlush = size_t{512} << 20;

__global__ void LdRead(const uint4* p, size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * size_t{kLdThreads} + threadIdx.x; i < n; i += size_t{gridDim.x} * kLdThreads) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p + i));
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // (never true for the fill below; keeps the loads)
}

__device__ __forceinline__ size_t MinSz(size_t a, size_t b) { return a < b ? a : b; }
__device__ __forceinline__ unsigned Smem(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

__global__ void __launch_bounds__(kBulkThreads) BulkRead(const char* p, size_t bytes, unsigned* sink) {
  extern __shared__ __align__(128) unsigned char ring[];  // 2 × kBulkPiece
  __shared__ __align__(8) uint64_t bar[2];
  const size_t share = (bytes / gridDim.x + 15) / 16 * 16;
  const size_t begin = MinSz(bytes, share * blockIdx.x), end = MinSz(bytes, begin + share);
  const size_t pieces = (end - begin + kBulkPiece - 1) / kBulkPiece;
  if (threadIdx.x == 0) {
    for (int i = 0; i < 2; ++i) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(Smem(&bar[i])) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto request = [&](size_t i) {
    const unsigned n = static_cast<unsigned>(MinSz(kBulkPiece, end - begin - i * kBulkPiece));
    uint64_t* b = &bar[i % 2];
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(Smem(b)), "r"(n) : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            Smem(ring + (i % 2) * kBulkPiece)),
        "l"(p + begin + i * kBulkPiece), "r"(n), "r"(Smem(b))
        : "memory");
  };
  if (threadIdx.x == 0) {
    for (size_t i = 0; i < MinSz(2, pieces); ++i) request(i);
  }
  unsigned acc = 0;
  for (size_t i = 0; i < pieces; ++i) {
    const unsigned parity = static_cast<unsigned>((i / 2) % 2);
    unsigned done = 0;
    do {
      asm volatile(
          "{\n.reg .pred q;\nmbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2;\nselp.u32 %0, 1, 0, q;\n}\n"
          : "=r"(done)
          : "r"(Smem(&bar[i % 2])), "r"(parity)
          : "memory");
    } while (!done);
    const unsigned n = static_cast<unsigned>(MinSz(kBulkPiece, end - begin - i * kBulkPiece));
    const uint4* v = reinterpret_cast<const uint4*>(ring + (i % 2) * kBulkPiece);
    for (unsigned j = threadIdx.x; j < n / 16; j += kBulkThreads) acc ^= v[j].x ^ v[j].w;
    __syncthreads();  // every thread is done with the slot before it is refilled
    if (threadIdx.x == 0 && i + 2 < pieces) {
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      request(i + 2);
    }
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// The prefetch modes (a grid of 16 CTAs of 64 threads, as a side-stream kernel would take):
// 0, 1: cp.async.bulk.prefetch.L2 in 32 KB or 4 KB pieces; 2: prefetch.global.L2 a 128-byte
// line at a time; 3: the same with evict_last; 4: 16-byte loads whose values are dropped.
constexpr int kPrefetchModes = 5;
const char* const kPrefetchNames[kPrefetchModes] = {"bulk 32K", "bulk 4K", "line", "line el", "ld"};
__global__ void PrefetchL2(const char* p, size_t bytes, int mode, unsigned* sink) {
  const size_t threads = size_t{gridDim.x} * blockDim.x, t = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  if (mode <= 1) {
    const size_t piece = mode == 0 ? 32u << 10 : 4u << 10;
    for (size_t off = t * piece; off < bytes; off += threads * piece) {
      const unsigned n = static_cast<unsigned>(MinSz(piece, bytes - off));
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p + off), "r"(n) : "memory");
    }
  } else if (mode <= 3) {
    for (size_t off = t * 128; off < bytes; off += threads * 128) {
      if (mode == 2) {
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p + off) : "memory");
      } else {
        asm volatile("prefetch.global.L2::evict_last [%0];\n" ::"l"(p + off) : "memory");
      }
    }
  } else {
    unsigned acc = 0;
    for (size_t off = t * 16; off < bytes; off += threads * 16) {
      uint4 v;
      asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "l"(p + off));
      acc ^= v.x;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
  }
}

__global__ void Spin(long long ns) {
  long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  } while (t - t0 < ns);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<size_t> sizes_mb = {8, 16, 24, 32};
  int reps = 9, wait_us = 40;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("usage: bench_l2_read [--sizes 8,16,24,32] [--reps 9] [--wait-us 40] [--json]\n(see the file's header)\n");
      return 0;
    } else if (a == "--json") {
      json = true;
    } else if ((a == "--sizes" || a == "--reps" || a == "--wait-us") && i + 1 < argc) {
      const std::string v = argv[++i];
      if (a == "--wait-us") {
        wait_us = std::atoi(v.c_str());
        if (wait_us < 0 || wait_us > 100000) {
          std::fprintf(stderr, "bench_l2_read: --wait-us: %s is not in 0..100000\n", v.c_str());
          return 2;
        }
      } else if (a == "--reps") {
        reps = std::atoi(v.c_str());
        if (reps < 1 || reps > 1000) {
          std::fprintf(stderr, "bench_l2_read: --reps: %s is not in 1..1000\n", v.c_str());
          return 2;
        }
      } else {
        sizes_mb.clear();
        for (size_t at = 0; at < v.size();) {
          const size_t comma = std::min(v.find(',', at), v.size());
          const long mb = std::atol(v.substr(at, comma - at).c_str());
          if (mb < 1 || mb > 64) {
            std::fprintf(stderr, "bench_l2_read: --sizes: '%s' is not a size in MB in 1..64\n",
                         v.substr(at, comma - at).c_str());
            return 2;
          }
          sizes_mb.push_back(static_cast<size_t>(mb));
          at = comma + 1;
        }
      }
    } else {
      std::fprintf(stderr, "bench_l2_read: unknown or incomplete flag %s (--help)\n", a.c_str());
      return 2;
    }
  }
  int sms = 0, l2 = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  char* buf = nullptr;
  unsigned* sink = nullptr;
  CHECK_CUDA(cudaMalloc(&buf, kRegion * kRegions + kFlush));
  CHECK_CUDA(cudaMemset(buf, 0x5a, kRegion * kRegions + kFlush));
  CHECK_CUDA(cudaMalloc(&sink, 16));
  CHECK_CUDA(cudaFuncSetAttribute(BulkRead, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * kBulkPiece));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  const char* flush_at = buf + kRegion * kRegions;
  auto flush = [&] { LdRead<<<sms * 8, kLdThreads>>>(reinterpret_cast<const uint4*>(flush_at), kFlush / 16, sink); };
  auto read = [&](int reader, const char* p, size_t bytes) {
    if (reader == 0) {
      LdRead<<<sms * 8, kLdThreads>>>(reinterpret_cast<const uint4*>(p), bytes / 16, sink);
    } else {
      BulkRead<<<sms * 4, kBulkThreads, 2 * kBulkPiece>>>(p, bytes, sink);
    }
  };
  auto timed = [&](int reader, const char* p, size_t bytes) {
    CHECK_CUDA(cudaEventRecord(e0));
    read(reader, p, bytes);
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    return ms * 1e3;  // µs
  };
  size_t region = 0;
  auto next = [&] { return buf + (region++ % kRegions) * kRegion; };
  // The SM clock idles low: ~0.2 s of reads first.
  for (int i = 0; i < 1500; ++i) flush();
  CHECK_CUDA(cudaDeviceSynchronize());
  const char* names[2] = {"ld", "bulk"};
  std::printf("device: %s, %d SMs, L2 %d MB; prefetch grid 16 × 64 threads, then %d µs before the read\n", prop.name,
              sms, l2 >> 20, wait_us);
  std::string js = "{\"device\":\"" + std::string(prop.name) + "\",\"l2_bytes\":" + std::to_string(l2) +
                   ",\"wait_us\":" + std::to_string(wait_us) + ",\"runs\":[";
  bool first = true;
  constexpr int kStates = 2 + kPrefetchModes;  // hbm, l2, each prefetch mode
  for (int reader = 0; reader < 2; ++reader) {
    std::printf("reader %s: µs for one read of all of it, by the data's state before\n  %5s %9s %9s", names[reader],
                "MB", "hbm", "l2");
    for (int m = 0; m < kPrefetchModes; ++m) std::printf(" %9s", kPrefetchNames[m]);
    std::printf("\n");
    std::vector<std::vector<double>> med(sizes_mb.size(), std::vector<double>(kStates));
    for (size_t si = 0; si < sizes_mb.size(); ++si) {
      const size_t bytes = sizes_mb[si] << 20;
      std::vector<std::vector<double>> t(kStates);
      for (int r = 0; r < reps; ++r) {
        for (int st = 0; st < kStates; ++st) {
          const char* p = next();
          flush();
          if (st == 1) read(reader, p, bytes);
          if (st >= 2) PrefetchL2<<<16, 64>>>(p, bytes, st - 2, sink);
          Spin<<<1, 1>>>(static_cast<long long>(wait_us) * 1000);
          t[st].push_back(timed(reader, p, bytes));
        }
      }
      CHECK_CUDA(cudaGetLastError());
      std::printf("  %5zu", sizes_mb[si]);
      for (int st = 0; st < kStates; ++st) {
        med[si][st] = Median(t[st]);
        std::printf(" %9.2f", med[si][st]);
      }
      std::printf("\n");
      char row[512];
      int n = std::snprintf(row, sizeof row, "%s{\"reader\":\"%s\",\"mb\":%zu,\"hbm_us\":%.3f,\"l2_us\":%.3f",
                            first ? "" : ",", names[reader], sizes_mb[si], med[si][0], med[si][1]);
      for (int m = 0; m < kPrefetchModes; ++m) {
        n += std::snprintf(row + n, sizeof row - n, ",\"%s_us\":%.3f", kPrefetchNames[m], med[si][2 + m]);
      }
      std::snprintf(row + n, sizeof row - n, "}");
      js += row;
      first = false;
    }
    // Rates from the time each added MB takes (the launch and ramp cancel out).
    if (sizes_mb.size() >= 2) {
      const size_t lo = 0, hi = sizes_mb.size() - 1;
      const double mb = static_cast<double>(sizes_mb[hi] - sizes_mb[lo]) * (1 << 20);
      std::printf("  GB/s from %zu to %zu MB:", sizes_mb[lo], sizes_mb[hi]);
      for (int st = 0; st < kStates; ++st) {
        const double dt = med[hi][st] - med[lo][st];
        std::printf(" %9.0f", dt > 0 ? mb / dt / 1e3 : 0.0);
      }
      std::printf("\n");
    }
  }
  js += "]}";
  if (json) std::printf("%s\n", js.c_str());
  return 0;
}
