// kernels/host_device.h — LS_HD marks a function that both the host compiler and nvcc compile
// (__host__ __device__ under nvcc, nothing elsewhere): the headers whose very same code runs
// on the CPU and in the CUDA kernels (philox.h, row_stats.h, xxh3.h, mla_splits.h).
#pragma once

#if defined(__CUDACC__)
#define LS_HD __host__ __device__
#else
#define LS_HD
#endif
