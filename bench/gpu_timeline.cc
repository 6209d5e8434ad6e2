// bench/gpu_timeline.cc — CUPTI activity collection for bench/gpu_timeline.h.
#include "bench/gpu_timeline.h"

#include <cupti.h>
#include <cxxabi.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
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

namespace {
// "_ZN8lockstep…" → "Kernel<4, 1>": demangled, without the return type, namespaces and
// parameter list.
std::string ShortName(const std::string& raw) {
  int status = 0;
  char* d = abi::__cxa_demangle(raw.c_str(), nullptr, nullptr, &status);
  std::string s = status == 0 && d != nullptr ? d : raw;
  std::free(d);
  const std::string anon = "(anonymous namespace)";
  for (size_t at; (at = s.find(anon)) != std::string::npos;) s.replace(at, anon.size(), "anon");
  int depth = 0;
  size_t name_begin = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '<') ++depth;
    else if (s[i] == '>') --depth;
    else if (depth == 0 && s[i] == ' ') name_begin = i + 1;  // after "void "
    else if (depth == 0 && s[i] == ':' && i + 1 < s.size() && s[i + 1] == ':') name_begin = i + 2;
    else if (depth == 0 && s[i] == '(') return s.substr(name_begin, i - name_begin);
  }
  return s.substr(name_begin);
}
}  // namespace

Status WriteTimeline(const std::vector<KernelSpan>& spans, const std::string& csv_path, int64_t steps,
                     std::string* digest) {
  if (spans.empty()) return Status::InvalidArgument("timeline: no kernels were recorded (CUPTI saw none)");
  FILE* f = std::fopen(csv_path.c_str(), "w");
  if (f == nullptr) return Status::InvalidArgument(csv_path + ": cannot write the timeline");
  std::fprintf(f, "kernel,stream,start_us,duration_us,gap_us,grid,block\n");
  const uint64_t t0 = spans.front().start_ns;
  uint64_t busy_until = t0, busy = 0;
  struct Agg {
    int64_t n = 0;
    double total_us = 0;
  };
  std::map<std::string, Agg> by_name;
  double gaps_us = 0;
  for (const KernelSpan& s : spans) {
    const double gap = s.start_ns > busy_until ? (s.start_ns - busy_until) / 1e3 : 0.0;
    gaps_us += gap;
    const std::string name = ShortName(s.name);
    std::fprintf(f, "\"%s\",%u,%.3f,%.3f,%.3f,%dx%dx%d,%dx%dx%d\n", name.c_str(), s.stream, (s.start_ns - t0) / 1e3,
                 (s.end_ns - s.start_ns) / 1e3, gap, s.grid[0], s.grid[1], s.grid[2], s.block[0], s.block[1],
                 s.block[2]);
    // Busy time: the union of spans (the side stream's overlap counted once).
    if (s.end_ns > busy_until) {
      busy += s.end_ns - std::max(s.start_ns, busy_until);
      busy_until = s.end_ns;
    }
    Agg& a = by_name[name];
    ++a.n;
    a.total_us += (s.end_ns - s.start_ns) / 1e3;
  }
  std::fclose(f);
  const double wall_us = (busy_until - t0) / 1e3;
  std::vector<std::pair<std::string, Agg>> rows(by_name.begin(), by_name.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.total_us > b.second.total_us; });
  char line[512];
  const double per = static_cast<double>(std::max<int64_t>(steps, 1));
  std::snprintf(line, sizeof line,
                "timeline: %zu kernels over %lld steps; per step %.1f µs from the first kernel's start to the last's end, "
                "GPU busy %.1f µs (%.0f%%), idle between kernels %.1f µs\n",
                spans.size(), static_cast<long long>(steps), wall_us / per, busy / 1e3 / per,
                100.0 * busy / 1e3 / wall_us, gaps_us / per);
  *digest = line;
  *digest += "  µs/step   count/step  mean µs  kernel\n";
  for (const auto& [name, a] : rows) {
    std::snprintf(line, sizeof line, "  %8.1f %8.1f %9.2f  %s\n", a.total_us / per, a.n / per, a.total_us / a.n,
                  name.c_str());
    *digest += line;
  }
  return Status::Ok();
}

}  // namespace lockstep::bench
