// bench/cuda_bench.h — what the CUDA benchmarks share: exit-on-error checks for CUDA calls and
// lockstep Status values (a benchmark has nothing to recover to), event timing, and (in CUDA
// sources) an acquire load for the benchmarks that spin on a flag.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "base/status.h"

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

// Milliseconds per call of run() (its launches on the default stream): `warmups` untimed calls,
// then `reps` calls between two events.
template <typename F>
double MsPerCall(F&& run, int reps, int warmups = 1) {
  for (int i = 0; i < warmups; ++i) run();
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  CHECK_CUDA(cudaEventRecord(e0));
  for (int i = 0; i < reps; ++i) run();
  CHECK_CUDA(cudaEventRecord(e1));
  CHECK_CUDA(cudaEventSynchronize(e1));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
  return static_cast<double>(ms) / reps;
}

// Milliseconds one replay of `graph` takes on stream `s`: instantiated, replayed once untimed,
// then `reps` replays between two events.
inline double GraphReplayMs(cudaStream_t s, cudaGraph_t graph, int reps = 1) {
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  CHECK_CUDA(cudaGraphLaunch(exec, s));
  CHECK_CUDA(cudaStreamSynchronize(s));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  CHECK_CUDA(cudaEventRecord(e0, s));
  for (int r = 0; r < reps; ++r) CHECK_CUDA(cudaGraphLaunch(exec, s));
  CHECK_CUDA(cudaEventRecord(e1, s));
  CHECK_CUDA(cudaEventSynchronize(e1));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  return static_cast<double>(ms) / reps;
}

#ifdef __CUDACC__
// A counter another CTA bumps, read with acquire semantics at GPU scope (the flag and grid
// barrier benchmarks' spin).
__device__ __forceinline__ unsigned LoadAcquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
#endif
