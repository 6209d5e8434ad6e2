// kernels/cuda/check.cuh — CUDA/cuBLAS error checks that become a lockstep Status.
//
// LS_CUDA_RETURN_IF_ERROR(cudaMalloc(...)) returns Status::Internal("kernels/cuda/x.cu:42:
// cudaMalloc(...): out of memory (cudaErrorMemoryAllocation)") from the enclosing function.
// LS_CUDA_LAUNCH_CHECK() after a <<<>>> launch reports bad launch configurations at once
// (errors inside the kernel surface at the next synchronising call). Include only from .cu.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <string>

#include "base/status.h"
#include "kernels/cuda/cublaslt_api.h"

namespace lockstep::kernels::cuda {

inline Status CudaStatus(cudaError_t e, const char* expr, const char* file, int line) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string(file) + ":" + std::to_string(line) + ": " + expr + ": " + cudaGetErrorString(e) +
                          " (" + cudaGetErrorName(e) + ")");
}

inline Status CublasStatus(cublasStatus_t e, const char* expr, const char* file, int line) {
  if (e == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return Status::Internal(std::string(file) + ":" + std::to_string(line) + ": " + expr + ": cuBLAS status " +
                          std::to_string(static_cast<int>(e)) + CublasStatusText(e));
}

}  // namespace lockstep::kernels::cuda

#define LS_CUDA_RETURN_IF_ERROR(expr) \
  LS_RETURN_IF_ERROR(::lockstep::kernels::cuda::CudaStatus((expr), #expr, __FILE__, __LINE__))
#define LS_CUBLAS_RETURN_IF_ERROR(expr) \
  LS_RETURN_IF_ERROR(::lockstep::kernels::cuda::CublasStatus((expr), #expr, __FILE__, __LINE__))
#define LS_CUDA_LAUNCH_CHECK() LS_CUDA_RETURN_IF_ERROR(cudaGetLastError())

// Argument validation: LS_CHECK_ARG(p.rows > 0, "RmsNorm", "rows", p.rows) returns
// InvalidArgument("RmsNorm: rows = 0 fails `p.rows > 0`").
#define LS_CHECK_ARG(cond, op, field, value)                                                              \
  do {                                                                                                    \
    if (!(cond)) {                                                                                        \
      return ::lockstep::Status::InvalidArgument(std::string(op) + ": " + (field) + " = " +               \
                                                 ::lockstep::kernels::cuda::ArgText(value) + " fails `" + \
                                                 #cond + "`");                                            \
    }                                                                                                     \
  } while (0)

namespace lockstep::kernels::cuda {
inline std::string ArgText(const void* p) { return p ? "a pointer" : "null"; }
inline std::string ArgText(int64_t v) { return std::to_string(v); }
inline std::string ArgText(int v) { return std::to_string(v); }
inline std::string ArgText(size_t v) { return std::to_string(v); }
inline std::string ArgText(double v) { return std::to_string(v); }
inline std::string ArgText(float v) { return std::to_string(v); }
}  // namespace lockstep::kernels::cuda
