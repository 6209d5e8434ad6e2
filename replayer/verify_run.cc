// replayer/verify_run.cc — see verify_run.h.
#include "replayer/verify_run.h"

#include <map>
#include <tuple>

#include <nlohmann/json.hpp>

#include "engine/tap.h"
#include "replayer/replay_session.h"

namespace lockstep::replayer {

BatchCheck CompareHashes(const traces::TraceReader& a, const traces::TraceReader& b) {
  BatchCheck r;
  r.run = true;
  std::tuple<int64_t, int64_t, int, int32_t, int64_t> best{INT64_MAX, 0, 0, 0, 0};
  for (const auto& ta : a.tensors()) {
    const traces::TensorInfo* tb = b.FindTensor(ta.path);
    auto sa = a.ReadSummary(ta);
    if (!sa.ok()) continue;
    std::map<std::pair<int32_t, int64_t>, uint64_t> hb;
    if (tb != nullptr) {
      auto sb = b.ReadSummary(*tb);
      if (sb.ok()) {
        for (const auto& row : *sb) hb[{row.request, row.position}] = row.hash;
      }
    }
    int64_t layer = -1;
    int order = 0;
    if (ta.group == "kv") {
      const size_t dot = ta.name.find('.', 7);
      layer = std::stoll(ta.name.substr(7, dot - 7));
      order = engine::kKvCacheOrder;
    } else if (const engine::TapPoint* tp = engine::FindTapPoint(ta.name, &layer)) {
      order = tp->order;
      if (!tp->per_layer) layer = tp->order == 0 ? -1 : 1 << 30;
    } else if (ta.name.rfind("logits", 0) == 0) {
      layer = 1 << 30;
      order = 2;
    }
    for (const auto& row : *sa) {
      auto it = hb.find({row.request, row.position});
      if (it == hb.end()) {
        ++r.rows_missing;
        continue;
      }
      ++r.rows_compared;
      if (it->second == row.hash) continue;
      ++r.rows_differing;
      r.invariant = false;
      const auto key = std::make_tuple(int64_t{row.step}, layer, order, row.request, row.position);
      if (key < best) {
        best = key;
        r.first = verify::Location{row.request, layer >= (1 << 30) ? -1 : layer, row.position, row.step, ta.path};
      }
    }
  }
  if (r.rows_missing > 0) r.invariant = false;
  return r;
}

Result<VerifyRunResult> VerifyRun(const traces::TraceReader& trace, const VerifyRunOptions& opt) {
  VerifyRunResult res;
  std::filesystem::create_directories(opt.work_dir);
  std::unique_ptr<traces::TraceReader> full;
  const traces::TraceReader* checked = &trace;
  res.checked = trace.path();
  bool has_values = false;
  for (const auto& t : trace.tensors()) has_values |= t.has_values && t.group == "taps";
  if (!has_values) {
    if (opt.progress) opt.progress("summary-only trace: exact replay with full capture");
    ReplayOptions o;
    o.mode = ReplayMode::kExact;
    o.capture = recorder::CapturePolicy::Mode::kFull;
    o.model_dir = opt.model_dir;
    o.progress = opt.row_progress;
    o.output = opt.work_dir / "verify_full.h5";
    LS_ASSIGN_OR_RETURN(auto r, Replay(trace, o));
    if (!r.deterministic) {
      return Status::InvalidArgument(trace.path().string() +
                                     ": summary-only, and its exact replay does not reproduce its summary hashes (" +
                                     r.verdict + "): nothing to verify the twins against");
    }
    LS_ASSIGN_OR_RETURN(full, traces::TraceReader::Open(o.output));
    checked = full.get();
    res.upgraded = true;
    res.checked = o.output;
    res.upgrade_detail = "exact replay with full capture reproduced every summary hash of the recording (" + r.verdict + ")";
  }
  if (opt.progress) opt.progress("golden twins on every recorded row");
  verify::CheckOptions co;
  co.model_dir = opt.model_dir;
  co.progress = opt.row_progress;
  LS_ASSIGN_OR_RETURN(res.check, verify::CheckTrace(*checked, co));
  if (opt.batch_check && trace.requests().size() > 1) {
    if (opt.progress) opt.progress("batch invariance: every request alone (max_batch 1), hashes compared");
    ReplayOptions o;
    o.mode = ReplayMode::kForced;
    o.overrides.max_batch = 1;
    o.model_dir = opt.model_dir;
    o.progress = opt.row_progress;
    o.output = opt.work_dir / "verify_alone.h5";
    LS_ASSIGN_OR_RETURN(auto r, Replay(trace, o));
    (void)r;
    LS_ASSIGN_OR_RETURN(auto alone, traces::TraceReader::Open(o.output));
    res.batch = CompareHashes(trace, *alone);
    res.batch.replay_trace = o.output.string();
  }
  return res;
}

}  // namespace lockstep::replayer
