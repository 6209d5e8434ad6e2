// kernels/cuda/async_copy.cuh — cp.async (sm_80+) helpers: 16-byte global → shared copies that
// run in the background, grouped; a thread sees its own copies after waiting for their group,
// other threads after a barrier (__syncwarp within a warp, __syncthreads across warps).
#pragma once

#include <cuda_runtime.h>

namespace lockstep::kernels::cuda::dev {

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Until at most kN of this thread's committed groups are pending (groups complete in order).
template <int kN>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kN) : "memory");
}
// The same for a count known at run time (wait_group takes an immediate): counts above 11
// wait as for 11, which is only slower.
__device__ __forceinline__ void CpAsyncWaitAtMost(int n) {
  switch (n) {
    case 0: CpAsyncWait<0>(); break;
    case 1: CpAsyncWait<1>(); break;
    case 2: CpAsyncWait<2>(); break;
    case 3: CpAsyncWait<3>(); break;
    case 4: CpAsyncWait<4>(); break;
    case 5: CpAsyncWait<5>(); break;
    case 6: CpAsyncWait<6>(); break;
    case 7: CpAsyncWait<7>(); break;
    case 8: CpAsyncWait<8>(); break;
    case 9: CpAsyncWait<9>(); break;
    case 10: CpAsyncWait<10>(); break;
    default: CpAsyncWait<11>(); break;
  }
}

}  // namespace lockstep::kernels::cuda::dev
