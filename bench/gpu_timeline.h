// bench/gpu_timeline.h — what the GPU ran and when, kernel by kernel (CUPTI activity records:
// start and end on the GPU's clock, also for kernels replayed from a CUDA graph). For the
// benchmarks' --timeline: where a decode step's time goes between kernels, which ncu (one
// kernel at a time, serialised) cannot show.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace lockstep::bench {

struct KernelSpan {
  std::string name;   // demangled, as CUPTI reports it
  uint64_t start_ns = 0, end_ns = 0;
  uint32_t stream = 0;
  int32_t grid[3] = {0, 0, 0}, block[3] = {0, 0, 0};
};

// Collects kernel spans between Start and Stop (one collection per process at a time).
class GpuTimeline {
 public:
  static Status Start();
  // Flushes and returns the spans in start order.
  static Result<std::vector<KernelSpan>> Stop();
};

// `spans` as CSV (name, stream, start µs from the first, duration µs, gap µs since the previous
// kernel on the GPU ended, grid, block, critical µs) and a digest on `digest`: per kernel name
// its share of the critical path, busy time, count and mean, largest share first; the GPU's
// busy time (the union of spans) against the wall span. A kernel's critical share is how far it
// moved the latest end of the kernels before it (taken in the order they end; idle time before
// it included): the shares add up to the wall span, and a kernel launched ahead of its
// predecessor's end is charged from that end, not from its early start (bench/timeline_write.cc).
Status WriteTimeline(const std::vector<KernelSpan>& spans, const std::string& csv_path, int64_t steps,
                     std::string* digest);

}  // namespace lockstep::bench
