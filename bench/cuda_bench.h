// bench/cuda_bench.h — what the CUDA benchmarks share: exit-on-error checks for CUDA calls and
// lockstep Status values (a benchmark has nothing to recover to).
#pragma once

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
