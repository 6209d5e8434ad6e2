// traces/trace_format.h — the on-disk layout of a lockstep trace, shared by TraceWriter and
// TraceReader. Every group, dataset and attribute name and every version constant lives
// here; docs/trace-format.md is the prose spec of the same layout (keep them in step).
//
// A trace is one HDF5 file (default file format, readable by HDF5 ≥ 1.8, h5py, h5dump):
//
//   /                      attrs: lockstep_trace, format_version [major, minor], complete,
//                                 flushed_steps, writer
//   /meta                  attrs: one string per key (model config JSON, fingerprint, …)
//   /requests/<id>         attrs: name, max_new_tokens, seed, temperature, top_k, top_p, min_p
//                          datasets: prompt int32 [P], prompt_text
//   /requests/<id>/final   (format 1.1; created with the request, filled when it finishes)
//                          attr finish_reason; datasets generated int32 [G], generated_text.
//                          Finishing writes only into this child, never into the request's
//                          own object header, so a kill while it is flushed cannot tear what
//                          an earlier flush made durable. Format 1.0 kept these three in
//                          /requests/<id> itself; readers accept both.
//   /sampling              SamplingRow [N]: one row per generated token, any request
//   /steps                 StepRow [N]: one row per engine step
//   /step_batch            int64 [N, batch_width]: the request ids of each step, −1 padded
//   /taps/<tap name>/      attrs: dtype, cols, has_values, + caller's attrs
//        summary           SummaryRow [N]: (request, position) of each row + its statistics
//        values            [N, cols] in the stored dtype (only with has_values = 1);
//                          row i of values is described by row i of summary
//   /kv/<layer.stream>/    same shape as a tap: the KV cache bytes as stored
//
// Beside it, only while recording (or after a crash), the sidecar <trace>.tails (HDF5):
//   /tails/<k>             the rows of the unfinished last chunk of the table named by attr
//                          `target` (rows [base, base + count) of that table)
// and the chunk directory <trace>.chunks (a plain binary file of ChunkRecord): where in the
// trace every full chunk was written, so that a table whose chunk index a kill tore can
// still be read. A clean close writes the tails' rows into the trace and deletes both.
//
// Tables grow along rows in chunks of `chunk_rows` rows (attribute on each table). A chunk
// is written once, shuffled and Zstandard-compressed (filter 32015), when it is full.
// Rows of the unfinished last chunk go, at each flush, to an uncompressed "tail" dataset in
// the sidecar that is overwritten in place; the full rule is in docs/trace-format.md
// ("Crash safety").
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace lockstep::traces {

// The format's limits, which a reader enforces before it allocates anything a file claims
// (issue 31): a chunk holds at most kMaxChunkRows rows and kMaxChunkDecodedBytes bytes once
// decoded (the writer makes ~64-128 KiB chunks of 8-4096 rows; 8 rows of a 129k-token logits
// row are 4 MiB), a tensor at most kMaxCols columns, a row's position and a layer index fit
// these bounds.
inline constexpr int64_t kMaxChunkRows = 4096;
inline constexpr int64_t kMaxChunkDecodedBytes = int64_t{64} << 20;
inline constexpr int64_t kMaxCols = int64_t{1} << 22;
inline constexpr int64_t kMaxPosition = int64_t{1} << 31;
inline constexpr int64_t kMaxLayer = 1 << 16;
// A request's numbers (attributes of /requests/<id>): what a writer refuses to write and a reader
// refuses to read, so that no trace is written that lockstep cannot open. Prompt and generated
// token lists of at most 2^26 tokens keep every position below kMaxPosition; a text at most 1 GiB.
inline constexpr int64_t kMaxRequestTokens = int64_t{1} << 26;  // prompt, generated, max_new_tokens
inline constexpr int64_t kMaxTopK = int64_t{1} << 26;
inline constexpr double kMaxTemperature = 1e6;
inline constexpr int64_t kMaxTextBytes = int64_t{1} << 30;
inline constexpr int64_t kMaxBatchWidth = 4096;  // columns of /step_batch: requests in one step

// Version: a reader refuses a trace whose major is newer than its own; a larger minor
// only adds things an older reader may ignore.
inline constexpr int32_t kFormatMajor = 1;
inline constexpr int32_t kFormatMinor = 3;  // 1.1: /requests/<id>/final; 1.2: KV byte counts as int64;
                                           // 1.3: tensors whose values lie in rank shards

// Root attributes.
inline constexpr char kAttrMagic[] = "lockstep_trace";         // string, value kMagicValue
inline constexpr char kMagicValue[] = "lockstep trace";
inline constexpr char kAttrFormatVersion[] = "format_version";  // int32 [2]
inline constexpr char kAttrComplete[] = "complete";             // uint8: 1 once closed cleanly
inline constexpr char kAttrFlushedSteps[] = "flushed_steps";    // int64: engine steps durable
inline constexpr char kAttrWriter[] = "writer";                 // string: "lockstep 0.1.0 (rev)"

// Groups and tables.
inline constexpr char kMetaGroup[] = "meta";
inline constexpr char kRequestsGroup[] = "requests";
inline constexpr char kTapsGroup[] = "taps";
inline constexpr char kKvGroup[] = "kv";
inline constexpr char kTailsGroup[] = "tails";
inline constexpr char kSamplingTable[] = "sampling";
inline constexpr char kStepsTable[] = "steps";
inline constexpr char kStepBatchTable[] = "step_batch";

// Inside a tensor group.
inline constexpr char kValuesDataset[] = "values";
inline constexpr char kSummaryDataset[] = "summary";
inline constexpr char kAttrDType[] = "dtype";          // string, see DTypeName
inline constexpr char kAttrCols[] = "cols";            // int64
inline constexpr char kAttrHasValues[] = "has_values";  // uint8
inline constexpr char kAttrChunkRows[] = "chunk_rows";  // int64, on every table
// On a kv/ tensor group: the stream's bytes a token and this part's offset in them (int64 from
// format 1.2; 1.1 wrote decimal strings).
inline constexpr char kAttrTokenBytes[] = "token_bytes";
inline constexpr char kAttrByteOffset[] = "byte_offset";

// Rank shards (format 1.3; docs/trace-format.md "Format 1.3: rank shards"): a tensor group with int64
// attribute `shards` = N keeps its summary here and its values in N shard files, each a trace
// of its own holding columns [r·cols/N, (r+1)·cols/N) of the rows as taps/<name>; `values` here
// is an HDF5 virtual dataset stitching them (for h5py; lockstep reads the shards itself), and
// has_values is 0 so that a reader that knows no shards sees a summary capture. /meta names the
// shards: kMetaShardRanks, kMetaShardRunId and kMetaShardFile + r (a file name in the trace's
// folder); a shard's /meta: kMetaShardRank, kMetaShardRanks, kMetaShardRunId.
inline constexpr char kAttrShards[] = "shards";
inline constexpr int64_t kMaxShards = 64;
// A recording that ended on an error (an engine step, a rank, a writer) still closes its trace
// with what it recorded; this /meta key then holds the error, and `inspect` says so.
inline constexpr char kMetaStopped[] = "stopped";
inline constexpr char kMetaShardRanks[] = "shard_ranks";
inline constexpr char kMetaShardRunId[] = "shard_run_id";
inline constexpr char kMetaShardFile[] = "shard_file_";
inline constexpr char kMetaShardRank[] = "shard_rank";
// Which rank wrote a shard (0: one writer for every shard, the emulation's), and its process id:
// informational, not checked.
inline constexpr char kMetaShardWriterRank[] = "shard_writer_rank";
inline constexpr char kMetaShardWriterPid[] = "shard_writer_pid";
// /meta keys that describe the files a trace lies in, not what it holds (a pack, which
// materialises the shards' values, leaves them out).
inline bool IsShardMetaKey(std::string_view k) { return k.rfind("shard_", 0) == 0; }
// A shard's file name as a trace may name it: a plain name in the trace's folder (no folder part,
// not "." or "..", printable, at most 255 bytes) — a hostile trace cannot point a reader elsewhere.
inline bool IsShardFileName(std::string_view f) {
  if (f.empty() || f.size() > 255 || f == "." || f == "..") return false;
  for (const char c : f) {
    if (c == '/' || c == '\\' || static_cast<unsigned char>(c) < 0x20 || c == 0x7f) return false;
  }
  return true;
}

// Tail datasets (crash recovery), in the sidecar file <trace>.tails.
inline constexpr char kTailsSuffix[] = ".tails";
inline constexpr char kAttrTailTarget[] = "target";  // string: the table's path
inline constexpr char kAttrTailBase[] = "base";      // int64: table row of the tail's row 0
inline constexpr char kAttrTailCount[] = "count";    // int64: valid rows in the tail

// The chunk directory <trace>.chunks: kChunksMagic (8 bytes), then one ChunkRecord per full
// chunk, appended right after the chunk's bytes reach the trace and before any flush makes
// the trace's index point at it. A kill can leave a partial last record; `check` tells a
// whole record from a torn one.
inline constexpr char kChunksSuffix[] = ".chunks";
inline constexpr char kChunksMagic[8] = {'l', 's', 'c', 'h', 'u', 'n', 'k', '1'};

// Inside /requests/<id>.
inline constexpr char kPromptDataset[] = "prompt";
inline constexpr char kGeneratedDataset[] = "generated";
inline constexpr char kAttrName[] = "name";
inline constexpr char kPromptTextDataset[] = "prompt_text";        // scalar UTF-8 string
inline constexpr char kGeneratedTextDataset[] = "generated_text";  // scalar UTF-8 string
inline constexpr char kAttrFinishReason[] = "finish_reason";
inline constexpr char kFinalGroup[] = "final";  // /requests/<id>/final (format ≥ 1.1)
inline constexpr char kAttrMaxNewTokens[] = "max_new_tokens";
inline constexpr char kAttrSeed[] = "seed";
inline constexpr char kAttrTemperature[] = "temperature";
inline constexpr char kAttrTopK[] = "top_k";
inline constexpr char kAttrTopP[] = "top_p";
inline constexpr char kAttrMinP[] = "min_p";

// Compression: HDF5 byte-shuffle, then Zstandard through the registered filter ID 32015
// (cd_values[0] = level), one ZSTD_compress frame per chunk so that the HDF Group's
// H5Zzstd and hdf5plugin decode it.
inline constexpr int kZstdFilterId = 32015;
inline constexpr int kDefaultZstdLevel = 3;

// Element types of tensor values. bf16 is stored as uint16 (the top half of an IEEE fp32:
// value = float32(bits << 16)); fp8_e4m3 as uint8 (OCP E4M3FN: bias 7, no Inf, 0x7F/0xFF
// NaN, max 448). HDF5 custom floats are deliberately not used: HDF5 reads E4M3's 448 as NaN.
enum class DType : uint8_t { kF32 = 0, kI32 = 1, kBf16 = 2, kFp8E4m3 = 3, kU8 = 4 };
inline constexpr const char* DTypeName(DType d) {
  switch (d) {
    case DType::kF32: return "f32";
    case DType::kI32: return "i32";
    case DType::kBf16: return "bf16";
    case DType::kFp8E4m3: return "fp8_e4m3";
    case DType::kU8: return "u8";
  }
  return "?";
}
inline constexpr size_t DTypeSize(DType d) {
  switch (d) {
    case DType::kF32: case DType::kI32: return 4;
    case DType::kBf16: return 2;
    case DType::kFp8E4m3: case DType::kU8: return 1;
  }
  return 0;
}

// Content hash of a row: XXH3-64 with seed 0 over the row's stored bytes (little-endian,
// row-major). Python: xxhash.xxh3_64_intdigest(row.tobytes()).
inline constexpr uint64_t kHashSeed = 0;

// One row of a summary table: where the row came from and statistics of its values
// (computed in double from the values as stored, then rounded to float; NaN and ±Inf are
// counted and excluded from rms/absmax/min/max, which are 0 when no value is finite).
// The struct is the file layout: little-endian, no padding (static_asserts below).
struct SummaryRow {
  int64_t position = 0;  // sequence position within the request
  uint64_t hash = 0;     // XXH3-64 of the row's bytes
  int32_t request = 0;   // engine request id
  int32_t step = 0;      // engine step that produced the row
  uint32_t nan_count = 0;
  uint32_t inf_count = 0;
  float rms = 0, absmax = 0, min = 0, max = 0;
};
static_assert(sizeof(SummaryRow) == 48);

// One sampled token: the sampler's inputs and its draw (docs/sampling.md).
struct SamplingRow {
  int32_t request = 0;
  int32_t token = -1;
  int64_t token_index = 0;  // index of the token within the request's generation
  int64_t step = 0;         // engine step
  uint64_t seed = 0;        // Philox key
  uint64_t counter = 0;     // Philox counter (the token index)
  int64_t top_k = 0;
  int64_t candidates = 0;   // tokens left after the filters
  double probability = 0;   // of the chosen token under the filtered distribution
  double uniform = -1;      // the draw; −1 when greedy
  double temperature = 0;
  double top_p = 1;
  double min_p = 0;
  int32_t batch_size = 0;
  int32_t finished = 0;     // on the request's last token: 1 "length", 2 "stop", 3 other; else 0
  int32_t sampled = -1;     // the sampler's own choice (differs from token when forced)
  int32_t forced = 0;       // 1 when the token was teacher-forced (replay), not sampled
};
static_assert(sizeof(SamplingRow) == 112);

// One engine step.
struct StepRow {
  int64_t step = 0;
  int32_t batch_size = 0;
  int32_t tokens = 0;       // tokens the forward pass processed (prefill + decode rows)
  int64_t wall_ns = 0;      // engine time of the step (forward + sampling)
  int64_t stall_ns = 0;     // time the engine waited on the trace during the step (a full queue,
                            // or a lent tap buffer not yet back: engine/lending_pool.h)
};
static_assert(sizeof(StepRow) == 32);

// One full chunk of a table, as written: little-endian, no padding.
struct ChunkRecord {
  uint64_t table = 0;        // XXH3-64 (seed 0) of the table's dataset path, e.g. "taps/x/values"
  int64_t index = 0;         // chunk number along rows: rows [index·chunk_rows, +chunk_rows)
  uint64_t address = 0;      // byte offset of the stored (filtered) chunk in the trace file
  uint64_t size = 0;         // its stored bytes
  uint32_t filter_mask = 0;  // HDF5's: bit k set = filter k skipped (0: shuffle and zstd applied)
  uint32_t check = 0;        // low 32 bits of XXH3-64 (seed 0) of the 36 bytes before it
};
static_assert(sizeof(ChunkRecord) == 40);

}  // namespace lockstep::traces
