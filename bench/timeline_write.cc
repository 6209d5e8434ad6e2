// bench/timeline_write.cc — the timeline's CSV and digest (bench/gpu_timeline.h), apart from
// CUPTI: plain host code, tested on its own (tests/timeline_write_test.cc).
#include <cxxabi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "bench/gpu_timeline.h"

namespace lockstep::bench {
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
  std::fprintf(f, "kernel,stream,start_us,duration_us,gap_us,grid,block,critical_us\n");
  const uint64_t t0 = spans.front().start_ns;
  uint64_t busy_until = t0, busy = 0;
  struct Agg {
    int64_t n = 0;
    double total_us = 0, critical_us = 0;
  };
  // Each kernel's share of the critical path: taken in the order they end, how far it moved
  // the latest end so far (idle time before it included; 0 when another kernel already ended
  // later). The shares add up to the wall span; for a chain of kernels each launched ahead
  // (programmatic dependent launch) a kernel's share is the time from its predecessor's end
  // to its own — what it costs the step, where its span says when it was scheduled.
  std::vector<double> critical(spans.size(), 0.0);
  {
    std::vector<size_t> by_end(spans.size());
    for (size_t i = 0; i < spans.size(); ++i) by_end[i] = i;
    std::stable_sort(by_end.begin(), by_end.end(),
                     [&](size_t a, size_t b) { return spans[a].end_ns < spans[b].end_ns; });
    uint64_t frontier = spans.front().start_ns;
    for (size_t i : by_end) {
      if (spans[i].end_ns > frontier) {
        critical[i] = (spans[i].end_ns - frontier) / 1e3;
        frontier = spans[i].end_ns;
      }
    }
  }
  std::map<std::string, Agg> by_name;
  double gaps_us = 0;
  for (size_t k = 0; k < spans.size(); ++k) {
    const KernelSpan& s = spans[k];
    const double gap = s.start_ns > busy_until ? (s.start_ns - busy_until) / 1e3 : 0.0;
    gaps_us += gap;
    const std::string name = ShortName(s.name);
    std::fprintf(f, "\"%s\",%u,%.3f,%.3f,%.3f,%dx%dx%d,%dx%dx%d,%.3f\n", name.c_str(), s.stream,
                 (s.start_ns - t0) / 1e3, (s.end_ns - s.start_ns) / 1e3, gap, s.grid[0], s.grid[1], s.grid[2],
                 s.block[0], s.block[1], s.block[2], critical[k]);
    // Busy time: the union of spans (the side stream's overlap counted once).
    if (s.end_ns > busy_until) {
      busy += s.end_ns - std::max(s.start_ns, busy_until);
      busy_until = s.end_ns;
    }
    Agg& a = by_name[name];
    ++a.n;
    a.total_us += (s.end_ns - s.start_ns) / 1e3;
    a.critical_us += critical[k];
  }
  std::fclose(f);
  const double wall_us = (busy_until - t0) / 1e3;
  std::vector<std::pair<std::string, Agg>> rows(by_name.begin(), by_name.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.critical_us > b.second.critical_us; });
  char line[512];
  const double per = static_cast<double>(std::max<int64_t>(steps, 1));
  std::snprintf(line, sizeof line,
                "timeline: %zu kernels over %lld steps; per step %.1f µs from the first kernel's start to the last's end, "
                "GPU busy %.1f µs (%.0f%%), idle between kernels %.1f µs\n",
                spans.size(), static_cast<long long>(steps), wall_us / per, busy / 1e3 / per,
                100.0 * busy / 1e3 / wall_us, gaps_us / per);
  *digest = line;
  *digest += "  critical µs/step  busy µs/step  count/step  mean µs  kernel\n";
  for (const auto& [name, a] : rows) {
    std::snprintf(line, sizeof line, "  %16.1f %13.1f %11.1f %8.2f  %s\n", a.critical_us / per, a.total_us / per,
                  a.n / per, a.total_us / a.n, name.c_str());
    *digest += line;
  }
  return Status::Ok();
}

}  // namespace lockstep::bench
