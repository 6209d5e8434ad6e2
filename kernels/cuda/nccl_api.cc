// kernels/cuda/nccl_api.cc — see nccl_api.h.
#include "kernels/cuda/nccl_api.h"

#include <dlfcn.h>
#include <nccl.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

namespace lockstep::kernels::cuda {
namespace {

struct NcclApi {
  decltype(&::ncclGetVersion) GetVersion;
  decltype(&::ncclGetUniqueId) GetUniqueId;
  decltype(&::ncclCommInitRank) CommInitRank;
  decltype(&::ncclCommDestroy) CommDestroy;
  decltype(&::ncclCommAbort) CommAbort;
  decltype(&::ncclAllGather) AllGather;
  decltype(&::ncclGetErrorString) GetErrorString;
};

Result<NcclApi> Load() {
  const std::string name = "libnccl.so." + std::to_string(NCCL_MAJOR);
  std::vector<std::string> tries;
  if (const char* env = std::getenv("LOCKSTEP_NCCL_LIBRARY"); env != nullptr && *env != '\0') tries.push_back(env);
  tries.push_back(name);
#ifdef LOCKSTEP_CUDA_LIBRARY_DIR
  tries.push_back(std::string(LOCKSTEP_CUDA_LIBRARY_DIR) + "/" + name);
  tries.push_back(std::string(LOCKSTEP_CUDA_LIBRARY_DIR) + "/../lib/" + name);
#endif
  void* lib = nullptr;
  std::string why;
  for (const std::string& t : tries) {
    lib = dlopen(t.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) break;
    why += (why.empty() ? "" : "; ") + std::string(dlerror());
  }
  if (lib == nullptr) {
    return Status::NotFound("NCCL (" + name + ", which tensor parallelism over several GPUs needs) could not be "
                            "loaded — set LOCKSTEP_NCCL_LIBRARY to the file (the nvidia-nccl wheel's "
                            "nvidia/nccl/lib/" + name + "): " + why);
  }
  NcclApi api{};
  Status missing = Status::Ok();
  auto bind = [&](auto& fn, const char* symbol) {
    void* p = dlsym(lib, symbol);
    if (!p && missing.ok()) missing = Status::NotFound(name + " has no symbol " + symbol);
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
  };
  bind(api.GetVersion, "ncclGetVersion");
  bind(api.GetUniqueId, "ncclGetUniqueId");
  bind(api.CommInitRank, "ncclCommInitRank");
  bind(api.CommDestroy, "ncclCommDestroy");
  bind(api.CommAbort, "ncclCommAbort");
  bind(api.AllGather, "ncclAllGather");
  bind(api.GetErrorString, "ncclGetErrorString");
  if (!missing.ok()) {
    dlclose(lib);
    return missing;
  }
  return api;  // loaded for the process's life
}

Status Check(const NcclApi* api, ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return Status::Ok();
  return Status::Internal(std::string("NCCL ") + what + ": " + api->GetErrorString(r) + " (ncclResult " +
                          std::to_string(static_cast<int>(r)) + ")");
}

Result<const NcclApi*> LoadNccl() {
  static std::once_flag once;
  static Result<NcclApi> loaded = Status::Internal("unset");
  std::call_once(once, [] { loaded = Load(); });
  if (!loaded.ok()) return loaded.status();
  return &*loaded;
}

}  // namespace

Status NcclAvailable() { return LoadNccl().status(); }

std::string NcclComm::Version() {
  auto api = LoadNccl();
  int v = 0;
  if (!api.ok() || (*api)->GetVersion(&v) != ncclSuccess) return "NCCL (not loaded)";
  // NCCL_VERSION_CODE: major·10000 + minor·100 + patch since 2.9.
  return "NCCL " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

Result<std::string> NcclComm::NewId() {
  LS_ASSIGN_OR_RETURN(const NcclApi* api, LoadNccl());
  ncclUniqueId id;
  LS_RETURN_IF_ERROR(Check(api, api->GetUniqueId(&id), "GetUniqueId"));
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (char c : id.internal) {
    hex += kHex[static_cast<unsigned char>(c) >> 4];
    hex += kHex[static_cast<unsigned char>(c) & 15];
  }
  return hex;
}

Result<std::unique_ptr<NcclComm>> NcclComm::Join(const std::string& id_hex, int rank, int ranks) {
  LS_ASSIGN_OR_RETURN(const NcclApi* api, LoadNccl());
  if (ranks < 1 || rank < 0 || rank >= ranks) {
    return Status::InvalidArgument("NCCL: rank " + std::to_string(rank) + " of " + std::to_string(ranks));
  }
  ncclUniqueId id;
  if (id_hex.size() != 2 * sizeof id.internal) {
    return Status::InvalidArgument("NCCL: a communicator id is " + std::to_string(2 * sizeof id.internal) +
                                   " hex digits, not " + std::to_string(id_hex.size()));
  }
  auto nibble = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
  for (size_t i = 0; i < sizeof id.internal; ++i) {
    const int hi = nibble(id_hex[2 * i]), lo = nibble(id_hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return Status::InvalidArgument("NCCL: the communicator id is not lowercase hex");
    id.internal[i] = static_cast<char>(hi << 4 | lo);
  }
  std::unique_ptr<NcclComm> c(new NcclComm());
  c->rank_ = rank;
  c->ranks_ = ranks;
  ncclComm_t comm = nullptr;
  LS_RETURN_IF_ERROR(Check(api, api->CommInitRank(&comm, ranks, id, rank), "CommInitRank"));
  c->comm_ = comm;
  return c;
}

NcclComm::~NcclComm() {
  if (void* c = comm_.exchange(nullptr); c != nullptr) {
    if (auto api = LoadNccl(); api.ok()) (*api)->CommDestroy(static_cast<ncclComm_t>(c));
  }
}

void NcclComm::Abort() {
  if (void* c = comm_.exchange(nullptr); c != nullptr) {
    if (auto api = LoadNccl(); api.ok()) (*api)->CommAbort(static_cast<ncclComm_t>(c));
  }
}

Status NcclComm::AllGather(const float* send, int64_t n, float* recv, Stream stream) {
  LS_ASSIGN_OR_RETURN(const NcclApi* api, LoadNccl());
  if (n < 0) return Status::InvalidArgument("NCCL AllGather: n = " + std::to_string(n));
  void* comm = comm_.load();
  if (comm == nullptr) return Status::Internal("NCCL AllGather: the communicator was aborted");
  return Check(api, api->AllGather(send, recv, static_cast<size_t>(n), ncclFloat32, static_cast<ncclComm_t>(comm),
                              static_cast<cudaStream_t>(stream)),
               "AllGather");
}

}  // namespace lockstep::kernels::cuda
