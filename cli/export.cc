// cli/export.cc — `lockstep export run.h5 --request ID --tap NAME -o x.npy`: one request's
// rows of one tensor as a NumPy .npy file (format 1.0), for notebooks. Rows are in position
// order; --positions-out writes the positions beside them. bf16 is widened to float32
// (exactly) unless --raw; an FP8 cache part is dequantised with its `.scales` rows (each value
// e4m3(q) × the scale of its tile: V3.2's float32 per 128 values, V4 MODEL1's UE8M0 2^(s−127)
// per 64, with the row's BF16 RoPE tail appended) unless --raw, which keeps the uint8 codes.
// --summary exports the per-row summaries as a structured array instead.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>

#include "cli/commands.h"
#include "cli/common.h"
#include "traces/row_summary.h"
#include "traces/trace_reader.h"

namespace lockstep::cli {
namespace {

struct ExportArgs {
  std::string trace, request, tap, output, positions_out;
  bool raw = false;
  bool summary = false;
};

// NumPy .npy 1.0: magic, version, little-endian header length, a Python dict literal padded
// with spaces and a newline so that the data starts at a multiple of 64 bytes.
Status WriteNpy(const std::string& path, const std::string& descr, const std::vector<int64_t>& shape,
                const void* data, size_t bytes) {
  std::string dims;  // "(n,)" or "(n, c)"
  for (size_t i = 0; i < shape.size(); ++i) dims += (i ? ", " : "") + std::to_string(shape[i]);
  if (shape.size() == 1) dims += ",";
  std::string header = "{'descr': " + descr + ", 'fortran_order': False, 'shape': (" + dims + "), }";
  const size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  if (!out) return Status::IoError(path + ": cannot create");
  const uint16_t hlen = static_cast<uint16_t>(header.size());
  out.write("\x93NUMPY\x01\x00", 8);
  const char len[2] = {static_cast<char>(hlen & 0xFF), static_cast<char>(hlen >> 8)};
  out.write(len, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  out.close();
  if (!out) return Status::IoError(path + ": write failed (disk full?)");
  return Status::Ok();
}

Status RunExport(const ExportArgs& a) {
  LS_ASSIGN_OR_RETURN(auto reader, OpenTrace(a.trace));
  const traces::TraceReader& r = *reader;
  const traces::TensorInfo* t = r.FindTensor(a.tap);
  if (!t && (a.tap == "logits" || a.tap == "taps/logits") && r.FindTensor("logits.topk_ids")) {
    return Status::NotFound(a.trace + ": the logits were captured as their top-k (vocabulary > " +
                            "full_logits_max_vocab): export 'logits.topk_ids', 'logits.topk_values' and " +
                            "'logits.logsumexp' (log-probability = value - logsumexp), or record with --logits full");
  }
  if (!t) {
    return Status::NotFound(a.trace + ": no tensor '" + a.tap + "' (`lockstep inspect " + a.trace + "` lists them)");
  }
  if (t->path == "taps/logits" && !t->has_values && r.FindTensor("logits.topk_ids")) {
    return Status::NotFound(a.trace + ": taps/logits holds only summaries; the values are the top-k: export " +
                            "'logits.topk_ids', 'logits.topk_values' and 'logits.logsumexp' (log-probability = value - " +
                            "logsumexp), or record with --logits full");
  }
  int32_t id = -1;
  for (const auto& q : r.requests()) {
    if (std::to_string(q.id) == a.request || q.name == a.request) {
      id = q.id;
      break;
    }
  }
  if (id < 0) return Status::NotFound(a.trace + ": no request '" + a.request + "' (by id or name)");
  LS_ASSIGN_OR_RETURN(std::vector<traces::SummaryRow> sum, r.ReadSummary(*t));
  std::vector<int64_t> rows, positions;
  std::vector<traces::SummaryRow> mine;
  for (int64_t i = 0; i < static_cast<int64_t>(sum.size()); ++i) {
    if (sum[i].request == id) {
      rows.push_back(i);
      positions.push_back(sum[i].position);
      mine.push_back(sum[i]);
    }
  }
  if (rows.empty()) return Status::NotFound(a.trace + ": " + t->path + " has no rows of request " + a.request);
  const int64_t n = static_cast<int64_t>(rows.size());
  if (a.summary) {
    const std::string descr =
        "[('position', '<i8'), ('hash', '<u8'), ('request', '<i4'), ('step', '<i4'), ('nan_count', '<u4'), "
        "('inf_count', '<u4'), ('rms', '<f4'), ('absmax', '<f4'), ('min', '<f4'), ('max', '<f4')]";
    LS_RETURN_IF_ERROR(WriteNpy(a.output, descr, {n}, mine.data(), mine.size() * sizeof(traces::SummaryRow)));
  } else {
    if (!t->has_values && t->shards > 0) {
      // Its values lie in rank shards, one of which is not beside the trace: the reader says which.
      return r.ReadValues(*t, 0, 0).status().WithContext(a.trace + ": ");
    }
    if (!t->has_values) {
      return Status::NotFound(a.trace + ": " + t->path + " was captured as a summary only (use --summary)");
    }
    const size_t rb = t->cols * traces::DTypeSize(t->dtype);
    std::vector<uint8_t> values(n * rb);
    // Read contiguous runs of table rows.
    for (int64_t k = 0; k < n;) {
      int64_t e = k + 1;
      while (e < n && rows[e] == rows[e - 1] + 1) ++e;
      LS_ASSIGN_OR_RETURN(std::vector<uint8_t> v, r.ReadValues(*t, rows[k], e - k));
      std::memcpy(values.data() + k * rb, v.data(), v.size());
      k = e;
    }
    std::string descr;
    switch (t->dtype) {
      case traces::DType::kF32: descr = "'<f4'"; break;
      case traces::DType::kI32: descr = "'<i4'"; break;
      case traces::DType::kBf16: descr = a.raw ? "'<u2'" : "'<f4'"; break;
      case traces::DType::kFp8E4m3:
      case traces::DType::kU8: descr = "'|u1'"; break;
    }
    // An FP8 part and its scales, found by (request, position): V3.2's (kv/layers.L.latent +
    // .scales, .indexer_k + .scales: one float32 a 128-value tile) or V4's MODEL1 (kv/….window,
    // .compressed: .scales one UE8M0 exponent a 64-value tile, and the row's BF16 RoPE tail in
    // .rope, appended so the row comes out whole, as the attention reads it).
    const traces::TensorInfo* scales = t->dtype == traces::DType::kFp8E4m3 ? r.FindTensor(t->path + ".scales") : nullptr;
    if (t->dtype == traces::DType::kFp8E4m3 && !a.raw) {
      const bool model1 = scales && scales->dtype == traces::DType::kU8;
      if (!scales || !scales->has_values || (scales->dtype != traces::DType::kF32 && !model1)) {
        return Status::NotFound(a.trace + ": " + t->path + " is FP8 without a '.scales' tensor (float32 or UE8M0 " +
                                "values) to dequantise it with (--raw exports the codes)");
      }
      const int64_t tile = model1 ? 64 : 128, tiles = (t->cols + tile - 1) / tile;
      if (scales->cols != tiles) {
        return Status::Corruption(a.trace + ": " + scales->path + ": " + std::to_string(scales->cols) +
                                  " scales a row, expected " + std::to_string(tiles) + " for " + std::to_string(t->cols) +
                                  " values");
      }
      const traces::TensorInfo* rope = model1 ? r.FindTensor(t->path + ".rope") : nullptr;
      if (model1 && (!rope || !rope->has_values || rope->dtype != traces::DType::kBf16)) {
        return Status::NotFound(a.trace + ": " + t->path + " is a MODEL1 row without its '.rope' tensor of bf16 " +
                                "values (--raw exports the codes)");
      }
      auto rows_by_place = [&](const traces::TensorInfo& x) -> Result<std::map<std::pair<int32_t, int64_t>, int64_t>> {
        LS_ASSIGN_OR_RETURN(std::vector<traces::SummaryRow> xs, r.ReadSummary(x));
        std::map<std::pair<int32_t, int64_t>, int64_t> m;
        for (int64_t i = 0; i < static_cast<int64_t>(xs.size()); ++i) m[{xs[i].request, xs[i].position}] = i;
        return m;
      };
      auto row_of = [&](const traces::TensorInfo& x, const std::map<std::pair<int32_t, int64_t>, int64_t>& m,
                        int64_t pos, size_t bytes) -> Result<std::vector<uint8_t>> {
        auto it = m.find({id, pos});
        if (it == m.end()) {
          return Status::Corruption(a.trace + ": " + x.path + ": no row for request " + std::to_string(id) +
                                    " position " + std::to_string(pos));
        }
        LS_ASSIGN_OR_RETURN(std::vector<uint8_t> v, r.ReadValues(x, it->second, 1));
        if (v.size() != bytes) return Status::Corruption(a.trace + ": " + x.path + ": short row");
        return v;
      };
      LS_ASSIGN_OR_RETURN(auto srow, rows_by_place(*scales));
      std::map<std::pair<int32_t, int64_t>, int64_t> rrow;
      if (rope) {
        LS_ASSIGN_OR_RETURN(rrow, rows_by_place(*rope));
      }
      const int64_t width = t->cols + (rope ? rope->cols : 0);
      std::vector<float> wide(n * width);
      for (int64_t k = 0; k < n; ++k) {
        LS_ASSIGN_OR_RETURN(std::vector<uint8_t> sv, row_of(*scales, srow, positions[k], tiles * (model1 ? 1 : 4)));
        float* out = wide.data() + k * width;
        for (int64_t c = 0; c < t->cols; ++c) {
          float sc;
          if (model1) {
            sc = std::ldexp(1.0f, static_cast<int>(sv[c / tile]) - 127);
          } else {
            std::memcpy(&sc, sv.data() + 4 * (c / tile), 4);
          }
          out[c] = traces::Fp8E4m3ToFloat(values[k * rb + c]) * sc;
        }
        if (rope) {
          LS_ASSIGN_OR_RETURN(std::vector<uint8_t> rv, row_of(*rope, rrow, positions[k], rope->cols * 2));
          for (int64_t c = 0; c < rope->cols; ++c) {
            uint16_t h;
            std::memcpy(&h, rv.data() + 2 * c, 2);
            out[t->cols + c] = traces::Bf16ToFloat(h);
          }
        }
      }
      descr = "'<f4'";
      LS_RETURN_IF_ERROR(WriteNpy(a.output, descr, {n, width}, wide.data(), wide.size() * 4));
    } else if (t->dtype == traces::DType::kBf16 && !a.raw) {
      std::vector<float> wide(n * t->cols);
      for (size_t i = 0; i < wide.size(); ++i) {
        uint16_t h;
        std::memcpy(&h, values.data() + 2 * i, 2);
        wide[i] = traces::Bf16ToFloat(h);
      }
      LS_RETURN_IF_ERROR(WriteNpy(a.output, descr, {n, t->cols}, wide.data(), wide.size() * 4));
    } else {
      LS_RETURN_IF_ERROR(WriteNpy(a.output, descr, {n, t->cols}, values.data(), values.size()));
    }
  }
  if (!a.positions_out.empty()) {
    LS_RETURN_IF_ERROR(WriteNpy(a.positions_out, "'<i8'", {n}, positions.data(), positions.size() * 8));
  }
  std::fprintf(stderr, "lockstep: wrote %s: %lld rows of %s (request %d, positions %lld..%lld)\n", a.output.c_str(),
               static_cast<long long>(n), t->path.c_str(), id, static_cast<long long>(positions.front()),
               static_cast<long long>(positions.back()));
  return Status::Ok();
}

}  // namespace

void RegisterExport(CLI::App& app, SetAction set_action) {
  auto args = std::make_shared<ExportArgs>();
  CLI::App* cmd = app.add_subcommand("export", "Write one request's rows of one tensor as a NumPy .npy file");
  cmd->add_option("trace", args->trace, "Trace file (.h5)")->required();
  cmd->add_option("--request,-r", args->request, "Request id or name")->required();
  cmd->add_option("--tap", args->tap, "Tensor: a tap name (layers.0.attn.out) or a path (kv/layers.0.latent)")
      ->required();
  cmd->add_option("--output,-o", args->output, "Output .npy file")->required();
  cmd->add_option("--positions-out", args->positions_out, "Also write the rows' positions (.npy, int64)");
  cmd->add_flag("--raw", args->raw,
                "Keep values as stored: bf16 as its uint16 bits (else widened to float32), FP8 as its uint8 codes "
                "(else dequantised with its .scales rows to float32; a V4 MODEL1 row gets its .rope tail appended)");
  cmd->add_flag("--summary", args->summary, "Export the per-row summaries (structured array) instead of values");
  cmd->footer("In Python: x = numpy.load('x.npy')");
  cmd->callback([args, set_action] { set_action([args] { return RunExport(*args); }); });
}

}  // namespace lockstep::cli
