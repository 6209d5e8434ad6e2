// tests/fuzz/fuzz_trace_reader.cc — TraceReader on arbitrary bytes: Open must return an error
// or a reader whose every table can be read (or refused) without a crash, a hang or an
// unbounded allocation. HDF5 opens files by name, so the input goes to a per-process file.
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "traces/trace_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/tmp/lockstep_fuzz_trace_" + std::to_string(getpid()) + ".h5";
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  auto r = lockstep::traces::TraceReader::Open(path);
  if (r.ok()) {
    const auto& reader = **r;
    // The reads run for the sanitizers (a crash, an overflow, a leak is the finding): a
    // failed read of a mangled file is a correct answer, so their results are dropped.
    (void)reader.ReadSampling();
    (void)reader.ReadSteps();
    int64_t width = 0;
    (void)reader.ReadStepBatch(&width);
    for (const auto& t : reader.tensors()) {
      (void)reader.ReadSummary(t);
      if (t.has_values) (void)reader.ReadValues(t, 0, std::min<int64_t>(t.rows, 64));
    }
  } else if (r.status().message().find('\n') != std::string::npos) {
    __builtin_trap();  // errors are one line
  }
  std::remove(path.c_str());
  return 0;
}
