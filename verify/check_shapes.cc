// verify/check_shapes.cc — every tensor of a trace against the shape this model gives it,
// before verify reads a row (internal::CheckShapes, check_internal.h).
#include <algorithm>
#include <map>
#include <string>

#include "engine/kv_cache.h"
#include "engine/tap_cols.h"
#include "verify/check_internal.h"

namespace lockstep::verify::internal {
namespace {

traces::DType TraceDType(engine::TapDType t) {
  switch (t) {
    case engine::TapDType::kF32: return traces::DType::kF32;
    case engine::TapDType::kI32: return traces::DType::kI32;
    case engine::TapDType::kBf16: return traces::DType::kBf16;
    case engine::TapDType::kFp8E4m3: return traces::DType::kFp8E4m3;
    case engine::TapDType::kU8: return traces::DType::kU8;
  }
  return traces::DType::kF32;
}

}  // namespace

Status CheckShapes(const traces::TraceReader& trace, const engine::ModelConfig& c, const std::string& kv_format,
                   bool fp8_index_keys, int64_t tp) {
  const std::string file = trace.path().string();
  auto fmt = engine::ParseKvFormat(kv_format);
  if (!fmt.ok()) return Status::Corruption(file + ": meta.kv_cache_format '" + kv_format + "' is no cache format");
  std::map<std::string, std::pair<int64_t, engine::TapDType>> kv;  // "layers.L.<stream><suffix>"
  const engine::PagedKvCache probe(c, *fmt, 1, 0, fp8_index_keys);  // no page allocated
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const auto& streams = probe.streams(l);
    for (size_t si = 0; si < streams.size(); ++si) {
      for (const engine::KvPart& p : probe.parts(l, si)) {
        kv["layers." + std::to_string(l) + "." + streams[si].name + p.suffix] = {p.cols, p.type};
      }
    }
  }
  auto bad = [&](const traces::TensorInfo& t, int64_t cols, traces::DType dt, const std::string& why) {
    return Status::Corruption(file + ": " + t.path + ": " + std::to_string(t.cols) + " columns of " +
                              traces::DTypeName(t.dtype) + ", where this model (" + why + ") has " +
                              std::to_string(cols) + " of " + traces::DTypeName(dt) +
                              ": the trace was not recorded with this model (pass the recorded one with --model)");
  };
  const traces::TensorInfo* top_ids = nullptr;
  const traces::TensorInfo* top_values = nullptr;
  for (const traces::TensorInfo& t : trace.tensors()) {
    int64_t cols = -1;
    traces::DType dt = traces::DType::kF32;
    std::string why;
    if (t.group == "kv") {
      auto it = kv.find(t.name);
      if (it == kv.end()) continue;
      cols = it->second.first;
      dt = TraceDType(it->second.second);
      why = kv_format + " cache";
    } else if (t.name == "logits.topk_ids" || t.name == "logits.topk_values") {
      (t.name == "logits.topk_ids" ? top_ids : top_values) = &t;
      dt = t.name == "logits.topk_ids" ? traces::DType::kI32 : traces::DType::kF32;
      if (t.dtype != dt || t.cols < 1 || t.cols > c.vocab_size) return bad(t, std::min<int64_t>(t.cols, c.vocab_size), dt, "top-k ≤ vocab_size");
      continue;
    } else if (t.name == "logits.logsumexp" || t.name == "logits.logsumexp_t") {
      cols = 1;
      why = "one value a row";
    } else {
      int64_t layer = -1;
      const engine::TapPoint* point = engine::FindTapPoint(t.name, &layer);
      if (point == nullptr || layer >= c.num_hidden_layers) continue;
      cols = engine::TapCols(*point, c, tp);
      if (cols < 0) continue;
      dt = TraceDType(point->dtype);
      why = std::string(point->cols);
    }
    if (t.cols != cols || t.dtype != dt) return bad(t, cols, dt, why);
  }
  if (top_ids != nullptr && top_values != nullptr && top_ids->cols != top_values->cols) {
    return Status::Corruption(file + ": " + top_values->path + ": " + std::to_string(top_values->cols) +
                              " columns, its " + top_ids->path + " has " + std::to_string(top_ids->cols));
  }
  return Status::Ok();
}

}  // namespace lockstep::verify::internal
