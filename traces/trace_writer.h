// traces/trace_writer.h — writes a lockstep trace (layout: trace_format.h,
// docs/trace-format.md) without making its caller wait on HDF5 or compression.
//
// Threads: the caller (the engine thread) only copies rows into a bounded queue. One
// writer thread owns the file and every HDF5 call; compression workers shuffle and
// zstd-compress full chunks, which the writer stores with H5Dwrite_chunk. The caller blocks
// only when the queue holds more than `queue_bytes`; that time is counted (stall_ns()).
//
// Crash safety: Flush() makes everything appended before it durable against the process
// dying (not against power loss: no fsync). Full chunks are written once and never
// rewritten; rows of an unfinished chunk go to an uncompressed tail overwritten in place;
// no freed file space is reused before the flush that unlinks it. A file killed at any
// moment opens normally and holds every row up to the last completed flush.
//
// Errors: the first failure (an unwritable path, a full disk) is kept; every later call
// returns it and the writer stops touching the file, so what was flushed stays readable.
//
// Not thread-safe: call from one thread. The writer must outlive nothing it was given:
// every call copies its inputs.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "traces/trace_format.h"

namespace lockstep::traces {

struct TraceWriterOptions {
  int zstd_level = kDefaultZstdLevel;
  int compression_threads = 1;            // workers besides the writer thread
  int64_t queue_bytes = 256ll << 20;      // appended but not yet written bytes, at most
  int64_t target_chunk_bytes = 64 << 10;  // a chunk holds about this many bytes of rows
  int64_t batch_width = 8;                // columns of /step_batch (the engine's max batch)
  // Raw data is allocated in blocks of this size (HDF5's small-data aggregator), so that the
  // chunks written between two flushes mostly land below the end of file the last flush
  // recorded; a kill inside a flush then cannot leave pointers past it (docs/trace-format.md,
  // "Crash safety"). Also the most space a trace can waste: about what 10–100 steps write.
  int64_t alloc_block_bytes = 1 << 20;
  std::string writer;                     // root attribute `writer` ("" → "lockstep"; RecordRun names the version)
  // Called on the writer thread after each completed flush with its `flushed_steps`.
  std::function<void(int64_t)> on_flushed;
};

// A request as the trace records it (the sampler fields are its defaults; each sampled
// token's actual parameters are in its SamplingRow).
struct RequestRecord {
  int32_t id = 0;
  std::string name;
  std::vector<int32_t> prompt;
  std::string prompt_text;  // empty when the prompt came as ids
  int64_t max_new_tokens = 0;
  uint64_t seed = 0;
  double temperature = 0, top_p = 1, min_p = 0;
  int64_t top_k = 0;
};

struct TensorSpec {
  std::string path;   // "taps/layers.3.attn.out", "kv/layers.0.latent"
  DType dtype = DType::kF32;
  int64_t cols = 0;   // values per row
  bool values = true;  // store the rows' values, not only their summaries
  std::map<std::string, std::string> attrs;  // extra string attributes on the group
  std::map<std::string, int64_t> int_attrs;  // extra integer attributes on the group (int64)
  // Not empty: the values lie in these rank shards (file names beside the trace; shard r holds
  // columns [r·cols/N, (r+1)·cols/N)), which `values` stitches as a virtual dataset; this file
  // keeps only the summaries (`values` must be false). trace_format.h kAttrShards.
  std::vector<std::string> shard_files;
};

struct Command;  // a queued call, private to the writer (trace_writer_impl.h)

// The sidecar that holds unfinished chunks while a trace is being written: <trace>.tails.
std::filesystem::path TailsPath(const std::filesystem::path& trace);
// The chunk directory beside a trace while it is written: <trace>.chunks.
std::filesystem::path ChunksPath(const std::filesystem::path& trace);
// Rank r's shard of a trace: <trace>.rank<r> (trace_format.h kAttrShards).
std::filesystem::path ShardPath(const std::filesystem::path& trace, int rank);
// Where a file lives until its first flush: <file>.partial.
std::filesystem::path PartialPath(const std::filesystem::path& file);

class TraceWriter {
 public:
  // Creates (truncates) `path` and starts the writer thread. Fails with the path in the
  // message when the file cannot be created.
  static Result<std::unique_ptr<TraceWriter>> Create(const std::filesystem::path& path,
                                                     TraceWriterOptions options = {});
  ~TraceWriter();  // Close(), ignoring its status
  TraceWriter(const TraceWriter&) = delete;
  TraceWriter& operator=(const TraceWriter&) = delete;

  // A string attribute of /meta.
  Status SetMeta(const std::string& key, const std::string& value);
  Status AddRequest(const RequestRecord& request);
  Status FinishRequest(int32_t id, std::span<const int32_t> generated, const std::string& generated_text,
                       const std::string& finish_reason);

  // Declares a tensor; returns its handle for Append. Paths must be unique.
  Result<int32_t> DefineTensor(const TensorSpec& spec);
  // Appends rows: `summaries` describes each row; `values` holds rows × cols elements of
  // the tensor's dtype, row-major (ignored, and may be null, when the tensor stores no values).
  // With `values_owner` the values are lent, not copied: the writer's threads compress whole
  // chunks where the rows are (copying only what ends in an unfinished chunk) and hold a copy
  // of values_owner until they have; the bytes must not change while any holder remains.
  // Lent bytes do not count against queue_bytes: the lender bounds them by the buffers it
  // lends (the CUDA backend's tap buffers, engine/lending_pool.h).
  Status Append(int32_t tensor, std::span<const SummaryRow> summaries, const void* values,
                std::shared_ptr<const void> values_owner = nullptr);
  // Summary rows of many summary-only tensors at once: row i of `summaries` goes to
  // tensors[i]'s table, in order — the same trace as Append(tensors[i], {summaries[i]}, nullptr)
  // for each i, in one hand-over (a step's backend-computed tap summaries).
  Status AppendSummaries(std::span<const int32_t> tensors, std::span<const SummaryRow> summaries);
  // Appends rows whose summaries the writer thread computes: row i is position positions[i]
  // of `request`, made in engine step `step`; `values` holds the rows (positions.size() ×
  // cols of the dtype). They are stored only when the tensor stores values. This keeps the
  // statistics and hashing off the caller's (the engine's) thread.
  //
  // With `topk` (an f32 logits tensor): the writer thread also derives each row's LogitsTopK
  // (row_summary.h) and appends it as one row each of the three tensors named there, which
  // must store values (ids: i32 × k, values: f32 × k, logsumexp: f32 × 1) — summaries and
  // values, as AppendToSummarize would. The k-best scan and the exponentials of a 100k
  // vocabulary then cost the writer's thread, not the engine's.
  // With logsumexp_t (optional: f32 × 1, stored) the writer also derives each row's
  // LogitsLogSumExp at `temperature` (> 0: the request's sampling temperature) into it.
  struct LogitsTopKTensors {
    int32_t ids = -1, values = -1, logsumexp = -1;
    int64_t k = 0;
    int32_t logsumexp_t = -1;
    double temperature = 0;
  };
  //
  // With `values_owner` the rows are not copied: the writer thread reads them where they are
  // and holds a copy of values_owner until it has (the CUDA backend's pinned logits buffers,
  // engine/tap.h TapEvent::owner); the bytes must not change while any holder remains.
  Status AppendToSummarize(int32_t tensor, int32_t request, int32_t step, std::span<const int64_t> positions,
                           const void* values, const LogitsTopKTensors* topk = nullptr,
                           std::shared_ptr<const void> values_owner = nullptr);
  Status AppendSampling(const SamplingRow& row);
  // `batch` holds the request ids of the step (at most batch_width are kept).
  Status AppendStep(const StepRow& row, std::span<const int64_t> batch);

  // Hands the calls made so far to the writer thread. Calls are batched on the caller's side
  // (one hand-over per engine step is cheap; one per tensor is not); Flush and Close submit.
  void Submit();
  // Makes everything appended so far durable; records `flushed_steps` in the file. Returns
  // at once: the writer thread does the work in order.
  Status Flush(int64_t flushed_steps);
  // Writes the last chunks, removes the tails, marks the trace complete, closes the file.
  // Waits for the writer thread. Idempotent.
  Status Close();

  // The first error the writer met, or Ok.
  Status status() const;
  // Nanoseconds the caller spent blocked on a full queue, in total.
  int64_t stall_ns() const { return stall_ns_.load(); }
  // Bytes handed to Append* so far, and the compressed bytes written for full chunks.
  int64_t bytes_in() const { return bytes_in_.load(); }
  // Where the writer thread's time went, in total (it sets the pace when full capture outruns
  // it: HDF5 is called from that one thread). Read at any time; exact once closed.
  struct ThreadTimes {
    int64_t append_ns = 0;       // commands made into table rows and chunks …
    int64_t derive_wait_ns = 0;  // … of which waiting for the workers' summaries and top-k rows
    int64_t write_ns = 0;        // finished chunks stored (extents, H5Dwrite_chunk, the chunk directory)
    int64_t flush_ns = 0;        // flushes and the close (the chunks they store also in write_ns)
    int64_t chunks = 0;          // full chunks stored
  };
  ThreadTimes thread_times() const;

  class Impl;

 private:
  TraceWriter() = default;
  Status Enqueue(Command cmd);
  Status AppendRows(int32_t table, const void* data, size_t bytes);
  Command& AppendCommand(size_t bytes);  // the pending append command for `bytes` more
  std::unique_ptr<Impl> impl_;
  std::vector<TensorSpec> tensors_;
  std::atomic<int64_t> stall_ns_{0};
  std::atomic<int64_t> bytes_in_{0};
  int64_t batch_width_ = 1;
  // Writer-thread table ids: 0 sampling, 1 steps, 2 step_batch, then per tensor its summary
  // and (when stored) its values, in the order of DefineTensor.
  std::vector<int32_t> summary_table_;
  int32_t next_table_ = 3;
  int64_t append_reserve_ = 0;  // bytes of the largest step so far (to reserve the next)
  size_t entries_reserve_ = 0;  // … and its entries (a step's ~300 taps: no regrowth per step)
  // After rows went into `c` (AppendCommand's): the reserves grow to what it holds.
  void NoteAppended(const Command& c);
  bool closed_ = false;
};

}  // namespace lockstep::traces
