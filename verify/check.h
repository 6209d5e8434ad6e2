// verify/check.h — every op of a recorded run against its golden twin, on the run's own
// recorded inputs (`lockstep verify`, bisect's first step).
//
// For each op and each row the trace holds, the twin (verify/golden.h) recomputes the op's
// output from the recorded inputs of that op — attention from the request's OWN recorded
// latent / k_rope taps at earlier positions (encoded as the recorded KV format stores them, by
// an independent encoder), not from the cache; the experts on the recorded router choice; the
// sampler from the recorded logits, parameters and Philox counter — and compares it with the
// recorded output, element by element, against the budget the op's declared precision allows.
// An error above budget is a defect at that exact (request, layer, position). Per op a
// systematic-bias test runs over all rows too: rounding errors have no preferred sign, a
// "looks like rounding" bug (truncation, a biased low-precision path) does.
//
// The twin table is `kOps` in check.cc: a new block kind adds its twins there. Needs a full
// capture (values); replayer/verify_run.h upgrades a summary trace first.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "base/status.h"
#include "traces/trace_reader.h"

namespace lockstep::verify {

// Where a row sits, and what was measured there.
struct Location {
  int32_t request = -1;
  int64_t layer = -1;       // −1 for model-level ops (embed, final norm, LM head, sampler)
  int64_t position = -1;
  int64_t step = -1;        // the engine step that produced the row
  std::string tensor;       // the tap (or kv/ tensor) checked
  int64_t column = -1;      // the worst element of the row
  double measured = 0;      // |recorded − twin| at it
  double budget = 0;        // what the op's precision allows there
  std::string detail;       // for set-valued ops (top-k, routing, sampler): what differs
  bool prefill = false;     // a prompt row (position < prompt length)
};

struct OpReport {
  std::string op;           // "attn_norm", "attention", "router", …
  std::string kernel_op;    // the registry op whose variant ran it ("norm", "attn_decode"), or "" when none
  std::string variant;      // that variant, as the trace names it
  std::string what;         // one line: the twin and its inputs
  int64_t rows = 0;         // rows checked
  int64_t values = 0;       // elements checked
  double max_ratio = 0;     // max over elements of |error| / budget (> 1: defect)
  double max_error = 0, budget_at_max = 0;
  int64_t failing_rows = 0;
  int64_t prefill_rows = 0, failing_prefill_rows = 0;  // of rows / failing_rows: prompt rows
  bool failed = false;      // some row over budget
  Location first;           // the causally first failing row (when failed)
  Location worst;           // where max_ratio is
  // Systematic bias: over rows r, a_r = Σ_i err_i·sign(twin_i) / Σ_i budget_i (and the same
  // without the sign); t = Σ a_r / √(Σ a_r²) is ~N(0, 1) for unbiased rounding.
  double bias_t = 0, bias_mean = 0;
  bool bias_failed = false;
  int64_t not_checked = 0;  // rows the trace holds but this op could not check
  std::string not_checked_why;
};

struct CheckReport {
  std::filesystem::path trace;
  std::string kv_format;
  std::vector<OpReport> ops;          // in causal order of the block
  std::vector<std::string> not_verified;  // whole ops or inputs the trace lacked
  int64_t rows = 0, values = 0;
  bool clean() const;
  // The causally first defect (lowest step, then layer, then op order), or null.
  const OpReport* first_defect() const;
};

struct CheckOptions {
  std::filesystem::path model_dir;  // empty: the trace's meta.model_dir
  std::function<void(int64_t done, int64_t total)> progress;  // rows checked of all
};

Result<CheckReport> CheckTrace(const traces::TraceReader& trace, const CheckOptions& options);

// Bias test thresholds: |t| above kBiasT over at least kBiasMinRows rows, with a mean
// relative bias of at least kBiasMinMean of the budget.
inline constexpr double kBiasT = 8.0;
inline constexpr int64_t kBiasMinRows = 32;
inline constexpr double kBiasMinMean = 0.02;

}  // namespace lockstep::verify
