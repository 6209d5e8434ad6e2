// traces/trace_writer.cc — see trace_writer.h. The caller's side of the writer (the calls that
// queue commands), opening the file, and handing commands to the writer thread
// (trace_writer_thread.cc), whose writes to the files are in trace_writer_storage.cc. The
// writer's protocol for crash safety is described in docs/trace-format.md ("Crash safety");
// the comments here say which step of it each piece of code is.
#include "traces/trace_writer.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

#include <fcntl.h>
#include <unistd.h>

#include "traces/trace_writer_impl.h"
#include "traces/zstd_filter.h"

namespace lockstep::traces {

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

std::filesystem::path ShardPath(const std::filesystem::path& trace, int rank) {
  std::filesystem::path p = trace;
  p += ".rank" + std::to_string(rank);
  return p;
}

std::filesystem::path PartialPath(const std::filesystem::path& file) {
  std::filesystem::path p = file;
  p += ".partial";
  return p;
}

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
  // The format's limits (trace_format.h) are refused here, not written: a reader refuses them.
  if (options.batch_width > kMaxBatchWidth) {
    return Status::InvalidArgument("a batch of " + std::to_string(options.batch_width) +
                                   " requests: a trace holds at most " + std::to_string(kMaxBatchWidth) +
                                   " a step (--max-batch)");
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
  // What the reader checks, refused before it is written (trace_format.h).
  const std::string who = "request '" + request.name + "' (" + std::to_string(request.id) + "): ";
  if (request.id < 0) return Status::InvalidArgument(who + "a request id is ≥ 0");
  if (static_cast<int64_t>(request.prompt.size()) > kMaxRequestTokens ||
      request.max_new_tokens > kMaxRequestTokens || request.max_new_tokens < 0) {
    return Status::InvalidArgument(who + "prompt of " + std::to_string(request.prompt.size()) +
                                   " tokens, max_new_tokens " + std::to_string(request.max_new_tokens) +
                                   ": a trace holds at most 2^26 (" + std::to_string(kMaxRequestTokens) + ") of each");
  }
  if (static_cast<int64_t>(request.prompt_text.size()) > kMaxTextBytes) {
    return Status::InvalidArgument(who + "a prompt text of more than 1 GiB");
  }
  if (!(request.temperature >= 0 && request.temperature <= kMaxTemperature) || !(request.top_p >= 0 && request.top_p <= 1) ||
      !(request.min_p >= 0 && request.min_p <= 1) || request.top_k < 0 || request.top_k > kMaxTopK) {
    return Status::InvalidArgument(who + "sampling parameters outside what a trace holds (temperature in [0, 1e6], "
                                   "top_p and min_p in [0, 1], top_k in [0, 2^26])");
  }
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
  if (spec.cols <= 0 || spec.cols > kMaxCols) {
    return Status::InvalidArgument("tensor '" + spec.path + "': " + std::to_string(spec.cols) +
                                   " columns; a trace holds 1 to 2^22 (" + std::to_string(kMaxCols) + ")");
  }
  // A layer index is what the reader accepts: digits, below kMaxLayer.
  if (const size_t at = spec.path.find("/layers."); at != std::string::npos) {
    const size_t b = at + 8, e = spec.path.find('.', b);
    const std::string num = spec.path.substr(b, e == std::string::npos ? std::string::npos : e - b);
    if (num.empty() || num.size() > 6 || num.find_first_not_of("0123456789") != std::string::npos ||
        std::stoll(num) >= kMaxLayer) {
      return Status::InvalidArgument("tensor '" + spec.path + "': layer index '" + num + "' is not a number below " +
                                     std::to_string(kMaxLayer));
    }
  }
  for (const auto& t : tensors_) {
    if (t.path == spec.path) return Status::InvalidArgument("tensor '" + spec.path + "' defined twice");
  }
  if (!spec.shard_files.empty()) {
    const int64_t n = static_cast<int64_t>(spec.shard_files.size());
    if (spec.values || n < 2 || n > kMaxShards || spec.cols % n != 0) {
      return Status::InvalidArgument("tensor '" + spec.path + "': " + std::to_string(n) +
                                     " rank shards need 2 to 64 of them, its " + std::to_string(spec.cols) +
                                     " columns divisible among them, and no values here");
    }
    for (const auto& f : spec.shard_files) {
      if (!IsShardFileName(f)) return Status::InvalidArgument("tensor '" + spec.path + "': shard file '" + f + "' is not a plain file name");
    }
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
    if (topk->logsumexp_t >= 0) {
      const int32_t h = topk->logsumexp_t;
      if (h >= static_cast<int32_t>(tensors_.size()) || !tensors_[h].values || tensors_[h].dtype != DType::kF32 ||
          tensors_[h].cols != 1 || !(topk->temperature > 0) || !std::isfinite(topk->temperature)) {
        return Status::InvalidArgument("logsumexp_t tensor handle " + std::to_string(h) + " of '" + lg.path +
                                       "': needs a stored f32 tensor of 1 column and a temperature > 0");
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
    if (topk->logsumexp_t >= 0) {
      e.lse_t_table = summary_table_[topk->logsumexp_t];
      e.temperature = topk->temperature;
      bytes_in_ += rows * static_cast<int64_t>(sizeof(SummaryRow) + 4);
    }
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
