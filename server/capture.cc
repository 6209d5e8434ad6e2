// server/capture.cc — see capture.h.
#include "base/json_text.h"
#include "server/capture.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "recorder/record_session.h"
#include "traces/trace_reader.h"

namespace lockstep::server {

using json = nlohmann::json;

Status MakePrivateDir(const std::filesystem::path& dir) {
  std::error_code ec;
  if (std::filesystem::exists(dir, ec)) {
    if (!std::filesystem::is_directory(dir, ec)) return Status::IoError(dir.string() + ": exists and is not a directory");
    return Status::Ok();
  }
  if (!dir.parent_path().empty()) std::filesystem::create_directories(dir.parent_path(), ec);
  // mkdir with 0700 directly: no window in which the directory is readable by others.
  if (::mkdir(dir.c_str(), 0700) != 0 && !std::filesystem::is_directory(dir, ec)) {
    return Status::IoError(dir.string() + ": cannot create the capture directory");
  }
  return Status::Ok();
}

bool SafeRequestId(const std::string& id) {
  if (id.empty() || id.size() > 128 || id[0] == '.') return false;
  for (char c : id) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) return false;
  }
  return true;
}

namespace {

std::string Hex(uint64_t v) {
  char hash[17];
  std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(v));
  return hash;
}

// Checks every tap row the trace holds against the live record's summary of it: the same
// taps, the same positions, the same content hash and statistics. Returns the first
// difference ("" when none) and counts the rows compared.
std::string VerifyTaps(const LiveRecord& live, const traces::TraceReader& trace, int64_t* rows_checked) {
  size_t live_taps = 0;
  for (const auto& t : live.taps) live_taps += t.rows.empty() ? 0 : 1;
  size_t trace_taps = 0;
  for (const traces::TensorInfo& info : trace.tensors()) {
    // Only the engine's taps: logits.topk_* and logsumexp are derived by the recorder ("of").
    if (info.group != traces::kTapsGroup || info.attrs.count("of")) continue;
    auto rows = trace.ReadSummary(info);
    if (!rows.ok()) return "cannot read " + info.path + ": " + rows.status().message();
    std::vector<traces::SummaryRow> got = std::move(*rows);
    if (got.empty()) continue;
    ++trace_taps;
    const LiveTap* want = live.FindTap(info.name);
    if (want == nullptr || want->rows.empty()) return "tap " + info.name + ": in the trace, not in the live record";
    if (want->rows.size() != got.size()) {
      return "tap " + info.name + ": the live run summarised " + std::to_string(want->rows.size()) +
             " rows, the re-run " + std::to_string(got.size());
    }
    std::vector<LiveTapRow> live_rows = want->rows;
    auto by_pos = [](const auto& a, const auto& b) { return a.position < b.position; };
    std::stable_sort(live_rows.begin(), live_rows.end(), by_pos);
    std::stable_sort(got.begin(), got.end(), by_pos);
    for (size_t i = 0; i < got.size(); ++i) {
      const LiveTapRow& a = live_rows[i];
      const traces::SummaryRow& b = got[i];
      std::string what;
      if (a.position != b.position) {
        what = "live position " + std::to_string(a.position) + ", re-run position " + std::to_string(b.position);
      } else if (a.hash != b.hash) {
        what = "hash " + Hex(a.hash) + " (live) != " + Hex(b.hash) + " (re-run)";
      } else if (a.nan_count != b.nan_count || a.inf_count != b.inf_count) {
        what = "NaN/Inf counts differ";
      } else if (std::memcmp(&a.rms, &b.rms, 4 * sizeof(float)) != 0) {
        what = "statistics differ under equal hashes";
      }
      if (!what.empty()) return "tap " + info.name + " position " + std::to_string(b.position) + ": " + what;
      ++*rows_checked;
    }
  }
  if (trace_taps != live_taps) {
    return "the live record has " + std::to_string(live_taps) + " taps with rows, the trace " + std::to_string(trace_taps);
  }
  return "";
}

json LiveJson(const LiveRecord& live, const CaptureResult& r) {
  json steps = json::array();
  for (const auto& s : live.steps) {
    const std::string hash = Hex(s.logits_hash);
    steps.push_back({{"engine_step", s.engine_step},
                     {"token", s.token},
                     {"probability", s.probability},
                     {"uniform", s.uniform},
                     {"counter", s.counter},
                     {"candidates", s.candidates},
                     {"logits_xxh3", hash},
                     {"batch", s.batch}});
  }
  // Per tap: the content hash of each row in position order, and the non-finite counts.
  json taps = json::array();
  for (const auto& t : live.taps) {
    if (t.rows.empty()) continue;
    json hashes = json::array(), positions = json::array();
    uint64_t nan = 0, inf = 0;
    for (const auto& row : t.rows) {
      positions.push_back(row.position);
      hashes.push_back(Hex(row.hash));
      nan += row.nan_count;
      inf += row.inf_count;
    }
    taps.push_back({{"name", t.name}, {"positions", positions}, {"xxh3", hashes}, {"nan_count", nan}, {"inf_count", inf}});
  }
  const auto& q = live.request;
  return {{"request_id", live.id},
          {"trigger", r.trigger},
          {"mode", r.mode},
          {"verified", r.verified},
          {"detail", r.detail},
          {"finish_reason", live.finish_reason},
          {"created_unix", live.created_unix},
          {"engine_epoch", live.engine_epoch},
          {"prompt_chunks", live.prompt_chunks},
          {"prompt_ids", q.prompt},
          {"max_new_tokens", q.max_new_tokens},
          {"stop_tokens", q.stop_tokens},
          {"sampling",
           {{"temperature", q.sampling.temperature},
            {"top_k", q.sampling.top_k},
            {"top_p", q.sampling.top_p},
            {"min_p", q.sampling.min_p},
            {"seed", q.sampling.seed}}},
          {"steps", steps},
          {"taps", taps}};
}

}  // namespace

Result<CaptureResult> CaptureRequest(const std::shared_ptr<engine::Model>& model, const LiveRecord& live,
                                     const std::string& trigger, recorder::CapturePolicy::Mode mode,
                                     const CaptureOptions& o) {
  if (!SafeRequestId(live.id)) return Status::InvalidArgument("request id '" + live.id + "' is not a safe file name");
  LS_RETURN_IF_ERROR(MakePrivateDir(o.dir));
  CaptureResult r;
  r.request_id = live.id;
  r.trigger = trigger;
  r.mode = std::string(recorder::CapturePolicy::ModeName(mode));
  r.trace = o.dir / (live.id + ".h5");
  r.live_json = o.dir / (live.id + ".live.json");

  // The re-run generates exactly the live tokens: a request ended early (stop string, client
  // gone) is re-run to the length it had, which the stateless sampler makes equivalent.
  recorder::RecordedRequest rr;
  rr.request = live.request;
  rr.request.keep_logits = true;  // each step's logits hash is checked against the live one's
  rr.request.name = live.id;
  rr.request.max_new_tokens = static_cast<int64_t>(live.steps.size());
  rr.prompt_text = o.redact ? "" : live.prompt_text;

  engine::EngineOptions eo = o.engine;
  LS_ASSIGN_OR_RETURN(auto eng, engine::Engine::Create(model, eo));
  recorder::RecordSessionOptions so;
  so.output = r.trace;
  so.policy.mode = mode;
  so.writer.batch_width = eo.max_batch;
  so.flush_interval_s = 0;
  if (!o.redact) so.detokenize = o.detokenize;
  so.meta = o.trace_meta;
  so.meta["request_id"] = live.id;
  so.meta["capture_trigger"] = trigger;
  so.meta["capture_source"] = "lockstep serve: offline re-run of a live request, verified against its live record";

  // Verify as the re-run goes: the Recorder keeps its step callback, ours runs after it.
  std::string mismatch;
  int64_t checked = 0;
  engine::Engine* e = eng.get();
  so.wrap = [&](recorder::Recorder* rec) -> engine::TapHook* {
    e->SetStepCallback([&, rec, e](const engine::StepEvent& ev) {
      rec->OnStep(ev);
      if (!mismatch.empty()) return;
      const size_t i = static_cast<size_t>(ev.token_index);
      if (i >= live.steps.size()) {
        mismatch = "the re-run generated more tokens than the live request";
        return;
      }
      const LiveStep& s = live.steps[i];
      const auto& lg = e->request(ev.request_id).last_logits;
      const uint64_t h = XXH3_64bits(lg.data(), lg.size() * sizeof(float));
      std::ostringstream m;
      if (h != s.logits_hash) m << "logits hash differs";
      else if (ev.token != s.token) m << "token " << ev.token << " != live " << s.token;
      else if (ev.sample.counter != s.counter) m << "Philox counter differs";
      else if (ev.sample.uniform != s.uniform) m << "uniform draw differs";
      else if (ev.sample.probability != s.probability) m << "probability differs";
      if (!m.str().empty()) {
        mismatch = "token " + std::to_string(i) + " (live step " + std::to_string(s.engine_step) + ", batch of " +
                   std::to_string(s.batch.size()) + "): " + m.str();
      }
      ++checked;
    });
    return rec;
  };
  auto run = recorder::RecordRun(*eng, {rr}, so);
  if (!run.ok()) return run.status();
  if (mismatch.empty() && checked != static_cast<int64_t>(live.steps.size())) {
    mismatch = "the re-run generated " + std::to_string(checked) + " tokens, the live request " +
               std::to_string(live.steps.size());
  }
  // Then every tap: the trace's own summaries (what a replay will be checked against) must
  // equal the live ones.
  int64_t tap_rows = 0;
  if (mismatch.empty() && !live.taps.empty()) {
    auto reader = traces::TraceReader::Open(r.trace);
    if (!reader.ok()) return reader.status();
    mismatch = VerifyTaps(live, **reader, &tap_rows);
  }
  r.verified = mismatch.empty();
  r.tokens = checked;
  r.tap_rows = tap_rows;
  if (r.verified) {
    r.detail = std::to_string(checked) + " tokens verified (token, Philox counter, draw, probability, logits hash)";
    r.detail += live.taps.empty() ? "; no tap summaries in the live record"
                                  : ", " + std::to_string(tap_rows) + " tap rows verified (hash, statistics)";
  } else {
    r.detail = mismatch;
  }

  // Written aside and renamed into place: whoever watches the directory for *.live.json (a
  // test, a collector) never reads half a record.
  std::filesystem::path partial = r.live_json;
  partial += ".partial";
  std::ofstream out(partial);
  out << JsonText(LiveJson(live, r), 1) << "\n";
  out.close();
  if (!out) return Status::IoError(partial.string() + ": cannot write");
  std::error_code ec;
  ::chmod(r.trace.c_str(), 0600);
  ::chmod(partial.c_str(), 0600);
  std::filesystem::rename(partial, r.live_json, ec);
  if (ec) return Status::IoError(r.live_json.string() + ": cannot move the record into place: " + ec.message());
  r.bytes = std::filesystem::file_size(r.trace, ec) + std::filesystem::file_size(r.live_json, ec);
  return r;
}

}  // namespace lockstep::server
