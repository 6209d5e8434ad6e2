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

}  // namespace lockstep::engine
