// kernels/collective.h — the collective tensor parallelism over real ranks calls (docs/parallelism.md,
// "Over real GPUs"): an all-gather, after which every rank sums the gathered partials itself in the
// plan's order, so N ranks give emulated TP N's bits (engine/tensor_parallel.h AllReduce).
//
// LocalCollectives(n): n ranks that are threads of one process (host memory) — the CPU reference's
// rank mode and its tests. Over GPUs the same call is NCCL's (kernels/cuda/nccl_api.h).
//
// Thread-safety: each rank's object is used by one thread (its rank's engine); the ranks of a
// group meet in every call, in the same order.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "base/status.h"

namespace lockstep::kernels {

class Collective {
 public:
  virtual ~Collective() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // recv [size × n], rank q's n values at q·n, = every rank's send [n]. Blocks until every rank
  // of the group has called it with the same n; fails, on every rank, once any rank aborted.
  virtual Status AllGather(const float* send, int64_t n, float* recv) = 0;
  // Whether the group gathers device memory itself, on a stream (NCCL's: kernels/cuda/nccl_api.h),
  // inside a CUDA graph too; else a GPU rank stages its rows through host memory and AllGather.
  virtual bool device_native() const { return false; }
  // device_native groups: AllGather over device pointers, enqueued on `stream` (a cudaStream_t).
  virtual Status AllGatherDevice(const float* send, int64_t n, float* recv, void* stream) {
    (void)send, (void)n, (void)recv, (void)stream;
    return Status::Unsupported("this collective gathers host memory only");
  }
  // Fails this and every other rank's pending and later calls with `why` (a rank whose step
  // failed calls it, so the others do not wait for it forever).
  virtual void Abort(const Status& why) = 0;
};

// A group of n ranks in one process, rank r at [r]; 1 ≤ n ≤ 64.
std::vector<std::shared_ptr<Collective>> LocalCollectives(int n);

}  // namespace lockstep::kernels
