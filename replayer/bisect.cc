// replayer/bisect.cc — see bisect.h.
#include "replayer/bisect.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "diff/degeneration.h"
#include "kernels/registry.h"

namespace lockstep::replayer {
namespace {

std::string Fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

std::string Where(const diff::RowDiff& r) {
  std::ostringstream w;
  const std::string tap = r.tensor.substr(r.tensor.find('/') + 1);
  if (r.layer >= 0) w << "layer " << r.layer << ", ";
  w << "position " << r.position << ", in " << tap;
  return w.str();
}

}  // namespace

Result<BisectResult> Bisect(const traces::TraceReader& trace, const BisectOptions& opt) {
  BisectResult res;
  std::filesystem::create_directories(opt.work_dir);
  int n = 0;
  auto run = [&](ReplayOptions o, const std::string& what) -> Result<ReplayResult> {
    if (opt.progress) opt.progress(what);
    o.model_dir = opt.model_dir;
    o.progress = opt.replay_progress;
    o.output = opt.work_dir / ("bisect_" + std::to_string(n++) + ".h5");
    return Replay(trace, o);
  };

  // 1. Reproducible?
  {
    LS_ASSIGN_OR_RETURN(auto r, run({}, "exact replay"));
    res.reproducible = r.deterministic;
    res.reproducible_detail = r.verdict;
  }
  // 2. Batch dependence (only meaningful with more than one request).
  LS_ASSIGN_OR_RETURN(engine::EngineOptions rec, RecordedEngineOptions(trace));
  if (trace.requests().size() > 1) {
    ReplayOptions o;
    o.mode = ReplayMode::kForced;
    o.overrides.max_batch = 1;
    LS_ASSIGN_OR_RETURN(auto r, run(o, "every request alone (max_batch 1)"));
    for (const auto& q : r.diff.requests) {
      if (!q.has_divergence) continue;
      res.batch_dependent = true;
      res.batch_detail += "request " + std::to_string(q.id) + " changes when it runs alone (first at " + Where(q.first) +
                          "): it read another request's data; ";
    }
  }

  // 3. The reference configuration.
  const auto& reg = kernels::Registry::Get();
  Overrides ref;
  std::vector<std::pair<std::string, Overrides>> swaps;  // component → single swap
  std::vector<std::pair<std::string, std::string>> labels;  // component → (recorded → swapped)
  if (rec.kv_format != engine::KvFormat::kFp32) {
    ref.kv_cache = engine::KvFormat::kFp32;
    Overrides s;
    s.kv_cache = engine::KvFormat::kFp32;
    swaps.push_back({"kv_cache", s});
    labels.push_back({std::string(engine::KvFormatName(rec.kv_format)), "fp32"});
    if (rec.kv_format == engine::KvFormat::kFp8E4m3) {
      Overrides b;
      b.kv_cache = engine::KvFormat::kBf16;
      swaps.push_back({"kv_cache", b});
      labels.push_back({"fp8_e4m3", "bf16"});
    }
  }
  if (!rec.fault.empty()) {
    ref.fault = "";
    Overrides s;
    s.fault = "";
    const kernels::KernelVariant* v = nullptr;
    for (const auto& x : reg.variants()) {
      if (x.name == rec.fault) v = &x;
    }
    swaps.push_back({v ? v->op : "fault", s});
    labels.push_back({rec.fault, v ? reg.Default(v->op) : "reference"});
  }
  for (const auto& [op, variant] : rec.kernels) {
    const std::string dflt = reg.Default(op);
    if (variant == dflt || dflt.empty()) continue;
    ref.kernels[op] = dflt;
    Overrides s;
    s.kernels[op] = dflt;
    swaps.push_back({op, s});
    labels.push_back({variant, dflt});
  }
  res.reference = ref.Describe();

  double total = 0;
  if (!ref.empty()) {
    ReplayOptions o;
    o.mode = ReplayMode::kForced;
    o.overrides = ref;
    LS_ASSIGN_OR_RETURN(auto r, run(o, "reference configuration (" + ref.Describe() + ")"));
    total = std::max(0.0, r.diff.mean_logit_kl);
    res.total_kl = total;
    const std::filesystem::path reference_trace = o.output.empty() ? opt.work_dir / ("bisect_" + std::to_string(n - 1) + ".h5") : o.output;
    LS_ASSIGN_OR_RETURN(auto ref_reader, traces::TraceReader::Open(reference_trace));

    // 4. One component at a time.
    for (size_t i = 0; i < swaps.size(); ++i) {
      ReplayOptions so;
      so.mode = ReplayMode::kForced;
      so.overrides = swaps[i].second;
      LS_ASSIGN_OR_RETURN(auto r, run(so, "only " + swaps[i].first + ": " + labels[i].first + " → " + labels[i].second));
      ComponentResult c;
      c.component = swaps[i].first;
      c.recorded = labels[i].first;
      c.swapped_to = labels[i].second;
      c.has_divergence = r.diff.has_divergence;
      c.first = r.diff.first;
      // The swapped run against the reference run: what is left unexplained.
      LS_ASSIGN_OR_RETURN(auto swapped, traces::TraceReader::Open(opt.work_dir / ("bisect_" + std::to_string(n - 1) + ".h5")));
      LS_ASSIGN_OR_RETURN(auto left, diff::CompareTraces(*swapped, *ref_reader));
      c.kl_to_reference = std::max(0.0, left.mean_logit_kl);
      c.explained = total > 0 ? std::clamp(1.0 - c.kl_to_reference / total, 0.0, 1.0) : 0.0;
      res.components.push_back(c);
    }
    // Most explanatory first. Swaps that explain about as much (within 0.05) are ranked by
    // how narrow they are: a recorded fault, then a kernel, then the cache format — switching
    // the cache to fp32 also disables every fp8-only code path, so it "explains" their bugs too.
    auto breadth = [](const ComponentResult& c) {
      if (c.recorded.rfind("fault_", 0) == 0) return 0;
      return c.component == "kv_cache" ? 2 : 1;
    };
    std::stable_sort(res.components.begin(), res.components.end(), [&](const ComponentResult& a, const ComponentResult& b) {
      if (std::fabs(a.explained - b.explained) > 0.05) return a.explained > b.explained;
      return breadth(a) < breadth(b);
    });
  }

  // 5. Sampling, when the recording was greedy.
  bool greedy = !trace.requests().empty();
  bool sampled_fixes = false;  // greedy degenerates, sampling at 0.6 does not
  for (const auto& q : trace.requests()) greedy &= q.temperature == 0.0;
  if (greedy) {
    int64_t rec_deg = 0, new_deg = 0;
    for (const auto& q : trace.requests()) rec_deg += diff::DetectDegeneration(q.generated).degenerate;
    ReplayOptions o;
    o.mode = ReplayMode::kFree;
    o.overrides.temperature = 0.6;
    o.overrides.top_p = 0.95;
    LS_ASSIGN_OR_RETURN(auto r, run(o, "sampling at temperature 0.6 instead of greedy"));
    for (const auto& q : r.diff.requests) new_deg += diff::DetectDegeneration(q.tokens_b).degenerate;
    sampled_fixes = rec_deg > 0 && new_deg < rec_deg;
    res.sampling_note = "the recording is greedy; " + std::to_string(rec_deg) + " of " +
                        std::to_string(trace.requests().size()) + " request(s) degenerate as recorded, " +
                        std::to_string(new_deg) + " when sampled at temperature 0.6 (top_p 0.95)";
  }

  // The verdict.
  std::ostringstream v;
  if (!res.reproducible) v << "The run is not reproducible: " << res.reproducible_detail << ". ";
  if (res.batch_dependent) v << "Batch dependence: " << res.batch_detail;
  // Below this mean logit KL the configurations agree to within what reduced precision
  // normally costs; the numerics are then not what went wrong.
  constexpr double kSmallKl = 0.01;
  if (!res.components.empty() && res.components[0].explained > 0) {
    const ComponentResult& c = res.components[0];
    if (total < kSmallKl) {
      v << "Numerically the recording is close to the reference configuration (" << res.reference
        << "): mean logit KL " << Fmt("%.3g", total) << " nats, of which " << c.component << "=" << c.recorded
        << " accounts for " << Fmt("%.0f", 100 * c.explained) << "% (first visible at "
        << (c.has_divergence ? Where(c.first) : std::string("no captured tensor")) << ").";
    } else {
      v << "Divergence starts at " << (c.has_divergence ? Where(c.first) : std::string("no captured tensor")) << " when "
        << c.component << "=" << c.recorded << "; with " << c.component << "=" << c.swapped_to << " the logit KL "
        << "against the reference configuration falls by " << Fmt("%.0f", 100 * c.explained) << "% (from "
        << Fmt("%.3g", total) << " to " << Fmt("%.3g", c.kl_to_reference) << " nats).";
    }
    for (size_t i = 1; i < res.components.size(); ++i) {
      const auto& o = res.components[i];
      v << " " << o.component << " (" << o.recorded << " → " << o.swapped_to << ") explains "
        << Fmt("%.0f", 100 * o.explained) << "%.";
    }
  } else if (ref.empty()) {
    v << "The recording already uses the reference configuration (fp32 cache, default kernels, no fault): no component "
         "has an alternative to test.";
  } else {
    v << "No single component explains the divergence from the reference configuration (" << res.reference << ").";
  }
  if (greedy && sampled_fixes && (total < kSmallKl || ref.empty())) {
    v << " The degeneration comes from greedy decoding, not from the numerics: " << res.sampling_note << ".";
  } else if (!res.sampling_note.empty()) {
    v << " Sampling: " << res.sampling_note << ".";
  }
  res.verdict = v.str();
  return res;
}

}  // namespace lockstep::replayer
