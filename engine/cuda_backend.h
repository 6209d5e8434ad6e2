// engine/cuda_backend.h — the CUDA forward pass (engine/cuda_backend.cc; a stub that
// explains itself in builds without CUDA). Use through engine/backend.h.
#pragma once

#include <memory>

#include "base/status.h"
#include "engine/backend.h"

namespace lockstep::engine {

Result<std::unique_ptr<Backend>> CreateCudaBackend(std::shared_ptr<Model> model, const PagedKvCache& cache,
                                                   const kernels::KernelPlan& plan, const BackendOptions& options);

}  // namespace lockstep::engine
