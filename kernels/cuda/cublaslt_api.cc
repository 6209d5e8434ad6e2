// kernels/cuda/cublaslt_api.cc — see cublaslt_api.h.
#include "kernels/cuda/cublaslt_api.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <string>

namespace lockstep::kernels::cuda {
namespace {

std::atomic<const CublasLtApi*> g_loaded{nullptr};

Result<CublasLtApi> Load() {
  const std::string name = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
  void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string why = lib ? "" : std::string(dlerror());
#ifdef LOCKSTEP_CUDA_LIBRARY_DIR
  if (!lib) {
    const std::string path = std::string(LOCKSTEP_CUDA_LIBRARY_DIR) + "/" + name;
    lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) why += "; " + std::string(dlerror());
  }
#endif
  if (!lib) return Status::NotFound("cuBLASLt (" + name + ", which the CUDA backend's GEMMs need) could not be loaded: " + why);
  CublasLtApi api{};
  Status missing = Status::Ok();
  auto bind = [&](auto& fn, const char* symbol) {
    void* p = dlsym(lib, symbol);
    if (!p && missing.ok()) missing = Status::NotFound(name + " has no symbol " + symbol);
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
  };
  bind(api.Create, "cublasLtCreate");
  bind(api.Destroy, "cublasLtDestroy");
  bind(api.GetStatusName, "cublasLtGetStatusName");
  bind(api.GetStatusString, "cublasLtGetStatusString");
  bind(api.Matmul, "cublasLtMatmul");
  bind(api.MatmulAlgoCheck, "cublasLtMatmulAlgoCheck");
  bind(api.MatmulAlgoConfigGetAttribute, "cublasLtMatmulAlgoConfigGetAttribute");
  bind(api.MatmulAlgoConfigSetAttribute, "cublasLtMatmulAlgoConfigSetAttribute");
  bind(api.MatmulAlgoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic");
  bind(api.MatmulDescCreate, "cublasLtMatmulDescCreate");
  bind(api.MatmulDescDestroy, "cublasLtMatmulDescDestroy");
  bind(api.MatmulDescSetAttribute, "cublasLtMatmulDescSetAttribute");
  bind(api.MatmulPreferenceCreate, "cublasLtMatmulPreferenceCreate");
  bind(api.MatmulPreferenceDestroy, "cublasLtMatmulPreferenceDestroy");
  bind(api.MatmulPreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute");
  bind(api.MatrixLayoutCreate, "cublasLtMatrixLayoutCreate");
  bind(api.MatrixLayoutDestroy, "cublasLtMatrixLayoutDestroy");
  if (!missing.ok()) {
    dlclose(lib);
    return missing;
  }
  return api;  // the library stays loaded for the process's life
}

}  // namespace

Result<const CublasLtApi*> LoadCublasLt() {
  static std::once_flag once;
  static CublasLtApi api;
  static Status status = Status::Ok();
  std::call_once(once, [] {
    Result<CublasLtApi> r = Load();
    if (!r.ok()) {
      status = r.status();
      return;
    }
    api = r.value();
    g_loaded = &api;
  });
  if (!status.ok()) return status;
  return g_loaded.load();
}

const CublasLtApi* LoadedCublasLt() { return g_loaded.load(); }

std::string CublasStatusText(cublasStatus_t e) {
  const CublasLtApi* api = LoadedCublasLt();
  if (!api) return "";
  return std::string(" (") + api->GetStatusName(e) + ": " + api->GetStatusString(e) + ")";
}

}  // namespace lockstep::kernels::cuda
