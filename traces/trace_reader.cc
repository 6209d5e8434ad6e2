// traces/trace_reader.cc — see trace_reader.h.
#include "traces/trace_reader.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <fstream>

#include "traces/row_summary.h"
#include "traces/trace_types.h"
#include "traces/trace_writer.h"
#include "traces/zstd_filter.h"

namespace lockstep::traces {
namespace {

// A table claiming more rows than this is refused at open, whatever its chunks say:
// 2^40 rows is far past any trace (a million tokens × a million rows each).
constexpr int64_t kMaxRows = 1ll << 40;

std::string Join(const std::string& a, const std::string& b) { return a + "/" + b; }

}  // namespace

Status TraceReader::Err(const Status& s) const { return s.WithContext(path_.string() + ": "); }

Result<std::unique_ptr<TraceReader>> TraceReader::Open(const std::filesystem::path& path) {
  return OpenAs(path, false);
}

Result<std::unique_ptr<TraceReader>> TraceReader::OpenAs(const std::filesystem::path& path, bool shard) {
  std::unique_ptr<TraceReader> r(new TraceReader());
  r->path_ = path;
  r->as_shard_ = shard;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return Status::NotFound(path.string() + ": no such trace file");
  }
  r->file_bytes_ = static_cast<int64_t>(std::filesystem::file_size(path, ec));
  LS_RETURN_IF_ERROR(RegisterZstdFilter());
  h5::Quiet();
  const htri_t is_h5 = H5Fis_hdf5(path.c_str());
  if (is_h5 <= 0) {
    h5::LastError();
    return Status::Corruption(path.string() + ": not an HDF5 file (no HDF5 signature), so not a lockstep trace");
  }
  r->file_ = h5::Hid(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  if (!r->file_.valid()) {
    const std::string why = h5::LastError();
    return Status::Corruption(path.string() + ": cannot open (truncated, damaged, or still being written?)" +
                              (why.empty() ? "" : ": " + why));
  }
  LS_RETURN_IF_ERROR(r->Err(r->Load()));
  return r;
}

// The tails of an incomplete trace. Best effort by design: a sidecar that cannot be read
// costs only the rows after the last full chunk, never the trace.
void TraceReader::LoadTails(const std::filesystem::path& side) {
  tails_file_ = h5::Hid(H5Fopen(side.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  if (!tails_file_.valid()) {
    h5::LastError();
    notes_.push_back(side.string() + ": unreadable, rows after the last full chunk are lost");
    return;
  }
  const hid_t tf = tails_file_.get();
  auto tails = h5::OpenGroup(tf, kTailsGroup);
  auto names = tails.ok() ? h5::LinkNames(tails->get()) : Result<std::vector<std::string>>(tails.status());
  if (!names.ok()) {
    notes_.push_back(side.string() + ": " + names.status().message());
    return;
  }
  for (const auto& n : *names) {
    const std::string p = Join(kTailsGroup, n);
    auto d = h5::OpenDataset(tf, p);
    if (!d.ok()) continue;
    auto target = h5::ReadStringAttr(d->get(), kAttrTailTarget);
    auto base = h5::ReadIntAttr(d->get(), kAttrTailBase);
    auto count = h5::ReadIntAttr(d->get(), kAttrTailCount);
    auto dims = h5::Dims(d->get(), 2);
    if (!target.ok() || !base.ok() || !count.ok() || !dims.ok() || dims->empty() || *count <= 0) continue;
    // A tail holds at most one chunk of rows (kMaxChunkRows), and only rows stored in the
    // sidecar: an unallocated tail claiming 2^25 rows is not read as gigabytes of fill.
    const hsize_t row_bytes = H5Dget_storage_size(d->get()) / std::max<hsize_t>((*dims)[0], 1);
    if (*base < 0 || *base > kMaxRows || *count > static_cast<int64_t>((*dims)[0]) || *count > kMaxChunkRows ||
        row_bytes == 0) {
      notes_.push_back(side.string() + ": " + p + ": base/count outside the tail, ignored");
      continue;
    }
    tails_[*target] = {p, {*base, *count}};
  }
}

// The chunk directory of an incomplete trace: where each full chunk of each table was
// written. Whole records only (a kill can cut the last one short); best effort like the tails.
void TraceReader::LoadChunkDirectory(const std::filesystem::path& side) {
  std::ifstream in(side, std::ios::binary);
  char magic[sizeof kChunksMagic] = {};
  if (!in.read(magic, sizeof magic) || std::memcmp(magic, kChunksMagic, sizeof magic) != 0) {
    notes_.push_back(side.string() + ": not a chunk directory, ignored");
    return;
  }
  ChunkRecord r;
  int64_t torn = 0;
  while (in.read(reinterpret_cast<char*>(&r), sizeof r)) {
    if (r.check != static_cast<uint32_t>(ContentHash(&r, offsetof(ChunkRecord, check))) || r.index < 0 ||
        r.index > kMaxRows) {
      ++torn;
      continue;
    }
    chunk_dir_[r.table][r.index] = r;
  }
  if (torn) notes_.push_back(side.string() + ": " + std::to_string(torn) + " damaged records ignored");
}

Status TraceReader::Load() {
  const hid_t f = file_.get();
  auto magic = h5::ReadStringAttr(f, kAttrMagic);
  if (!magic.ok() || *magic != kMagicValue) {
    return Status::Corruption(std::string("not a lockstep trace (root attribute '") + kAttrMagic + "' missing)");
  }
  auto version_attr = h5::ReadIntsAttr(f, kAttrFormatVersion, 2);
  if (!version_attr.ok()) {
    return Status::Corruption(std::string("root attribute '") + kAttrFormatVersion + "' missing or malformed");
  }
  const std::vector<int64_t>& version = *version_attr;
  if (version.size() != 2 || version[0] < 0 || version[1] < 0 || version[0] > INT32_MAX || version[1] > INT32_MAX) {
    return Status::Corruption(std::string("root attribute '") + kAttrFormatVersion + "' must be [major, minor]");
  }
  major_ = static_cast<int32_t>(version[0]);
  minor_ = static_cast<int32_t>(version[1]);
  if (major_ > kFormatMajor) {
    return Status::Unsupported("trace format " + std::to_string(major_) + "." + std::to_string(minor_) +
                               " is newer than this lockstep reads (" + std::to_string(kFormatMajor) +
                               ".x); open it with a newer lockstep");
  }
  if (major_ < 1) return Status::Corruption("format_version " + std::to_string(major_) + " was never written");
  auto complete = h5::ReadIntAttr(f, kAttrComplete);
  complete_ = complete.ok() && *complete == 1;
  auto flushed = h5::ReadIntAttr(f, kAttrFlushedSteps);
  flushed_steps_ = flushed.ok() ? *flushed : 0;
  auto writer = h5::ReadStringAttr(f, kAttrWriter);
  if (writer.ok()) writer_ = *writer;

  // /meta: string attributes.
  {
    LS_ASSIGN_OR_RETURN(h5::Hid meta, h5::OpenGroup(f, kMetaGroup));
    LS_ASSIGN_OR_RETURN(std::vector<std::string> names, h5::AttrNames(meta.get()));
    for (const auto& n : names) {
      auto v = h5::ReadStringAttr(meta.get(), n);
      if (!v.ok()) return v.status().WithContext(std::string(kMetaGroup) + "/" + n + ": ");
      meta_[n] = *v;
    }
  }

  // The sidecar <trace>.tails: the unfinished chunks of a trace that did not close.
  const std::filesystem::path side = TailsPath(path_);
  std::error_code ec;
  if (!complete_ && std::filesystem::exists(side, ec)) LoadTails(side);
  if (!complete_ && std::filesystem::exists(ChunksPath(path_), ec)) LoadChunkDirectory(ChunksPath(path_));

  LS_RETURN_IF_ERROR(LoadShards());
  LS_RETURN_IF_ERROR(LoadTensors(kTapsGroup));
  LS_RETURN_IF_ERROR(LoadTensors(kKvGroup));
  {
    LS_ASSIGN_OR_RETURN(Table t, InspectTable(kSamplingTable, 0, SamplingType().get()));
    tables_[t.path] = t;
  }
  {
    LS_ASSIGN_OR_RETURN(Table t, InspectTable(kStepsTable, 0, StepType().get()));
    tables_[t.path] = t;
  }
  {
    LS_ASSIGN_OR_RETURN(h5::Hid d, h5::OpenDataset(f, kStepBatchTable));
    LS_ASSIGN_OR_RETURN(std::vector<hsize_t> dims, h5::Dims(d.get(), 2));
    if (dims.size() != 2 || dims[1] == 0 || dims[1] > static_cast<hsize_t>(kMaxBatchWidth)) {
      return Status::Corruption(std::string(kStepBatchTable) + ": expected [steps, batch width ≤ " +
                                std::to_string(kMaxBatchWidth) + "]");
    }
    LS_ASSIGN_OR_RETURN(Table t, InspectTable(kStepBatchTable, static_cast<int64_t>(dims[1]), H5T_STD_I64LE));
    tables_[t.path] = t;
  }
  return LoadRequests();
}

// Checks one table against what it claims: rank, element type, row count versus the chunks
// actually stored (a shape of petabytes with a few chunks behind it is refused here).
Result<TraceReader::Table> TraceReader::InspectTable(const std::string& path, int64_t cols, hid_t expected_type) {
  const size_t element_size = H5Tget_size(expected_type);
  const hid_t f = file_.get();
  LS_ASSIGN_OR_RETURN(h5::Hid d, h5::OpenDataset(f, path));
  Table t;
  t.path = path;
  t.cols = cols;
  t.element_size = element_size;
  auto dims_r = h5::Dims(d.get(), 2);
  if (!dims_r.ok()) return dims_r.status().WithContext(path + ": ");
  std::vector<hsize_t> dims = *dims_r;
  const size_t want_rank = cols > 0 ? 2 : 1;
  if (dims.size() != want_rank || (cols > 0 && dims[1] != static_cast<hsize_t>(cols))) {
    return Status::Corruption(path + ": shape does not match " + (cols > 0 ? "[rows, " + std::to_string(cols) + "]" : "[rows]"));
  }
  // The stored type must be exactly the one this format writes (the same members at the same
  // offsets): reads then need no conversion, and a damaged type description never reaches
  // HDF5's converters (which trust it).
  h5::Hid type(H5Dget_type(d.get()));
  if (!type.valid() || H5Tequal(type.get(), expected_type) <= 0) {
    h5::LastError();
    return Status::Corruption(path + ": element type is not the one this format stores (" +
                              std::to_string(element_size) + "-byte " +
                              (H5Tget_class(expected_type) == H5T_COMPOUND ? "record" : "number") + ")");
  }
  h5::Hid dcpl(H5Dget_create_plist(d.get()));
  hsize_t chunk[2] = {0, 0};
  if (!dcpl.valid() || H5Pget_layout(dcpl.get()) != H5D_CHUNKED ||
      H5Pget_chunk(dcpl.get(), 2, chunk) != static_cast<int>(want_rank) || chunk[0] == 0) {
    h5::LastError();
    return Status::Corruption(path + ": not chunked along rows");
  }
  t.chunk_rows = static_cast<int64_t>(chunk[0]);
  if (auto attr = h5::ReadIntAttr(d.get(), kAttrChunkRows); attr.ok() && *attr != t.chunk_rows) {
    return Status::Corruption(path + ": attribute chunk_rows " + std::to_string(*attr) + " but chunks of " +
                              std::to_string(t.chunk_rows) + " rows");
  } else if (!attr.ok()) {
    H5Eclear2(H5E_DEFAULT);
  }
  // The format's chunk limits, before any chunk is decoded (a 2^24-row or 1 GiB chunk is a
  // memory bomb, whatever its frame compresses to).
  const int64_t row_bytes_i = static_cast<int64_t>(element_size) * std::max<int64_t>(cols, 1);
  if (t.chunk_rows > kMaxChunkRows || (cols > 0 && chunk[1] != static_cast<hsize_t>(cols)) ||
      t.chunk_rows * row_bytes_i > kMaxChunkDecodedBytes) {
    return Status::Corruption(path + ": chunks of " + std::to_string(chunk[0]) + " rows x " +
                              std::to_string(row_bytes_i) + " bytes exceed the format's limits (" +
                              std::to_string(kMaxChunkRows) + " rows, " + std::to_string(kMaxChunkDecodedBytes >> 20) +
                              " MiB)");
  }
  if (dims[0] > static_cast<hsize_t>(kMaxRows)) {
    return Status::Corruption(path + ": claims " + std::to_string(dims[0]) + " rows, more than any trace holds");
  }
  t.main_rows = static_cast<int64_t>(dims[0]);
  hsize_t nchunks = 0;
  h5::Hid space(H5Dget_space(d.get()));
  if (H5Dget_num_chunks(d.get(), space.get(), &nchunks) < 0) {
    if (complete_) return h5::Error(path + ": chunk index");
    h5::LastError();
    // A kill inside a flush that changed the index's structure (stored a table's first
    // chunk, or split a B-tree node) can leave the index unreadable. Its chunks are still in
    // the file, written once and never moved: the chunk directory says where.
    const size_t row_bytes = element_size * static_cast<size_t>(std::max<int64_t>(cols, 1));
    const auto dir = chunk_dir_.find(ContentHash(path.data(), path.size()));
    if (dir != chunk_dir_.end()) {
      for (const auto& [index, rec] : dir->second) {
        if (index != static_cast<int64_t>(t.recovered.size()) || rec.filter_mask != 0 || rec.size == 0 ||
            rec.size > 2 * t.chunk_rows * row_bytes + 4096 ||
            rec.address + rec.size > static_cast<uint64_t>(file_bytes_)) {
          break;
        }
        t.recovered.push_back(rec);
      }
    }
    notes_.push_back(path + ": chunk index torn by the crash; " + std::to_string(t.recovered.size()) +
                     " chunks found through the chunk directory, the rest from the tails");
    nchunks = 0;
    dims[0] = 0;
  }
  int64_t backed = static_cast<int64_t>(nchunks) * t.chunk_rows;
  if (!complete_ && nchunks > 0) {
    // A kill that tears a flush can leave the chunk index pointing at chunks past the end of
    // file the superblock records (written last in a flush). Those chunks were allocated
    // after the last completed flush, so their rows, if flushed, are still in the tails.
    // The table's rows are those of its leading chunks that lie within the recorded end.
    haddr_t eoa = 0;
    if (H5Fget_eoa(file_.get(), &eoa) >= 0) {
      hsize_t good = 0;
      for (hsize_t i = 0; i < nchunks; ++i) {
        hsize_t offset[2] = {0, 0}, size = 0;
        unsigned mask = 0;
        haddr_t addr = HADDR_UNDEF;
        if (H5Dget_chunk_info(d.get(), space.get(), i, offset, &mask, &addr, &size) < 0 || addr == HADDR_UNDEF ||
            addr + size > eoa || offset[0] != i * static_cast<hsize_t>(t.chunk_rows)) {
          h5::LastError();
          break;
        }
        ++good;
      }
      if (good < nchunks) notes_.push_back(path + ": chunks past the recorded end of file (torn flush) ignored");
      backed = static_cast<int64_t>(good) * t.chunk_rows;
    } else {
      h5::LastError();
    }
  }
  if (t.main_rows > backed && !complete_) {
    // A kill inside a flush can leave a new extent written before the chunk index that
    // backs it; the rows of the previous flush are all backed. Read what is backed.
    t.main_rows = backed;
  } else if (t.main_rows > backed) {
    return Status::Corruption(path + ": claims " + std::to_string(t.main_rows) + " rows but stores " +
                              std::to_string(nchunks) + " chunks of " + std::to_string(t.chunk_rows) +
                              " (at most " + std::to_string(backed) + " rows)");
  }
  if (!t.recovered.empty()) t.main_rows = static_cast<int64_t>(t.recovered.size()) * t.chunk_rows;
  t.stored_bytes = static_cast<int64_t>(H5Dget_storage_size(d.get()));
  for (const auto& rec : t.recovered) t.stored_bytes += static_cast<int64_t>(rec.size);
  t.rows = t.main_rows;
  auto tail = tails_.find(path);
  if (tail != tails_.end()) {
    const auto [base, count] = tail->second.second;
    // Rows [base, base + count) of the table are in the tail. A tail that ends at or
    // before the main rows is stale (those rows made it into a chunk); one that starts past
    // them would leave a gap and cannot come from our writer.
    if (base <= t.main_rows && base + count > t.main_rows) {
      t.rows = base + count;
      t.tail = tail->second.first;
      t.tail_base = base;
    } else if (base > t.main_rows) {
      // Our writer never leaves a gap (the chunks before a tail are in the index or the
      // chunk directory); a damaged or missing sidecar can. The rows up to the gap stand.
      notes_.push_back(path + ": tail starts at row " + std::to_string(base) + " past the table's " +
                       std::to_string(t.main_rows) + " readable rows; ignored");
    }
  }
  return t;
}

Status TraceReader::LoadTensors(const char* group) {
  const hid_t f = file_.get();
  LS_ASSIGN_OR_RETURN(h5::Hid g, h5::OpenGroup(f, group));
  LS_ASSIGN_OR_RETURN(std::vector<std::string> names, h5::LinkNames(g.get()));
  for (const auto& n : names) {
    TensorInfo ti;
    ti.group = group;
    ti.name = n;
    ti.path = Join(group, n);
    auto where = [&](const std::string& field) { return ti.path + ": " + field; };
    // A layer index is a number below kMaxLayer (commands size tables by it).
    if (n.rfind("layers.", 0) == 0) {
      const size_t dot = n.find('.', 7);
      const std::string num = n.substr(7, dot == std::string::npos ? std::string::npos : dot - 7);
      if (num.empty() || num.size() > 6 || num.find_first_not_of("0123456789") != std::string::npos ||
          std::stoll(num) >= kMaxLayer) {
        return Status::Corruption(ti.path + ": layer index '" + num + "' is not a number below " +
                                  std::to_string(kMaxLayer));
      }
    }
    LS_ASSIGN_OR_RETURN(h5::Hid tg, h5::OpenGroup(f, ti.path));
    auto dtype = h5::ReadStringAttr(tg.get(), kAttrDType);
    if (!dtype.ok()) return dtype.status().WithContext(ti.path + ": ");
    auto parsed = ParseDType(*dtype);
    if (!parsed.ok()) return parsed.status().WithContext(where(kAttrDType) + ": ");
    ti.dtype = *parsed;
    auto cols = h5::ReadIntAttr(tg.get(), kAttrCols);
    if (!cols.ok()) return cols.status().WithContext(ti.path + ": ");
    if (*cols <= 0 || *cols > kMaxCols) return Status::Corruption(where(kAttrCols) + " out of range");
    ti.cols = *cols;
    auto has_values = h5::ReadIntAttr(tg.get(), kAttrHasValues);
    if (!has_values.ok()) return has_values.status().WithContext(ti.path + ": ");
    ti.has_values = *has_values != 0;
    LS_ASSIGN_OR_RETURN(std::vector<std::string> attrs, h5::AttrNames(tg.get()));
    for (const auto& a : attrs) {
      if (a == kAttrCols || a == kAttrHasValues) continue;
      if (auto n = h5::ReadIntAttr(tg.get(), a); n.ok()) {
        ti.int_attrs[a] = *n;
        continue;
      }
      H5Eclear2(H5E_DEFAULT);
      auto v = h5::ReadStringAttr(tg.get(), a);
      if (!v.ok()) continue;
      // Format 1.1 wrote the KV parts' byte counts as decimal strings.
      if ((a == kAttrTokenBytes || a == kAttrByteOffset) && !v->empty() && v->size() < 19 &&
          v->find_first_not_of("0123456789") == std::string::npos) {
        ti.int_attrs[a] = std::stoll(*v);
      } else {
        ti.attrs[a] = *v;
      }
    }
    auto summary = InspectTable(Join(ti.path, kSummaryDataset), 0, SummaryType().get());
    if (!summary.ok()) return summary.status();
    ti.rows = summary->rows;
    ti.stored_bytes = summary->stored_bytes;
    ti.raw_bytes = summary->main_rows * static_cast<int64_t>(sizeof(SummaryRow));
    tables_[summary->path] = *summary;
    if (ti.has_values) {
      auto values = InspectTable(Join(ti.path, kValuesDataset), ti.cols, ValueType(ti.dtype));
      if (!values.ok()) return values.status();
      // Values and summary grow together; a crash can leave one a flush ahead only if the
      // file is not ours. Read the rows both have.
      ti.rows = std::min(ti.rows, values->rows);
      ti.value_stored_bytes = values->stored_bytes;
      ti.value_raw_bytes = values->main_rows * ti.cols * static_cast<int64_t>(DTypeSize(ti.dtype));
      ti.stored_bytes += values->stored_bytes;
      ti.raw_bytes += ti.value_raw_bytes;
      tables_[values->path] = *values;
    }
    if (auto sh = ti.int_attrs.find(kAttrShards); sh != ti.int_attrs.end()) {
      ti.shards = sh->second;
      ti.int_attrs.erase(sh);
      LS_RETURN_IF_ERROR(BindShards(&ti));
    }
    tensors_.push_back(std::move(ti));
  }
  return Status::Ok();
}

Status TraceReader::LoadShards() {
  auto ranks_it = meta_.find(kMetaShardRanks);
  if (as_shard_ && meta_.count(kMetaShardRank) == 0) {
    return Status::Corruption(std::string("not a rank shard (no /meta/") + kMetaShardRank + ")");
  }
  if (meta_.count(kMetaShardRank) != 0) {
    // A shard opened on its own reads as a trace of its columns; one naming shards itself is not ours.
    if (ranks_it == meta_.end() || meta_.count(std::string(kMetaShardFile) + "0") != 0) {
      return Status::Corruption(std::string("/meta: a rank shard that names shards of its own"));
    }
    return Status::Ok();
  }
  if (ranks_it == meta_.end()) return Status::Ok();
  const std::string& rv = ranks_it->second;
  if (rv.empty() || rv.size() > 2 || rv.find_first_not_of("0123456789") != std::string::npos ||
      std::stoll(rv) < 2 || std::stoll(rv) > kMaxShards) {
    return Status::Corruption(std::string("/meta/") + kMetaShardRanks + ": '" + rv + "' is not 2 to 64");
  }
  const int64_t n = std::stoll(rv);
  auto run = meta_.find(kMetaShardRunId);
  if (run == meta_.end() || run->second.empty()) {
    return Status::Corruption(std::string("/meta/") + kMetaShardRunId + ": missing (a sharded trace names its run)");
  }
  for (int64_t r = 0; r < n; ++r) {
    const std::string key = std::string(kMetaShardFile) + std::to_string(r);
    auto f = meta_.find(key);
    if (f == meta_.end() || !IsShardFileName(f->second)) {
      return Status::Corruption("/meta/" + key + ": " + (f == meta_.end() ? "missing" : "'" + f->second + "' is not a file name beside the trace"));
    }
    shard_files_.push_back(f->second);
    const std::filesystem::path sp = path_.parent_path() / f->second;
    std::error_code ec;
    const bool exists = std::filesystem::exists(sp, ec);
    if (!exists || !std::filesystem::is_regular_file(sp, ec)) {
      shards_.push_back(nullptr);
      if (missing_shard_.empty()) missing_shard_ = sp.string();
      notes_.push_back(sp.string() + ": rank " + std::to_string(r) + "'s shard is " +
                       (exists ? "not a file" : "missing") + "; its tensors have no values");
      continue;
    }
    auto sub = TraceReader::OpenAs(sp, true);
    if (!sub.ok()) return Status::Corruption("rank " + std::to_string(r) + " shard: " + sub.status().message());
    const auto& m = (*sub)->meta();
    auto field = [&](const char* k) { auto it = m.find(k); return it == m.end() ? std::string() : it->second; };
    const char* bad = field(kMetaShardRank) != std::to_string(r) ? kMetaShardRank
                      : field(kMetaShardRanks) != rv           ? kMetaShardRanks
                      : field(kMetaShardRunId) != run->second  ? kMetaShardRunId
                                                               : nullptr;
    if (bad != nullptr) {
      return Status::Corruption(sp.string() + ": /meta/" + bad + " '" + field(bad) + "' is not this trace's rank " +
                                std::to_string(r) + " of " + rv + " (run " + run->second + ")");
    }
    for (const auto& note : (*sub)->notes()) notes_.push_back(note);
    shards_.push_back(std::move(*sub));
  }
  return Status::Ok();
}

Status TraceReader::BindShards(TensorInfo* ti) {
  const int64_t n = static_cast<int64_t>(shard_files_.size());
  if (ti->shards != n || n == 0 || ti->cols % n != 0 || ti->has_values) {
    return Status::Corruption(ti->path + ": attribute shards " + std::to_string(ti->shards) + " but /meta names " +
                              std::to_string(n) + " shards (and its " + std::to_string(ti->cols) +
                              " columns must split among them, with no values of its own)");
  }
  // The virtual `values` must stitch the shards /meta names (what h5py reads is what we read).
  {
    auto d = h5::OpenDataset(file_.get(), Join(ti->path, kValuesDataset));
    if (!d.ok()) return d.status().WithContext(ti->path + ": ");
    h5::Hid dcpl(H5Dget_create_plist(d->get()));
    size_t count = 0;
    if (!dcpl.valid() || H5Pget_layout(dcpl.get()) != H5D_VIRTUAL || H5Pget_virtual_count(dcpl.get(), &count) < 0 ||
        count != static_cast<size_t>(n)) {
      h5::LastError();
      return Status::Corruption(ti->path + "/values: not a virtual dataset of its " + std::to_string(n) + " shards");
    }
    for (size_t i = 0; i < count; ++i) {
      char name[512] = {0};
      const ssize_t len = H5Pget_virtual_filename(dcpl.get(), i, name, sizeof name);
      if (len < 0 || static_cast<size_t>(len) >= sizeof name || shard_files_[i] != name) {
        h5::LastError();
        return Status::Corruption(ti->path + "/values: virtual mapping " + std::to_string(i) + " reads '" + name +
                                  "', not the shard /meta names ('" + shard_files_[i] + "')");
      }
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    if (shards_[r] == nullptr) return Status::Ok();  // missing: no values (LoadShards' note)
    const TensorInfo* st = shards_[r]->FindTensor(ti->path);
    const std::string where = shards_[r]->path().string() + ": " + ti->path;
    if (st == nullptr || !st->has_values) return Status::Corruption(where + ": missing, or without values");
    if (st->dtype != ti->dtype || st->cols * n != ti->cols) {
      return Status::Corruption(where + ": " + std::string(DTypeName(st->dtype)) + " × " + std::to_string(st->cols) +
                                ", not this trace's " + std::string(DTypeName(ti->dtype)) + " × " +
                                std::to_string(ti->cols) + " / " + std::to_string(n));
    }
    if (st->rows < ti->rows) {
      notes_.push_back(where + ": " + std::to_string(st->rows) + " of " + std::to_string(ti->rows) +
                       " rows in the shard; the rest have no values");
    }
    ti->rows = std::min(ti->rows, st->rows);
    ti->value_stored_bytes += st->value_stored_bytes;
    ti->value_raw_bytes += st->value_raw_bytes;
  }
  ti->has_values = true;
  ti->stored_bytes += ti->value_stored_bytes;
  ti->raw_bytes += ti->value_raw_bytes;
  return Status::Ok();
}

Result<std::vector<uint8_t>> TraceReader::ReadShardedValues(const TensorInfo& ti, int64_t begin, int64_t count) const {
  const int64_t n = ti.shards, w = ti.cols / n;
  const size_t es = DTypeSize(ti.dtype), row_bytes = static_cast<size_t>(ti.cols) * es, part = static_cast<size_t>(w) * es;
  if (static_cast<int64_t>(row_bytes) * count > kMaxReadBytes) {
    return Err(Status::InvalidArgument(ti.path + ": " + std::to_string(count) + " rows are more than one read takes"));
  }
  bool& checked = shard_rows_checked_[ti.path];
  if (!checked) {
    // Row i of every shard is row i here: the same request and position.
    LS_ASSIGN_OR_RETURN(std::vector<SummaryRow> mine, ReadSummary(ti));
    for (int64_t r = 0; r < n; ++r) {
      const TensorInfo* st = shards_[r]->FindTensor(ti.path);
      LS_ASSIGN_OR_RETURN(std::vector<SummaryRow> theirs, shards_[r]->ReadSummary(*st));
      for (int64_t i = 0; i < ti.rows; ++i) {
        if (theirs[i].request != mine[i].request || theirs[i].position != mine[i].position) {
          return Err(Status::Corruption(shards_[r]->path().string() + ": " + ti.path + " row " + std::to_string(i) +
                                        " is request " + std::to_string(theirs[i].request) + " position " +
                                        std::to_string(theirs[i].position) + ", this trace's request " +
                                        std::to_string(mine[i].request) + " position " +
                                        std::to_string(mine[i].position)));
        }
      }
    }
    std::vector<uint64_t>& hashes = shard_row_hashes_[ti.path];
    hashes.resize(static_cast<size_t>(ti.rows));
    for (int64_t i = 0; i < ti.rows; ++i) hashes[i] = mine[i].hash;
    checked = true;
  }
  std::vector<uint8_t> out(static_cast<size_t>(count) * row_bytes);
  for (int64_t r = 0; r < n; ++r) {
    LS_ASSIGN_OR_RETURN(std::vector<uint8_t> b, shards_[r]->ReadValues(*shards_[r]->FindTensor(ti.path), begin, count));
    for (int64_t i = 0; i < count; ++i) std::memcpy(&out[i * row_bytes + r * part], &b[i * part], part);
  }
  // The shards were written apart (by their own ranks, or as separate files that can be swapped
  // for others of the same run): a stitched row is the trace's only if it hashes to the trace's
  // summary of that row, computed from the whole row where it was made.
  const std::vector<uint64_t>& hashes = shard_row_hashes_[ti.path];
  for (int64_t i = 0; i < count; ++i) {
    const int64_t row = begin + i;
    if (row < 0 || row >= static_cast<int64_t>(hashes.size())) break;  // (ReadValues bounded the range)
    if (ContentHash(&out[i * row_bytes], row_bytes) != hashes[row]) {
      return Err(Status::Corruption(ti.path + " row " + std::to_string(row) + ": the values its " + std::to_string(n) +
                                    " shards hold do not match the row's content hash in this trace (a shard "
                                    "changed, or a rank that wrote other values than rank 0 hashed)"));
    }
  }
  return out;
}

Status TraceReader::LoadRequests() {
  const hid_t f = file_.get();
  LS_ASSIGN_OR_RETURN(h5::Hid g, h5::OpenGroup(f, kRequestsGroup));
  LS_ASSIGN_OR_RETURN(std::vector<std::string> names, h5::LinkNames(g.get()));
  std::vector<SamplingRow> sampling;
  bool sampling_read = false;
  for (const auto& n : names) {
    const std::string p = Join(kRequestsGroup, n);
    // One request; in an incomplete trace, a request that a kill left unreadable (its group
    // created after the last durable flush) is skipped with a note instead of failing the trace.
    const Status one = [&]() -> Status {
    RequestInfo r;
    char* end = nullptr;
    const long id = std::strtol(n.c_str(), &end, 10);
    if (n.empty() || *end != '\0' || id < 0 || id > INT32_MAX) return Status::Corruption(p + ": not a request id");
    r.id = static_cast<int32_t>(id);
    LS_ASSIGN_OR_RETURN(h5::Hid rg, h5::OpenGroup(f, p));
    auto str = [&](const char* k, std::string* out) -> Status {
      auto v = h5::ReadStringAttr(rg.get(), k);
      if (!v.ok()) return v.status().WithContext(p + ": ");
      *out = *v;
      return Status::Ok();
    };
    LS_RETURN_IF_ERROR(str(kAttrName, &r.name));
    {
      auto t = h5::ReadStringDataset(f, Join(p, kPromptTextDataset), kMaxTextBytes);
      if (!t.ok()) return t.status().WithContext(p + ": ");
      r.prompt_text = *t;
    }
    // What finishing writes (finish reason, generated tokens and text) lives in <p>/final
    // (format ≥ 1.1; 1.0 wrote it into <p>) and may be torn in a trace whose recorder died
    // while flushing it: an incomplete trace then falls back to /sampling.
    std::string fp = p;
    h5::Hid fg;
    if (h5::Exists(f, Join(p, kFinalGroup))) {
      fp = Join(p, kFinalGroup);
      auto opened = h5::OpenGroup(f, fp);
      if (!opened.ok() && complete_) return opened.status();
      if (opened.ok()) fg = std::move(*opened);
    }
    const hid_t fin = fp == p ? rg.get() : fg.get();
    if (fin >= 0 && h5::HasAttr(fin, kAttrFinishReason) && h5::Exists(f, Join(fp, kGeneratedTextDataset)) &&
        h5::Exists(f, Join(fp, kGeneratedDataset))) {
      auto reason = h5::ReadStringAttr(fin, kAttrFinishReason);
      if (!reason.ok() && complete_) return reason.status().WithContext(fp + ": ");
      if (reason.ok()) r.finish_reason = *reason;
      auto t = h5::ReadStringDataset(f, Join(fp, kGeneratedTextDataset), kMaxTextBytes);
      if (!t.ok() && complete_) return t.status().WithContext(fp + ": ");
      if (t.ok()) r.generated_text = *t;
    }
    auto num = [&](const char* k, auto* out) -> Status {
      auto v = h5::ReadDoubleAttr(rg.get(), k);
      if (!v.ok()) return v.status().WithContext(p + ": ");
      *out = static_cast<std::remove_reference_t<decltype(*out)>>(*v);
      return Status::Ok();
    };
    // Numbers checked as numbers before any conversion: a count is a whole number in range
    // (1e300 or NaN cast to int64 is undefined), a sampling parameter finite and in its range.
    auto in_range = [&](const char* k, double lo, double hi, bool whole) -> Status {
      auto v = h5::ReadDoubleAttr(rg.get(), k);
      if (!v.ok()) return v.status().WithContext(p + ": ");
      if (!(*v >= lo && *v <= hi) || (whole && *v != std::floor(*v))) {
        return Status::Corruption(p + ": " + k + " = " + std::to_string(*v) + " is not " + (whole ? "a whole number " : "") +
                                  "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
      }
      return Status::Ok();
    };
    LS_RETURN_IF_ERROR(in_range(kAttrMaxNewTokens, 0, static_cast<double>(kMaxRequestTokens), true));
    LS_RETURN_IF_ERROR(in_range(kAttrTemperature, 0, kMaxTemperature, false));
    LS_RETURN_IF_ERROR(in_range(kAttrTopK, 0, static_cast<double>(kMaxTopK), true));
    LS_RETURN_IF_ERROR(in_range(kAttrTopP, 0, 1, false));
    LS_RETURN_IF_ERROR(in_range(kAttrMinP, 0, 1, false));
    LS_RETURN_IF_ERROR(num(kAttrMaxNewTokens, &r.max_new_tokens));
    LS_RETURN_IF_ERROR(num(kAttrTemperature, &r.temperature));
    LS_RETURN_IF_ERROR(num(kAttrTopK, &r.top_k));
    LS_RETURN_IF_ERROR(num(kAttrTopP, &r.top_p));
    LS_RETURN_IF_ERROR(num(kAttrMinP, &r.min_p));
    {
      auto seed = h5::ReadIntAttr(rg.get(), kAttrSeed);
      if (!seed.ok()) return seed.status().WithContext(p + ": ");
      r.seed = static_cast<uint64_t>(*seed);
    }
    auto read_tokens = [&](const std::string& dir, const char* name, std::vector<int32_t>* out) -> Status {
      const std::string dp = Join(dir, name);
      LS_ASSIGN_OR_RETURN(h5::Hid d, h5::OpenDataset(f, dp));
      auto dims = h5::Dims(d.get(), 1);
      if (!dims.ok() || dims->size() != 1) return Status::Corruption(dp + ": expected a 1-D token list");
      if ((*dims)[0] > static_cast<hsize_t>(kMaxRequestTokens)) return Status::Corruption(dp + ": claims " + std::to_string((*dims)[0]) + " tokens");
      // Token ids as the writer stores them: little-endian int32, uncompressed, every byte in
      // the file (an unallocated list of 2^26 float64 "tokens" read as 800 MB of converted fill:
      // tests/fuzz/corpus/fuzz_trace_edits/slow_unallocated_f64_prompt).
      {
        h5::Hid type(H5Dget_type(d.get()));
        h5::Hid dcpl(H5Dget_create_plist(d.get()));
        const hsize_t stored = H5Dget_storage_size(d.get());
        // Contiguous, as written: a chunked list's chunk could be stored unfiltered and short,
        // which HDF5 1.10 copies past (tests/fuzz/corpus/fuzz_trace_edits/crash_raw_prompt_chunk).
        if (!dcpl.valid() || ((*dims)[0] > 0 && H5Pget_layout(dcpl.get()) != H5D_CONTIGUOUS)) {
          h5::LastError();
          return Status::Corruption(dp + ": a token list is stored contiguous, not chunked");
        }
        if (!type.valid() || H5Tequal(type.get(), H5T_STD_I32LE) <= 0) {
          h5::LastError();
          return Status::Corruption(dp + ": token ids must be stored as little-endian int32");
        }
        if (stored < (*dims)[0] * 4) {
          return Status::Corruption(dp + ": claims " + std::to_string((*dims)[0]) + " tokens but stores " +
                                    std::to_string(stored) + " bytes (token lists are stored uncompressed)");
        }
      }
      out->resize((*dims)[0]);
      if (!out->empty() && H5Dread(d.get(), H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, out->data()) < 0) {
        return h5::Error(dp);
      }
      return Status::Ok();
    };
    LS_RETURN_IF_ERROR(read_tokens(p, kPromptDataset, &r.prompt));
    Status gen = Status::NotFound("");
    if (fin >= 0 && h5::Exists(f, Join(fp, kGeneratedDataset))) {
      gen = read_tokens(fp, kGeneratedDataset, &r.generated);
      if (!gen.ok() && complete_) return gen;
    }
    if (!gen.ok()) {
      r.generated.clear();
      r.finish_reason.clear();
      // Not finished when the trace was last flushed: the tokens are in /sampling.
      if (!sampling_read) {
        LS_ASSIGN_OR_RETURN(sampling, ReadSampling());
        sampling_read = true;
      }
      std::vector<std::pair<int64_t, int32_t>> toks;
      for (const auto& s : sampling) {
        if (s.request == r.id) toks.push_back({s.token_index, s.token});
      }
      std::sort(toks.begin(), toks.end());
      for (const auto& [i, t] : toks) r.generated.push_back(t);
      for (const auto& s : sampling) {
        if (s.request == r.id && s.finished) r.finish_reason = s.finished == 1 ? "length" : s.finished == 2 ? "stop" : "other";
      }
    }
    requests_.push_back(std::move(r));
    return Status::Ok();
    }();
    if (!one.ok()) {
      if (complete_) return one;
      notes_.push_back(p + ": unreadable in this incomplete trace, skipped (" + one.message() + ")");
    }
  }
  std::sort(requests_.begin(), requests_.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  for (const auto& r : requests_) {
    if (static_cast<int64_t>(r.generated.size()) > r.max_new_tokens) {
      const Status s = Status::Corruption(std::string(kRequestsGroup) + "/" + std::to_string(r.id) + ": " +
                                          std::to_string(r.generated.size()) + " generated tokens, more than its " +
                                          kAttrMaxNewTokens + " " + std::to_string(r.max_new_tokens));
      if (complete_) return s;
      notes_.push_back(s.message());
    }
  }
  if (!complete_) {
    // What a kill cut short may be missing rows the requests still name (or hold rows of a
    // request the kill left unreadable): a note, not a refusal.
    if (Status s = CheckSampling(); !s.ok()) notes_.push_back(s.message() + " (incomplete trace)");
    return Status::Ok();
  }
  return CheckSampling();
}

// A complete trace's /sampling holds one row per generated token of every request, each token
// once, the same tokens its `generated` holds, drawn with the request's seed and sampling
// parameters: a sampling table that lost, moved, duplicated or changed rows (or a request whose
// tokens, seed or parameters were edited) is refused.
Status TraceReader::CheckSampling() const {
  LS_ASSIGN_OR_RETURN(std::vector<SamplingRow> sampling, ReadSampling());
  std::map<int32_t, const RequestInfo*> by_id;
  std::map<int32_t, int64_t> seen;
  std::map<int32_t, std::vector<bool>> have;
  for (const auto& r : requests_) {
    by_id[r.id] = &r;
    have[r.id].assign(r.generated.size(), false);
  }
  for (size_t i = 0; i < sampling.size(); ++i) {
    const SamplingRow& s = sampling[i];
    auto it = by_id.find(s.request);
    const std::string where = std::string(kSamplingTable) + ": row " + std::to_string(i);
    if (it == by_id.end()) return Status::Corruption(where + " names request " + std::to_string(s.request) + ", not in the trace");
    const RequestInfo& r = *it->second;
    const std::string which = where + " (request " + std::to_string(s.request) + ", token " + std::to_string(s.token_index) + ")";
    if (s.token_index < 0 || s.token_index >= static_cast<int64_t>(r.generated.size()) ||
        r.generated[static_cast<size_t>(s.token_index)] != s.token) {
      return Status::Corruption(which + " does not match the request's generated tokens");
    }
    if (s.seed != r.seed) {
      return Status::Corruption(which + " was drawn with seed " + std::to_string(s.seed) + ", the request says " +
                                std::to_string(r.seed));
    }
    if (s.temperature != r.temperature || s.top_p != r.top_p || s.min_p != r.min_p || s.top_k != r.top_k) {
      return Status::Corruption(which + " was drawn with other sampling parameters than the request's");
    }
    std::vector<bool>& h = have[s.request];
    if (h[static_cast<size_t>(s.token_index)]) return Status::Corruption(which + " repeats an earlier row");
    h[static_cast<size_t>(s.token_index)] = true;
    ++seen[s.request];
  }
  for (const auto& r : requests_) {
    if (seen[r.id] != static_cast<int64_t>(r.generated.size())) {
      return Status::Corruption(std::string(kSamplingTable) + ": " + std::to_string(seen[r.id]) + " rows for request " +
                                std::to_string(r.id) + ", which generated " + std::to_string(r.generated.size()) + " tokens");
    }
  }
  return Status::Ok();
}

const TensorInfo* TraceReader::FindTensor(const std::string& s) const {
  for (const auto& t : tensors_) {
    if (t.path == s) return &t;
  }
  for (const char* g : {kTapsGroup, kKvGroup}) {
    for (const auto& t : tensors_) {
      if (t.group == g && t.name == s) return &t;
    }
  }
  return nullptr;
}

Result<std::vector<uint8_t>> TraceReader::ReadRows(const Table& t, hid_t mem_type, size_t row_bytes, int64_t begin,
                                                   int64_t count) const {
  if (begin < 0 || count < 0 || begin > t.rows || count > t.rows - begin) {
    return Err(Status::InvalidArgument(t.path + ": rows [" + std::to_string(begin) + ", +" + std::to_string(count) +
                                       ") outside its " + std::to_string(t.rows)));
  }
  if (static_cast<double>(count) * static_cast<double>(row_bytes) > static_cast<double>(kMaxReadBytes)) {
    return Err(Status::InvalidArgument(t.path + ": reading " + std::to_string(count) + " rows needs more than " +
                                       std::to_string(kMaxReadBytes >> 30) + " GiB; read a range"));
  }
  std::vector<uint8_t> out(static_cast<size_t>(count) * row_bytes);
  auto read_part = [&](const std::string& dpath, int64_t first, int64_t n, uint8_t* dst) -> Status {
    if (n <= 0) return Status::Ok();
    if (dpath == t.path && !t.recovered.empty()) return ReadRecovered(t, row_bytes, first, n, dst);
    const bool tail = dpath == t.tail;
    LS_ASSIGN_OR_RETURN(h5::Hid d, h5::OpenDataset(tail ? tails_file_.get() : file_.get(), dpath));
    if (tail) {  // the sidecar was not validated at open: the same type and shape as its table
      h5::Hid type(H5Dget_type(d.get()));
      auto dims = h5::Dims(d.get(), 2);
      if (!type.valid() || H5Tequal(type.get(), mem_type) <= 0 || !dims.ok() ||
          dims->size() != (t.cols > 0 ? 2u : 1u) || (*dims)[0] < static_cast<hsize_t>(first + n) ||
          (t.cols > 0 && (*dims)[1] != static_cast<hsize_t>(t.cols))) {
        h5::LastError();
        return Status::Corruption(TailsPath(path_).string() + ": " + dpath + " does not match " + t.path);
      }
    }
    if (!tail) {
      // A chunk stored with its filters skipped (filter mask set) reaches no filter that could
      // check its size, and HDF5 copies a whole chunk out of whatever it stored: one shorter
      // than the chunk is refused here, before the read (found by tests/fuzz/fuzz_trace_edits.cc,
      // regression input tests/fuzz/corpus/fuzz_trace_edits/crash_unfiltered_short_chunk).
      const hsize_t chunk_bytes = static_cast<hsize_t>(t.chunk_rows) * row_bytes;
      for (int64_t c = first / t.chunk_rows; c <= (first + n - 1) / t.chunk_rows; ++c) {
        hsize_t off[2] = {static_cast<hsize_t>(c * t.chunk_rows), 0};
        unsigned mask = 0;
        haddr_t addr = HADDR_UNDEF;
        hsize_t size = 0;
        if (H5Dget_chunk_info_by_coord(d.get(), off, &mask, &addr, &size) < 0) {
          h5::LastError();  // not allocated: HDF5 reads the fill value
          continue;
        }
        if (mask != 0 && addr != HADDR_UNDEF && size != chunk_bytes) {
          return Status::Corruption(dpath + ": chunk " + std::to_string(c) + " is stored unfiltered as " +
                                    std::to_string(size) + " bytes, not the chunk's " + std::to_string(chunk_bytes));
        }
      }
    }
    h5::Hid fspace(H5Dget_space(d.get()));
    const int rank = t.cols > 0 ? 2 : 1;
    hsize_t start[2] = {static_cast<hsize_t>(first), 0};
    hsize_t cnt[2] = {static_cast<hsize_t>(n), static_cast<hsize_t>(t.cols)};
    h5::Hid mspace(H5Screate_simple(rank, cnt, nullptr));
    ExpectChunkBytes expect(tail ? 0 : static_cast<size_t>(t.chunk_rows) * row_bytes);
    if (H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start, nullptr, cnt, nullptr) < 0 ||
        H5Dread(d.get(), mem_type, mspace.get(), fspace.get(), H5P_DEFAULT, dst) < 0) {
      return h5::Error(dpath + ": rows [" + std::to_string(first) + ", +" + std::to_string(n) +
                       ") unreadable (damaged chunk, or the zstd filter missing?)");
    }
    return Status::Ok();
  };
  const int64_t end = begin + count;
  const int64_t main_end = std::min(end, t.main_rows);
  if (t.tail.empty() || end <= t.main_rows) {
    LS_RETURN_IF_ERROR(Err(read_part(t.path, begin, count, out.data())));
    return out;
  }
  // Main rows first, the rest from the tail (rows from max(begin, main_rows) on).
  const int64_t from_tail = std::max(begin, t.main_rows);
  if (main_end > begin) LS_RETURN_IF_ERROR(Err(read_part(t.path, begin, main_end - begin, out.data())));
  LS_RETURN_IF_ERROR(Err(read_part(t.tail, from_tail - t.tail_base, end - from_tail,
                                   out.data() + static_cast<size_t>(from_tail - begin) * row_bytes)));
  return out;
}

Status TraceReader::ReadRecovered(const Table& t, size_t row_bytes, int64_t first, int64_t n, uint8_t* dst) const {
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::IoError(path_.string() + ": " + std::strerror(errno));
  const size_t chunk_bytes = static_cast<size_t>(t.chunk_rows) * row_bytes;
  std::vector<uint8_t> stored, raw;
  Status st;
  for (int64_t row = first; row < first + n && st.ok();) {
    const ChunkRecord& rec = t.recovered[static_cast<size_t>(row / t.chunk_rows)];
    stored.resize(rec.size);
    if (::pread(fd, stored.data(), rec.size, static_cast<off_t>(rec.address)) != static_cast<ssize_t>(rec.size)) {
      st = Status::Corruption(t.path + ": chunk " + std::to_string(rec.index) + " unreadable at its recorded address");
      break;
    }
    st = DecompressUnshuffleChunk(stored.data(), stored.size(), t.element_size, chunk_bytes, &raw);
    if (!st.ok()) {
      st = st.WithContext(t.path + ": chunk " + std::to_string(rec.index) + ": ");
      break;
    }
    const int64_t in_chunk = row % t.chunk_rows;
    const int64_t take = std::min(first + n - row, t.chunk_rows - in_chunk);
    std::memcpy(dst + static_cast<size_t>(row - first) * row_bytes, raw.data() + in_chunk * row_bytes,
                static_cast<size_t>(take) * row_bytes);
    row += take;
  }
  ::close(fd);
  return st;
}

Result<std::vector<SummaryRow>> TraceReader::ReadSummary(const TensorInfo& ti) const {
  auto it = tables_.find(Join(ti.path, kSummaryDataset));
  if (it == tables_.end()) return Err(Status::NotFound(ti.path + ": no summary"));
  h5::Hid type = SummaryType();
  LS_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadRows(it->second, type.get(), sizeof(SummaryRow), 0, ti.rows));
  std::vector<SummaryRow> rows(ti.rows);
  if (!rows.empty()) std::memcpy(rows.data(), bytes.data(), bytes.size());
  // Positions and request ids index tables in every command: in range, or the trace is refused.
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].position < 0 || rows[i].position >= kMaxPosition || rows[i].request < 0) {
      return Err(Status::Corruption(ti.path + ": summary row " + std::to_string(i) + " has position " +
                                    std::to_string(rows[i].position) + ", request " + std::to_string(rows[i].request) +
                                    " (positions are 0 to 2^31 - 1)"));
    }
  }
  return rows;
}

Result<std::vector<uint8_t>> TraceReader::ReadValues(const TensorInfo& ti, int64_t begin, int64_t count) const {
  if (!ti.has_values && ti.shards > 0) {
    return Err(Status::NotFound(ti.path + ": its values lie in rank shards, and " + missing_shard_ + " is missing"));
  }
  if (!ti.has_values) return Err(Status::NotFound(ti.path + ": summary capture, no values stored"));
  if (ti.shards > 0) {
    if (begin < 0 || count < 0 || begin > ti.rows || count > ti.rows - begin) {
      return Err(Status::InvalidArgument(ti.path + ": rows [" + std::to_string(begin) + ", +" + std::to_string(count) +
                                         ") outside its " + std::to_string(ti.rows)));
    }
    return ReadShardedValues(ti, begin, count);
  }
  auto it = tables_.find(Join(ti.path, kValuesDataset));
  if (it == tables_.end()) return Err(Status::NotFound(ti.path + ": no values"));
  if (begin < 0 || count < 0 || begin > ti.rows || count > ti.rows - begin) {
    return Err(Status::InvalidArgument(ti.path + ": rows [" + std::to_string(begin) + ", +" + std::to_string(count) +
                                       ") outside its " + std::to_string(ti.rows)));
  }
  return ReadRows(it->second, ValueType(ti.dtype), ti.cols * DTypeSize(ti.dtype), begin, count);
}

Result<std::vector<SamplingRow>> TraceReader::ReadSampling() const {
  const Table& t = tables_.at(kSamplingTable);
  h5::Hid type = SamplingType();
  LS_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadRows(t, type.get(), sizeof(SamplingRow), 0, t.rows));
  std::vector<SamplingRow> rows(t.rows);
  if (!rows.empty()) std::memcpy(rows.data(), bytes.data(), bytes.size());
  return rows;
}

Result<std::vector<StepRow>> TraceReader::ReadSteps() const {
  const Table& t = tables_.at(kStepsTable);
  h5::Hid type = StepType();
  LS_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadRows(t, type.get(), sizeof(StepRow), 0, t.rows));
  std::vector<StepRow> rows(t.rows);
  if (!rows.empty()) std::memcpy(rows.data(), bytes.data(), bytes.size());
  return rows;
}

Result<std::vector<int64_t>> TraceReader::ReadStepBatch(int64_t* width) const {
  const Table& t = tables_.at(kStepBatchTable);
  *width = t.cols;
  LS_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadRows(t, H5T_NATIVE_INT64, 8 * t.cols, 0, t.rows));
  std::vector<int64_t> ids(t.rows * t.cols);
  if (!ids.empty()) std::memcpy(ids.data(), bytes.data(), bytes.size());
  return ids;
}

}  // namespace lockstep::traces
