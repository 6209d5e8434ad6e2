// replayer/replay_session.cc — see replay_session.h.
#include "replayer/replay_session.h"

#include <cstring>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "base/version.h"
#include "engine/tensor_parallel.h"
#include "engine/tokenizer.h"
#include "recorder/fingerprint.h"

namespace lockstep::replayer {
namespace {

using json = nlohmann::json;

std::string MetaOr(const traces::TraceReader& t, const char* key, const std::string& dflt = "") {
  auto it = t.meta().find(key);
  return it == t.meta().end() ? dflt : it->second;
}

Result<recorder::CapturePolicy> PolicyFromTrace(const traces::TraceReader& t) {
  const std::string text = MetaOr(t, "capture_policy");
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    return Status::Corruption(t.path().string() + ": meta.capture_policy is missing or not JSON");
  }
  recorder::CapturePolicy p;
  try {
    LS_ASSIGN_OR_RETURN(p.mode, recorder::CapturePolicy::ParseMode(j.value("mode", "full")));
    p.taps = j.value("taps", std::vector<std::string>{});
    auto layers = j.value("layers", std::vector<int64_t>{0, p.layer_last});
    auto positions = j.value("positions", std::vector<int64_t>{0, p.pos_last});
    if (layers.size() == 2) p.layer_first = layers[0], p.layer_last = layers[1];
    if (positions.size() == 2) p.pos_first = positions[0], p.pos_last = positions[1];
    p.pos_stride = std::max<int64_t>(1, j.value("position_stride", int64_t{1}));
    p.kv = j.value("kv", true);
    const std::string lg = j.value("logits", "auto");
    p.logits = lg == "full"   ? recorder::CapturePolicy::Logits::kFull
               : lg == "topk" ? recorder::CapturePolicy::Logits::kTopK
                              : recorder::CapturePolicy::Logits::kAuto;
    p.logits_topk = j.value("logits_topk", p.logits_topk);
    p.full_logits_max_vocab = j.value("full_logits_max_vocab", p.full_logits_max_vocab);
  } catch (const json::exception& e) {
    return Status::Corruption(t.path().string() + ": meta.capture_policy: " + e.what());
  }
  return p;
}

// Grafting: overwrites each layer's input with the recorded one (embed, layers.L.resid_out).
class GraftHook : public engine::TapHook {
 public:
  GraftHook(engine::TapHook* inner, std::map<std::string, std::map<std::pair<int32_t, int64_t>, std::vector<float>>> rows)
      : inner_(inner), rows_(std::move(rows)) {}
  void OnTap(const engine::TapEvent& e) override { inner_->OnTap(e); }
  bool WantsOverride() const override { return true; }
  bool Override(const engine::TapEvent& e, void* data) override {
    auto it = rows_.find(std::string(e.name));
    if (it == rows_.end()) return false;
    bool any = false;
    for (int64_t r = 0; r < e.rows; ++r) {
      auto jt = it->second.find({static_cast<int32_t>(e.request_id), e.position + r});
      if (jt == it->second.end() || static_cast<int64_t>(jt->second.size()) != e.cols) continue;
      std::memcpy(static_cast<float*>(data) + r * e.cols, jt->second.data(), e.cols * sizeof(float));
      any = true;
    }
    return any;
  }

 private:
  engine::TapHook* inner_;
  std::map<std::string, std::map<std::pair<int32_t, int64_t>, std::vector<float>>> rows_;
};

Result<std::map<std::string, std::map<std::pair<int32_t, int64_t>, std::vector<float>>>> LoadGraftRows(
    const traces::TraceReader& t, int64_t layers) {
  std::map<std::string, std::map<std::pair<int32_t, int64_t>, std::vector<float>>> out;
  std::vector<std::string> names = {std::string(engine::kModelTaps[engine::kTapEmbed].name)};
  for (int64_t l = 0; l + 1 < layers; ++l) {
    names.push_back("layers." + std::to_string(l) + "." + std::string(engine::kLayerTaps[engine::kTapResidOut].name));
  }
  for (const auto& n : names) {
    const traces::TensorInfo* ti = t.FindTensor("taps/" + n);
    if (ti == nullptr || !ti->has_values || ti->dtype != traces::DType::kF32) {
      return Status::InvalidArgument("--graft needs the recorded values of taps/" + n + " in " + t.path().string() +
                                     " (record with --capture full and taps embed, layers.*.resid_out)");
    }
    LS_ASSIGN_OR_RETURN(auto sum, t.ReadSummary(*ti));
    LS_ASSIGN_OR_RETURN(auto vals, t.ReadValues(*ti, 0, static_cast<int64_t>(sum.size())));
    auto& m = out[n];
    for (size_t i = 0; i < sum.size(); ++i) {
      std::vector<float> row(ti->cols);
      std::memcpy(row.data(), vals.data() + i * ti->cols * 4, ti->cols * 4);
      m[{sum[i].request, sum[i].position}] = std::move(row);
    }
  }
  return out;
}

std::string Join(const std::vector<int32_t>& v, size_t from, size_t to) {
  std::string s;
  for (size_t i = from; i < to && i < v.size(); ++i) s += (s.empty() ? "" : " ") + std::to_string(v[i]);
  return s;
}

}  // namespace

std::string_view ReplayModeName(ReplayMode m) {
  switch (m) {
    case ReplayMode::kExact: return "exact";
    case ReplayMode::kForced: return "forced";
    case ReplayMode::kFree: return "free";
  }
  return "?";
}

Result<ReplayMode> ParseReplayMode(std::string_view s) {
  if (s == "exact") return ReplayMode::kExact;
  if (s == "forced") return ReplayMode::kForced;
  if (s == "free") return ReplayMode::kFree;
  return Status::InvalidArgument("--mode: '" + std::string(s) + "' is not one of exact, forced, free");
}

bool Overrides::empty() const {
  return !kv_cache && !backend && kernels.empty() && !fault && !temperature && !top_p && !min_p && !top_k && !max_batch && !emulate_tp && !seed;
}

std::string Overrides::Describe() const {
  std::ostringstream os;
  if (backend) os << "backend=" << *backend << " ";
  if (kv_cache) os << "kv_cache=" << engine::KvFormatName(*kv_cache) << " ";
  for (const auto& [op, v] : kernels) os << op << "=" << v << " ";
  if (fault) os << "fault=" << (fault->empty() ? "none" : *fault) << " ";
  if (temperature) os << "temperature=" << *temperature << " ";
  if (top_p) os << "top_p=" << *top_p << " ";
  if (top_k) os << "top_k=" << *top_k << " ";
  if (min_p) os << "min_p=" << *min_p << " ";
  if (max_batch) os << "max_batch=" << *max_batch << " ";
  if (emulate_tp) os << "emulate_tp=" << *emulate_tp << " ";
  if (seed) os << "seed=" << *seed << " ";
  std::string s = os.str();
  if (s.empty()) return "none";
  s.pop_back();
  return s;
}

Result<engine::EngineOptions> RecordedEngineOptions(const traces::TraceReader& t) {
  const std::string where = t.path().string() + ": meta.engine_options";
  json j = json::parse(MetaOr(t, "engine_options"), nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return Status::Corruption(where + " is missing or not JSON");
  engine::EngineOptions o;
  // Counts are whole numbers in range before they become int64 (1e300 or -1 as a page size
  // is a damaged trace, not a setting).
  auto count = [&](const char* k, int64_t lo, int64_t hi, int64_t* out) -> Status {
    if (!j.contains(k)) return Status::Ok();
    const json& v = j[k];
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi)) ||
        v.get<int64_t>() < lo || v.get<int64_t>() > hi) {
      return Status::Corruption(where + ": " + k + " is " + v.dump() + ", not a whole number from " +
                                std::to_string(lo) + " to " + std::to_string(hi));
    }
    *out = v.get<int64_t>();
    return Status::Ok();
  };
  LS_RETURN_IF_ERROR(count("page_size", 1, 1 << 20, &o.page_size));
  LS_RETURN_IF_ERROR(count("kv_cache_tokens", 1, INT64_MAX, &o.kv_cache_tokens));
  LS_RETURN_IF_ERROR(count("max_batch", 1, traces::kMaxBatchWidth, &o.max_batch));
  LS_RETURN_IF_ERROR(count("max_prefill_tokens", 0, INT64_MAX, &o.max_prefill_tokens));
  LS_RETURN_IF_ERROR(count("emulate_tp", 1, engine::kMaxEmulatedTp, &o.emulate_tp));
  // A run over real ranks (--tp-ranks N) has emulated TP N's bits (docs/parallelism.md): it
  // replays as that, on one device.
  int64_t tp_ranks = 1;
  LS_RETURN_IF_ERROR(count("tp_ranks", 1, engine::kMaxEmulatedTp, &tp_ranks));
  if (tp_ranks > 1 && o.emulate_tp != 1 && o.emulate_tp != tp_ranks) {
    return Status::Corruption(where + ": tp_ranks " + std::to_string(tp_ranks) + " but emulate_tp " +
                              std::to_string(o.emulate_tp));
  }
  if (tp_ranks > 1) o.emulate_tp = tp_ranks;
  try {
    LS_ASSIGN_OR_RETURN(o.kv_format, engine::ParseKvFormat(j.value("kv_cache", "fp32")));
    o.kernels = j.value("kernels", kernels::KernelChoice{});
    o.fault = j.value("fault", std::string());
    o.backend = j.value("backend", std::string("cpu"));
    // Where the recording sampled (traces from before the key sampled on the host).
    o.device.device_sampler = j.value("device_sampler", false);
  } catch (const json::exception& e) {
    return Status::Corruption(where + ": " + e.what());
  }
  return o;
}

// What a forced replay did to the logits, in one sentence a person can act on: how many
// positions changed their most likely token and where, how far the distributions moved, and
// what that means for the text. Teacher forcing feeds the recorded tokens, so the replayed
// text cannot change; for a greedy request the first flip at a generated position is exactly
// where a free greedy run's text would part from the recording (the prefix up to it is the
// same, and greedy takes the argmax).
static std::string LogitSentence(const traces::TraceReader& trace, const diff::LogitSummary& ls) {
  std::ostringstream v;
  std::map<int32_t, const traces::RequestInfo*> by_id;
  for (const auto& q : trace.requests()) by_id[q.id] = &q;
  auto at = [&](int32_t req, int64_t pos) {
    std::ostringstream w;
    w << "request " << req << " position " << pos;
    auto it = by_id.find(req);
    if (it != by_id.end()) {
      const int64_t k = pos - (static_cast<int64_t>(it->second->prompt.size()) - 1);
      if (k >= 0) w << " (generated token " << k << ")";
      else w << " (prompt)";
    }
    return w.str();
  };
  v << ls.top1_flips << " of " << ls.rows << " positions changed their most likely token";
  if (ls.top1_flips > 0) {
    v << " (first at " << at(ls.flips[0].first, ls.flips[0].second);
    if (ls.flips.size() > 1) {
      v << "; then";
      for (size_t i = 1; i < std::min<size_t>(ls.flips.size(), 6); ++i) {
        v << (i > 1 ? "," : "") << " " << ls.flips[i].first << ":" << ls.flips[i].second;
      }
      if (ls.top1_flips > 6) v << ", …";
    }
    v << ")";
  }
  char kl[96];
  std::snprintf(kl, sizeof kl, "; mean KL %.3g nats, max %.3g", ls.mean_kl, ls.max_kl);
  v << kl << " at " << at(ls.max_kl_request, ls.max_kl_position);
  // The text: greedy requests' first flip at a generated position.
  std::string text;
  int greedy = 0;
  for (const auto& q : trace.requests()) {
    if (q.temperature != 0) continue;
    ++greedy;
    const int64_t first_gen = static_cast<int64_t>(q.prompt.size()) - 1;
    int64_t k = -1;
    for (const auto& [req, pos] : ls.flips) {
      if (req == q.id && pos >= first_gen && pos - first_gen < static_cast<int64_t>(q.generated.size())) {
        k = pos - first_gen;
        break;
      }
    }
    if (k >= 0) text += (text.empty() ? "" : ", ") + ("request " + std::to_string(q.id) + " from token " + std::to_string(k));
  }
  if (greedy > 0) {
    v << ". Text: " << (text.empty() ? "the greedy text would not change (no flip at a generated position)"
                                      : "the greedy text would change — " + text)
      << " (the replay itself is teacher-forced: `--mode free` runs it)";
  } else {
    v << ". Text: teacher-forced, so the replay generated the recorded tokens; a sampled request's text may change "
         "wherever the distributions moved (`--mode free` runs it)";
  }
  return v.str();
}

Result<ReplayResult> Replay(const traces::TraceReader& trace, const ReplayOptions& opt) {
  ReplayResult res;
  // The model: the recorded one unless told otherwise, and it must be the same weights.
  std::filesystem::path model_dir = opt.model_dir.empty() ? std::filesystem::path(MetaOr(trace, "model_dir")) : opt.model_dir;
  if (model_dir.empty()) return Status::InvalidArgument(trace.path().string() + ": meta.model_dir is missing; pass --model");
  if (!std::filesystem::is_directory(model_dir)) {
    // The common case: the trace came from another machine, or the model folder moved.
    return Status::NotFound(opt.model_dir.empty()
                                ? trace.path().string() + ": the recorded model folder " + model_dir.string() +
                                      " (meta.model_dir) is not there; pass the model's folder with --model DIR "
                                      "(its fingerprint must match meta.model_fingerprint)"
                                : "--model " + model_dir.string() + ": not a directory");
  }
  LS_ASSIGN_OR_RETURN(std::string fingerprint, recorder::ModelFingerprint(model_dir));
  if (fingerprint != MetaOr(trace, "model_fingerprint") && !opt.allow_model_mismatch) {
    return Status::InvalidArgument(model_dir.string() + ": model fingerprint " + fingerprint +
                                   " differs from the trace's " + MetaOr(trace, "model_fingerprint") +
                                   " (meta.model_fingerprint); pass the recorded model with --model");
  }
  LS_ASSIGN_OR_RETURN(auto model, engine::Model::Load(model_dir));
  std::shared_ptr<const engine::Tokenizer> tok;
  if (std::filesystem::exists(model_dir / "tokenizer.json")) {
    LS_ASSIGN_OR_RETURN(tok, engine::Tokenizer::Load(model_dir / "tokenizer.json"));
  }

  // The engine as recorded, then the overrides.
  LS_ASSIGN_OR_RETURN(engine::EngineOptions eo, RecordedEngineOptions(trace));
  const Overrides& ov = opt.overrides;
  if (ov.kv_cache) eo.kv_format = *ov.kv_cache;
  std::string from_backend;           // the recording's backend when --backend changes it
  kernels::KernelChoice ran_kernels;  // what it ran (resolved, defaults included)
  if (ov.backend && *ov.backend != eo.backend) {
    // What ran carries over wherever the new backend has the same variant: the recording engine's
    // resolved choices (meta.kernels, its defaults included — a GPU trace replays on the CPU in
    // the absorbed prefill it ran, not the CPU's default expanded form), else what was asked for
    // (traces without meta.kernels). The rest take the new backend's defaults.
    from_backend = eo.backend;
    eo.backend = *ov.backend;
    kernels::KernelChoice ran = eo.kernels;
    const json resolved = json::parse(MetaOr(trace, "kernels"), nullptr, /*allow_exceptions=*/false);
    if (resolved.is_object()) {
      for (const auto& [op, v] : resolved.items()) {
        if (v.is_string() && !ran.count(op)) ran[op] = v.get<std::string>();
      }
    }
    ran_kernels = ran;
    eo.kernels.clear();
    for (const auto& [op, v] : ran) {
      const kernels::KernelVariant* k = kernels::Registry::Get().Find(op, v, eo.backend);
      if (k != nullptr && !k->fault) eo.kernels[op] = v;
    }
  }
  for (const auto& [op, v] : ov.kernels) eo.kernels[op] = v;
  if (ov.fault) eo.fault = *ov.fault;
  if (ov.max_batch) eo.max_batch = *ov.max_batch;
  if (ov.emulate_tp) eo.emulate_tp = *ov.emulate_tp;
  // Kernel choices that were defaults when recorded are recorded as such; a fault that was
  // replaced must not linger as the op's choice.
  if (ov.fault && ov.fault->empty()) {
    for (auto it = eo.kernels.begin(); it != eo.kernels.end();) {
      it = it->second.rfind("fault_", 0) == 0 ? eo.kernels.erase(it) : std::next(it);
    }
  }
  auto created = engine::Engine::Create(model, eo);
  if (!created.ok()) {
    // The flags' names in the engine's message are the recorded options' (meta.engine_options).
    return created.status().WithContext(trace.path().string() + ": the recorded engine options (meta.engine_options): ");
  }
  auto eng = std::move(*created);
  res.engine_options = eo;

  // The requests, in recorded id order (so ids match).
  std::vector<recorder::RecordedRequest> reqs;
  int64_t total = 0;
  std::vector<int32_t> eos;
  for (int64_t e : model->config().eos_token_ids) eos.push_back(static_cast<int32_t>(e));
  // Requests whose recording holds logits rows at prompt positions (an import of a server's
  // prompt_logprobs, python/lockstep/import_openai.py) get those rows from the replay too.
  std::set<int32_t> prompt_logits;
  for (const char* name : {"taps/logits", "taps/logits.topk_ids"}) {
    const traces::TensorInfo* ti = trace.FindTensor(name);
    if (ti == nullptr) continue;
    LS_ASSIGN_OR_RETURN(auto sum, trace.ReadSummary(*ti));
    std::map<int32_t, int64_t> prompt_len;
    for (const auto& ri : trace.requests()) prompt_len[ri.id] = static_cast<int64_t>(ri.prompt.size());
    for (const auto& s : sum) {
      auto it = prompt_len.find(s.request);
      if (it != prompt_len.end() && s.position + 1 < it->second) prompt_logits.insert(s.request);
    }
  }
  for (const auto& ri : trace.requests()) {
    engine::Request r;
    r.name = ri.name;
    r.all_prompt_logits = prompt_logits.count(ri.id) > 0;
    r.prompt = ri.prompt;
    r.sampling.seed = ov.seed ? *ov.seed + static_cast<uint64_t>(reqs.size()) : ri.seed;
    r.sampling.temperature = ov.temperature.value_or(ri.temperature);
    r.sampling.top_p = ov.top_p.value_or(ri.top_p);
    r.sampling.top_k = ov.top_k.value_or(ri.top_k);
    r.sampling.min_p = ov.min_p.value_or(ri.min_p);
    switch (opt.mode) {
      case ReplayMode::kExact:
        r.max_new_tokens = static_cast<int64_t>(ri.generated.size());
        r.recorded_max_new_tokens = ri.max_new_tokens;
        break;
      case ReplayMode::kForced:
        r.max_new_tokens = static_cast<int64_t>(ri.generated.size());
        r.recorded_max_new_tokens = ri.max_new_tokens;
        r.forced_tokens = ri.generated;
        break;
      case ReplayMode::kFree: {
        r.max_new_tokens = ri.max_new_tokens;
        // Stop at EOS unless the recording generated through one (it ran with --ignore-eos).
        bool through_eos = false;
        for (size_t i = 0; i + 1 < ri.generated.size(); ++i) {
          through_eos |= std::find(eos.begin(), eos.end(), ri.generated[i]) != eos.end();
        }
        if (!through_eos) r.stop_tokens = eos;
        break;
      }
    }
    total += r.max_new_tokens;
    reqs.push_back({r, ri.prompt_text});
  }

  recorder::RecordSessionOptions so;
  so.output = opt.output;
  LS_ASSIGN_OR_RETURN(so.policy, PolicyFromTrace(trace));
  if (opt.capture) so.policy.mode = *opt.capture;  // --capture full: a summary trace's values
  so.writer.batch_width = eo.max_batch;
  so.writer.writer = std::string("lockstep ") + kVersion + " (" + kGitRevision + ") replay";
  so.flush_interval_s = 5.0;
  if (tok) so.detokenize = [tok](const std::vector<int32_t>& ids) { return tok->Decode(ids); };
  so.meta = {{"model_dir", std::filesystem::absolute(model_dir).string()},
             {"model_config", MetaOr(trace, "model_config")},
             {"model_fingerprint", fingerprint},
             {"tokenizer_hash", MetaOr(trace, "tokenizer_hash")},
             {"replay_of", std::filesystem::absolute(trace.path()).string()},
             {"replay_mode", std::string(ReplayModeName(opt.mode))},
             {"replay_overrides", ov.Describe()},
             {"replay_graft", opt.graft ? "1" : "0"}};
  std::unique_ptr<GraftHook> graft;
  if (opt.graft) {
    LS_ASSIGN_OR_RETURN(auto rows, LoadGraftRows(trace, model->config().num_hidden_layers));
    so.wrap = [&graft, rows = std::move(rows)](recorder::Recorder* rec) mutable -> engine::TapHook* {
      graft = std::make_unique<GraftHook>(rec, std::move(rows));
      return graft.get();
    };
  }
  if (opt.progress) {
    so.on_step = [&](const recorder::Recorder& rec, const traces::TraceWriter&) { opt.progress(rec.tokens(), total); };
  }
  LS_ASSIGN_OR_RETURN(res.run, recorder::RecordRun(*eng, reqs, so));

  // Compare with the one oracle.
  LS_ASSIGN_OR_RETURN(auto replayed, traces::TraceReader::Open(opt.output));
  diff::DiffOptions dopt;
  dopt.thresholds = opt.thresholds;
  if (opt.mode == ReplayMode::kExact) dopt.thresholds.exact = true;
  dopt.allow_model_mismatch = opt.allow_model_mismatch;
  LS_ASSIGN_OR_RETURN(res.diff, diff::CompareTraces(trace, *replayed, dopt));
  const diff::TraceDiffReport& d = res.diff;

  std::ostringstream v;
  auto where = [&](const diff::RowDiff& r) {
    std::ostringstream w;
    const auto& reqs_info = trace.requests();
    std::string name = std::to_string(r.request);
    for (const auto& ri : reqs_info) {
      if (ri.id == r.request && !ri.name.empty() && ri.name != name) name += " ('" + ri.name + "')";
    }
    w << "request " << name << ", position " << r.position << ", " << r.tensor.substr(r.tensor.find('/') + 1)
      << " (" << r.how << ")";
    return w.str();
  };
  int64_t rows = 0;
  for (const auto& t : d.tensors) rows += t.rows;
  switch (opt.mode) {
    case ReplayMode::kExact:
      res.deterministic = d.identical && !d.has_divergence;
      if (res.deterministic) {
        v << "deterministic: " << trace.requests().size() << " request(s), " << res.run.tokens << " tokens, "
          << rows << " captured rows in " << d.tensors.size() << " tensors are bit-identical to the recording";
        if (!ov.empty()) v << " under " << ov.Describe();
      } else if (d.has_divergence) {
        v << "NOT deterministic: the first difference is at " << where(d.first);
      } else if (!d.missing.empty()) {
        v << "NOT deterministic: the recording and the replay do not hold the same rows (" << d.missing.front()
          << (d.missing.size() > 1 ? "; " + std::to_string(d.missing.size() - 1) + " more" : std::string()) << ")";
      } else {
        v << "NOT deterministic: generated tokens differ although no captured tensor does";
      }
      if (!res.deterministic) {
        // Another build may define a kernel differently: say so when the trace names its own.
        const std::string rev = MetaOr(trace, "git_revision");
        if (!rev.empty() && rev != kGitRevision && rev != "unknown" && std::string(kGitRevision) != "unknown") {
          v << " (recorded by lockstep " << rev << ", replayed by " << kGitRevision
            << ": kernel definitions may differ between them — `git log " << rev << ".." << kGitRevision
            << " -- kernels engine`)";
        }
      }
      break;
    case ReplayMode::kForced: {
      v << "with " << ov.Describe() << (opt.graft ? " (grafted)" : "") << ": ";
      const diff::LogitSummary& ls = d.logit_summary;
      if (ls.rows > 0) {
        v << LogitSentence(trace, ls) << ". ";
      } else {
        v << "no logits were captured on both sides (record with --logits full or topk to compare them). ";
      }
      if (d.has_divergence) {
        v << "The first divergence above the thresholds is at " << where(d.first);
      } else {
        v << "No captured tensor diverges above the thresholds";
      }
      break;
    }
    case ReplayMode::kFree: {
      bool any = false;
      for (const auto& r : d.requests) {
        if (r.first_token_diff < 0) continue;
        any = true;
        v << "request " << r.id << ": the generated tokens first differ at token " << r.first_token_diff << " (recorded ["
          << Join(r.tokens_a, r.first_token_diff, r.first_token_diff + 5) << "], replayed ["
          << Join(r.tokens_b, r.first_token_diff, r.first_token_diff + 5) << "]); ";
      }
      if (!any) v << "with " << ov.Describe() << ", every request generated the recorded tokens";
      if (d.has_divergence) v << (any ? "the " : "; the ") << "first numeric divergence is at " << where(d.first);
      break;
    }
  }
  // Across backends with nothing else changed (batching changes no bit): say whether equal bits
  // were to be expected, so that a difference reads as rounding or as a finding.
  Overrides rest = ov;
  rest.backend.reset();
  rest.max_batch.reset();
  if (!from_backend.empty() && rest.empty() && !opt.graft) {
    const std::vector<std::string> apart = kernels::BitsApartAcross(ran_kernels, from_backend, eo.backend);
    if (d.identical && !d.has_divergence) {
      v << "; every captured row is bit-identical across the two backends";
    } else if (!apart.empty()) {
      std::string list;
      for (const auto& a : apart) list += (list.empty() ? "" : ", ") + a;
      v << ". Not bit-identical, as expected: " << list << " ran on " << from_backend
        << " in an order " << eo.backend << " does not share (the cuBLAS GEMMs: gemm=fp32, bf16); record with "
        << "--kernel gemm=fp32_dot (or bf16_dot, fp8_dot) for runs the two backends give bit for bit";
    } else {
      v << ". Not bit-identical, although every kernel that ran computes the same bits on both backends: "
        << "not rounding — `lockstep diff <recording> <replay> --exact` names the first differing row";
    }
  }
  res.verdict = v.str();
  return res;
}

}  // namespace lockstep::replayer
