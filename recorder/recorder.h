// recorder/recorder.h — turns what the engine does into a trace.
//
// A Recorder is the engine's tap hook, forward callback and step callback at once (Attach
// installs all three). On the engine thread it applies the capture policy and hands rows to
// the TraceWriter, which queues them; HDF5 and compression happen on the writer's threads.
// In summary capture each kept row's summary (statistics + XXH3-64 content hash) is computed
// where the row is — by a backend that can summarise on its device (the CUDA backend: taps and
// the KV cache rows it stores, TapHook::WantsKvTaps), else on the engine thread — and only
// those 48-byte records travel; in full capture the rows are copied (or lent) and the writer
// thread summarises what the backend did not. Tensor names:
// taps keep the engine's tap name (taps/<name>); the KV cache is kv/layers.L.<stream>, with
// the fp8 latent split into its parts (docs/trace-format.md, "KV cache").
//
// Drive it like this: Attach, AddRequest for each request added to the engine, then after
// every Engine::Step() call EndStep; Finish at the end. Errors (the writer's included) are
// kept and returned by EndStep/Finish: the caller stops the run on the first one.
//
// Not thread-safe: the engine thread only. `engine` and `writer` must outlive the Recorder.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/status.h"
#include "engine/engine.h"
#include "recorder/capture_policy.h"
#include "traces/trace_writer.h"

namespace lockstep::recorder {

struct RecorderOptions {
  CapturePolicy policy;
  // TraceWriterOptions::alloc_block_bytes suited to a policy: about a hundred steps of rows.
  static int64_t AllocBlockBytes(const CapturePolicy& p) {
    return p.mode == CapturePolicy::Mode::kFull ? 1 << 20 : p.mode == CapturePolicy::Mode::kSummary ? 128 << 10 : 16 << 10;
  }
  // The trace writer's zstd level and workers suited to a policy (`record`'s defaults). Full
  // capture moves megabytes a step (V2-Lite: 2.3 MB a token) that compress about 1.1 : 1
  // whatever the level, so it takes level 1 and up to 8 workers (half the cores): at batch 8
  // on the H200's host, 8 workers at level 3 kept 75 % of decode's pace, at level 1 82 %, for
  // files 0.7 % larger; 4 workers at level 3, 67 % (2026-11-30). Summaries are small: level 3,
  // one worker.
  static int ZstdLevel(const CapturePolicy& p) { return p.mode == CapturePolicy::Mode::kFull ? 1 : 3; }
  // TraceWriterOptions::target_chunk_bytes: full capture's in 128 KB chunks — half the HDF5
  // calls the writer thread makes for 64 KB ones (the thread that sets full capture's pace at
  // batch 8: docs/performance.md), while a step of 8 requests still lends half a chunk of a
  // hidden-size tap (8 KB rows), which the writer then compresses without a copy.
  static int64_t TargetChunkBytes(const CapturePolicy& p) {
    return p.mode == CapturePolicy::Mode::kFull ? 128 << 10 : traces::TraceWriterOptions{}.target_chunk_bytes;
  }
  static int CompressionThreads(const CapturePolicy& p, unsigned cores) {
    return p.mode == CapturePolicy::Mode::kFull ? static_cast<int>(std::clamp(cores / 2, 1u, 8u)) : 1;
  }
  // Make the trace durable every this many seconds of recording; 0 = after every step.
  double flush_interval_s = 1.0;
  // Token ids → text, for the generated text of finished requests; may be empty.
  std::function<std::string(const std::vector<int32_t>&)> detokenize;
  // Summary-only rows up to this many bytes are summarised on the engine's thread; wider ones
  // (a 100k-vocabulary logits row is 400 KB) are copied and summarised on the writer's thread,
  // which costs the engine a fraction. Same summaries either way.
  size_t summarize_here_max_row_bytes = size_t{64} << 10;
  // Rank shards (TP N, full capture; docs/trace-format.md "Format 1.3: rank shards"): one writer
  // per rank and its file's name beside the trace. Each rank-split tap (engine::IsRankSplitTap) keeps
  // its summaries in the trace and column block r of its values in shard r. Empty: none. A null
  // writer is a shard its own rank writes (--tp-ranks: recorder/rank_shard_writer.h).
  std::vector<traces::TraceWriter*> shard_writers;
  std::vector<std::string> shard_files;
};


// A backend-computed tap row summary (engine/tap.h) as the trace's SummaryRow (same fields, same
// bits); position, request and step are the caller's.
traces::SummaryRow ToSummaryRow(const engine::TapRowSummary& s);
// The trace's element type for a tap's (or a KV part's) dtype.
traces::DType ToTraceDType(engine::TapDType t);
// Whether tap `name` (cols values a row) keeps its values in `ranks` rank shards under `policy`:
// a wanted rank-split tap (engine::IsRankSplitTap) in full capture whose columns split evenly.
// The recorder and each rank's own shard writer (rank_shard_writer.h) decide by this alike.
bool ShardsTap(const CapturePolicy& policy, int64_t ranks, std::string_view name, int64_t cols);
// Appends rank `rank`'s column block (`part` bytes at rank·part) of the rows row(k) at positions[k]
// of `request`, made in `step`, to tensor `handle` of a shard's writer: what every shard's rows are,
// whichever process writes them. `scratch` holds the gathered blocks.
Status AppendRankColumns(traces::TraceWriter& shard, int32_t handle, int64_t request, int64_t step,
                         std::span<const int64_t> positions, const std::function<const uint8_t*(int64_t)>& row,
                         size_t part, int64_t rank, std::vector<uint8_t>* scratch);

class Recorder : public engine::TapHook {
 public:
  Recorder(engine::Engine* engine, traces::TraceWriter* writer, RecorderOptions options);
  ~Recorder() override;

  // Installs the tap hook and the forward and step callbacks on the engine.
  void Attach();
  // Records a request the engine has accepted (`id` from Engine::AddRequest).
  Status AddRequest(int64_t id, const std::string& prompt_text);
  // After each Engine::Step(): the step's row, and a flush when one is due.
  Status EndStep();
  // Final flush; the caller then closes the writer.
  Status Finish();

  int64_t steps() const { return steps_; }
  int64_t tokens() const { return tokens_; }
  // The time this recorder has spent on the engine's thread, in its callbacks (stalls on a
  // full writer queue included): what recording adds to a step beyond the backend's own
  // work for the hook. Split by callback: taps (OnTap, OnTapSummaries, OnStepTaps — logits
  // and the backend's kv/ taps included),
  // the KV cache rows (OnForward), the sampler rows and the step's end (OnStep, EndStep).
  struct EngineThreadTimes {
    int64_t taps_ns = 0, kv_ns = 0, steps_ns = 0;
  };
  const EngineThreadTimes& engine_thread_times() const { return times_; }
  const Status& status() const { return status_; }

  // The engine callbacks Attach installs; public so that a caller can chain its own.
  void OnTap(const engine::TapEvent& event) override;
  // The same as OnTap for each event, with the summary rows appended in one hand-over.
  void OnTapSummaries(std::span<const engine::TapEvent> events) override;
  // The same as TapHook's split into one event a segment, taking each tensor's rows of every
  // segment together: summary rows in one hand-over, a stored tensor's values (lent or
  // copied) in one append.
  void OnStepTaps(std::span<const engine::TapEvent> events, std::span<const engine::TapSegment> segments) override;
  // Summary capture stores no tap values: a backend may summarise where the tensors live.
  // The KV cache rows may come as kv/ events too (summaries, or values with summaries): then
  // OnForward leaves the cache alone in that step.
  bool WantsTapValues() const override;
  bool WantsKvTaps() const override;
  void OnForward(std::span<const engine::Segment> segments, const engine::PagedKvCache& cache);
  void OnStep(const engine::StepEvent& ev);

 private:
  struct Tensor {
    int32_t handle = -1;
    traces::DType dtype = traces::DType::kF32;
    int64_t cols = 0;
    bool values = false;
    std::vector<int32_t> shard_handles;  // a rank-sharded tap's tensor in each shard
  };
  // A rank-sharded tap: summaries here, column block r of the values in shard r.
  const Tensor* DefineSharded(const std::string& path, traces::DType dtype, int64_t cols);
  // Rows of a rank-sharded tensor to its shards: row k (at positions[k]) from row(k).
  void AppendShards(const Tensor& t, int64_t request, std::span<const int64_t> positions,
                    const std::function<const uint8_t*(int64_t)>& row);
  // The same for `rows` contiguous rows from `position` (the positions the policy keeps).
  void ShardRowsOf(const Tensor& t, int64_t request, int64_t position, int64_t rows, const uint8_t* data);
  std::vector<uint8_t> shard_gather_;
  std::vector<int64_t> shard_positions_;
  // The tensor for `path`, defined on first use; null when it cannot be (status_ is set).
  const Tensor* Define(const std::string& path, traces::DType dtype, int64_t cols, bool values,
                       std::map<std::string, std::string> attrs = {}, std::map<std::string, int64_t> int_attrs = {});
  // Summarises the rows of `data` (rows × cols of dtype) at positions position + i that the
  // position filter keeps, and appends them. With `topk` (logits), the writer also derives
  // each row's top-k and logsumexp into those tensors.
  // With `owner` (TapEvent::owner), rows the writer thread summarises are not copied: it
  // reads them in place and holds the owner until it has.
  void Capture(const Tensor& t, int64_t request, int64_t position, int64_t rows, const void* data,
               int64_t row_stride_bytes, const traces::TraceWriter::LogitsTopKTensors* topk = nullptr,
               const std::shared_ptr<const void>& owner = nullptr);
  // The same for rows anywhere: row(i) is row i; `contiguous`, when not null, holds all
  // `rows` rows back to back (then nothing is gathered when every row is kept).
  void CaptureRows(const Tensor& t, int64_t request, int64_t position, int64_t rows,
                   const std::function<const uint8_t*(int64_t)>& row, const uint8_t* contiguous = nullptr,
                   const traces::TraceWriter::LogitsTopKTensors* topk = nullptr,
                   const std::shared_ptr<const void>& owner = nullptr);
  void CaptureLogits(const engine::TapEvent& e);
  // Rows the backend summarised itself (TapEvent::summaries), filtered by position like
  // Capture; with their values when the tensor stores them (lent with `owner` when every row
  // is kept, else the kept rows copied).
  void CaptureSummaries(const Tensor& t, int64_t request, int64_t position, int64_t rows,
                        const engine::TapRowSummary* rows_summaries, const void* values = nullptr,
                        const std::shared_ptr<const void>& owner = nullptr);
  void DefineKvTensors(const engine::PagedKvCache& cache);
  void Fail(const Status& s) {
    if (status_.ok()) status_ = s;
  }

  engine::Engine* engine_;
  traces::TraceWriter* writer_;
  RecorderOptions opts_;
  std::map<std::string, Tensor, std::less<>> tensors_;
  struct TapEntry {
    std::string name;
    bool wanted = false;
    const Tensor* tensor = nullptr;  // null for logits (CaptureLogits defines its tensors)
    bool kv = false;                 // a KV part's rows (TapHook::WantsKvTaps)
  };
  std::unordered_map<const void*, TapEntry> by_address_;  // tap name's address → decision
  // The entry of a tap event by its name; null when its tensor cannot be defined (status_ set).
  const TapEntry* Resolve(const engine::TapEvent& e);
  // A backend-made row summary as the trace's row of `request` at `position` in this step.
  traces::SummaryRow RowOf(const engine::TapRowSummary& s, int64_t request, int64_t position) const;
  // OnTapSummaries / OnStepTaps: event i's entry (null when it cannot be defined); a tensor's
  // summary rows into the batch, by the position filter; the batch to the writer.
  const TapEntry* EntryOfBatch(size_t i, const engine::TapEvent& e);
  void BatchSummaryRows(const TapEntry& entry, const engine::TapRowSummary* in, int64_t request, int64_t position,
                        int64_t rows);
  void FlushBatch();
  // OnTapSummaries / OnStepTaps: event i's entry at the last call; the rows and their tensors' handles.
  struct BatchEntry {
    const TapEntry* entry = nullptr;
    const char* name = nullptr;  // the event name's address it was resolved for
  };
  std::vector<BatchEntry> batch_entries_;
  std::vector<int32_t> batch_tensors_;
  std::vector<traces::SummaryRow> batch_rows_;
  Status status_;
  int64_t steps_ = 0, tokens_ = 0;
  int64_t step_tokens_ = 0;
  std::vector<int64_t> step_batch_;
  std::chrono::steady_clock::time_point step_start_, last_flush_;
  int64_t stall_at_step_start_ = 0;
  int64_t Stalled() const;
  // Scratch buffers reused across calls (no allocation per tap in the steady state).
  std::vector<int64_t> positions_;
  std::vector<uint8_t> gather_;
  std::vector<traces::SummaryRow> summaries_;
  struct KvPart {
    int64_t layer;
    size_t stream;
    engine::KvPart part;  // where it lies in a token's bytes (PagedKvCache::PartBytes)
    const Tensor* tensor;
  };
  std::vector<KvPart> kv_parts_;
  // Whether this step's KV rows came from the backend as kv/ taps already.
  bool kv_came_ = false;
  EngineThreadTimes times_;
  int timing_depth_ = 0;  // the batch hand-overs call OnTap: only the outer call is timed
  // Adds the time from construction to destruction to *into, when not nested in another.
  class Timed {
   public:
    Timed(Recorder* r, int64_t* into) : r_(r), into_(r->timing_depth_++ == 0 ? into : nullptr) {
      if (into_) t0_ = std::chrono::steady_clock::now();
    }
    ~Timed() {
      --r_->timing_depth_;
      if (into_) *into_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_).count();
    }
    Timed(const Timed&) = delete;
    Timed& operator=(const Timed&) = delete;

   private:
    Recorder* r_;
    int64_t* into_;
    std::chrono::steady_clock::time_point t0_;
  };
};

}  // namespace lockstep::recorder
