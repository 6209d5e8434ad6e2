// traces/trace_pack.h — a pack: one request of a trace, made into a trace a stranger can replay
// (rr's `pack`; `lockstep pack`, docs/trace-format.md "Packs").
//
// A pack is an ordinary complete trace (the same layout, any command opens it) that holds one
// request of its source, renumbered to request 0: its rows of every tap and KV stream, its
// sampling rows, the steps it took part in, the source's /meta (model config, fingerprint,
// tokenizer hash, engine options, capture policy) and meta.recorded_with, the exact lockstep that
// wrote the source. Beside them the group /pack holds what the receiver needs and cannot get
// from the weights' owner:
//   /pack/manifest        text: "<xxh3-64 hex>  <entry>" a line, the content hash of every part
//                         (meta/<key>, requests/<id>, sampling, steps, <tensor>/attrs|summary|values,
//                         pack/config.json, pack/tokenizer.json)
//   /pack/config.json     the model's config.json as recorded (meta.model_config)
//   /pack/tokenizer.json  the model's tokenizer.json, when the packer had it
//   attrs on /pack: request (the source's id), request_name, source (file name), packed_with
// Not the weights: the receiver brings them, and the fingerprint says whether they are the same.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "base/status.h"
#include "traces/trace_reader.h"

namespace lockstep::traces {

inline constexpr char kPackGroup[] = "pack";
inline constexpr char kPackManifest[] = "manifest";
inline constexpr char kPackConfig[] = "config.json";
inline constexpr char kPackTokenizer[] = "tokenizer.json";
inline constexpr char kMetaRecordedWith[] = "recorded_with";  // /meta key: the source's `writer`
// What a pack's files may hold, at most (a DeepSeek V3 tokenizer.json is 7.8 MB).
inline constexpr size_t kMaxPackFileBytes = size_t{256} << 20;

struct PackOptions {
  int32_t request = 0;             // the source's request id
  std::filesystem::path output;    // must not be the source
  std::string tokenizer_json;      // the model's tokenizer.json bytes, or "" when not at hand
  std::string packed_with;         // "lockstep 0.1.0 (rev)": the packer's version
};

// What WritePack wrote, for its caller's report.
struct PackSummary {
  int64_t rows = 0;      // tensor rows (summary rows) of the request, all tensors
  int64_t tensors = 0;   // tensors with at least one row of it
  int64_t tokens = 0;    // generated tokens (sampling rows)
  int64_t file_bytes = 0;
};

// Writes the pack of `options.request` of `src` (a complete trace) to options.output.
Result<PackSummary> WritePack(const TraceReader& src, const PackOptions& options);

// The content hash of every part of `t`, as a manifest lists it (entry → "xxh3-64 hex").
Result<std::map<std::string, std::string>> ContentHashes(const TraceReader& t);

// A pack's /pack contents: the manifest's entries and the files. NotFound when `t` is no pack.
struct PackContents {
  std::map<std::string, std::string> manifest;  // entry → hash
  std::map<std::string, std::string> attrs;     // request, request_name, source, packed_with
  std::string config_json, tokenizer_json;      // tokenizer "" when not packed
};
Result<PackContents> ReadPack(const TraceReader& t);

// The manifest checked against what the pack holds now: one line per entry that differs, is
// missing or was added ("" entries when all match).
Result<std::vector<std::string>> CheckManifest(const TraceReader& t, const PackContents& pack);

}  // namespace lockstep::traces
