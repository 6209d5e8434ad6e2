// kernels/cuda/launch.cuh — how every kernel of this folder is launched, and the two lines
// each one runs first (programmatic dependent launch, sm_90; ops.h SetOverlappedLaunch).
//
// A decode step is ~600 small kernels back to back; serialised, each one's launch, ramp-up and
// tail sit between the previous kernel's last store and its own first load. Launched with
// programmatic stream serialisation, kernel N+1 is scheduled as soon as every CTA of kernel N
// has passed its own wait (LaunchDependents below), runs its preamble — a GEMV requests its
// weight blocks, which no kernel writes — and then blocks in WaitForPrior until kernel N has
// finished and its stores are visible. The rule that keeps this exact: before WaitForPrior a
// kernel reads only memory no kernel of the step writes, and writes nothing. Since every kernel
// triggers only after its own wait, when kernel N+1 starts kernel N−1 has finished: at most two
// kernels of a stream are resident at once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include <utility>

#include "kernels/cuda/ops.h"

namespace lockstep::kernels::cuda {
namespace dev {

// Blocks until the previous kernel on the stream has completed and its memory is visible (a
// no-op when this kernel was launched without the overlap, or before sm_90).
__device__ __forceinline__ void WaitForPrior() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// Lets the next kernel on the stream be scheduled once every CTA of this one has called it.
__device__ __forceinline__ void LaunchDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// Both, in the order every kernel without a preamble uses: the first statement of its body.
__device__ __forceinline__ void GridDependencySync() {
  WaitForPrior();
  LaunchDependents();
}

}  // namespace dev

// Elementwise kernels over [rows, n]: kElemThreads threads a CTA, grid x over the columns in
// blocks of kElemThreads, y over the rows (grid.y ≤ 65535); both loop, so any shape fits the
// grid limits. In the kernel, LS_FOR_EACH_ELEMENT(rows, n) { … r, i … }.
inline constexpr int kElemThreads = 256;
inline dim3 ElementGrid(int64_t rows, int64_t n) {
  const int64_t bx = (n + kElemThreads - 1) / kElemThreads;
  return dim3(static_cast<unsigned>(bx < 4096 ? bx : 4096), static_cast<unsigned>(rows < 65535 ? rows : 65535));
}
#define LS_FOR_EACH_ELEMENT(rows, n)                                                        \
  for (int64_t r = blockIdx.y; r < (rows); r += gridDim.y)                                  \
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kElemThreads + threadIdx.x; i < (n); \
         i += static_cast<int64_t>(gridDim.x) * kElemThreads)

// kernel<<<grid, block, smem, stream>>>(args...), with the overlap when OverlappedLaunch().
// The kernel must start with dev::GridDependencySync() (or keep the rule above).
template <typename... Params, typename... Args>
cudaError_t LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Stream stream,
                         Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = OverlappedLaunch() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace lockstep::kernels::cuda
