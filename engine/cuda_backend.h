// engine/cuda_backend.h — the CUDA forward pass (engine/cuda_backend.cc; a stub that
// explains itself in builds without CUDA). Use through engine/backend.h.
#pragma once

#include <memory>
#include <string>

#include "base/status.h"
#include "engine/backend.h"
#include "kernels/collective.h"

namespace lockstep::engine {

Result<std::unique_ptr<Backend>> CreateCudaBackend(std::shared_ptr<Model> model, const PagedKvCache& cache,
                                                   const kernels::KernelPlan& plan, const BackendOptions& options);

// Ranks that are processes, one GPU each (engine/rank_group.h's "nccl" groups): the GPUs this
// process sees (0 without CUDA), a new NCCL communicator id (rank 0), and joining it on the
// current GPU (blocks until every rank has joined). Without CUDA or NCCL: an error saying which.
int CudaDeviceCount();
Result<std::string> NewNcclGroupId();
Result<std::shared_ptr<kernels::Collective>> JoinNcclGroup(const std::string& id, int rank, int ranks);

}  // namespace lockstep::engine
