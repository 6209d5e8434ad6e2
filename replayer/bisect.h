// replayer/bisect.h — the A/B an engineer would do by hand, automated.
//
//  1. Exact replay: is the run even reproducible? (If not, that is the finding.)
//  2. Batch dependence: replay with every request alone (max_batch 1). A request whose numbers
//     change read something of its neighbours' — a page-table or batching fault.
//  3. The reference configuration: every component that has a reference alternative swapped
//     to it (KV cache → fp32, each kernel → its default, a recorded fault removed). The
//     divergence of the recording from it (mean logit KL) is what there is to explain.
//  4. One replay per component with only that component swapped: how much of the divergence
//     it explains (1 − KL(swapped → reference) / KL(recorded → reference)), and where the
//     recording first parts from the swapped run (layer, position, tap).
//  5. When the recording was greedy: a free replay at temperature 0.6 — does sampling alone
//     end the degeneration?
// The verdict is one paragraph naming the component that explains most.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "base/status.h"
#include "replayer/replay_session.h"

namespace lockstep::replayer {

struct BisectOptions {
  std::filesystem::path work_dir;     // where the replays' traces go
  std::filesystem::path model_dir;    // empty: the trace's
  std::function<void(const std::string&)> progress;  // one line per replay started
  std::function<void(int64_t tokens, int64_t total)> replay_progress;  // within each replay (ReplayOptions::progress)
};

struct ComponentResult {
  std::string component;   // "kv_cache", "attn_decode", "fault", "temperature"
  std::string recorded;    // "fp8_e4m3"
  std::string swapped_to;  // "fp32"
  double kl_to_reference = 0;  // mean logit KL of the swapped run vs the reference run
  double explained = 0;        // 1 − kl_to_reference / total, clamped to [0, 1]
  bool has_divergence = false; // the recording parts from the swapped run
  diff::RowDiff first;         // where
  std::string note;
};

struct BisectResult {
  bool reproducible = false;
  std::string reproducible_detail;
  bool batch_dependent = false;
  std::string batch_detail;
  double total_kl = 0;            // recorded vs reference configuration
  std::string reference;          // the reference configuration, described
  std::vector<ComponentResult> components;  // ranked, most explanatory first
  std::string sampling_note;      // greedy recordings: what temperature 0.6 does
  std::string verdict;
};

Result<BisectResult> Bisect(const traces::TraceReader& trace, const BisectOptions& options);

}  // namespace lockstep::replayer
