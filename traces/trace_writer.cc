// traces/trace_writer.cc — see trace_writer.h. The writer thread's protocol for crash
// safety is described in docs/trace-format.md ("Crash safety"); the comments here say
// which step of it each piece of code is.
#include "traces/trace_writer.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include <fcntl.h>
#include <unistd.h>

#include "traces/h5.h"
#include "traces/row_summary.h"
#include "traces/trace_types.h"
#include "traces/zstd_filter.h"

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
const uint8_t* EntryValues(const Command::Entry& e, const uint8_t* data) {
  int64_t rows;
  std::memcpy(&rows, data + 8, 8);
  return e.ext_values != nullptr ? e.ext_values : data + 16 + 8 * rows;
}

std::filesystem::path TailsPath(const std::filesystem::path& trace) {
  std::filesystem::path p = trace;
  p += kTailsSuffix;
  return p;
}

std::filesystem::path ChunksPath(const std::filesystem::path& trace) {
  std::filesystem::path p = trace;
  p += kChunksSuffix;
  return p;
}

std::filesystem::path PartialPath(const std::filesystem::path& file) {
  std::filesystem::path p = file;
  p += ".partial";
  return p;
}

namespace {

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

}  // namespace

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
    std::vector<float> topk_values, logsumexp;
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

Status TraceWriter::Impl::Open(const std::filesystem::path& path) {
  path_ = path;
  LS_RETURN_IF_ERROR(RegisterZstdFilter());
  h5::Quiet();
  // Metadata reaches the file only at H5Fflush/close: with evictions off, the metadata
  // cache never writes a half-updated index between two flushes (docs/trace-format.md).
  fapl_ = h5::Hid(H5Pcreate(H5P_FILE_ACCESS));
  const h5::Hid& fapl = fapl_;
  H5AC_cache_config_t mdc;
  mdc.version = H5AC__CURR_CACHE_CONFIG_VERSION;
  if (H5Pget_mdc_config(fapl.get(), &mdc) >= 0) {
    mdc.evictions_enabled = false;
    mdc.incr_mode = H5C_incr__off;
    mdc.flash_incr_mode = H5C_flash_incr__off;
    mdc.decr_mode = H5C_decr__off;
    mdc.set_initial_size = true;
    mdc.initial_size = 16 << 20;
    mdc.max_size = 64 << 20;
    H5Pset_mdc_config(fapl.get(), &mdc);
  }
  // The trace is built under <trace>.partial and renamed into place by the first flush, so
  // the file at `path` appears whole: its creation (every group and dataset of the first
  // step) is never caught half-written by a kill. An older trace at `path` goes first.
  {
    std::error_code ec;
    std::filesystem::remove(path, ec);
    std::filesystem::remove(TailsPath(path), ec);  // a crashed earlier run's sidecars are not ours
    std::filesystem::remove(ChunksPath(path), ec);
  }
  // The file's end of allocation (EOA, in the superblock) is written last in a flush: a
  // pointer, written earlier in a flush that a kill tears, to space allocated past the old
  // EOA makes HDF5 refuse the object ("addr overflow"). Allocating raw data and metadata in
  // large blocks keeps most allocations below the EOA the last flush recorded (the file is
  // sparse there; the close gives the unused ends back).
  // The unused end of the last block is given back at close only when it ends the file, so
  // the block size is also the most a trace can waste: it comes from the caller, who knows
  // how fast the trace grows (TraceWriterOptions::alloc_block_bytes).
  H5Pset_small_data_block_size(fapl.get(), static_cast<hsize_t>(opts_.alloc_block_bytes));
  // Metadata too (a chunk-index node that splits, a new object header), in smaller blocks.
  H5Pset_meta_block_size(fapl.get(), static_cast<hsize_t>(std::min<int64_t>(opts_.alloc_block_bytes, 64 << 10)));
  file_ = h5::Hid(H5Fcreate(PartialPath(path).c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()));
  if (!file_.valid()) {
    std::string why = h5::LastError();
    return Status::IoError(path.string() + ": cannot create the trace" + (why.empty() ? "" : " (" + why + ")"));
  }
  // The chunk directory: where every full chunk went, so that a reader can still find the
  // chunks of a table whose index a kill tore mid-flush (docs/trace-format.md, "Crash
  // safety"). Appended with plain write(2): a kill can only cut its last record short.
  chunks_fd_ = ::open(ChunksPath(path).c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
  if (chunks_fd_ < 0 || ::write(chunks_fd_, kChunksMagic, sizeof kChunksMagic) != sizeof kChunksMagic) {
    return Status::IoError(ChunksPath(path).string() + ": cannot create the chunk directory: " + std::strerror(errno));
  }
  const hid_t f = file_.get();
  LS_RETURN_IF_ERROR(h5::WriteAttr(f, kAttrMagic, std::string(kMagicValue)));
  LS_RETURN_IF_ERROR(h5::WriteAttrI32s(f, kAttrFormatVersion, {kFormatMajor, kFormatMinor}));
  LS_RETURN_IF_ERROR(h5::WriteAttrU8(f, kAttrComplete, 0));
  LS_RETURN_IF_ERROR(h5::WriteAttr(f, kAttrFlushedSteps, int64_t{0}));
  LS_RETURN_IF_ERROR(h5::WriteAttr(f, kAttrWriter, opts_.writer.empty() ? std::string("lockstep") : opts_.writer));
  LS_ASSIGN_OR_RETURN(meta_, h5::CreateGroup(f, kMetaGroup));
  LS_ASSIGN_OR_RETURN(requests_, h5::CreateGroup(f, kRequestsGroup));
  LS_ASSIGN_OR_RETURN(h5::Hid taps, h5::CreateGroup(f, kTapsGroup));
  LS_ASSIGN_OR_RETURN(h5::Hid kv, h5::CreateGroup(f, kKvGroup));
  LS_ASSIGN_OR_RETURN(sampling_, MakeTable(kSamplingTable, SamplingType(), 0, f));
  LS_ASSIGN_OR_RETURN(steps_, MakeTable(kStepsTable, StepType(), 0, f));
  LS_ASSIGN_OR_RETURN(batch_, MakeTable(kStepBatchTable, h5::Hid(H5Tcopy(H5T_STD_I64LE)),
                                        std::max<int64_t>(1, opts_.batch_width), f));
  if (H5Fflush(f, H5F_SCOPE_GLOBAL) < 0) return h5::Error(path.string() + ": flush");
  return Status::Ok();
}

// After a failure (a full disk, an I/O error) HDF5 would still write its cached metadata
// when the file closes, over the last flushed, consistent state, and possibly pointing at
// chunks whose writes failed. HDF5 has no "close without flushing", so the file descriptor
// of the sec2 driver is pointed at /dev/null: every later write, the close's included, goes
// nowhere, and the file on disk stays exactly as the last successful flush left it.
void TraceWriter::Impl::Detach() {
  if (!file_.valid()) return;
  void* handle = nullptr;
  if (H5Fget_vfd_handle(file_.get(), H5P_DEFAULT, &handle) < 0 || !handle) {
    h5::LastError();
    return;
  }
  const int fd = *static_cast<int*>(handle);
  const int null_fd = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  if (null_fd >= 0) {
    ::dup2(null_fd, fd);
    ::close(null_fd);
  }
}

void TraceWriter::Impl::Start() {
  for (int i = 0; i < opts_.compression_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  thread_ = std::thread([this] { Run(); });
}

void TraceWriter::Impl::Push(Command cmd, int64_t* stall_ns) {
  pending.push_back(std::move(cmd));
  Submit(stall_ns);
}

// Hands the caller's pending commands to the writer thread: one lock and one wake-up per
// batch (per engine step, typically), not per tensor.
void TraceWriter::Impl::Submit(int64_t* stall_ns) {
  if (pending.empty()) return;
  const int64_t bytes = pending_bytes;
  std::unique_lock<std::mutex> l(mu_);
  if (queued_bytes_ > 0 && queued_bytes_ + bytes > opts_.queue_bytes && error_.ok()) {
    const auto t0 = Clock::now();
    space_cv_.wait(l, [&] { return queued_bytes_ == 0 || queued_bytes_ + bytes <= opts_.queue_bytes || !error_.ok(); });
    *stall_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
  }
  queued_bytes_ += bytes;
  bool urgent = queued_bytes_ > (1 << 20) || pending_borrows;
  for (auto& c : pending) {
    urgent |= c.kind != Command::Kind::kAppend;
    commands_.push_back(std::move(c));
  }
  if (fresh.capacity() == 0 && !spare_.empty()) {
    fresh = std::move(spare_.back());
    spare_.pop_back();
  }
  l.unlock();
  // Waking the writer is a system call; a batch of rows can wait for its periodic look
  // (kWriterPoll) unless a flush, a close or a large backlog is in the queue.
  const auto now = Clock::now();
  if (urgent || now - last_wake_ > kWriterPoll) {
    cmd_cv_.notify_one();
    last_wake_ = now;
  }
  pending.clear();
  pending_bytes = 0;
  pending_borrows = false;
}

void TraceWriter::Impl::WorkerLoop() {
  while (true) {
    std::shared_ptr<ChunkJob> job;
    {
      std::unique_lock<std::mutex> l(mu_);
      work_cv_.wait(l, [&] { return stop_workers_ || !to_compress_.empty(); });
      if (to_compress_.empty()) return;
      job = to_compress_.front();
      to_compress_.pop_front();
    }
    Status s;
    if (job->task) {
      job->task();
    } else {
      s = CompressJob(*job);
    }
    {
      std::lock_guard<std::mutex> l(mu_);
      job->status = s;
      job->done = true;
    }
    cmd_cv_.notify_one();
  }
}

void TraceWriter::Impl::Run() {
  h5::Quiet();
  while (true) {
    Command cmd;
    {
      std::unique_lock<std::mutex> l(mu_);
      cmd_cv_.wait_for(l, kWriterPoll, [&] { return !commands_.empty() || (!jobs_.empty() && jobs_.front()->done); });
      if (commands_.empty() && (jobs_.empty() || !jobs_.front()->done)) continue;
      if (commands_.empty()) {
        l.unlock();
        if (error().ok()) {
          Status s = WriteReadyChunks(false);
          if (!s.ok()) Fail(s);
        }
        continue;
      }
      cmd = std::move(commands_.front());
      commands_.pop_front();
    }
    const Command::Kind kind = cmd.kind;
    const int64_t bytes = static_cast<int64_t>(cmd.bytes.size());
    if (error().ok()) {
      const int64_t t0 = Now();
      Status s = Process(cmd);
      (kind == Command::Kind::kFlush || kind == Command::Kind::kClose ? t_flush : t_append) += Now() - t0;
      if (s.ok()) s = WriteReadyChunks(false);
      if (!s.ok()) Fail(s);
    }
    {
      std::lock_guard<std::mutex> l(mu_);
      queued_bytes_ -= bytes;
      if (kind == Command::Kind::kAppend && spare_.size() < kMaxSpare) {
        cmd.bytes.clear();
        spare_.push_back(std::move(cmd.bytes));
      }
    }
    space_cv_.notify_all();
    if (kind == Command::Kind::kClose) return;
  }
}

Status TraceWriter::Impl::Process(Command& c) {
  switch (c.kind) {
    case Command::Kind::kMeta: return h5::WriteAttr(meta_.get(), c.key, c.value);
    case Command::Kind::kAddRequest: return DoAddRequest(c.request);
    case Command::Kind::kFinishRequest:
      // New datasets and strings mid-run would change the file's structure at a flush,
      // which a kill could catch half-written; the sampler rows already say when and why
      // each request finished, so the tokens and text are written once, at close.
      finished_.push_back(std::move(c));
      return Status::Ok();
    case Command::Kind::kDefineTensor: return DoDefineTensor(c.tensor);
    case Command::Kind::kAppend: {
      std::vector<Derived> pre;
      PrecomputeDerived(c, &pre);
      size_t at = 0;
      for (size_t i = 0; i < c.entries.size(); ++i) {
        const auto& e = c.entries[i];
        if (e.summarize) {
          LS_RETURN_IF_ERROR(DoSummarizeAppend(e, c.bytes.data() + at, pre.empty() ? nullptr : &pre[i]));
        } else if (e.scatter_rows > 0) {
          const uint8_t* p = c.bytes.data() + at;
          const uint8_t* rows = p + 4 * e.scatter_rows;
          for (size_t r = 0; r < e.scatter_rows;) {  // runs of rows bound for one table
            int32_t t = 0, u = 0;
            std::memcpy(&t, p + 4 * r, 4);
            size_t q = r + 1;
            for (; q < e.scatter_rows; ++q) {
              std::memcpy(&u, p + 4 * q, 4);
              if (u != t) break;
            }
            LS_RETURN_IF_ERROR(DoAppend(*tables_[t], rows + r * sizeof(SummaryRow), (q - r) * sizeof(SummaryRow)));
            r = q;
          }
        } else if (e.ext_values != nullptr) {  // lent rows (Append's values_owner)
          LS_RETURN_IF_ERROR(DoAppend(*tables_[e.table], e.ext_values, e.ext_bytes, &e.ext_owner));
        } else {
          LS_RETURN_IF_ERROR(DoAppend(*tables_[e.table], c.bytes.data() + at, e.bytes));
        }
        at += e.bytes;
      }
      PublishJobs();
      return Status::Ok();
    }
    case Command::Kind::kFlush: return DoFlush(c.steps);
    case Command::Kind::kClose: return DoClose();
  }
  return Status::Internal("unknown command");
}

Result<int32_t> TraceWriter::Impl::MakeTable(const std::string& path, h5::Hid type, int64_t cols, hid_t parent) {
  auto t = std::make_unique<Table>();
  t->path = path;
  t->element_size = H5Tget_size(type.get());
  t->type = std::move(type);
  t->cols = cols;
  t->row_bytes = t->element_size * static_cast<size_t>(std::max<int64_t>(cols, 1));
  // Rows per chunk: a power of two near target_chunk_bytes, at least 8 rows (so decode's
  // one row per step still fills chunks) and at most 4096.
  int64_t rows = 8;
  while (rows < 4096 && static_cast<int64_t>(rows * 2 * t->row_bytes) <= opts_.target_chunk_bytes) rows *= 2;
  t->chunk_rows = rows;
  t->index = static_cast<int64_t>(tables_.size());
  t->path_hash = ContentHash(path.data(), path.size());

  const int rank = cols > 0 ? 2 : 1;
  hsize_t dims[2] = {0, static_cast<hsize_t>(cols)};
  hsize_t maxdims[2] = {H5S_UNLIMITED, static_cast<hsize_t>(cols)};
  hsize_t chunk[2] = {static_cast<hsize_t>(rows), static_cast<hsize_t>(cols)};
  h5::Hid space(H5Screate_simple(rank, dims, maxdims));
  h5::Hid dcpl = h5::CreationProps(H5P_DATASET_CREATE);
  const unsigned level = static_cast<unsigned>(opts_.zstd_level);
  if (H5Pset_chunk(dcpl.get(), rank, chunk) < 0 || H5Pset_shuffle(dcpl.get()) < 0 ||
      H5Pset_filter(dcpl.get(), kZstdFilterId, H5Z_FLAG_MANDATORY, 1, &level) < 0) {
    return h5::Error(path + ": dataset properties");
  }
  t->dset = h5::Hid(H5Dcreate2(parent, path.c_str(), t->type.get(), space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT));
  if (!t->dset.valid()) return h5::Error(path_.string() + ": cannot create dataset '" + path + "'");
  LS_RETURN_IF_ERROR(h5::WriteAttr(t->dset.get(), kAttrChunkRows, rows));
  tables_.push_back(std::move(t));
  return static_cast<int32_t>(tables_.size() - 1);
}

Status TraceWriter::Impl::DoDefineTensor(const TensorSpec& spec) {
  LS_ASSIGN_OR_RETURN(h5::Hid g, h5::CreateGroup(file_.get(), spec.path));
  LS_RETURN_IF_ERROR(h5::WriteAttr(g.get(), kAttrDType, std::string(DTypeName(spec.dtype))));
  LS_RETURN_IF_ERROR(h5::WriteAttr(g.get(), kAttrCols, spec.cols));
  LS_RETURN_IF_ERROR(h5::WriteAttrU8(g.get(), kAttrHasValues, spec.values ? 1 : 0));
  for (const auto& [k, v] : spec.attrs) LS_RETURN_IF_ERROR(h5::WriteAttr(g.get(), k, v));
  for (const auto& [k, v] : spec.int_attrs) LS_RETURN_IF_ERROR(h5::WriteAttr(g.get(), k, v));
  // Table ids are handed out by TraceWriter::DefineTensor in the same order: summary, values.
  LS_RETURN_IF_ERROR(MakeTable(spec.path + "/" + kSummaryDataset, SummaryType(), 0, file_.get()).status());
  if (spec.values) {
    LS_ASSIGN_OR_RETURN(int32_t v, MakeTable(spec.path + "/" + kValuesDataset, h5::Hid(H5Tcopy(ValueType(spec.dtype))),
                                             spec.cols, file_.get()));
    LS_RETURN_IF_ERROR(h5::WriteAttr(tables_[v]->dset.get(), kAttrDType, std::string(DTypeName(spec.dtype))));
  }
  return Status::Ok();
}

// Layout of a summarize entry: request i32, step i32, rows i64, positions i64 × rows, then
// the rows' values (rows × cols × dtype size).
void TraceWriter::Impl::Derive(const Command::Entry& e, const uint8_t* data, Derived* out) {
  int32_t request, step;
  int64_t rows;
  std::memcpy(&request, data, 4);
  std::memcpy(&step, data + 4, 4);
  std::memcpy(&rows, data + 8, 8);
  const uint8_t* positions = data + 16;
  const uint8_t* values = EntryValues(e, data);
  const size_t row_bytes = static_cast<size_t>(e.cols) * DTypeSize(e.dtype);
  out->summaries.resize(rows);
  for (int64_t i = 0; i < rows; ++i) {
    SummaryRow& s = out->summaries[i];
    s = SummaryRow();
    std::memcpy(&s.position, positions + 8 * i, 8);
    s.request = request;
    s.step = step;
    Summarize(e.dtype, values + i * row_bytes, e.cols, &s);
  }
  if (e.topk_tables[0] < 0) return;
  const int64_t k = e.topk;
  out->topk_ids.resize(static_cast<size_t>(rows * k));
  out->topk_values.resize(static_cast<size_t>(rows * k));
  out->logsumexp.resize(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) {
    LogitsTopK(reinterpret_cast<const float*>(values + i * row_bytes), e.cols, k, &out->topk_ids[i * k],
               &out->topk_values[i * k], &out->logsumexp[i]);
  }
}

// Summaries (and the logits' top-k) are the writer thread's main work in full capture: every
// value hashed and reduced once. For a command of more than kParallelBytes, the compression
// workers take shares of its entries (tasks queued ahead of any chunk) while this thread does
// its own; an entry's results are the same whoever computes them, and are appended in order.
void TraceWriter::Impl::PrecomputeDerived(const Command& c, std::vector<Derived>* out) {
  constexpr size_t kParallelBytes = size_t{2} << 20;
  if (workers_.empty()) return;
  std::vector<size_t> offset(c.entries.size());
  auto weight = [&](const Command::Entry& e) -> size_t {  // a top-k scan costs about 3 summaries
    const size_t b = e.bytes + e.ext_bytes;
    return !e.summarize ? 0 : e.topk_tables[0] >= 0 ? 4 * b : b;
  };
  size_t at = 0, total = 0;
  for (size_t i = 0; i < c.entries.size(); ++i) {
    offset[i] = at;
    at += c.entries[i].bytes;
    total += weight(c.entries[i]);
  }
  if (total < kParallelBytes) return;
  out->assign(c.entries.size(), {});
  // Shares of about equal weight, in entry order: share k takes entries [cut[k], cut[k+1]).
  const size_t shares = workers_.size() + 1;
  std::vector<size_t> cut = {0};
  size_t acc = 0;
  for (size_t i = 0; i < c.entries.size(); ++i) {
    acc += weight(c.entries[i]);
    if (cut.size() < shares && acc * shares >= total * cut.size()) cut.push_back(i + 1);
  }
  while (cut.size() <= shares) cut.push_back(c.entries.size());
  auto run = [&c, &offset, out](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      if (c.entries[i].summarize) Derive(c.entries[i], c.bytes.data() + offset[i], &(*out)[i]);
    }
  };
  std::vector<std::shared_ptr<ChunkJob>> tasks;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (size_t k = 1; k + 1 < cut.size(); ++k) {
      auto job = std::make_shared<ChunkJob>();
      job->task = [run, b = cut[k], e = cut[k + 1]] { run(b, e); };
      to_compress_.push_front(job);  // ahead of the chunks: this thread waits for them
      tasks.push_back(std::move(job));
    }
  }
  work_cv_.notify_all();
  run(cut[0], cut[1]);
  const int64_t t0 = Now();
  struct Waited {
    std::atomic<int64_t>& total;
    int64_t t0;
    ~Waited() { total += Now() - t0; }
  } waited{t_derive_wait, t0};
  std::unique_lock<std::mutex> l(mu_);
  cmd_cv_.wait(l, [&] {
    for (const auto& t : tasks) {
      if (!t->done) return false;
    }
    return true;
  });
}

Status TraceWriter::Impl::DoSummarizeAppend(const Command::Entry& e, const uint8_t* data, Derived* pre) {
  int64_t rows;
  std::memcpy(&rows, data + 8, 8);
  const uint8_t* values = EntryValues(e, data);
  const size_t row_bytes = static_cast<size_t>(e.cols) * DTypeSize(e.dtype);
  Derived& d = pre != nullptr ? *pre : derived_;
  if (pre == nullptr) Derive(e, data, &d);
  LS_RETURN_IF_ERROR(DoAppend(*tables_[e.table], reinterpret_cast<const uint8_t*>(d.summaries.data()),
                              d.summaries.size() * sizeof(SummaryRow)));
  if (e.store_values) LS_RETURN_IF_ERROR(DoAppend(*tables_[e.table + 1], values, rows * row_bytes));
  if (e.topk_tables[0] < 0) return Status::Ok();
  // The derived rows, each as a summarised and stored row of its own tensor.
  const int64_t k = e.topk;
  for (int64_t i = 0; i < rows; ++i) {
    const struct {
      DType dtype;
      const void* data;
      int64_t cols;
    } parts[3] = {{DType::kI32, &d.topk_ids[i * k], k}, {DType::kF32, &d.topk_values[i * k], k},
                  {DType::kF32, &d.logsumexp[i], 1}};
    for (int j = 0; j < 3; ++j) {
      SummaryRow sr = d.summaries[i];
      Summarize(parts[j].dtype, parts[j].data, parts[j].cols, &sr);
      LS_RETURN_IF_ERROR(
          DoAppend(*tables_[e.topk_tables[j]], reinterpret_cast<const uint8_t*>(&sr), sizeof(SummaryRow)));
      LS_RETURN_IF_ERROR(DoAppend(*tables_[e.topk_tables[j] + 1], static_cast<const uint8_t*>(parts[j].data),
                                  static_cast<size_t>(parts[j].cols) * 4));
    }
  }
  return Status::Ok();
}

// A chunk buffer written out before, when there is one: no fresh pages to fault in.
std::vector<uint8_t> TraceWriter::Impl::TakeRaw() {
  std::lock_guard<std::mutex> l(mu_);
  if (raw_pool_.empty()) return {};
  std::vector<uint8_t> b = std::move(raw_pool_.back());
  raw_pool_.pop_back();
  return b;
}

void TraceWriter::Impl::QueueChunk(Table& t, std::shared_ptr<ChunkJob> job) {
  job->table = &t;
  job->index = t.chunks_queued++;
  if (workers_.empty()) {
    job->status = CompressJob(*job);
    job->done = true;
  }
  new_jobs_.push_back(std::move(job));
}

// The chunks a command made go to the workers at once: one lock and one wake-up for a
// step's ~300 chunks (full capture at batch 8), not one each; their frame buffers come from
// the pool under the same lock.
void TraceWriter::Impl::PublishJobs() {
  if (new_jobs_.empty()) return;
  bool compress = false;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (auto& job : new_jobs_) {
      if (!raw_pool_.empty() && job->packed.capacity() == 0) {
        job->packed = std::move(raw_pool_.back());  // (recycled: the frame lands in pages already faulted in)
        raw_pool_.pop_back();
      }
      if (!job->done) {
        to_compress_.push_back(job);
        compress = true;
      }
      jobs_.push_back(std::move(job));
    }
  }
  new_jobs_.clear();
  if (compress) work_cv_.notify_all();
}

// A chunk from lent pieces is gathered on the worker (in parallel), not the writer's thread.
Status TraceWriter::Impl::CompressJob(ChunkJob& job) const {
  const Table& t = *job.table;
  if (job.lent.empty()) return ShuffleCompressChunk(job.raw.data(), job.raw.size(), t.element_size, opts_.zstd_level, &job.packed);
  if (job.lent.size() == 1) {
    return ShuffleCompressChunk(job.lent[0].data, job.lent[0].bytes, t.element_size, opts_.zstd_level, &job.packed);
  }
  thread_local std::vector<uint8_t> gathered;
  gathered.clear();
  for (const LentRows& r : job.lent) gathered.insert(gathered.end(), r.data, r.data + r.bytes);
  return ShuffleCompressChunk(gathered.data(), gathered.size(), t.element_size, opts_.zstd_level, &job.packed);
}

void TraceWriter::Impl::MaterializeLent(Table& t) {
  for (const LentRows& r : t.lent) t.tail.insert(t.tail.end(), r.data, r.data + r.bytes);
  t.lent.clear();
  t.lent_bytes = 0;
}

Status TraceWriter::Impl::DoAppend(Table& t, const uint8_t* data, size_t bytes, const std::shared_ptr<const void>* owner) {
  t.tail_dirty = true;
  const size_t chunk_bytes = t.chunk_rows * t.row_bytes;
  if (owner == nullptr) MaterializeLent(t);  // (rows in order: the lent ones first)
  if (!t.tail.empty()) {  // complete the unfinished chunk first
    const size_t take = std::min(bytes, chunk_bytes - t.tail.size());
    t.tail.insert(t.tail.end(), data, data + take);
    data += take;
    bytes -= take;
    if (t.tail.size() < chunk_bytes) return Status::Ok();
    auto job = std::make_shared<ChunkJob>();
    job->raw = std::move(t.tail);  // the tail becomes the chunk; a pooled buffer the next tail
    t.tail = TakeRaw();
    t.tail.clear();
    QueueChunk(t, std::move(job));
  }
  if (owner != nullptr) {
    // Lent rows: whole chunks (with the piece waiting before them) go to compression where
    // they lie; a rest of half a chunk or more waits for the next append, a smaller one is
    // copied. So a tail holds at most one earlier append's buffer, which the next append
    // frees: a lender waiting for a buffer to come back (the CUDA backend) never waits on rows
    // it has yet to lend.
    while (bytes > 0 && t.lent_bytes + bytes >= chunk_bytes) {
      const size_t take = chunk_bytes - t.lent_bytes;
      t.lent.push_back({data, take, *owner});
      auto job = std::make_shared<ChunkJob>();
      job->lent = std::move(t.lent);
      t.lent.clear();
      t.lent_bytes = 0;
      QueueChunk(t, std::move(job));
      data += take;
      bytes -= take;
    }
    if (bytes == 0) return Status::Ok();
    if (t.lent.empty() && 2 * bytes >= chunk_bytes) {
      t.lent.push_back({data, bytes, *owner});
      t.lent_bytes += bytes;
      return Status::Ok();
    }
    MaterializeLent(t);
    t.tail.insert(t.tail.end(), data, data + bytes);
    return Status::Ok();
  }
  for (; bytes >= chunk_bytes; data += chunk_bytes, bytes -= chunk_bytes) {
    auto job = std::make_shared<ChunkJob>();
    job->raw = TakeRaw();
    job->raw.assign(data, data + chunk_bytes);
    QueueChunk(t, std::move(job));
  }
  t.tail.insert(t.tail.end(), data, data + bytes);
  return Status::Ok();
}

// A chunk at a new index: first grow the extent to cover it (H5Dwrite_chunk wants the
// offset inside the dataset), then store it. The chunk's space is fresh, never reused.
Status TraceWriter::Impl::WriteChunk(Table& t, int64_t index, const std::vector<uint8_t>& packed, int64_t rows) {
  if (rows < 0) rows = (index + 1) * t.chunk_rows;
  hsize_t dims[2] = {static_cast<hsize_t>(rows), static_cast<hsize_t>(t.cols)};
  if (H5Dset_extent(t.dset.get(), dims) < 0) return h5::Error(path_.string() + ": '" + t.path + "': extend");
  t.extent = rows;
  return WriteChunkData(t, index, packed);
}

// A chunk inside the extent.
Status TraceWriter::Impl::WriteChunkData(Table& t, int64_t index, const std::vector<uint8_t>& packed) {
  hsize_t offset[2] = {static_cast<hsize_t>(index * t.chunk_rows), 0};
  if (H5Dwrite_chunk(t.dset.get(), H5P_DEFAULT, 0, offset, packed.size(), packed.data()) < 0) {
    return h5::Error(path_.string() + ": '" + t.path + "': write chunk");
  }
  return Status::Ok();
}

Status TraceWriter::Impl::WriteReadyChunks(bool wait_all) {
  PublishJobs();
  Status st;
  while (st.ok()) {
    ready_.clear();
    {  // every finished job at the front, in order, under one lock
      std::unique_lock<std::mutex> l(mu_);
      if (jobs_.empty()) break;
      if (!jobs_.front()->done) {
        if (!wait_all) break;
        cmd_cv_.wait(l, [&] { return jobs_.front()->done; });
      }
      while (!jobs_.empty() && jobs_.front()->done) {
        ready_.push_back(std::move(jobs_.front()));
        jobs_.pop_front();
      }
    }
    const int64_t t0 = Now();
    // Each table's extent grows once for the batch: its chunks come in index order, so from
    // the back the first of a table's is its last.
    for (auto job = ready_.rbegin(); job != ready_.rend(); ++job) {
      Table& t = *(*job)->table;
      const int64_t rows = ((*job)->index + 1) * t.chunk_rows;
      if (rows <= t.extent) continue;
      hsize_t dims[2] = {static_cast<hsize_t>(rows), static_cast<hsize_t>(t.cols)};
      if (H5Dset_extent(t.dset.get(), dims) < 0) {
        st = h5::Error(path_.string() + ": '" + t.path + "': extend");
        break;
      }
      t.extent = rows;
    }
    for (auto& job : ready_) {
      if (!st.ok()) break;
      st = job->status;
      if (st.ok()) st = WriteChunkData(*job->table, job->index, job->packed);
      if (!st.ok()) break;
      job->table->chunks_written = job->index + 1;
      st = RecordChunk(*job->table, job->index);
      job->lent.clear();  // the lender's rows are free again
      ++t_chunks;
    }
    t_write += Now() - t0;
    std::lock_guard<std::mutex> l(mu_);
    for (auto& job : ready_) {
      for (std::vector<uint8_t>* b : {&job->raw, &job->packed}) {
        if (b->capacity() > 0 && raw_pool_.size() < kMaxRawPool) raw_pool_.push_back(std::move(*b));
      }
    }
  }
  ready_.clear();
  const Status records = WriteChunkRecords();
  return st.ok() ? records : st;
}

// Appends the chunk's place in the file to the chunk directory. The chunk's bytes are in the
// file already (H5Dwrite_chunk writes raw data at once); the flush that makes the trace's
// index point at them comes later, so a reader never misses a chunk the index had.
Status TraceWriter::Impl::RecordChunk(const Table& t, int64_t index) {
  ChunkRecord r;
  r.table = t.path_hash;
  r.index = index;
  hsize_t offset[2] = {static_cast<hsize_t>(index * t.chunk_rows), 0};
  haddr_t addr = HADDR_UNDEF;
  hsize_t size = 0;
  unsigned mask = 0;
  if (H5Dget_chunk_info_by_coord(t.dset.get(), offset, &mask, &addr, &size) < 0 || addr == HADDR_UNDEF) {
    return h5::Error(path_.string() + ": '" + t.path + "': chunk " + std::to_string(index) + " not found after writing it");
  }
  r.address = addr;
  r.size = size;
  r.filter_mask = mask;
  r.check = static_cast<uint32_t>(ContentHash(&r, offsetof(ChunkRecord, check)));
  records_.push_back(r);
  return Status::Ok();
}

// The records of a batch of chunks in one write(2), before anything can flush an index that
// points at those chunks (WriteReadyChunks ends with it; flushes and the close come after).
Status TraceWriter::Impl::WriteChunkRecords() {
  if (records_.empty()) return Status::Ok();
  const size_t bytes = records_.size() * sizeof(ChunkRecord);
  const ssize_t n = ::write(chunks_fd_, records_.data(), bytes);
  records_.clear();
  if (n != static_cast<ssize_t>(bytes)) {
    return Status::IoError(ChunksPath(path_).string() + ": write: " + std::strerror(errno));
  }
  return Status::Ok();
}

// The tail of a table: rows of its unfinished chunk, padded to a whole chunk, stored
// uncompressed in /tails/<index>. Same size every time, so HDF5 overwrites it in place.
Status TraceWriter::Impl::EnsureTailDataset(Table& t) {
  if (t.tail_dset.valid()) return Status::Ok();
  const int rank = t.cols > 0 ? 2 : 1;
  hsize_t dims[2] = {static_cast<hsize_t>(t.chunk_rows), static_cast<hsize_t>(t.cols)};
  h5::Hid space(H5Screate_simple(rank, dims, nullptr));
  // Contiguous, allocated now: every later write lands in place, at a fixed offset.
  h5::Hid dcpl = h5::CreationProps(H5P_DATASET_CREATE);
  H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY);
  H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER);
  const std::string name = std::to_string(t.index);
  t.tail_dset =
      h5::Hid(H5Dcreate2(tails_.get(), name.c_str(), t.type.get(), space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT));
  if (!t.tail_dset.valid()) return h5::Error(path_.string() + ": cannot create tail of '" + t.path + "'");
  // All three attributes exist from the start, so later flushes rewrite them in place.
  LS_RETURN_IF_ERROR(h5::WriteAttr(t.tail_dset.get(), kAttrTailTarget, t.path));
  LS_RETURN_IF_ERROR(h5::WriteAttr(t.tail_dset.get(), kAttrTailBase, int64_t{0}));
  LS_RETURN_IF_ERROR(h5::WriteAttr(t.tail_dset.get(), kAttrTailCount, int64_t{0}));
  return Status::Ok();
}

// Writes the rows of the table's unfinished chunk that the tail does not hold yet (all of
// them when the tail moved on to a new chunk), then the counters. With the sidecar's sieve
// buffer off, H5Dwrite puts the bytes in the file at once, and the counters follow at the
// flush: a reader never sees a count covering rows not written.
Status TraceWriter::Impl::WriteTail(Table& t) {
  LS_RETURN_IF_ERROR(EnsureTailDataset(t));
  const int64_t first = t.tail_base == t.main_rows() ? std::min(t.tail_count, t.tail_rows()) : 0;
  const int64_t n = t.tail_rows() - first;
  if (n > 0) {
    const int rank = t.cols > 0 ? 2 : 1;
    hsize_t start[2] = {static_cast<hsize_t>(first), 0};
    hsize_t count[2] = {static_cast<hsize_t>(n), static_cast<hsize_t>(t.cols)};
    h5::Hid fspace(H5Dget_space(t.tail_dset.get()));
    h5::Hid mspace(H5Screate_simple(rank, count, nullptr));
    if (H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start, nullptr, count, nullptr) < 0 ||
        H5Dwrite(t.tail_dset.get(), t.type.get(), mspace.get(), fspace.get(), H5P_DEFAULT,
                 t.tail.data() + first * t.row_bytes) < 0) {
      return h5::Error(path_.string() + ": '" + t.path + "': write tail");
    }
  }
  LS_RETURN_IF_ERROR(h5::WriteAttr(t.tail_dset.get(), kAttrTailBase, t.main_rows()));
  LS_RETURN_IF_ERROR(h5::WriteAttr(t.tail_dset.get(), kAttrTailCount, t.tail_rows()));
  t.tail_base = t.main_rows();
  t.tail_count = t.tail_rows();
  return Status::Ok();
}

// Moves <file>.partial to <file> once its first flush made it consistent (rename is atomic).
Status TraceWriter::Impl::Publish(const std::filesystem::path& final_path, bool* published) {
  if (*published) return Status::Ok();
  std::error_code ec;
  std::filesystem::rename(PartialPath(final_path), final_path, ec);
  if (ec) return Status::IoError(final_path.string() + ": cannot rename the new trace into place: " + ec.message());
  *published = true;
  return Status::Ok();
}

// The sidecar, with a tail dataset for every table that exists now, so that later flushes
// only overwrite what is there (tables defined later add theirs when they first need one).
Status TraceWriter::Impl::CreateTails() {
  const std::filesystem::path side = TailsPath(path_);
  h5::Hid fapl(H5Pcopy(fapl_.get()));
  H5Pset_sieve_buf_size(fapl.get(), 0);  // raw data straight to the file (see WriteTail)
  tails_file_ = h5::Hid(H5Fcreate(PartialPath(side).c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()));
  if (!tails_file_.valid()) return h5::Error(side.string() + ": cannot create the tails file");
  LS_ASSIGN_OR_RETURN(tails_, h5::CreateGroup(tails_file_.get(), kTailsGroup));
  for (auto& t : tables_) LS_RETURN_IF_ERROR(EnsureTailDataset(*t));
  return Status::Ok();
}

Status TraceWriter::Impl::DoFlush(int64_t steps) {
  // 1. Every full chunk queued so far goes to the file (fresh space, main extent grows);
  //    rows still lent join their tails (and go back to their lenders).
  LS_RETURN_IF_ERROR(WriteReadyChunks(true));
  for (auto& t : tables_) MaterializeLent(*t);
  // 2. A tail about to be overwritten with rows of a later chunk still holds rows that only
  //    the new chunks hold now: make those chunks durable first.
  bool barrier = false;
  for (auto& t : tables_) {
    if (t->tail_dirty && t->tail_rows() > 0 && t->tail_count > 0 && t->tail_base != t->main_rows()) barrier = true;
  }
  if (barrier && H5Fflush(file_.get(), H5F_SCOPE_LOCAL) < 0) return h5::Error(path_.string() + ": flush");
  // 3. Tails in place, in the sidecar file, durable before the main file says more steps.
  bool tails_written = false;
  for (auto& t : tables_) {
    if (!t->tail_dirty) continue;
    if (t->tail_rows() > 0) {
      if (!tails_file_.valid()) LS_RETURN_IF_ERROR(CreateTails());
      LS_RETURN_IF_ERROR(WriteTail(*t));
      tails_written = true;
    }
    t->tail_dirty = false;
  }
  if (tails_written) {
    if (H5Fflush(tails_file_.get(), H5F_SCOPE_LOCAL) < 0) return h5::Error(TailsPath(path_).string() + ": flush");
    LS_RETURN_IF_ERROR(Publish(TailsPath(path_), &tails_published_));
  }
  // 4. The new state of the main file.
  LS_RETURN_IF_ERROR(h5::WriteAttr(file_.get(), kAttrFlushedSteps, steps));
  if (H5Fflush(file_.get(), H5F_SCOPE_LOCAL) < 0) return h5::Error(path_.string() + ": flush");
  LS_RETURN_IF_ERROR(Publish(path_, &main_published_));
  if (opts_.on_flushed) opts_.on_flushed(steps);
  return Status::Ok();
}

Status TraceWriter::Impl::DoClose() {
  LS_RETURN_IF_ERROR(WriteReadyChunks(true));
  for (auto& t : tables_) MaterializeLent(*t);
  // The last, partial chunk of each table: padded, compressed, at its own (new) index,
  // with the extent set to the real row count first. (Shrinking the extent after the write
  // would make HDF5 rewrite the edge chunk through its pipeline, leaving the old copy as
  // dead space.)
  for (auto& t : tables_) {
    const int64_t rows = t->tail_rows();
    if (rows == 0) continue;
    std::vector<uint8_t> chunk(t->chunk_rows * t->row_bytes, 0), packed;
    std::memcpy(chunk.data(), t->tail.data(), t->tail.size());
    LS_RETURN_IF_ERROR(ShuffleCompressChunk(chunk.data(), chunk.size(), t->element_size, opts_.zstd_level, &packed));
    LS_RETURN_IF_ERROR(WriteChunk(*t, t->chunks_written, packed, t->main_rows() + rows));
    t->tail.clear();
  }
  for (const Command& c : finished_) LS_RETURN_IF_ERROR(DoFinishRequest(c));
  // Two phases, so that a kill inside the close never leaves `complete = 1` over a
  // half-written file: first everything, still marked incomplete (the sidecar still covers
  // the last rows if this flush is torn); then the flag alone.
  if (H5Fflush(file_.get(), H5F_SCOPE_LOCAL) < 0) return h5::Error(path_.string() + ": flush");
  LS_RETURN_IF_ERROR(Publish(path_, &main_published_));
  LS_RETURN_IF_ERROR(h5::WriteAttrU8(file_.get(), kAttrComplete, 1));
  for (auto& t : tables_) t->dset.Reset();
  meta_.Reset();
  requests_.Reset();
  Status s = file_.Close();
  if (!s.ok()) return s.WithContext(path_.string() + ": ");
  LS_RETURN_IF_ERROR(Publish(path_, &main_published_));
  // The trace is complete and holds every row: the tails are no longer needed (a reader
  // ignores a sidecar beside a complete trace, so a kill between these steps is harmless).
  for (auto& t : tables_) t->tail_dset.Reset();
  tails_.Reset();
  if (tails_file_.valid()) {
    // The trace itself is complete and published above; the sidecar is deleted next, so a
    // failed close of it loses nothing a reader needs.
    (void)tails_file_.Close();
    std::error_code ec;
    std::filesystem::remove(TailsPath(path_), ec);
    std::filesystem::remove(PartialPath(TailsPath(path_)), ec);
  }
  CloseChunks();
  std::error_code ec;
  std::filesystem::remove(ChunksPath(path_), ec);
  return Status::Ok();
}

Status TraceWriter::Impl::DoAddRequest(const RequestRecord& r) {
  const std::string name = std::to_string(r.id);
  LS_ASSIGN_OR_RETURN(h5::Hid g, h5::CreateGroup(requests_.get(), name));
  // Where finishing writes (trace_format.h): created now, so that the request's own header
  // is complete at its first flush and never rewritten.
  LS_ASSIGN_OR_RETURN(h5::Hid fin, h5::CreateGroup(g.get(), kFinalGroup));
  LS_RETURN_IF_ERROR(h5::WriteAttr(g.get(), kAttrName, r.name));
  LS_RETURN_IF_ERROR(h5::WriteStringDataset(g.get(), kPromptTextDataset, r.prompt_text));
  LS_RETURN_IF_ERROR(h5::WriteAttr(g.get(), kAttrMaxNewTokens, r.max_new_tokens));
  LS_RETURN_IF_ERROR(h5::WriteAttr(g.get(), kAttrSeed, static_cast<int64_t>(r.seed)));
  LS_RETURN_IF_ERROR(h5::WriteAttr(g.get(), kAttrTemperature, r.temperature));
  LS_RETURN_IF_ERROR(h5::WriteAttr(g.get(), kAttrTopK, r.top_k));
  LS_RETURN_IF_ERROR(h5::WriteAttr(g.get(), kAttrTopP, r.top_p));
  LS_RETURN_IF_ERROR(h5::WriteAttr(g.get(), kAttrMinP, r.min_p));
  const hsize_t n = r.prompt.size();
  h5::Hid space(H5Screate_simple(1, &n, nullptr));
  h5::Hid dcpl = h5::CreationProps(H5P_DATASET_CREATE);
  h5::Hid d(H5Dcreate2(g.get(), kPromptDataset, H5T_STD_I32LE, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT));
  if (!d.valid() || (n > 0 && H5Dwrite(d.get(), H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, r.prompt.data()) < 0)) {
    return h5::Error(path_.string() + ": request " + name + ": prompt");
  }
  return Status::Ok();
}

Status TraceWriter::Impl::DoFinishRequest(const Command& c) {
  const std::string name = std::to_string(c.request.id);
  LS_ASSIGN_OR_RETURN(h5::Hid g, h5::OpenGroup(requests_.get(), name + "/" + kFinalGroup));
  const std::vector<int32_t>& gen = c.request.prompt;
  const hsize_t n = gen.size();
  h5::Hid space(H5Screate_simple(1, &n, nullptr));
  h5::Hid dcpl = h5::CreationProps(H5P_DATASET_CREATE);
  h5::Hid d(H5Dcreate2(g.get(), kGeneratedDataset, H5T_STD_I32LE, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT));
  if (!d.valid() || (n > 0 && H5Dwrite(d.get(), H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, gen.data()) < 0)) {
    return h5::Error(path_.string() + ": request " + name + ": generated");
  }
  LS_RETURN_IF_ERROR(h5::WriteStringDataset(g.get(), kGeneratedTextDataset, c.value));
  LS_RETURN_IF_ERROR(h5::WriteAttr(g.get(), kAttrFinishReason, c.key));
  return Status::Ok();
}

// ---- TraceWriter: the caller's side ----

Result<std::unique_ptr<TraceWriter>> TraceWriter::Create(const std::filesystem::path& path,
                                                         TraceWriterOptions options) {
  if (options.zstd_level < 1 || options.zstd_level > 22) {
    return Status::InvalidArgument("zstd level " + std::to_string(options.zstd_level) + " outside 1..22");
  }
  if (options.alloc_block_bytes < 2048 || options.alloc_block_bytes > (1ll << 30)) {
    return Status::InvalidArgument("alloc_block_bytes must be in 2 KiB..1 GiB");
  }
  if (options.compression_threads < 0 || options.compression_threads > 64) {
    return Status::InvalidArgument("compression threads must be in 0..64");
  }
  std::unique_ptr<TraceWriter> w(new TraceWriter());
  w->batch_width_ = std::max<int64_t>(1, options.batch_width);
  w->impl_ = std::make_unique<Impl>(std::move(options));
  LS_RETURN_IF_ERROR(w->impl_->Open(path));
  w->impl_->Start();
  return w;
}

// A destructor cannot report: a caller that needs the outcome calls Close() first (then this
// one does nothing); a failed close leaves the trace as of its last flush, marked incomplete.
TraceWriter::~TraceWriter() { (void)Close(); }

Status TraceWriter::Enqueue(Command cmd) {
  if (closed_) return Status::Internal("trace writer already closed");
  if (impl_->failed.load(std::memory_order_relaxed)) return impl_->error();
  const int64_t bytes = static_cast<int64_t>(cmd.bytes.size());
  impl_->pending.push_back(std::move(cmd));
  impl_->pending_bytes += bytes;
  if (impl_->pending_bytes >= kSubmitBytes) Submit();
  return Status::Ok();
}

void TraceWriter::Submit() {
  if (closed_) return;
  int64_t stall = 0;
  impl_->Submit(&stall);
  if (stall) stall_ns_ += stall;
}

Status TraceWriter::SetMeta(const std::string& key, const std::string& value) {
  if (key.empty() || key.find('/') != std::string::npos || key == ".") {
    return Status::InvalidArgument("meta key '" + key + "': must be non-empty without '/'");
  }
  Command c(Command::Kind::kMeta);
  c.key = key;
  c.value = value;
  return Enqueue(std::move(c));
}

Status TraceWriter::AddRequest(const RequestRecord& request) {
  Command c(Command::Kind::kAddRequest);
  c.request = request;
  return Enqueue(std::move(c));
}

Status TraceWriter::FinishRequest(int32_t id, std::span<const int32_t> generated, const std::string& generated_text,
                                  const std::string& finish_reason) {
  Command c(Command::Kind::kFinishRequest);
  c.request.id = id;
  c.request.prompt.assign(generated.begin(), generated.end());
  c.value = generated_text;
  c.key = finish_reason;
  return Enqueue(std::move(c));
}

Result<int32_t> TraceWriter::DefineTensor(const TensorSpec& spec) {
  if (spec.path.empty() || spec.path.front() == '/' || spec.path.back() == '/' ||
      spec.path.find("//") != std::string::npos) {
    return Status::InvalidArgument("tensor path '" + spec.path + "': must be relative like 'taps/name'");
  }
  if (spec.cols <= 0 || spec.cols > (1 << 26)) {
    return Status::InvalidArgument("tensor '" + spec.path + "': cols " + std::to_string(spec.cols) + " out of range");
  }
  for (const auto& t : tensors_) {
    if (t.path == spec.path) return Status::InvalidArgument("tensor '" + spec.path + "' defined twice");
  }
  Command c(Command::Kind::kDefineTensor);
  c.tensor = spec;
  LS_RETURN_IF_ERROR(Enqueue(std::move(c)));
  summary_table_.push_back(next_table_);
  next_table_ += spec.values ? 2 : 1;
  tensors_.push_back(spec);
  return static_cast<int32_t>(tensors_.size() - 1);
}

// The command the next rows go into: the open one, else a new one on a recycled buffer.
Command& TraceWriter::AppendCommand(size_t bytes) {
  auto& pending = impl_->pending;
  if (pending.empty() || pending.back().kind != Command::Kind::kAppend) {
    pending.emplace_back(Command::Kind::kAppend);
    std::vector<uint8_t>& buf = pending.back().bytes;
    buf = impl_->TakeBuffer();
    buf.clear();
    buf.reserve(std::max<size_t>(static_cast<size_t>(append_reserve_), bytes));
    pending.back().entries.reserve(entries_reserve_);
  }
  return pending.back();
}

void TraceWriter::NoteAppended(const Command& c) {
  append_reserve_ = std::max<int64_t>(append_reserve_, static_cast<int64_t>(c.bytes.size()));
  entries_reserve_ = std::max(entries_reserve_, c.entries.size());
}

Status TraceWriter::AppendRows(int32_t table, const void* data, size_t bytes) {
  if (closed_) return Status::Internal("trace writer already closed");
  if (impl_->failed.load(std::memory_order_relaxed)) return impl_->error();
  Command& c = AppendCommand(bytes);
  const auto* b = static_cast<const uint8_t*>(data);
  c.bytes.insert(c.bytes.end(), b, b + bytes);
  c.entries.push_back({table, bytes});
  NoteAppended(c);
  impl_->pending_bytes += static_cast<int64_t>(bytes);
  bytes_in_ += static_cast<int64_t>(bytes);
  if (impl_->pending_bytes >= kSubmitBytes) Submit();
  return Status::Ok();
}

Status TraceWriter::AppendToSummarize(int32_t tensor, int32_t request, int32_t step,
                                      std::span<const int64_t> positions, const void* values,
                                      const LogitsTopKTensors* topk, std::shared_ptr<const void> values_owner) {
  if (tensor < 0 || tensor >= static_cast<int32_t>(tensors_.size())) {
    return Status::InvalidArgument("unknown tensor handle " + std::to_string(tensor));
  }
  if (topk != nullptr) {
    const TensorSpec& lg = tensors_[tensor];
    if (lg.dtype != DType::kF32 || topk->k < 1 || topk->k > lg.cols) {
      return Status::InvalidArgument("tensor '" + lg.path + "': top-k needs f32 rows and 1 ≤ k ≤ cols");
    }
    const int32_t parts[3] = {topk->ids, topk->values, topk->logsumexp};
    const DType want[3] = {DType::kI32, DType::kF32, DType::kF32};
    const int64_t cols[3] = {topk->k, topk->k, 1};
    for (int j = 0; j < 3; ++j) {
      if (parts[j] < 0 || parts[j] >= static_cast<int32_t>(tensors_.size()) || !tensors_[parts[j]].values ||
          tensors_[parts[j]].dtype != want[j] || tensors_[parts[j]].cols != cols[j]) {
        return Status::InvalidArgument("top-k tensor handle " + std::to_string(parts[j]) + " of '" + lg.path +
                                       "': needs a stored " + DTypeName(want[j]) + " tensor of " +
                                       std::to_string(cols[j]) + " columns");
      }
    }
  }
  if (positions.empty()) return Status::Ok();
  if (closed_) return Status::Internal("trace writer already closed");
  if (impl_->failed.load(std::memory_order_relaxed)) return impl_->error();
  const TensorSpec& spec = tensors_[tensor];
  const int64_t rows = static_cast<int64_t>(positions.size());
  const size_t value_bytes = rows * spec.cols * DTypeSize(spec.dtype);
  const size_t inline_value_bytes = values_owner ? 0 : value_bytes;  // an owner: read in place
  Command& c = AppendCommand(16 + 8 * positions.size() + inline_value_bytes);
  const size_t n = 16 + 8 * positions.size() + inline_value_bytes;
  // Appended with insert, not resize + memcpy: resize would zero the bytes first (a second
  // pass over every tap value on the engine's thread).
  uint8_t head[16];
  std::memcpy(head, &request, 4);
  std::memcpy(head + 4, &step, 4);
  std::memcpy(head + 8, &rows, 8);
  const auto* pos = reinterpret_cast<const uint8_t*>(positions.data());
  const auto* val = static_cast<const uint8_t*>(values);
  c.bytes.insert(c.bytes.end(), head, head + 16);
  c.bytes.insert(c.bytes.end(), pos, pos + 8 * positions.size());
  c.bytes.insert(c.bytes.end(), val, val + inline_value_bytes);
  Command::Entry e{summary_table_[tensor], n};
  if (values_owner) {
    e.ext_values = val;
    e.ext_bytes = value_bytes;
    e.ext_owner = std::move(values_owner);
    impl_->pending_borrows = true;
  }
  e.summarize = true;
  e.store_values = spec.values;
  e.dtype = spec.dtype;
  e.cols = spec.cols;
  if (topk != nullptr) {
    e.topk_tables[0] = summary_table_[topk->ids];
    e.topk_tables[1] = summary_table_[topk->values];
    e.topk_tables[2] = summary_table_[topk->logsumexp];
    e.topk = topk->k;
    bytes_in_ += rows * static_cast<int64_t>(3 * sizeof(SummaryRow) + (2 * topk->k + 1) * 4);
  }
  c.entries.push_back(std::move(e));
  NoteAppended(c);
  impl_->pending_bytes += static_cast<int64_t>(n);
  bytes_in_ += static_cast<int64_t>(spec.values ? value_bytes + rows * sizeof(SummaryRow) : rows * sizeof(SummaryRow));
  if (impl_->pending_bytes >= kSubmitBytes) Submit();
  return Status::Ok();
}

Status TraceWriter::Append(int32_t tensor, std::span<const SummaryRow> summaries, const void* values,
                           std::shared_ptr<const void> values_owner) {
  if (tensor < 0 || tensor >= static_cast<int32_t>(tensors_.size())) {
    return Status::InvalidArgument("unknown tensor handle " + std::to_string(tensor));
  }
  if (summaries.empty()) return Status::Ok();
  const TensorSpec& spec = tensors_[tensor];
  const int32_t table = summary_table_[tensor];
  if (spec.values && !values) return Status::InvalidArgument("tensor '" + spec.path + "': values missing");
  if (!spec.values || !values_owner) {
    LS_RETURN_IF_ERROR(AppendRows(table, summaries.data(), summaries.size_bytes()));
    if (!spec.values) return Status::Ok();
    return AppendRows(table + 1, values, summaries.size() * spec.cols * DTypeSize(spec.dtype));
  }
  // Lent values: the entry carries where the rows are and their owner, not the rows.
  if (closed_) return Status::Internal("trace writer already closed");
  if (impl_->failed.load(std::memory_order_relaxed)) return impl_->error();
  const size_t bytes = summaries.size() * spec.cols * DTypeSize(spec.dtype);
  const auto* sum = reinterpret_cast<const uint8_t*>(summaries.data());
  Command& c = AppendCommand(summaries.size_bytes());
  const size_t n = c.entries.size();
  // Rows that continue this tensor's previous call — the command ends with its summary rows
  // (the bytes' last entry) and its lent rows in the same buffer, just before these (a step's
  // requests appended one at a time, back to back in the backend's buffer) — extend both
  // entries: one append of each table for the step, and whole chunks form where the rows lie.
  if (n >= 2) {
    Command::Entry& s_prev = c.entries[n - 2];
    Command::Entry& v_prev = c.entries[n - 1];
    if (s_prev.table == table && !s_prev.summarize && s_prev.scatter_rows == 0 && s_prev.ext_values == nullptr &&
        v_prev.table == table + 1 && !v_prev.summarize && v_prev.ext_values != nullptr &&
        v_prev.ext_owner == values_owner && v_prev.ext_values + v_prev.ext_bytes == static_cast<const uint8_t*>(values)) {
      c.bytes.insert(c.bytes.end(), sum, sum + summaries.size_bytes());
      s_prev.bytes += summaries.size_bytes();
      v_prev.ext_bytes += bytes;
      NoteAppended(c);
      impl_->pending_bytes += static_cast<int64_t>(summaries.size_bytes());
      bytes_in_ += static_cast<int64_t>(summaries.size_bytes() + bytes);
      if (impl_->pending_bytes >= kSubmitBytes) Submit();
      return Status::Ok();
    }
  }
  c.bytes.insert(c.bytes.end(), sum, sum + summaries.size_bytes());
  c.entries.push_back({table, summaries.size_bytes()});
  Command::Entry e{table + 1, 0};
  e.ext_values = static_cast<const uint8_t*>(values);
  e.ext_bytes = bytes;
  e.ext_owner = std::move(values_owner);
  c.entries.push_back(std::move(e));
  NoteAppended(c);
  impl_->pending_borrows = true;
  impl_->pending_bytes += static_cast<int64_t>(summaries.size_bytes());
  bytes_in_ += static_cast<int64_t>(summaries.size_bytes() + bytes);
  if (impl_->pending_bytes >= kSubmitBytes) Submit();
  return Status::Ok();
}

Status TraceWriter::AppendSummaries(std::span<const int32_t> tensors, std::span<const SummaryRow> summaries) {
  if (tensors.size() != summaries.size()) {
    return Status::InvalidArgument("AppendSummaries: " + std::to_string(tensors.size()) + " tensor handles for " +
                                   std::to_string(summaries.size()) + " summary rows");
  }
  for (const int32_t t : tensors) {
    if (t < 0 || t >= static_cast<int32_t>(tensors_.size())) {
      return Status::InvalidArgument("unknown tensor handle " + std::to_string(t));
    }
    if (tensors_[t].values) {
      return Status::InvalidArgument("tensor '" + tensors_[t].path + "' stores values: AppendSummaries takes summary-only tensors");
    }
  }
  if (summaries.empty()) return Status::Ok();
  if (closed_) return Status::Internal("trace writer already closed");
  if (impl_->failed.load(std::memory_order_relaxed)) return impl_->error();
  // One entry for all of them (Command::Entry::scatter_rows): their tables, then the rows.
  const size_t n = summaries.size();
  const size_t bytes = 4 * n + summaries.size_bytes();
  Command& c = AppendCommand(bytes);
  const size_t at = c.bytes.size();
  c.bytes.resize(at + 4 * n);  // (the table indices: written just below)
  uint8_t* tables = c.bytes.data() + at;
  for (size_t i = 0; i < n; ++i) std::memcpy(tables + 4 * i, &summary_table_[tensors[i]], 4);
  const auto* b = reinterpret_cast<const uint8_t*>(summaries.data());
  c.bytes.insert(c.bytes.end(), b, b + summaries.size_bytes());
  Command::Entry e{-1, bytes};
  e.scatter_rows = n;
  c.entries.push_back(std::move(e));
  NoteAppended(c);
  impl_->pending_bytes += static_cast<int64_t>(bytes);
  bytes_in_ += static_cast<int64_t>(summaries.size_bytes());
  if (impl_->pending_bytes >= kSubmitBytes) Submit();
  return Status::Ok();
}

Status TraceWriter::AppendSampling(const SamplingRow& row) { return AppendRows(0, &row, sizeof row); }

Status TraceWriter::AppendStep(const StepRow& row, std::span<const int64_t> batch) {
  LS_RETURN_IF_ERROR(AppendRows(1, &row, sizeof row));
  std::vector<int64_t> padded(static_cast<size_t>(batch_width_), -1);
  for (size_t i = 0; i < batch.size() && i < padded.size(); ++i) padded[i] = batch[i];
  return AppendRows(2, padded.data(), padded.size() * sizeof(int64_t));
}

Status TraceWriter::Flush(int64_t flushed_steps) {
  Command c(Command::Kind::kFlush);
  c.steps = flushed_steps;
  LS_RETURN_IF_ERROR(Enqueue(std::move(c)));
  Submit();
  return Status::Ok();
}

Status TraceWriter::Close() {
  if (closed_ || !impl_) return impl_ ? impl_->error() : Status::Ok();
  Command c(Command::Kind::kClose);
  int64_t stall = 0;
  impl_->Push(std::move(c), &stall);
  impl_->Join();
  closed_ = true;
  return impl_->error();
}

Status TraceWriter::status() const { return impl_->error(); }

TraceWriter::ThreadTimes TraceWriter::thread_times() const {
  ThreadTimes t;
  t.append_ns = impl_->t_append.load();
  t.derive_wait_ns = impl_->t_derive_wait.load();
  t.write_ns = impl_->t_write.load();
  t.flush_ns = impl_->t_flush.load();
  t.chunks = impl_->t_chunks.load();
  return t;
}

}  // namespace lockstep::traces
