// traces/trace_pack.cc — see trace_pack.h.
#include "traces/trace_pack.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "traces/h5.h"
#include "traces/row_summary.h"
#include "traces/trace_writer.h"

namespace lockstep::traces {
namespace {

std::string Hex(uint64_t h) {
  char b[17];
  std::snprintf(b, sizeof b, "%016" PRIx64, h);
  return b;
}

// A byte string that lists fields unambiguously (each with its length), for hashing.
struct Bytes {
  std::string s;
  void Add(const void* p, size_t n) {
    const uint64_t len = n;
    s.append(reinterpret_cast<const char*>(&len), sizeof len);
    s.append(static_cast<const char*>(p), n);
  }
  void Add(const std::string& v) { Add(v.data(), v.size()); }
  template <typename T>
  void Num(T v) { Add(&v, sizeof v); }
  template <typename T>
  void Vec(const std::vector<T>& v) { Add(v.data(), v.size() * sizeof(T)); }
  std::string Hash() const { return Hex(ContentHash(s.data(), s.size())); }
};

// Rows of a tensor's values are read this many at a time (bounded memory, whatever the trace).
constexpr int64_t kReadRows = 1024;

}  // namespace

Result<std::map<std::string, std::string>> ContentHashes(const TraceReader& t) {
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : t.meta()) {
    if (IsShardMetaKey(k)) continue;  // where the values lay, not what they are
    Bytes b;
    b.Add(v);
    out["meta/" + k] = b.Hash();
  }
  for (const auto& r : t.requests()) {
    Bytes b;
    b.Add(r.name);
    b.Vec(r.prompt);
    b.Add(r.prompt_text);
    b.Vec(r.generated);
    b.Add(r.generated_text);
    b.Add(r.finish_reason);
    b.Num(r.max_new_tokens);
    b.Num(r.seed);
    b.Num(r.temperature);
    b.Num(r.top_p);
    b.Num(r.min_p);
    b.Num(r.top_k);
    out[std::string(kRequestsGroup) + "/" + std::to_string(r.id)] = b.Hash();
  }
  {
    LS_ASSIGN_OR_RETURN(std::vector<SamplingRow> s, t.ReadSampling());
    Bytes b;
    b.Vec(s);
    out[kSamplingTable] = b.Hash();
  }
  {
    LS_ASSIGN_OR_RETURN(std::vector<StepRow> s, t.ReadSteps());
    int64_t width = 0;
    LS_ASSIGN_OR_RETURN(std::vector<int64_t> batch, t.ReadStepBatch(&width));
    Bytes b;
    b.Vec(s);
    b.Num(width);
    b.Vec(batch);
    out[kStepsTable] = b.Hash();
  }
  for (const auto& ti : t.tensors()) {
    Bytes a;
    a.Add(DTypeName(ti.dtype));
    a.Num(ti.cols);
    a.Num(static_cast<uint8_t>(ti.has_values));
    for (const auto& [k, v] : ti.attrs) {
      a.Add(k);
      a.Add(v);
    }
    for (const auto& [k, v] : ti.int_attrs) {
      a.Add(k);
      a.Num(v);
    }
    out[ti.path + "/attrs"] = a.Hash();
    LS_ASSIGN_OR_RETURN(std::vector<SummaryRow> rows, t.ReadSummary(ti));
    Bytes s;
    s.Vec(rows);
    out[ti.path + "/" + kSummaryDataset] = s.Hash();
    if (ti.has_values) {
      Bytes v;  // the hashes of the values in blocks of kReadRows rows, then their hash
      for (int64_t r0 = 0; r0 < ti.rows; r0 += kReadRows) {
        LS_ASSIGN_OR_RETURN(std::vector<uint8_t> vals, t.ReadValues(ti, r0, std::min(kReadRows, ti.rows - r0)));
        v.Num(ContentHash(vals.data(), vals.size()));
      }
      out[ti.path + "/" + kValuesDataset] = v.Hash();
    }
  }
  return out;
}

Result<PackSummary> WritePack(const TraceReader& src, const PackOptions& o) {
  if (!src.complete()) {
    return Status::InvalidArgument(src.path().string() + ": incomplete (its recorder did not close it); a pack is "
                                   "made of a complete trace");
  }
  const RequestInfo* req = nullptr;
  for (const auto& r : src.requests()) {
    if (r.id == o.request) req = &r;
  }
  if (req == nullptr) {
    std::string ids;
    for (const auto& r : src.requests()) ids += (ids.empty() ? "" : ", ") + std::to_string(r.id);
    return Status::InvalidArgument(src.path().string() + ": no request " + std::to_string(o.request) +
                                   " (it holds " + (ids.empty() ? std::string("none") : ids) + ")");
  }
  if (req->finish_reason.empty()) {
    return Status::InvalidArgument(src.path().string() + ": request " + std::to_string(o.request) +
                                   " did not finish in the trace; a pack holds a finished request");
  }
  auto cfg = src.meta().find("model_config");
  if (cfg == src.meta().end()) return Status::Corruption(src.path().string() + ": meta.model_config missing");
  PackSummary sum;
  std::error_code ec;
  std::filesystem::remove(o.output, ec);
  {
    TraceWriterOptions wo;
    wo.batch_width = 1;
    wo.compression_threads = 0;
    wo.writer = o.packed_with + " pack";
    LS_ASSIGN_OR_RETURN(auto w, TraceWriter::Create(o.output, wo));
    for (const auto& [k, v] : src.meta()) {
      if (!IsShardMetaKey(k)) LS_RETURN_IF_ERROR(w->SetMeta(k, v));  // (a pack holds the shards' values itself)
    }
    // The exact lockstep that recorded the rows (a pack of a pack keeps the first one's).
    auto rw = src.meta().find(kMetaRecordedWith);
    LS_RETURN_IF_ERROR(w->SetMeta(kMetaRecordedWith, rw != src.meta().end() ? rw->second : src.writer()));
    RequestRecord rr;
    rr.id = 0;
    rr.name = req->name;
    rr.prompt = req->prompt;
    rr.prompt_text = req->prompt_text;
    rr.max_new_tokens = req->max_new_tokens;
    rr.seed = req->seed;
    rr.temperature = req->temperature;
    rr.top_p = req->top_p;
    rr.min_p = req->min_p;
    rr.top_k = req->top_k;
    LS_RETURN_IF_ERROR(w->AddRequest(rr));
    for (const auto& ti : src.tensors()) {
      LS_ASSIGN_OR_RETURN(std::vector<SummaryRow> rows, src.ReadSummary(ti));
      std::vector<int64_t> mine;
      for (size_t i = 0; i < rows.size(); ++i) {
        if (rows[i].request == o.request) mine.push_back(static_cast<int64_t>(i));
      }
      TensorSpec spec{ti.path, ti.dtype, ti.cols, ti.has_values, ti.attrs, ti.int_attrs};
      LS_ASSIGN_OR_RETURN(int32_t h, w->DefineTensor(spec));
      if (mine.empty()) continue;
      ++sum.tensors;
      const size_t row_bytes = static_cast<size_t>(ti.cols) * DTypeSize(ti.dtype);
      // In blocks of source rows: that block's rows of the request, summaries and values.
      for (size_t k = 0; k < mine.size();) {
        const int64_t r0 = mine[k];
        const int64_t n = std::min(kReadRows, ti.rows - r0);
        std::vector<uint8_t> vals;
        if (ti.has_values) {
          LS_ASSIGN_OR_RETURN(vals, src.ReadValues(ti, r0, n));
        }
        std::vector<SummaryRow> part;
        std::vector<uint8_t> part_vals;
        for (; k < mine.size() && mine[k] < r0 + n; ++k) {
          SummaryRow s = rows[static_cast<size_t>(mine[k])];
          s.request = 0;
          part.push_back(s);
          if (ti.has_values) {
            const uint8_t* p = vals.data() + static_cast<size_t>(mine[k] - r0) * row_bytes;
            part_vals.insert(part_vals.end(), p, p + row_bytes);
          }
        }
        LS_RETURN_IF_ERROR(w->Append(h, part, ti.has_values ? part_vals.data() : nullptr));
        sum.rows += static_cast<int64_t>(part.size());
      }
      w->Submit();
    }
    LS_ASSIGN_OR_RETURN(std::vector<SamplingRow> sampling, src.ReadSampling());
    for (SamplingRow s : sampling) {
      if (s.request != o.request) continue;
      s.request = 0;
      LS_RETURN_IF_ERROR(w->AppendSampling(s));
      ++sum.tokens;
    }
    LS_ASSIGN_OR_RETURN(std::vector<StepRow> steps, src.ReadSteps());
    int64_t width = 0;
    LS_ASSIGN_OR_RETURN(std::vector<int64_t> batch, src.ReadStepBatch(&width));
    const int64_t zero[] = {0};
    for (size_t i = 0; i < steps.size() && (i + 1) * static_cast<size_t>(width) <= batch.size(); ++i) {
      const auto* ids = batch.data() + i * static_cast<size_t>(width);
      if (std::find(ids, ids + width, o.request) != ids + width) LS_RETURN_IF_ERROR(w->AppendStep(steps[i], zero));
    }
    LS_RETURN_IF_ERROR(w->FinishRequest(0, req->generated, req->generated_text, req->finish_reason));
    LS_RETURN_IF_ERROR(w->Close());
  }
  // The manifest hashes what a reader reads back from the pack as written, then /pack is added.
  std::map<std::string, std::string> hashes;
  {
    LS_ASSIGN_OR_RETURN(auto back, TraceReader::Open(o.output));
    LS_ASSIGN_OR_RETURN(hashes, ContentHashes(*back));
  }
  hashes[std::string(kPackGroup) + "/" + kPackConfig] = Hex(ContentHash(cfg->second.data(), cfg->second.size()));
  if (!o.tokenizer_json.empty()) {
    hashes[std::string(kPackGroup) + "/" + kPackTokenizer] =
        Hex(ContentHash(o.tokenizer_json.data(), o.tokenizer_json.size()));
  }
  std::string manifest;
  for (const auto& [k, v] : hashes) manifest += v + "  " + k + "\n";
  {
    h5::Quiet();
    h5::Hid f(H5Fopen(o.output.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    if (!f.valid()) return h5::Error(o.output.string() + ": cannot reopen to add /pack");
    LS_ASSIGN_OR_RETURN(h5::Hid g, h5::CreateGroup(f.get(), kPackGroup));
    LS_RETURN_IF_ERROR(h5::WriteStringDataset(g.get(), kPackManifest, manifest));
    LS_RETURN_IF_ERROR(h5::WriteStringDataset(g.get(), kPackConfig, cfg->second));
    if (!o.tokenizer_json.empty()) LS_RETURN_IF_ERROR(h5::WriteStringDataset(g.get(), kPackTokenizer, o.tokenizer_json));
    LS_RETURN_IF_ERROR(h5::WriteAttr(g.get(), "request", static_cast<int64_t>(o.request)));
    LS_RETURN_IF_ERROR(h5::WriteAttr(g.get(), "request_name", req->name));
    LS_RETURN_IF_ERROR(h5::WriteAttr(g.get(), "source", src.path().filename().string()));
    LS_RETURN_IF_ERROR(h5::WriteAttr(g.get(), "packed_with", o.packed_with));
    g.Reset();
    LS_RETURN_IF_ERROR(f.Close());
  }
  sum.file_bytes = static_cast<int64_t>(std::filesystem::file_size(o.output, ec));
  return sum;
}

Result<PackContents> ReadPack(const TraceReader& t) {
  const hid_t f = t.hdf5_file();
  if (!h5::Exists(f, kPackGroup)) return Status::NotFound(t.path().string() + ": not a pack (no /pack)");
  const std::string where = t.path().string() + ": /" + kPackGroup;
  auto text = [&](const char* name, bool required, std::string* out) -> Status {
    const std::string p = std::string(kPackGroup) + "/" + name;
    if (!h5::Exists(f, p)) {
      return required ? Status::Corruption(where + "/" + name + " missing") : Status::Ok();
    }
    auto s = h5::ReadStringDataset(f, p, kMaxPackFileBytes);
    if (!s.ok()) return s.status().WithContext(t.path().string() + ": ");
    *out = *s;
    return Status::Ok();
  };
  PackContents pc;
  std::string manifest;
  LS_RETURN_IF_ERROR(text(kPackManifest, true, &manifest));
  LS_RETURN_IF_ERROR(text(kPackConfig, true, &pc.config_json));
  LS_RETURN_IF_ERROR(text(kPackTokenizer, false, &pc.tokenizer_json));
  std::istringstream in(manifest);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    const size_t sp = line.find("  ");
    if (sp != 16 || line.find_first_not_of("0123456789abcdef") != 16 || line.size() <= 18) {
      return Status::Corruption(where + "/manifest: line " + std::to_string(n) + " is not '<16 hex digits>  <entry>'");
    }
    pc.manifest[line.substr(18)] = line.substr(0, 16);
  }
  LS_ASSIGN_OR_RETURN(h5::Hid g, h5::OpenGroup(f, kPackGroup));
  for (const char* k : {"request_name", "source", "packed_with"}) {
    if (auto v = h5::ReadStringAttr(g.get(), k); v.ok()) pc.attrs[k] = *v;
  }
  if (auto v = h5::ReadIntAttr(g.get(), "request"); v.ok()) pc.attrs["request"] = std::to_string(*v);
  H5Eclear2(H5E_DEFAULT);
  return pc;
}

Result<std::vector<std::string>> CheckManifest(const TraceReader& t, const PackContents& pack) {
  LS_ASSIGN_OR_RETURN(auto now, ContentHashes(t));
  now[std::string(kPackGroup) + "/" + kPackConfig] = Hex(ContentHash(pack.config_json.data(), pack.config_json.size()));
  if (!pack.tokenizer_json.empty()) {
    now[std::string(kPackGroup) + "/" + kPackTokenizer] =
        Hex(ContentHash(pack.tokenizer_json.data(), pack.tokenizer_json.size()));
  }
  std::vector<std::string> diffs;
  for (const auto& [k, v] : pack.manifest) {
    auto it = now.find(k);
    if (it == now.end()) {
      diffs.push_back("manifest: " + k + " is listed (xxh3 " + v + ") but not in the pack");
    } else if (it->second != v) {
      diffs.push_back("manifest: " + k + " has xxh3 " + it->second + ", the manifest says " + v +
                      " (changed since it was packed)");
    }
  }
  for (const auto& [k, v] : now) {
    if (!pack.manifest.count(k)) diffs.push_back("manifest: " + k + " is in the pack but not in its manifest");
  }
  return diffs;
}

}  // namespace lockstep::traces
