// traces/trace_writer_storage.cc — what TraceWriter's writer thread puts in the files
// (trace_writer_impl.h): compressed chunks and their extents, the chunk directory, the tails
// sidecar, flushes, publishing a file under its final name, the close, and the requests'
// groups — each a step of the crash-safety protocol of docs/trace-format.md ("Crash safety").
#include <algorithm>
#include <cerrno>
#include <cstring>

#include <unistd.h>

#include "traces/trace_writer_impl.h"
#include "traces/zstd_filter.h"

namespace lockstep::traces {

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

}  // namespace lockstep::traces
