// engine/cuda_backend_stub.cc — builds without a CUDA toolkit: `--backend cuda` explains.
#include "engine/cuda_backend.h"

namespace lockstep::engine {

bool HaveCudaBackend() { return false; }

Result<std::unique_ptr<Backend>> CreateCudaBackend(std::shared_ptr<Model>, const PagedKvCache&,
                                                   const kernels::KernelPlan&, const BackendOptions&) {
  return Status::Unsupported(
      "--backend cuda: this lockstep was built without CUDA (CMake found no toolkit at /usr/local/cuda; "
      "rebuild with one to get the GPU backend)");
}

int CudaDeviceCount() { return 0; }

Result<std::string> NewNcclGroupId() {
  return Status::Unsupported("NCCL: this lockstep was built without CUDA (a process per GPU needs a CUDA build)");
}

Result<std::shared_ptr<kernels::Collective>> JoinNcclGroup(const std::string&, int, int) { return NewNcclGroupId().status(); }

}  // namespace lockstep::engine
