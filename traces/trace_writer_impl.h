// traces/trace_writer_impl.h — TraceWriter's insides, shared by its three files:
// trace_writer.cc (the caller's side, opening the file, handing commands over),
// trace_writer_thread.cc (the writer thread and its compression workers: commands, derived rows,
// appends) and trace_writer_storage.cc (what reaches the files: chunks, the chunk directory,
// tails, flushes, the close). Private to traces/.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "traces/h5.h"
#include "traces/row_summary.h"
#include "traces/trace_types.h"
#include "traces/trace_writer.h"

namespace lockstep::traces {

// One unit of work for the writer thread, in call order.
struct Command {
  enum class Kind { kMeta, kAddRequest, kFinishRequest, kDefineTensor, kAppend, kFlush, kClose };
  explicit Command(Kind k = Kind::kMeta) : kind(k) {}
  Kind kind;
  // kAppend: rows for several tables, concatenated in `bytes`; entries say whose rows, in
  // order (one command, so one allocation, for a whole step's rows).
  struct Entry {
    int32_t table;     // destination (for kSummarize: the summary table; values go to table + 1)
    size_t bytes;      // of this entry in `bytes`
    bool summarize = false;  // rows to summarize here (see TraceWriter::AppendToSummarize)
    bool store_values = false;
    DType dtype = DType::kF32;
    int64_t cols = 0;
    // LogitsTopK of each row (summarize entries of logits): the three tensors' summary
    // tables (values at + 1), or −1.
    int32_t topk_tables[3] = {-1, -1, -1};
    int64_t topk = 0;
    // And each row's LogitsLogSumExp at `temperature` (LogitsTopKTensors::logsumexp_t): its
    // summary table (values at + 1), or −1.
    int32_t lse_t_table = -1;
    double temperature = 0;
    // Summarize entries whose values stay where the caller has them (AppendToSummarize's
    // values_owner): `bytes` then holds the head and positions only.
    const uint8_t* ext_values = nullptr;
    size_t ext_bytes = 0;
    std::shared_ptr<const void> ext_owner = nullptr;
    // AppendSummaries' rows, each bound for its own table: `bytes` holds scatter_rows int32
    // table indices, then as many SummaryRows (table is unused).
    size_t scatter_rows = 0;
  };
  std::vector<Entry> entries;
  std::vector<uint8_t> bytes;
  std::string key, value;      // kMeta; kFinishRequest: value = text, key = finish reason
  RequestRecord request;       // kAddRequest; kFinishRequest uses id and prompt (= generated)
  TensorSpec tensor;           // kDefineTensor
  int64_t steps = 0;           // kFlush
};


// A summarize entry's rows: after its head and positions in the command, or the caller's.
const uint8_t* EntryValues(const Command::Entry& e, const uint8_t* data);

using Clock = std::chrono::steady_clock;
// Appended rows go to the writer at least every this many bytes (else at Submit), so that the
// queue bound stays meaningful.
constexpr int64_t kSubmitBytes = 4 << 20;

// Rows a caller lent (TraceWriter::Append's values_owner), where they lie.
struct LentRows {
  const uint8_t* data = nullptr;
  size_t bytes = 0;
  std::shared_ptr<const void> owner;
};

// An append-only table: one chunked dataset plus the state of its unfinished chunk.
struct Table {
  std::string path;
  h5::Hid type;          // file (= memory) type of one element
  size_t element_size = 0;
  int64_t cols = 0;      // 0: a 1-D table of compound rows; else [rows, cols]
  size_t row_bytes = 0;
  int64_t chunk_rows = 0;
  h5::Hid dset;
  std::vector<uint8_t> tail;     // rows after the last full chunk
  // … or those rows still where their lender has them (then `tail` is empty): an append of
  // half a chunk or more waits there for the rest of its chunk (DoAppend), copied into `tail`
  // only by a flush, the close, or an append that is not lent (MaterializeLent).
  std::vector<LentRows> lent;
  size_t lent_bytes = 0;
  int64_t chunks_queued = 0;     // full chunks handed to compression
  int64_t chunks_written = 0;    // full chunks stored (main extent = chunks_written·chunk_rows)
  int64_t extent = 0;            // rows of the dataset's extent (ahead of chunks_written only
                                 // inside a WriteReadyChunks batch, which then writes them)
  // The tail dataset (/tails/<index>) and what the file says about it as of the last flush.
  h5::Hid tail_dset;
  int64_t tail_base = -1, tail_count = 0;
  bool tail_dirty = false;       // tail changed since the last flush
  int64_t index = 0;
  uint64_t path_hash = 0;        // ChunkRecord::table

  int64_t tail_rows() const { return static_cast<int64_t>(tail.size() / row_bytes); }
  int64_t main_rows() const { return chunks_written * chunk_rows; }
};

// A full chunk on its way through a worker.
struct ChunkJob {
  Table* table = nullptr;
  int64_t index = 0;  // chunk index along rows
  std::vector<uint8_t> raw, packed;
  // A chunk read where the caller lent its rows (Append's values_owner) instead of from
  // `raw`: the pieces in order, their owners held until the chunk is written.
  std::vector<LentRows> lent;
  Status status;
  bool done = false;
  std::function<void()> task;  // set: a share of the writer's work to run instead (no chunk)
};


class TraceWriter::Impl {
 public:
  Impl(TraceWriterOptions o) : opts_(std::move(o)) {}
  ~Impl() { CloseChunks(); }

  Status Open(const std::filesystem::path& path);
  void Start();
  void Push(Command cmd, int64_t* stall_ns);
  void Submit(int64_t* stall_ns);
  // The caller's side: commands not yet handed over (touched by the caller thread only).
  std::vector<Command> pending;
  int64_t pending_bytes = 0;
  // A pending command reads rows in the caller's buffers (AppendToSummarize's values_owner):
  // the writer is woken at once, so that the caller gets its buffers back within a step.
  bool pending_borrows = false;
  std::atomic<bool> failed{false};  // error_ is set (read without the lock)
  // TraceWriter::ThreadTimes, kept by the writer thread.
  std::atomic<int64_t> t_append{0}, t_derive_wait{0}, t_write{0}, t_flush{0}, t_chunks{0};
  static int64_t Now() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
  }
  static constexpr std::chrono::milliseconds kWriterPoll{20};
  // Row buffers travel caller → writer → back: a fresh multi-100-KB buffer per step would
  // cost page faults (zeroed pages) on the engine thread every step.
  std::vector<std::vector<uint8_t>> spare_;  // guarded by mu_
  std::vector<uint8_t> fresh;                // caller's next buffer
  static constexpr size_t kMaxSpare = 8;
  std::vector<std::vector<uint8_t>> raw_pool_;  // guarded by mu_: chunk and frame buffers for reuse
  static constexpr size_t kMaxRawPool = 1024;  // (a step of full capture at batch 8 queues ~300 chunks)
  // A buffer for a new batch of rows: the one kept for the caller, else one the writer has
  // given back (taken under the lock now rather than at the next Submit, so a step that fills
  // more than one buffer does not fault in new pages), else a new one.
  std::vector<uint8_t> TakeBuffer() {
    if (fresh.capacity() == 0) {
      std::lock_guard<std::mutex> l(mu_);
      if (!spare_.empty()) {
        fresh = std::move(spare_.back());
        spare_.pop_back();
      }
    }
    std::vector<uint8_t> b = std::move(fresh);
    fresh = std::vector<uint8_t>();
    return b;
  }
  std::chrono::steady_clock::time_point last_wake_{};
  void Join() {
    if (thread_.joinable()) thread_.join();
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_workers_ = true;
    }
    work_cv_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
  }
  Status error() const {
    std::lock_guard<std::mutex> l(mu_);
    return error_;
  }

 private:
  void Run();
  void WorkerLoop();
  Status Process(Command& cmd);
  Status DoDefineTensor(const TensorSpec& spec);
  Status DefineShardedValues(const TensorSpec& spec, hid_t group);
  Result<int32_t> MakeTable(const std::string& path, h5::Hid type, int64_t cols, hid_t parent);
  // Rows to a table: whole chunks go to compression as they fill, the rest to its tail. With
  // `owner` (lent rows) a whole chunk is compressed where the rows are, without a copy.
  Status DoAppend(Table& t, const uint8_t* data, size_t bytes, const std::shared_ptr<const void>* owner = nullptr);
  void QueueChunk(Table& t, std::shared_ptr<ChunkJob> job);  // to new_jobs_
  void PublishJobs();
  std::vector<std::shared_ptr<ChunkJob>> new_jobs_;  // writer thread: made, not yet in jobs_
  std::vector<std::shared_ptr<ChunkJob>> ready_;     // writer thread: WriteReadyChunks' batch
  std::vector<ChunkRecord> records_;                 // writer thread: chunk records not yet written
  Status WriteChunkRecords();
  std::vector<uint8_t> TakeRaw();
  Status CompressJob(ChunkJob& job) const;
  void MaterializeLent(Table& t);
  // What the writer derives from a summarize entry's rows: their summaries and, for logits
  // with top-k tensors, each row's LogitsTopK.
  struct Derived {
    std::vector<SummaryRow> summaries;
    std::vector<int32_t> topk_ids;
    std::vector<float> topk_values, logsumexp, logsumexp_t;
  };
  static void Derive(const struct Command::Entry& e, const uint8_t* data, Derived* out);
  // `pre`: derived already (PrecomputeDerived); else derived here.
  Status DoSummarizeAppend(const struct Command::Entry& e, const uint8_t* data, Derived* pre);
  // A large command's derived rows, by the compression workers and this thread together.
  void PrecomputeDerived(const Command& c, std::vector<Derived>* out);
  Derived derived_;  // scratch of DoSummarizeAppend
  // `rows`: the extent after the write (default: through the end of the chunk).
  Status WriteChunk(Table& t, int64_t index, const std::vector<uint8_t>& packed, int64_t rows = -1);
  Status WriteChunkData(Table& t, int64_t index, const std::vector<uint8_t>& packed);
  Status WriteReadyChunks(bool wait_all);
  Status DoFlush(int64_t steps);
  Status WriteTail(Table& t);
  Status DoClose();
  Status DoAddRequest(const RequestRecord& r);
  Status DoFinishRequest(const Command& c);
  // Records the first error; from then on the file is left as of the last flush.
  void Fail(const Status& s) {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!error_.ok()) return;
      error_ = s;
      failed = true;
    }
    Detach();
  }
  void Detach();
  void CloseChunks() {
    if (chunks_fd_ >= 0) ::close(chunks_fd_);
    chunks_fd_ = -1;
  }

  TraceWriterOptions opts_;
  std::filesystem::path path_;
  h5::Hid file_, meta_, requests_;
  h5::Hid fapl_;
  h5::Hid tails_file_, tails_;  // the sidecar <trace>.tails, created at the first tail
  int chunks_fd_ = -1;          // the chunk directory <trace>.chunks (append only)
  Status RecordChunk(const Table& t, int64_t index);
  bool main_published_ = false, tails_published_ = false;  // renamed from *.partial yet?
  std::vector<Command> finished_;  // FinishRequest calls, applied at close (see DoFinishRequest)
  Status Publish(const std::filesystem::path& final_path, bool* published);
  Status CreateTails();
  Status EnsureTailDataset(Table& t);
  std::vector<std::unique_ptr<Table>> tables_;
  int32_t sampling_ = -1, steps_ = -1, batch_ = -1;

  mutable std::mutex mu_;
  std::condition_variable cmd_cv_;    // writer waits: a command or a finished chunk
  std::condition_variable space_cv_;  // caller waits: queue space
  std::condition_variable work_cv_;   // workers wait: a chunk to compress
  std::deque<Command> commands_;
  std::deque<std::shared_ptr<ChunkJob>> jobs_;     // in submission order (writer's view)
  std::deque<std::shared_ptr<ChunkJob>> to_compress_;
  int64_t queued_bytes_ = 0;
  bool stop_workers_ = false;
  Status error_;
  std::thread thread_;
  std::vector<std::thread> workers_;
  std::vector<std::function<void()>> defer_;
};

}  // namespace lockstep::traces
