// kernels/cuda/cublaslt_api.h — cuBLASLt, loaded when the CUDA backend first needs it.
//
// libcublasLt is ~500 MB with ~400k relocations: linked directly, every lockstep process (an
// `inspect` of a trace, every CPU test) spent ~0.09 s and ~200 MB of resident memory loading it
// at start-up, GPU or not. It is dlopen()ed instead, by the first Gemm::Create; the CPU paths
// never touch it. The function pointers carry the header's own signatures (decltype), so a
// call through them is checked like a direct call.
#pragma once

#include <cublasLt.h>

#include <string>

#include "base/status.h"

namespace lockstep::kernels::cuda {

struct CublasLtApi {
  decltype(&::cublasLtCreate) Create;
  decltype(&::cublasLtDestroy) Destroy;
  decltype(&::cublasLtGetStatusName) GetStatusName;
  decltype(&::cublasLtGetStatusString) GetStatusString;
  decltype(&::cublasLtMatmul) Matmul;
  decltype(&::cublasLtMatmulAlgoCheck) MatmulAlgoCheck;
  decltype(&::cublasLtMatmulAlgoConfigGetAttribute) MatmulAlgoConfigGetAttribute;
  decltype(&::cublasLtMatmulAlgoConfigSetAttribute) MatmulAlgoConfigSetAttribute;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic;
  decltype(&::cublasLtMatmulDescCreate) MatmulDescCreate;
  decltype(&::cublasLtMatmulDescDestroy) MatmulDescDestroy;
  decltype(&::cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute;
  decltype(&::cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate;
  decltype(&::cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute;
  decltype(&::cublasLtMatrixLayoutCreate) MatrixLayoutCreate;
  decltype(&::cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy;
};

// Loads libcublasLt.so.<CUBLAS_VER_MAJOR> once (the loader's search path, then the toolkit's
// library directory this build was configured with) and resolves every entry point. An error
// names the library, the missing symbol or dlerror(). Thread-safe; later calls return the
// first call's result.
Result<const CublasLtApi*> LoadCublasLt();

// The loaded API, or nullptr before a successful LoadCublasLt().
const CublasLtApi* LoadedCublasLt();

// " (NAME: description)" of a cuBLAS status from the loaded library; "" before it is loaded.
std::string CublasStatusText(cublasStatus_t e);

}  // namespace lockstep::kernels::cuda
