// kernels/cuda/nccl_api.h — NCCL, loaded when a multi-GPU run first needs it, and the one
// collective tensor parallelism over real ranks uses.
//
// Like cuBLASLt (cublaslt_api.h) it is dlopen()ed, never linked: a CPU-only machine, CI and
// every single-GPU command run without it. The search: $LOCKSTEP_NCCL_LIBRARY (a file), the
// loader's path (libnccl.so.2), then the CUDA toolkit's library folders this build was configured
// with (the nvidia-nccl Python wheel's nvidia/nccl/lib is found through LD_LIBRARY_PATH or the
// variable).
//
// The collective is an all-gather: every rank receives every rank's partial output, rank-major,
// and sums them itself in the plan's order (the AllReduce kernel, ops.h) — the bits of the
// emulation on one device (engine/tensor_parallel.h), whatever NCCL's algorithm, protocol,
// topology or channel count, because a gather copies and never adds. (NCCL's own all-reduce
// sums in an order that depends on all of those; docs/parallelism.md.) Keep NVLink multicast off
// (NCCL_NVLS_ENABLE=0) as every run here does.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "base/status.h"
#include "kernels/collective.h"
#include "kernels/cuda/ops.h"

namespace lockstep::kernels::cuda {

// Whether NCCL can be loaded here (an error saying where it looked, or that this build has no
// NCCL headers). Thread-safe; loads it once.
Status NcclAvailable();

// One rank of a communicator of `ranks` processes (one GPU each). Not thread-safe.
class NcclComm {
 public:
  // The communicator's id, made by rank 0 and handed to every rank (any channel: a pipe, a
  // file, an environment variable): NCCL_UNIQUE_ID_BYTES bytes, as lowercase hex.
  static Result<std::string> NewId();
  // Joins the communicator `id` as `rank` of `ranks` on the current CUDA device (blocks until
  // every rank has joined).
  static Result<std::unique_ptr<NcclComm>> Join(const std::string& id, int rank, int ranks);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const { return rank_; }
  int ranks() const { return ranks_; }
  // recv [ranks × n] (rank q's n floats at q·n) = every rank's send [n], enqueued on `stream`
  // (device pointers; recv must not overlap send unless send is recv + rank·n).
  Status AllGather(const float* send, int64_t n, float* recv, Stream stream);
  // "NCCL 2.27.3" of the loaded library.
  static std::string Version();
  // ncclCommAbort: ends the communicator and every operation of it still waiting (for a rank
  // that died). Any thread, once; every later AllGather fails.
  void Abort();

 private:
  NcclComm() = default;
  std::atomic<void*> comm_{nullptr};  // ncclComm_t; null once aborted
  int rank_ = 0, ranks_ = 1;
};

// The group collective of a process per GPU (kernels/collective.h) over `comm`: device_native,
// AllGatherDevice enqueued on the caller's stream (a CUDA graph may hold it); AllGather of host
// memory stages through device buffers and returns when done. Abort ends the communicator.
std::shared_ptr<Collective> NcclCollective(std::unique_ptr<NcclComm> comm);

}  // namespace lockstep::kernels::cuda
