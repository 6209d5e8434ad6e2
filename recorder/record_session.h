// recorder/record_session.h — one recorded run: an Engine driven to completion with a
// Recorder attached, writing one trace. The one loop that `record`, `replay`, `bisect` and
// `degen --record-failures` share, so every trace is written the same way.
//
// The caller builds the Engine (model + options) and the requests; RecordRun adds the
// requests, writes /meta (the caller's keys plus what the engine knows: kernels, engine
// options, KV format, capture policy, version, host, time, command line), steps the engine,
// flushes per the policy and closes the file. On failure the trace keeps what was flushed and
// the error says after how many steps it stopped.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "base/status.h"
#include "engine/engine.h"
#include "engine/tap.h"
#include "recorder/capture_policy.h"
#include "recorder/recorder.h"
#include "traces/trace_writer.h"

namespace lockstep::recorder {

struct RecordSessionOptions {
  std::filesystem::path output;
  CapturePolicy policy;
  traces::TraceWriterOptions writer;
  double flush_interval_s = 1.0;
  size_t summarize_here_max_row_bytes = RecorderOptions{}.summarize_here_max_row_bytes;
  std::function<std::string(const std::vector<int32_t>&)> detokenize;  // may be empty
  std::map<std::string, std::string> meta;  // model_dir, model_fingerprint, … (merged into /meta)
  // Taps the recorder sees go through this hook first when set (replay: grafting, verifying).
  // It must forward OnTap to the Recorder it is given via `wrap`.
  std::function<engine::TapHook*(Recorder*)> wrap;
  std::function<void(const Recorder&, const traces::TraceWriter&)> on_step;  // progress
  // TP N > 1 (emulated, or --tp-ranks) in full capture: each rank's columns of the rank-split
  // taps in its own shard, <output>.rank<r>, stitched into the trace (docs/trace-format.md
  // "Format 1.3: rank shards") — the layout of a run over N GPUs. Emulated, RecordRun writes
  // every shard; over real ranks (EngineOptions::tp_ranks) it writes shard 0 and rank r ≥ 1
  // writes shard r itself (rank_shard_writer.h: the followers' observers must be its writers).
  bool rank_shards = false;
};

struct RecordSessionResult {
  int64_t steps = 0, tokens = 0;
  double run_s = 0, close_s = 0;
  uint64_t file_bytes = 0;
  int64_t stall_ns = 0;  // the engine waited on the trace: a full queue, or lent tap buffers not yet back
  // The recorder's own time on the engine thread, in its callbacks (stalls included):
  // Recorder::engine_thread_times summed over the run.
  int64_t recorder_ns = 0;
};

struct RecordedRequest {
  engine::Request request;
  std::string prompt_text;  // empty when the prompt came as ids
};

// Adds `requests` to `engine` (ids 0, 1, … in order) and records the run.
Result<RecordSessionResult> RecordRun(engine::Engine& engine, const std::vector<RecordedRequest>& requests,
                                      const RecordSessionOptions& options);

// The writer options RecordRun gives the trace, and each of its `ranks` shards (a share of the
// compression workers); rank_shard_writer.h's writers take the same.
traces::TraceWriterOptions TraceWriterOptionsOf(const RecordSessionOptions& options);
traces::TraceWriterOptions ShardWriterOptionsOf(const RecordSessionOptions& options, int64_t ranks);
// A shard's /meta: rank `rank` of `ranks` of run `run_id`, written by rank `writer_rank` (this process).
Status SetShardMeta(traces::TraceWriter& shard, int rank, int64_t ranks, const std::string& run_id, int writer_rank);

// Meta values every trace carries, exposed for tests and `inspect`.
std::string CpuName();
std::string CommandLine();  // this process's, shell-quoted
std::string UtcNow();

}  // namespace lockstep::recorder
