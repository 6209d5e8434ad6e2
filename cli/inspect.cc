// cli/inspect.cc — `lockstep inspect run.h5`: what a trace holds (requests and their text,
// tensors with shapes, dtypes and compression ratios, the capture policy, meta), as text or
// --json; --verify recomputes every stored row's content hash against its summary.
#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <iostream>
#include <limits>

#include <nlohmann/json.hpp>

#include "base/json_text.h"
#include "base/natural_order.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/table.h"
#include "traces/row_summary.h"
#include "traces/trace_pack.h"
#include "traces/trace_reader.h"

namespace lockstep::cli {
namespace {

using json = nlohmann::json;

struct InspectArgs {
  std::string trace;
  bool json = false;
  bool verify = false;
  bool all_meta = false;
};

// One line of at most `n` characters (meta values can be whole JSON files).
std::string OneLine(const std::string& s, size_t n) {
  std::string out;
  bool space = false;
  for (char c : s) {
    if (c == '\n' || c == '\r' || c == '\t' || c == ' ') {
      space = !out.empty();
      continue;
    }
    if (space) out += ' ';
    space = false;
    out += c;
  }
  if (out.size() > n) out = out.substr(0, n - 3) + "...";
  return out;
}

double Ratio(int64_t raw, int64_t stored) { return stored > 0 ? static_cast<double>(raw) / stored : 0.0; }

// A tensor group's attributes, numbers as numbers.
json AttrsJson(const traces::TensorInfo& t) {
  json j = t.attrs;
  for (const auto& [k, v] : t.int_attrs) j[k] = v;
  return j;
}

// The capture policy as stored (recorder::CapturePolicy::ToJson) with the open end of a range
// (INT64_MAX: "to the last") as null, for --json.
json PolicyJson(const std::string& text) {
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded()) return json(text);
  for (const char* k : {"layers", "positions"}) {
    if (j.contains(k) && j[k].is_array() && j[k].size() == 2 && j[k][1].is_number_integer() &&
        j[k][1].get<int64_t>() == std::numeric_limits<int64_t>::max()) {
      j[k][1] = nullptr;
    }
  }
  return j;
}

// The capture policy in words: "full; layers all, positions 0-63, stride 2; KV cache; logits top-32".
std::string DescribePolicy(const std::string& text) {
  const json j = json::parse(text, nullptr, false);
  if (!j.is_object()) return text;
  auto range = [&](const char* k) -> std::string {
    if (!j.contains(k) || !j[k].is_array() || j[k].size() != 2 || !j[k][0].is_number_integer() ||
        !j[k][1].is_number_integer()) {
      return "?";
    }
    const int64_t a = j[k][0].get<int64_t>(), b = j[k][1].get<int64_t>();
    const bool open = b == std::numeric_limits<int64_t>::max();
    if (a == 0 && open) return "all";
    return std::to_string(a) + (open ? " to the last" : "-" + std::to_string(b));
  };
  std::string s = j.value("mode", std::string("?"));
  s += "; layers " + range("layers") + ", positions " + range("positions");
  const int64_t stride = j.value("position_stride", int64_t{1});
  if (stride > 1) s += ", stride " + std::to_string(stride);
  if (j.contains("taps") && j["taps"].is_array() && !j["taps"].empty()) {
    std::string t;
    for (const auto& x : j["taps"]) t += (t.empty() ? "" : ", ") + (x.is_string() ? x.get<std::string>() : x.dump());
    s += "; taps " + t;
  }
  s += j.value("kv", true) ? "; KV cache" : "; no KV cache";
  const std::string logits = j.value("logits", std::string("auto"));
  const int64_t k = j.value("logits_topk", int64_t{0});
  if (logits == "full") s += "; logits full";
  else if (logits == "topk") s += "; logits top-" + std::to_string(k);
  else s += "; logits full when vocab <= " + std::to_string(j.value("full_logits_max_vocab", int64_t{0})) +
            ", else top-" + std::to_string(k);
  return s;
}

// Rereads every stored value row and checks XXH3-64 of its bytes against its summary.
Status Verify(const traces::TraceReader& r, int64_t* rows_checked) {
  for (const auto& t : r.tensors()) {
    LS_ASSIGN_OR_RETURN(std::vector<traces::SummaryRow> sum, r.ReadSummary(t));
    if (!t.has_values) continue;
    const size_t rb = t.cols * traces::DTypeSize(t.dtype);
    constexpr int64_t kBatch = 4096;
    for (int64_t b = 0; b < t.rows; b += kBatch) {
      const int64_t n = std::min(kBatch, t.rows - b);
      LS_ASSIGN_OR_RETURN(std::vector<uint8_t> v, r.ReadValues(t, b, n));
      for (int64_t i = 0; i < n; ++i) {
        if (traces::ContentHash(v.data() + i * rb, rb) != sum[b + i].hash) {
          return Status::Corruption(r.path().string() + ": " + t.path + ": row " + std::to_string(b + i) +
                                    " (request " + std::to_string(sum[b + i].request) + ", position " +
                                    std::to_string(sum[b + i].position) + ") does not match its content hash");
        }
      }
      *rows_checked += n;
    }
  }
  return Status::Ok();
}

Status RunInspect(const InspectArgs& a) {
  LS_ASSIGN_OR_RETURN(auto reader, OpenTrace(a.trace));
  const traces::TraceReader& r = *reader;
  LS_ASSIGN_OR_RETURN(std::vector<traces::StepRow> steps, r.ReadSteps());
  LS_ASSIGN_OR_RETURN(std::vector<traces::SamplingRow> sampling, r.ReadSampling());
  int64_t stall_ns = 0, wall_ns = 0;
  for (const auto& s : steps) {
    stall_ns += s.stall_ns;
    wall_ns += s.wall_ns;
  }
  int64_t raw = 0, stored = 0;
  for (const auto& t : r.tensors()) {
    raw += t.raw_bytes;
    stored += t.stored_bytes;
  }
  int64_t verified = -1;
  if (a.verify) {
    verified = 0;
    LS_RETURN_IF_ERROR(Verify(r, &verified));
  }
  const auto policy_it = r.meta().find("capture_policy");
  const std::string policy = policy_it == r.meta().end() ? "" : policy_it->second;
  // A pack (traces/trace_pack.h): what it holds and what a receiver needs to replay it.
  auto pack = traces::ReadPack(r);
  if (!pack.ok() && pack.status().code() != Status::Code::kNotFound) return pack.status();
  auto meta_of = [&](const char* k) {
    auto it = r.meta().find(k);
    return it == r.meta().end() ? std::string() : it->second;
  };

  if (a.json) {
    json j;
    j["file"] = a.trace;
    j["format_version"] = {r.format_major(), r.format_minor()};
    j["complete"] = r.complete();
    j["stopped"] = meta_of(traces::kMetaStopped).empty() ? json(nullptr) : json(meta_of(traces::kMetaStopped));
    j["flushed_steps"] = r.flushed_steps();
    j["writer"] = r.writer();
    j["file_bytes"] = r.file_bytes();
    j["meta"] = r.meta();
    j["capture_policy"] = PolicyJson(policy);
    j["steps"] = steps.size();
    j["sampled_tokens"] = sampling.size();
    j["engine_seconds"] = wall_ns / 1e9;
    j["stall_seconds"] = stall_ns / 1e9;
    j["requests"] = json::array();
    for (const auto& q : r.requests()) {
      j["requests"].push_back({{"id", q.id},
                               {"name", q.name},
                               {"prompt_tokens", q.prompt.size()},
                               {"prompt_text", q.prompt_text},
                               {"generated_tokens", q.generated.size()},
                               {"generated", q.generated},
                               {"generated_text", q.generated_text},
                               {"finish_reason", q.finish_reason},
                               {"seed", q.seed},
                               {"temperature", q.temperature},
                               {"top_k", q.top_k},
                               {"top_p", q.top_p},
                               {"min_p", q.min_p}});
    }
    j["tensors"] = json::array();
    std::vector<traces::TensorInfo> by_name = r.tensors();  // natural order, as the text
    std::stable_sort(by_name.begin(), by_name.end(),
                     [](const auto& x, const auto& y) { return NaturalLess{}(x.path, y.path); });
    for (const auto& t : by_name) {
      j["tensors"].push_back({{"path", t.path},
                              {"dtype", traces::DTypeName(t.dtype)},
                              {"rows", t.rows},
                              {"cols", t.cols},
                              {"values", t.has_values},
                              {"stored_bytes", t.stored_bytes},
                              {"raw_bytes", t.raw_bytes},
                              {"ratio", Ratio(t.raw_bytes, t.stored_bytes)},
                              {"value_ratio", Ratio(t.value_raw_bytes, t.value_stored_bytes)},
                              {"shards", t.shards},
                              {"attrs", AttrsJson(t)}});
    }
    j["tensor_raw_bytes"] = raw;
    j["tensor_stored_bytes"] = stored;
    if (verified >= 0) j["verified_rows"] = verified;
    j["notes"] = r.notes();
    if (pack.ok()) {
      j["pack"] = {{"request", pack->attrs["request"]},
                   {"request_name", pack->attrs["request_name"]},
                   {"source", pack->attrs["source"]},
                   {"packed_with", pack->attrs["packed_with"]},
                   {"manifest_entries", pack->manifest.size()},
                   {"holds", {{"config.json", pack->config_json.size()}, {"tokenizer.json", pack->tokenizer_json.size()}}},
                   {"needs",
                    {{"model_fingerprint", meta_of("model_fingerprint")},
                     {"tokenizer_hash", meta_of("tokenizer_hash")},
                     {"lockstep", meta_of(traces::kMetaRecordedWith)}}}};
    }
    std::cout << JsonText(j, 1) << "\n";
    return Status::Ok();
  }

  std::printf("%s: lockstep trace %d.%d, %s, %.2f MB, written by %s\n", a.trace.c_str(), r.format_major(),
              r.format_minor(),
              r.complete() ? "complete"
                           : ("INCOMPLETE (the recorder did not close it; it holds the " +
                              std::to_string(r.flushed_steps()) + " steps flushed before)")
                                 .c_str(),
              r.file_bytes() / 1e6, r.writer().c_str());
  if (const std::string why = meta_of(traces::kMetaStopped); !why.empty()) {
    std::printf("STOPPED: the recording ended on an error after %lld steps: %s\n",
                static_cast<long long>(steps.size()), why.c_str());
  }
  for (const auto& n : r.notes()) std::printf("note: %s\n", n.c_str());
  if (pack.ok()) {
    std::printf("pack: request %s ('%s') of %s, packed by %s; holds config.json (%zu bytes), %s, a manifest of %zu "
                "content hashes\n",
                pack->attrs["request"].c_str(), pack->attrs["request_name"].c_str(), pack->attrs["source"].c_str(),
                pack->attrs["packed_with"].c_str(), pack->config_json.size(),
                pack->tokenizer_json.empty() ? "no tokenizer.json"
                                             : ("tokenizer.json (" + std::to_string(pack->tokenizer_json.size()) + " bytes)").c_str(),
                pack->manifest.size());
    std::printf("pack needs: the model's weights with fingerprint %s (tokenizer %s), and %s; replay it with "
                "`lockstep replay %s -m MODEL`\n",
                meta_of("model_fingerprint").c_str(), meta_of("tokenizer_hash").c_str(),
                meta_of(traces::kMetaRecordedWith).c_str(), a.trace.c_str());
  }
  std::printf("capture: %s\n", policy.empty() ? "(not recorded)" : DescribePolicy(policy).c_str());
  if (const std::string n = meta_of(traces::kMetaShardRanks); !n.empty()) {
    int64_t sharded = 0;
    for (const auto& t : r.tensors()) sharded += t.shards > 0;
    const std::string last = std::string(traces::kMetaShardFile) + std::to_string(std::max(0, std::atoi(n.c_str()) - 1));
    std::printf("rank shards: %s beside the trace (%s … %s), holding the rank-split taps' values (%lld tensors, "
                "\"shard\" below)\n",
                n.c_str(), meta_of((std::string(traces::kMetaShardFile) + "0").c_str()).c_str(),
                meta_of(last.c_str()).c_str(), static_cast<long long>(sharded));
  }
  std::printf("meta:\n");
  Table meta({"", ""});
  for (const auto& [k, v] : r.meta()) {
    if (k == "capture_policy") continue;
    meta.Add({k, a.all_meta ? v : OneLine(v, 100)});
  }
  meta.Print(2, /*header=*/false);
  std::printf("run: %zu steps, %zu sampled tokens, %.3f s in the engine, %.3f s stalled on the trace\n",
              steps.size(), sampling.size(), wall_ns / 1e9, stall_ns / 1e9);
  std::printf("requests (%zu):\n", r.requests().size());
  for (const auto& q : r.requests()) {
    std::printf("  %d '%s': prompt %zu tokens%s%s, generated %zu tokens (%s)%s%s\n", q.id, q.name.c_str(),
                q.prompt.size(), q.prompt_text.empty() ? "" : " ", q.prompt_text.empty() ? "" : ("\"" + OneLine(q.prompt_text, 60) + "\"").c_str(),
                q.generated.size(), q.finish_reason.empty() ? "unfinished" : q.finish_reason.c_str(),
                q.generated_text.empty() ? "" : " ", q.generated_text.empty() ? "" : ("\"" + OneLine(q.generated_text, 60) + "\"").c_str());
  }
  // Tensors in natural order: layers.2 before layers.10.
  std::vector<const traces::TensorInfo*> sorted;
  for (const auto& t : r.tensors()) sorted.push_back(&t);
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const auto* x, const auto* y) { return NaturalLess{}(x->path, y->path); });
  std::printf("tensors (%zu):\n", r.tensors().size());
  Table tensors({"name", "dtype", "rows x cols", "stored", "MB", "ratio"}, {false, false, true, false, true, true});
  for (const auto* t : sorted) {
    tensors.Add({t->path, traces::DTypeName(t->dtype), std::to_string(t->rows) + " x " + std::to_string(t->cols),
                 t->shards > 0 ? (t->has_values ? "shard" : "summary (shard missing)") : t->has_values ? "values" : "summary",
                 Format("%.3f", t->stored_bytes / 1e6),
                 Format("%.2f", Ratio(t->raw_bytes, t->stored_bytes))});
  }
  tensors.Print(2);
  std::printf("total: %.2f MB of tensors stored as %.2f MB (ratio %.2f)\n", raw / 1e6, stored / 1e6, Ratio(raw, stored));
  if (verified >= 0) std::printf("verify: %lld stored rows match their content hashes\n", static_cast<long long>(verified));
  return Status::Ok();
}

}  // namespace

void RegisterInspect(CLI::App& app, SetAction set_action) {
  auto args = std::make_shared<InspectArgs>();
  CLI::App* cmd = app.add_subcommand("inspect", "Show what a trace holds: requests, tensors, compression, meta");
  cmd->add_option("trace", args->trace, "Trace file (.h5)")->required();
  cmd->add_flag("--json", args->json, "One JSON object on stdout");
  cmd->add_flag("--verify", args->verify, "Recompute every stored row's content hash and compare with its summary");
  cmd->add_flag("--all-meta", args->all_meta, "Print meta values whole, not cut to one line");
  cmd->callback([args, set_action] { set_action([args] { return RunInspect(*args); }); });
}

}  // namespace lockstep::cli
