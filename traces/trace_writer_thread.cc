// traces/trace_writer_thread.cc — TraceWriter's writer thread and compression workers
// (trace_writer_impl.h): the loop that takes the caller's commands in order, tables, the rows
// derived from summarize entries (summaries, the logits' top-k), and appends that hand full
// chunks to the workers. What then reaches the files is trace_writer_storage.cc.
#include <algorithm>
#include <cstring>

#include "traces/trace_writer_impl.h"
#include "traces/zstd_filter.h"

namespace lockstep::traces {

// A summarize entry's rows: after its head and positions in the command, or the caller's.
const uint8_t* EntryValues(const Command::Entry& e, const uint8_t* data) {
  int64_t rows;
  std::memcpy(&rows, data + 8, 8);
  return e.ext_values != nullptr ? e.ext_values : data + 16 + 8 * rows;
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
  // A row so wide that 8 of them pass the format's decoded chunk limit (kMaxChunkDecodedBytes)
  // gets fewer rows a chunk (a 2^22-column f32 row: 4).
  int64_t rows = 8;
  while (rows < kMaxChunkRows && static_cast<int64_t>(rows * 2 * t->row_bytes) <= opts_.target_chunk_bytes) rows *= 2;
  while (rows > 1 && static_cast<int64_t>(rows * t->row_bytes) > kMaxChunkDecodedBytes) rows /= 2;
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
  if (!spec.shard_files.empty()) LS_RETURN_IF_ERROR(DefineShardedValues(spec, g.get()));
  if (spec.values) {
    LS_ASSIGN_OR_RETURN(int32_t v, MakeTable(spec.path + "/" + kValuesDataset, h5::Hid(H5Tcopy(ValueType(spec.dtype))),
                                             spec.cols, file_.get()));
    LS_RETURN_IF_ERROR(h5::WriteAttr(tables_[v]->dset.get(), kAttrDType, std::string(DTypeName(spec.dtype))));
  }
  return Status::Ok();
}

// A sharded tensor's `values`: a virtual dataset [rows, cols] (rows unlimited: its extent follows
// the shards') whose column block r is shard r's taps/<name>/values [rows, cols / N]. Written once
// with the tensor; only readers resolve it (HDF5 looks for the shards beside this file).
Status TraceWriter::Impl::DefineShardedValues(const TensorSpec& spec, hid_t group) {
  const int64_t n = static_cast<int64_t>(spec.shard_files.size()), w = spec.cols / n;
  LS_RETURN_IF_ERROR(h5::WriteAttr(group, kAttrShards, n));
  const std::string src = spec.path + "/" + kValuesDataset;
  const hsize_t dims[2] = {0, static_cast<hsize_t>(spec.cols)}, max[2] = {H5S_UNLIMITED, dims[1]};
  const hsize_t sdims[2] = {0, static_cast<hsize_t>(w)}, smax[2] = {H5S_UNLIMITED, sdims[1]};
  h5::Hid vspace(H5Screate_simple(2, dims, max)), sspace(H5Screate_simple(2, sdims, smax));
  h5::Hid dcpl = h5::CreationProps(H5P_DATASET_CREATE);
  if (!vspace.valid() || !sspace.valid() || !dcpl.valid()) return h5::Error(src + ": virtual dataset spaces");
  const hsize_t start0[2] = {0, 0}, count[2] = {H5S_UNLIMITED, 1}, block[2] = {1, static_cast<hsize_t>(w)};
  if (H5Sselect_hyperslab(sspace.get(), H5S_SELECT_SET, start0, nullptr, count, block) < 0) {
    return h5::Error(src + ": shard selection");
  }
  for (int64_t r = 0; r < n; ++r) {
    const hsize_t start[2] = {0, static_cast<hsize_t>(r * w)};
    if (H5Sselect_hyperslab(vspace.get(), H5S_SELECT_SET, start, nullptr, count, block) < 0 ||
        H5Pset_virtual(dcpl.get(), vspace.get(), spec.shard_files[r].c_str(), src.c_str(), sspace.get()) < 0) {
      return h5::Error(src + ": mapping of shard " + std::to_string(r));
    }
  }
  h5::Hid type(H5Tcopy(ValueType(spec.dtype)));
  h5::Hid d(H5Dcreate2(file_.get(), src.c_str(), type.get(), vspace.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT));
  if (!d.valid()) return h5::Error(path_.string() + ": cannot create virtual dataset '" + src + "'");
  return h5::WriteAttr(d.get(), kAttrDType, std::string(DTypeName(spec.dtype)));
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
  if (e.lse_t_table < 0) return;
  out->logsumexp_t.resize(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) {
    out->logsumexp_t[i] = LogitsLogSumExp(reinterpret_cast<const float*>(values + i * row_bytes), e.cols, e.temperature);
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
    if (e.lse_t_table >= 0) {
      SummaryRow sr = d.summaries[i];
      Summarize(DType::kF32, &d.logsumexp_t[i], 1, &sr);
      LS_RETURN_IF_ERROR(DoAppend(*tables_[e.lse_t_table], reinterpret_cast<const uint8_t*>(&sr), sizeof(SummaryRow)));
      LS_RETURN_IF_ERROR(DoAppend(*tables_[e.lse_t_table + 1], reinterpret_cast<const uint8_t*>(&d.logsumexp_t[i]), 4));
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

}  // namespace lockstep::traces
