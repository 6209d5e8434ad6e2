// engine/cuda_ranks.cc — the GPU side of ranks that are processes (engine/cuda_backend.h): how
// many GPUs this process sees, and NCCL's group of a process per GPU.
#include "engine/cuda_backend.h"
#include "kernels/cuda/nccl_api.h"

namespace lockstep::engine {

namespace cu = kernels::cuda;

int CudaDeviceCount() { return cu::DeviceCount(); }

Result<std::string> NewNcclGroupId() {
  LS_RETURN_IF_ERROR(cu::NcclAvailable());
  return cu::NcclComm::NewId();
}

Result<std::shared_ptr<kernels::Collective>> JoinNcclGroup(const std::string& id, int rank, int ranks) {
  if (cu::DeviceCount() == 0) return Status::Unsupported("NCCL rank " + std::to_string(rank) + ": " + cu::DeviceDescription());
  LS_ASSIGN_OR_RETURN(std::unique_ptr<cu::NcclComm> comm, cu::NcclComm::Join(id, rank, ranks));
  return cu::NcclCollective(std::move(comm));
}

}  // namespace lockstep::engine
