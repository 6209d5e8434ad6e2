// replayer/verify_run.h — `lockstep verify`: a recorded run checked op by op against the golden
// twins (verify/check.h), plus what only a replay can show.
//
//  1. A summary-only trace is first upgraded to full capture by an exact replay (capture full)
//     whose summary hashes must all equal the recording's; the twins then check the replay,
//     which is provably the same run.
//  2. The twins, on every row (verify::CheckTrace).
//  3. Batch invariance in bits: every request replayed alone (max_batch 1, teacher-forced) must
//     give bit-identical rows (content hashes) to its batched self; the first differing op is
//     reported in causal order.
#pragma once

#include <filesystem>
#include <functional>
#include <string>

#include "base/status.h"
#include "traces/trace_reader.h"
#include "verify/check.h"

namespace lockstep::replayer {

struct BatchCheck {
  bool run = false;          // false: one request only, or not asked
  bool invariant = true;
  int64_t rows_compared = 0, rows_differing = 0;
  int64_t rows_missing = 0;  // rows the alone-replay lacks
  verify::Location first;    // the causally first differing row (tensor, request, layer, position)
  std::string replay_trace;  // what ran
  std::string detail;
};

struct VerifyRunOptions {
  std::filesystem::path model_dir;  // empty: the trace's
  std::filesystem::path work_dir;   // replays' traces
  bool batch_check = true;
  std::function<void(const std::string&)> progress;        // one line per stage
  std::function<void(int64_t, int64_t)> row_progress;      // within a stage
};

struct VerifyRunResult {
  verify::CheckReport check;
  BatchCheck batch;
  bool upgraded = false;            // the trace was summary-only: checked through its full replay
  std::string upgrade_detail;
  std::filesystem::path checked;    // the trace the twins read
  bool clean() const { return check.clean() && batch.invariant; }
};

Result<VerifyRunResult> VerifyRun(const traces::TraceReader& trace, const VerifyRunOptions& options);

// Rows of `b` whose content hash differs from `a`'s (same tensor, request, position), the
// causally first of them in `first`; counts rows of `a` that `b` lacks.
BatchCheck CompareHashes(const traces::TraceReader& a, const traces::TraceReader& b);

}  // namespace lockstep::replayer
