// bench/gpu_timeline.cc — CUPTI activity collection for bench/gpu_timeline.h.
#include "bench/gpu_timeline.h"

#include <cupti.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>

namespace lockstep::bench {
namespace {

// CUPTI is opened when a timeline is asked for (the benchmark runs without it otherwise): the
// six entry points used here.
struct CuptiApi {
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityDisable) disable = nullptr;
  decltype(&cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_record = nullptr;
  decltype(&cuptiGetResultString) result_string = nullptr;
};

Result<const CuptiApi*> Api() {
  static CuptiApi api;
  static std::string error;
  static std::once_flag once;
  std::call_once(once, [] {
    void* h = nullptr;
    for (const char* name : {"libcupti.so.13", "libcupti.so.12", "libcupti.so"}) {
      if ((h = dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
    }
    if (h == nullptr) {
      error = std::string("CUPTI not found (libcupti.so.13; add its folder to LD_LIBRARY_PATH): ") + dlerror();
      return;
    }
    auto get = [&](auto* fn, const char* sym) {
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(h, sym));
      if (*fn == nullptr && error.empty()) error = std::string("CUPTI lacks ") + sym;
    };
    get(&api.register_callbacks, "cuptiActivityRegisterCallbacks");
    get(&api.enable, "cuptiActivityEnable");
    get(&api.disable, "cuptiActivityDisable");
    get(&api.flush_all, "cuptiActivityFlushAll");
    get(&api.next_record, "cuptiActivityGetNextRecord");
    get(&api.result_string, "cuptiGetResultString");
  });
  if (!error.empty()) return Status::NotFound("timeline: " + error);
  return &api;
}

std::mutex mu;
std::vector<KernelSpan> spans;  // guarded by mu
bool collecting = false;        // guarded by mu: between Start and Stop

constexpr size_t kBufferBytes = size_t{8} << 20;

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  auto api = Api();
  while (api.ok() && (*api)->next_record(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && record->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    if (!collecting) continue;
    KernelSpan s;
    s.name = k->name != nullptr ? k->name : "?";
    s.start_ns = k->start;
    s.end_ns = k->end;
    s.stream = k->streamId;
    s.grid[0] = k->gridX, s.grid[1] = k->gridY, s.grid[2] = k->gridZ;
    s.block[0] = k->blockX, s.block[1] = k->blockY, s.block[2] = k->blockZ;
    spans.push_back(std::move(s));
  }
  std::free(buffer);
}

Status Cupti(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return Status::Ok();
  const char* text = nullptr;
  if (auto api = Api(); api.ok()) (*api)->result_string(r, &text);
  return Status::Internal(std::string("CUPTI ") + what + ": " + (text != nullptr ? text : "error"));
}

}  // namespace

Status GpuTimeline::Start() {
  LS_ASSIGN_OR_RETURN(const CuptiApi* api, Api());
  {
    std::lock_guard<std::mutex> lock(mu);
    spans.clear();
    collecting = true;
  }
  LS_RETURN_IF_ERROR(Cupti(api->register_callbacks(BufferRequested, BufferCompleted), "register callbacks"));
  return Cupti(api->enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernel activity");
}

Result<std::vector<KernelSpan>> GpuTimeline::Stop() {
  LS_ASSIGN_OR_RETURN(const CuptiApi* api, Api());
  LS_RETURN_IF_ERROR(Cupti(api->flush_all(1), "flush"));
  LS_RETURN_IF_ERROR(Cupti(api->disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "disable"));
  std::vector<KernelSpan> out;
  {
    std::lock_guard<std::mutex> lock(mu);
    out.swap(spans);
    collecting = false;
  }
  std::sort(out.begin(), out.end(), [](const KernelSpan& a, const KernelSpan& b) { return a.start_ns < b.start_ns; });
  return out;
}

}  // namespace lockstep::bench
