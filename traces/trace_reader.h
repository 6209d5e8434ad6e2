// traces/trace_reader.h — opens a lockstep trace, complete or not, and reads it back.
//
// Open() validates the file before anything else looks at it: an HDF5 file, a lockstep
// trace, a format major this reader knows, every table with the type and a row count its
// stored chunks can back. Any problem is one Status line naming the file and the field.
// A trace whose recorder died reads like a complete one, up to its last flush (the tail
// rule of docs/trace-format.md is applied here, so callers never see tails).
//
// A TraceReader holds the file open; not thread-safe (one thread at a time).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "traces/h5.h"
#include "traces/trace_format.h"

namespace lockstep::traces {

struct TensorInfo {
  std::string path;   // "taps/layers.0.attn.out"
  std::string group;  // "taps" | "kv"
  std::string name;   // "layers.0.attn.out"
  DType dtype = DType::kF32;
  int64_t cols = 0;
  bool has_values = false;
  int64_t rows = 0;          // rows readable (summary rows; values rows when stored)
  int64_t stored_bytes = 0;  // on disk: compressed chunks of summary + values
  int64_t raw_bytes = 0;     // the same rows uncompressed
  int64_t value_stored_bytes = 0, value_raw_bytes = 0;  // values only
  std::map<std::string, std::string> attrs;  // the group's string attributes
  // Its integer attributes other than cols and has_values (kv/: token_bytes, byte_offset); a
  // format 1.1 trace's decimal-string ones are read into here too.
  std::map<std::string, int64_t> int_attrs;
  // > 0: the values lie in that many rank shards (format 1.3), read through them; has_values
  // says whether every shard was there to read.
  int64_t shards = 0;
};

struct RequestInfo {
  int32_t id = 0;
  std::string name;
  std::vector<int32_t> prompt;
  std::string prompt_text;
  std::vector<int32_t> generated;  // from `generated`, or rebuilt from /sampling if unfinished
  std::string generated_text;
  std::string finish_reason;       // empty when the request did not finish in the trace
  int64_t max_new_tokens = 0;
  uint64_t seed = 0;
  double temperature = 0, top_p = 1, min_p = 0;
  int64_t top_k = 0;
};

class TraceReader {
 public:
  // Refuses to read more than this in one call (the size a "petabyte" shape would ask for).
  static constexpr int64_t kMaxReadBytes = 8ll << 30;

  static Result<std::unique_ptr<TraceReader>> Open(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return path_; }
  int32_t format_major() const { return major_; }
  int32_t format_minor() const { return minor_; }
  bool complete() const { return complete_; }
  int64_t flushed_steps() const { return flushed_steps_; }
  const std::string& writer() const { return writer_; }
  int64_t file_bytes() const { return file_bytes_; }
  const std::map<std::string, std::string>& meta() const { return meta_; }
  const std::vector<RequestInfo>& requests() const { return requests_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // What an incomplete trace lost beyond its last flush, when anything (one line each).
  const std::vector<std::string>& notes() const { return notes_; }
  // By path ("taps/x") or by name within taps/ then kv/ ("x"); null when absent.
  const TensorInfo* FindTensor(const std::string& path_or_name) const;

  Result<std::vector<SummaryRow>> ReadSummary(const TensorInfo& t) const;
  // Rows [begin, begin + count) of the values, as stored (row-major, cols × dtype size each).
  Result<std::vector<uint8_t>> ReadValues(const TensorInfo& t, int64_t begin, int64_t count) const;
  Result<std::vector<SamplingRow>> ReadSampling() const;
  Result<std::vector<StepRow>> ReadSteps() const;
  // [steps, width] request ids, −1 padded.
  Result<std::vector<int64_t>> ReadStepBatch(int64_t* width) const;

  // The open file, for traces/ code that reads a group this reader does not interpret (a pack's
  // /pack, trace_pack.h). Valid while the reader lives.
  hid_t hdf5_file() const { return file_.get(); }

  // What a table holds: dataset path → readable rows and chunk geometry.
  struct Table {
    std::string path;
    int64_t main_rows = 0;   // rows of the dataset's extent
    int64_t rows = 0;        // with the tail
    int64_t cols = 0;        // 0 for 1-D
    int64_t chunk_rows = 0;
    size_t element_size = 0;
    int64_t stored_bytes = 0;
    std::string tail;        // /tails/<k> holding rows [tail_base, rows), or empty
    int64_t tail_base = 0;
    // When the chunk index was torn by a crash: the chunks of rows [0, main_rows), in order,
    // as the chunk directory <trace>.chunks lists them (read without HDF5's index).
    std::vector<ChunkRecord> recovered;
  };

 private:
  TraceReader() = default;
  // Open, as a rank shard of another trace when `shard` (which must then say so in its /meta).
  static Result<std::unique_ptr<TraceReader>> OpenAs(const std::filesystem::path& path, bool shard);
  Status Load();
  Result<Table> InspectTable(const std::string& path, int64_t cols, hid_t expected_type);
  Result<std::vector<uint8_t>> ReadRows(const Table& t, hid_t mem_type, size_t row_bytes, int64_t begin,
                                        int64_t count) const;
  Status LoadRequests();
  Status CheckSampling() const;
  void LoadTails(const std::filesystem::path& side);
  void LoadChunkDirectory(const std::filesystem::path& side);
  // Rows [first, first + n) of a table whose main rows come from the chunk directory.
  Status ReadRecovered(const Table& t, size_t row_bytes, int64_t first, int64_t n, uint8_t* dst) const;
  Status LoadTensors(const char* group);
  // Format 1.3: opens the rank shards /meta names (validated: plain names beside the trace, each
  // a trace of this run, of that rank, unsharded itself); a missing one leaves its tensors without
  // values (a note), an inconsistent one is an error.
  Status LoadShards();
  // A sharded tensor's shard tensors, checked against it (dtype, cols / N, values); the rows
  // all of them hold.
  Status BindShards(TensorInfo* ti);
  Result<std::vector<uint8_t>> ReadShardedValues(const TensorInfo& t, int64_t begin, int64_t count) const;
  Status Err(const Status& s) const;

  std::filesystem::path path_;
  h5::Hid file_;
  h5::Hid tails_file_;  // <trace>.tails of an incomplete trace, when present
  int32_t major_ = 0, minor_ = 0;
  bool complete_ = false;
  int64_t flushed_steps_ = 0;
  int64_t file_bytes_ = 0;
  std::string writer_;
  std::map<std::string, std::string> meta_;
  std::map<std::string, std::pair<std::string, std::pair<int64_t, int64_t>>> tails_;  // target → (tail, (base, count))
  std::map<std::string, Table> tables_;
  std::map<uint64_t, std::map<int64_t, ChunkRecord>> chunk_dir_;  // table path hash → index → record
  std::vector<RequestInfo> requests_;
  std::vector<TensorInfo> tensors_;
  std::vector<std::string> notes_;
  bool as_shard_ = false;
  std::vector<std::unique_ptr<TraceReader>> shards_;  // rank order; null: missing
  std::vector<std::string> shard_files_;
  std::string missing_shard_;  // the first missing shard's file, when one is
  // Sharded tensors whose rows were checked to be the same (request, position) in every shard.
  mutable std::map<std::string, bool> shard_rows_checked_;
  // A sharded tensor's row hashes from this trace's summary: each stitched row must hash to it.
  mutable std::map<std::string, std::vector<uint64_t>> shard_row_hashes_;
};

}  // namespace lockstep::traces
