// replayer/replay_session.h — rerun a recorded trace, exactly or with one thing changed, and
// say where the numbers part.
//
// A replay runs the very same engine, configured from the trace's /meta (engine options,
// kernel variants, KV-cache format, the requests and their sampling) plus the overrides, and
// records itself into a new trace with the same capture policy (recorder/record_session.h).
// diff::CompareTraces then compares the two — the one oracle — so that
//   exact   proves bit-exactness ("deterministic") or names the first differing tensor;
//   forced  feeds the recorded tokens (teacher forcing), so positions line up under the
//           overrides and every layer can be compared;
//   free    samples anew from the recorded seeds (the Philox stream is a function of the
//           seed and the step), and reports where the generated text first differs;
// and `graft` makes every layer start from the recorded input (embed / the previous layer's
// resid_out), so each layer's own error is measured apart from what it inherits.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "base/status.h"
#include "diff/trace_diff.h"
#include "engine/engine.h"
#include "kernels/registry.h"
#include "recorder/record_session.h"
#include "traces/trace_reader.h"

namespace lockstep::replayer {

enum class ReplayMode { kExact, kForced, kFree };
std::string_view ReplayModeName(ReplayMode m);
Result<ReplayMode> ParseReplayMode(std::string_view s);

// What a replay changes. Unset = as recorded.
struct Overrides {
  std::optional<engine::KvFormat> kv_cache;
  std::optional<std::string> backend;   // "cpu" | "cuda"; recorded kernel choices the other backend lacks take its defaults
  kernels::KernelChoice kernels;        // op → variant, merged over the recorded choice
  std::optional<std::string> fault;     // "" removes a recorded fault
  std::optional<double> temperature, top_p, min_p;
  std::optional<int64_t> top_k;
  std::optional<int64_t> max_batch;
  std::optional<int64_t> emulate_tp;    // the emulated tensor-parallel degree (1 = none)
  std::optional<uint64_t> seed;         // request i samples with seed + i (free runs over seeds)

  bool empty() const;
  std::string Describe() const;  // "kv_cache=bf16 attn_decode=expanded", or "none"
};

struct ReplayOptions {
  ReplayMode mode = ReplayMode::kExact;
  Overrides overrides;
  bool graft = false;
  std::filesystem::path model_dir;   // empty: the trace's meta.model_dir
  bool allow_model_mismatch = false; // run even when the model's fingerprint differs
  std::filesystem::path output;      // the replay's own trace
  diff::Thresholds thresholds;       // for the comparison (exact mode forces exact)
  // Capture mode of the replay's own trace; unset = the recording's. An exact replay with
  // kFull upgrades a summary trace to full capture, proven by its summary hashes.
  std::optional<recorder::CapturePolicy::Mode> capture;
  std::function<void(int64_t tokens, int64_t total)> progress;
};

struct ReplayResult {
  recorder::RecordSessionResult run;
  diff::TraceDiffReport diff;
  bool deterministic = false;   // exact mode: every captured hash and token matched
  engine::EngineOptions engine_options;  // as replayed
  std::string verdict;          // one readable paragraph
};

Result<ReplayResult> Replay(const traces::TraceReader& trace, const ReplayOptions& options);

// The engine options a trace was recorded with (meta.engine_options).
Result<engine::EngineOptions> RecordedEngineOptions(const traces::TraceReader& trace);

}  // namespace lockstep::replayer
