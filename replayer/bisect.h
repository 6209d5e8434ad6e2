// replayer/bisect.h — a verdict that is a list of experiments.
//
//  1. Exact replay: is the run reproducible? (If not, that is a finding.)
//  2. Verify (replayer/verify_run.h): every op against its golden twin on the recorded inputs,
//     and every request alone against its batched self, in bits. The verified defects come
//     first in the verdict: op, variant, request, layer, position, measured error vs budget,
//     and on how many rows (prefill and decode counted apart).
//  3. Configuration questions, each an experiment: every op with alternatives swapped to each
//     other variant (both ways: from a default to the alternatives, from an alternative back),
//     the KV format likewise; a teacher-forced replay each, measured by the mean and largest
//     logit KL against the recording. A swap never becomes a defect: only a twin does.
//  4. Degeneration (when a recorded request degenerates): free runs — greedy, under the
//     recorded configuration when verify found it clean, and ≥ 8 seeds at the recommended
//     temperature — reported as rates with 95% Wilson intervals.
// Every sentence of the verdict carries its evidence (what ran, what was measured, what the
// other outcome would have looked like); with nothing found the verdict says "no defect found"
// and what was verified and what was not.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "base/status.h"
#include "replayer/replay_session.h"
#include "replayer/verify_run.h"

namespace lockstep::replayer {

struct BisectOptions {
  std::filesystem::path work_dir;     // where the replays' traces go
  std::filesystem::path model_dir;    // empty: the trace's
  int seeds = 8;                      // free runs per sampled configuration
  double temperature = -1;            // of the seeded free runs; < 0: generation_config.json's, else 0.6
  bool configuration = true;          // step 3
  std::function<void(const std::string&)> progress;  // one line per experiment
  std::function<void(int64_t tokens, int64_t total)> replay_progress;
};

// What one sentence of the verdict rests on.
struct Evidence {
  std::string run;        // what was run (command-like, with the trace it wrote)
  std::string measured;   // what it measured
  std::string otherwise;  // what the other outcome would have looked like
};

struct Sentence {
  std::string text;
  Evidence evidence;
};

struct Defect {
  std::string op;       // verify's op ("attention", "router", …), or "batch_invariance"
  std::string kernels;  // the registry ops involved, as run: "attn_decode=absorbed softmax=reference …"
  verify::Location first;
  int64_t failing_rows = 0, rows = 0, failing_prefill_rows = 0, prefill_rows = 0;
  bool bias = false;    // found by the systematic-bias test, not by a row over budget
  double bias_t = 0;
};

struct SwapExperiment {
  std::string op;          // registry op, or "kv_cache"
  std::string from, to;
  std::string trace;       // the replay's trace
  double mean_logit_kl = -1, max_logit_kl = -1;  // vs the recording; −1: not measured
  bool diverges = false;
  diff::RowDiff first;
};

struct FreeRuns {
  std::string config;      // "greedy, recorded configuration" | "temperature 0.6, seeds 1000..1007"
  int64_t runs = 0, degenerate = 0;
  double rate = 0, lo = 0, hi = 0;  // 95% Wilson interval
  std::vector<std::string> traces;
};

struct BisectResult {
  bool reproducible = false;
  std::string reproducible_detail;
  VerifyRunResult verify;
  std::vector<Defect> defects;            // causal order, first = the first defect
  std::vector<SwapExperiment> swaps;
  int64_t recorded_degenerate = 0, requests = 0;
  std::vector<FreeRuns> free_runs;
  std::vector<Sentence> sentences;        // the verdict, sentence by sentence
  std::string verdict;                    // the sentences joined
};

Result<BisectResult> Bisect(const traces::TraceReader& trace, const BisectOptions& options);

// 95% Wilson score interval of k successes in n.
void WilsonInterval(int64_t k, int64_t n, double* lo, double* hi);

}  // namespace lockstep::replayer
