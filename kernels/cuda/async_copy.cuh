// kernels/cuda/async_copy.cuh — cp.async (sm_80+) helpers: 16-byte global → shared copies that
// run in the background, grouped; a thread sees its own copies after waiting for their group,
// other threads after a barrier (__syncwarp within a warp, __syncthreads across warps).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

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

// --- Bulk copies (sm_90: the tensor memory accelerator's non-tensor form) ----------------------
// One thread requests a contiguous global → shared copy (16-byte aligned ends, a multiple of 16
// bytes) that completes on an mbarrier: the barrier's phase ends once its expected arrivals
// have arrived and the bytes announced with them (MbarArriveExpectTx) have landed. Waiting
// threads then see the bytes. A few instructions move kilobytes, so the requests of a CTA go
// out at once and the LSU queue stays free for the loads that follow them.
namespace lockstep::kernels::cuda::dev {

__device__ __forceinline__ unsigned SmemAddr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// Before any use: one thread, then a barrier (or __syncwarp for a warp's own barriers).
__device__ __forceinline__ void MbarInit(uint64_t* bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddr(bar)), "r"(arrivals) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also announces `bytes` more to land in this phase.
__device__ __forceinline__ void MbarArriveExpectTx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SmemAddr(bar)), "r"(bytes)
               : "memory");
}
// Until the phase with this parity (0 for the barrier's first phase, then 1, 0, …) is over.
__device__ __forceinline__ void MbarWait(uint64_t* bar, unsigned parity) {
  const unsigned a = SmemAddr(bar);
  unsigned done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void BulkCopyToShared(void* smem, const void* gmem, unsigned bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          SmemAddr(smem)),
      "l"(gmem), "r"(bytes), "r"(SmemAddr(bar))
      : "memory");
}
// Orders this thread's earlier shared-memory reads (and writes) before later bulk copies into
// the same bytes (the generic and the async proxy).
__device__ __forceinline__ void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace lockstep::kernels::cuda::dev
