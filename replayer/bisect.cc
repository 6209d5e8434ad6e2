// replayer/bisect.cc — see bisect.h.
#include "replayer/bisect.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "diff/degeneration.h"
#include "kernels/registry.h"

namespace lockstep::replayer {
namespace {

std::string Fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

std::string Where(const verify::Location& l) {
  std::ostringstream w;
  w << "request " << l.request;
  if (l.layer >= 0) w << ", layer " << l.layer;
  w << ", position " << l.position << (l.prefill ? " (prompt)" : "") << " (" << l.tensor << ", step " << l.step << ")";
  return w.str();
}

// The registry ops a verify op runs through, with the variants the trace ran.
std::string KernelsOf(const verify::OpReport& o, const std::map<std::string, std::string>& ran) {
  std::vector<std::string> ops;
  if (o.op == "attention" && o.kernel_op.rfind("softmax", 0) == 0) {
    // DeepSeek-V4's attention names its ops itself ("softmax+attn_sparse", verify/check_v4.cc).
    for (size_t a = 0, b; a <= o.kernel_op.size(); a = b + 1) {
      b = o.kernel_op.find('+', a);
      if (b == std::string::npos) b = o.kernel_op.size();
      ops.push_back(o.kernel_op.substr(a, b - a));
    }
  } else if (o.op == "attention") {
    ops = {o.first.prefill ? "attn_prefill" : "attn_decode", "softmax", "page_table"};
    if (o.kernel_op.find("attn_sparse") != std::string::npos) ops.push_back("attn_sparse");
  } else if (o.op == "kv_cache") {
    ops = {"kv_quant"};
  } else if (!o.kernel_op.empty()) {
    ops = {o.kernel_op};
  }
  std::string s;
  for (const auto& op : ops) {
    auto it = ran.find(op);
    s += (s.empty() ? "" : " ") + op + "=" + (it == ran.end() ? "?" : it->second);
  }
  return s.empty() ? "no kernel variants" : s;
}

// The op a tap belongs to, for a batch-invariance difference.
std::string OpOfTensor(const std::string& path) {
  const std::string n = path.substr(path.find('/') + 1);
  auto ends = [&](const char* s) {
    const std::string t(s);
    return n.size() >= t.size() && n.compare(n.size() - t.size(), t.size(), t) == 0;
  };
  if (path.rfind("kv/", 0) == 0) return "kv_cache";
  if (ends("attn_norm") || ends("ffn_norm") || n == "final_norm") return "norm";
  if (ends("attn.q") || ends("attn.latent") || ends("attn.k_rope")) return "q/kv projections and rope";
  if (ends("indexer.topk")) return "indexer";
  if (ends("attn.heads")) return "attention";
  if (ends("attn.partials") || ends("ffn.partials")) return "the ranks' partial products (emulated TP)";
  if (ends("attn.out")) return "o_proj";
  if (ends("topk_ids") || ends("topk_weights")) return "router";
  if (ends("ffn.out")) return "experts";
  if (n.rfind("logits", 0) == 0) return "lm_head";
  if (n == "embed") return "embed";
  return "residual add";
}

double TemperatureOf(const traces::TraceReader& trace, const std::filesystem::path& model_dir_opt) {
  std::filesystem::path dir = model_dir_opt;
  if (dir.empty()) {
    auto it = trace.meta().find("model_dir");
    if (it != trace.meta().end()) dir = it->second;
  }
  std::ifstream f(dir / "generation_config.json");
  if (f) {
    const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
    if (j.is_object() && j.contains("temperature") && j["temperature"].is_number() && j["temperature"].get<double>() > 0) {
      return j["temperature"].get<double>();
    }
  }
  return 0.6;
}

}  // namespace

void WilsonInterval(int64_t k, int64_t n, double* lo, double* hi) {
  if (n <= 0) {
    *lo = 0;
    *hi = 1;
    return;
  }
  const double z = 1.959963984540054, p = static_cast<double>(k) / n, z2 = z * z;
  const double c = (p + z2 / (2 * n)) / (1 + z2 / n);
  const double h = z * std::sqrt(p * (1 - p) / n + z2 / (4.0 * n * n)) / (1 + z2 / n);
  *lo = std::max(0.0, c - h);
  *hi = std::min(1.0, c + h);
}

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
  auto last_trace = [&] { return (opt.work_dir / ("bisect_" + std::to_string(n - 1) + ".h5")).string(); };
  auto say = [&](std::string text, Evidence e) { res.sentences.push_back({std::move(text), std::move(e)}); };
  const std::string tname = trace.path().filename().string();

  // 1. Reproducible?
  {
    LS_ASSIGN_OR_RETURN(auto r, run({}, "exact replay"));
    res.reproducible = r.deterministic;
    res.reproducible_detail = r.verdict;
    if (!r.deterministic) {
      say("The run is not reproducible: an exact replay of the recorded configuration differs from the recording (" +
              r.verdict + ").",
          {"lockstep replay --mode exact " + tname + " → " + last_trace(),
           "first difference: " + r.diff.first.tensor + " request " + std::to_string(r.diff.first.request) + " position " +
               std::to_string(r.diff.first.position),
           "every captured hash and token equal (a deterministic run)"});
    }
  }

  // 2. Verify.
  VerifyRunOptions vo;
  vo.model_dir = opt.model_dir;
  vo.work_dir = opt.work_dir / "verify";
  vo.progress = opt.progress;
  vo.row_progress = opt.replay_progress;
  LS_ASSIGN_OR_RETURN(res.verify, VerifyRun(trace, vo));
  const auto& chk = res.verify.check;
  std::map<std::string, std::string> ran;
  {
    auto it = trace.meta().find("kernels");
    const nlohmann::json j = nlohmann::json::parse(it == trace.meta().end() ? "{}" : it->second, nullptr, false);
    if (j.is_object()) {
      for (const auto& [k, v] : j.items()) {
        if (v.is_string()) ran[k] = v.get<std::string>();
      }
    }
  }
  LS_ASSIGN_OR_RETURN(engine::EngineOptions rec, RecordedEngineOptions(trace));
  // (A run over real ranks, --tp-ranks, has the emulation's bits: named as what it was.)
  bool real_ranks = false;
  if (auto eo = trace.meta().find("engine_options"); eo != trace.meta().end()) {
    const nlohmann::json j = nlohmann::json::parse(eo->second, nullptr, false);
    real_ranks = j.is_object() && j.contains("tp_ranks") && j["tp_ranks"].is_number_integer() &&
                 j["tp_ranks"].get<int64_t>() > 1;
  }
  const std::string tp_text = (real_ranks ? "TP over " + std::to_string(rec.emulate_tp) + " ranks"
                                          : "emulated TP " + std::to_string(rec.emulate_tp));
  std::vector<const verify::OpReport*> failed;
  for (const auto& o : chk.ops) {
    if (o.failed || o.bias_failed) failed.push_back(&o);
  }
  auto key = [](const verify::OpReport* o) {
    return std::make_tuple(!o->failed, o->first.step, o->first.layer < 0 && o->op != "embed" ? int64_t{1} << 30 : o->first.layer,
                           o->first.request, o->first.position);
  };
  std::stable_sort(failed.begin(), failed.end(), [&](auto* a, auto* b) { return key(a) < key(b); });
  const std::string verify_run = "lockstep verify " + tname + " (golden twins on every recorded row)";
  for (const auto* o : failed) {
    Defect d;
    d.op = o->op;
    d.kernels = KernelsOf(*o, ran) + (o->op == "allreduce" ? " — parallelism: " + tp_text : std::string());
    d.first = o->failed ? o->first : o->worst;
    d.failing_rows = o->failing_rows;
    d.rows = o->rows;
    d.failing_prefill_rows = o->failing_prefill_rows;
    d.prefill_rows = o->prefill_rows;
    d.bias = !o->failed;
    d.bias_t = o->bias_t;
    res.defects.push_back(d);
    if (o->failed) {
      say("Defect in " + o->op + " (" + d.kernels + "): first at " + Where(d.first) + ", error " + Fmt("%.3g", d.first.measured) +
              " against a budget of " + Fmt("%.3g", d.first.budget) + (d.first.detail.empty() ? "" : " — " + d.first.detail) +
              "; over budget on " + std::to_string(d.failing_rows) + " of " + std::to_string(d.rows) + " rows (" +
              std::to_string(d.failing_prefill_rows) + " of " + std::to_string(d.prefill_rows) + " prompt rows, " +
              std::to_string(d.failing_rows - d.failing_prefill_rows) + " of " + std::to_string(d.rows - d.prefill_rows) +
              " generated rows).",
          {verify_run + ": " + o->op + "'s twin (" + o->what + ")",
           "max error/budget " + (std::isinf(o->max_ratio) ? std::string("inf (bits differ)") : Fmt("%.3g", o->max_ratio)) +
               " over " + std::to_string(o->rows) + " rows, " + std::to_string(o->failing_rows) + " over budget",
           "every row within budget (error/budget ≤ 1), as rounding at the op's declared precision gives"});
    } else {
      say("Systematic bias in " + o->op + " (" + d.kernels + "): its errors lean one way (t = " + Fmt("%.1f", o->bias_t) +
              ", mean " + Fmt("%.3g", o->bias_mean) + " of the budget) although every row is within budget.",
          {verify_run + ": bias test over " + std::to_string(o->rows) + " rows of " + o->op,
           "t = " + Fmt("%.2f", o->bias_t) + ", mean error/budget " + Fmt("%.3g", o->bias_mean),
           "|t| ≤ " + Fmt("%.0f", verify::kBiasT) + ": rounding to nearest has no preferred sign"});
    }
  }
  const BatchCheck& b = res.verify.batch;
  if (b.run && !b.invariant) {
    Defect d;
    d.op = "batch_invariance";
    d.kernels = OpOfTensor(b.first.tensor);
    // Under emulated TP a block's output that differs while every tap before it — the ranks'
    // partials included — was bit-identical alone is the all-reduce's doing.
    const bool block_out = b.first.tensor.ends_with("attn.out") || b.first.tensor.ends_with("ffn.out");
    if (rec.emulate_tp > 1 && block_out) {
      auto it = ran.find("allreduce");
      d.kernels = "allreduce=" + (it == ran.end() ? std::string("ordered") : it->second) + " (parallelism: " + tp_text +
                  "; the ranks' partials before it were bit-identical alone)";
    }
    d.first = b.first;
    d.failing_rows = b.rows_differing;
    d.rows = b.rows_compared;
    res.defects.push_back(d);
    say("Batch dependence: request " + std::to_string(b.first.request) + " is not bit-identical to itself when it runs alone; the first differing op is " +
            d.kernels + " (" + b.first.tensor + (b.first.layer >= 0 ? ", layer " + std::to_string(b.first.layer) : "") +
            ", position " + std::to_string(b.first.position) + "); " + std::to_string(b.rows_differing) + " of " +
            std::to_string(b.rows_compared) + " rows differ" +
            (b.rows_missing > 0 ? ", " + std::to_string(b.rows_missing) + " missing" : "") + ".",
        {"lockstep replay --mode forced --max-batch 1 " + tname + " → " + b.replay_trace + ", content hashes compared row by row",
         std::to_string(b.rows_differing) + " of " + std::to_string(b.rows_compared) + " rows differ",
         "every row's hash equal: the engine's numbers do not depend on the batch"});
  }

  // 3. Configuration questions.
  if (opt.configuration) {
    const auto& reg = kernels::Registry::Get();
    std::map<std::string, std::vector<std::string>> alts;
    // The variants of the backend the trace ran on (a CUDA trace replays on CUDA).
    const std::string backend = rec.backend.empty() ? "cpu" : rec.backend;
    // The recorded config.json's model_type (empty when the trace has none or it does not parse).
    std::string model_type;
    if (auto cfg = trace.meta().find("model_config"); cfg != trace.meta().end()) {
      const nlohmann::json j = nlohmann::json::parse(cfg->second, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.contains("model_type") && j["model_type"].is_string()) model_type = j["model_type"];
    }
    for (const auto& v : reg.variants()) {
      if (v.backend != backend || v.fault) continue;
      // An alias gives another variant's bits (same_bits_as): swapping to it answers nothing new.
      if (!v.same_bits_as.empty()) continue;
      // A variant of another family's weights (KernelVariant::model_types) would be refused.
      if (!v.RunsOn(model_type)) continue;
      alts[v.op].push_back(v.name);
    }
    std::vector<std::pair<std::string, Overrides>> swaps;
    std::vector<std::pair<std::string, std::string>> labels;
    for (const auto& [op, names] : alts) {
      if (names.size() < 2) continue;
      if (op == "allreduce" && rec.emulate_tp <= 1) continue;  // nothing is all-reduced at TP 1
      const std::string from = ran.count(op) ? ran[op] : reg.Default(op, backend);
      for (const auto& to : names) {
        if (to == from) continue;
        if (op == "indexer" && !trace.meta().count("model_config")) continue;
        Overrides s;
        s.kernels[op] = to;
        swaps.push_back({op, s});
        labels.push_back({from, to});
      }
    }
    for (engine::KvFormat f : {engine::KvFormat::kFp32, engine::KvFormat::kBf16, engine::KvFormat::kFp8E4m3}) {
      if (f == rec.kv_format) continue;
      Overrides s;
      s.kv_cache = f;
      swaps.push_back({"kv_cache", s});
      labels.push_back({std::string(engine::KvFormatName(rec.kv_format)), std::string(engine::KvFormatName(f))});
    }
    // Parallelism: the recorded emulated TP degree against one device (the reduction order only).
    if (rec.emulate_tp > 1) {
      Overrides s;
      s.emulate_tp = 1;
      swaps.push_back({"parallelism", s});
      labels.push_back({tp_text, "TP 1"});
    }
    for (size_t i = 0; i < swaps.size(); ++i) {
      ReplayOptions so;
      so.mode = ReplayMode::kForced;
      so.overrides = swaps[i].second;
      auto r = run(so, "swap " + swaps[i].first + ": " + labels[i].first + " → " + labels[i].second);
      SwapExperiment e;
      e.op = swaps[i].first;
      e.from = labels[i].first;
      e.to = labels[i].second;
      e.trace = last_trace();
      if (!r.ok()) {
        // A variant this model cannot run (e.g. a Hadamard rotation of a non-power-of-two head).
        say("The swap " + e.op + " " + e.from + " → " + e.to + " could not run: " + r.status().message() + ".",
            {"lockstep replay --mode forced --kernel/--kv-cache " + e.op + "=" + e.to + " " + tname, "refused", "a replay to compare"});
        continue;
      }
      e.mean_logit_kl = r->diff.logit_summary.rows > 0 ? r->diff.logit_summary.mean_kl : -1;
      e.max_logit_kl = r->diff.logit_summary.rows > 0 ? r->diff.logit_summary.max_kl : -1;
      e.diverges = r->diff.has_divergence;
      e.first = r->diff.first;
      res.swaps.push_back(e);
      std::string text = "Swapping " + e.op + " " + e.from + " → " + e.to + " (teacher-forced) ";
      if (e.mean_logit_kl < 0) {
        text += "changes no logit the trace holds.";
      } else {
        text += "moves the logits by a mean KL of " + Fmt("%.3g", e.mean_logit_kl) + " nats (max " + Fmt("%.3g", e.max_logit_kl) +
                ", " + std::to_string(r->diff.logit_summary.top1_flips) + " of " + std::to_string(r->diff.logit_summary.rows) +
                " rows change their most likely token)" +
                (e.diverges ? "; the first tensor past threshold is " + e.first.tensor + " at request " + std::to_string(e.first.request) +
                                  ", position " + std::to_string(e.first.position)
                            : "") +
                ".";
      }
      const std::string flag = e.op == "kv_cache"      ? "--kv-cache " + e.to
                               : e.op == "parallelism" ? std::string("--emulate-tp 1")
                                                       : "--kernel " + e.op + "=" + e.to;
      say(text, {"lockstep replay --mode forced " + flag + " " + tname + " → " + e.trace,
                 "mean logit KL " + Fmt("%.3g", e.mean_logit_kl) + ", max " + Fmt("%.3g", e.max_logit_kl) + " over " +
                     std::to_string(r->diff.logit_summary.rows) + " logit rows",
                 "KL 0 and no top-1 flip: the two variants give the same logits"});
    }
  }

  // 4. Degeneration: free runs, only when a recorded request degenerates.
  res.requests = static_cast<int64_t>(trace.requests().size());
  for (const auto& q : trace.requests()) res.recorded_degenerate += diff::DetectDegeneration(q.generated).degenerate;
  if (res.recorded_degenerate > 0) {
    auto degen_of = [&](const ReplayResult& r) {
      int64_t d = 0;
      for (const auto& q : r.diff.requests) d += diff::DetectDegeneration(q.tokens_b).degenerate;
      return d;
    };
    if (res.verify.clean()) {
      ReplayOptions o;
      o.mode = ReplayMode::kFree;
      o.overrides.temperature = 0.0;
      LS_ASSIGN_OR_RETURN(auto r, run(o, "free run: greedy, recorded configuration (verified clean)"));
      FreeRuns f;
      f.config = "greedy under the recorded configuration (verify: clean)";
      f.runs = res.requests;
      f.degenerate = degen_of(r);
      f.traces.push_back(last_trace());
      f.rate = static_cast<double>(f.degenerate) / std::max<int64_t>(1, f.runs);
      WilsonInterval(f.degenerate, f.runs, &f.lo, &f.hi);
      res.free_runs.push_back(f);
    }
    const double t = opt.temperature > 0 ? opt.temperature : TemperatureOf(trace, opt.model_dir);
    FreeRuns f;
    f.config = "temperature " + Fmt("%g", t) + ", " + std::to_string(opt.seeds) + " seeds (1000…)";
    for (int s = 0; s < opt.seeds; ++s) {
      ReplayOptions o;
      o.mode = ReplayMode::kFree;
      o.overrides.temperature = t;
      o.overrides.seed = 1000 + static_cast<uint64_t>(s) * 64;
      LS_ASSIGN_OR_RETURN(auto r, run(o, "free run: temperature " + Fmt("%g", t) + ", seed " + std::to_string(1000 + s * 64)));
      f.runs += res.requests;
      f.degenerate += degen_of(r);
      f.traces.push_back(last_trace());
    }
    f.rate = static_cast<double>(f.degenerate) / std::max<int64_t>(1, f.runs);
    WilsonInterval(f.degenerate, f.runs, &f.lo, &f.hi);
    res.free_runs.push_back(f);
    std::string text = std::to_string(res.recorded_degenerate) + " of " + std::to_string(res.requests) +
                       " recorded request(s) degenerate.";
    say(text, {"degeneration detector (diff/degeneration.h) on the recorded tokens", text, "no request loops or collapses"});
    for (const auto& fr : res.free_runs) {
      say("Free runs, " + fr.config + ": " + std::to_string(fr.degenerate) + " of " + std::to_string(fr.runs) + " degenerate (rate " +
              Fmt("%.2f", fr.rate) + ", 95% interval " + Fmt("%.2f", fr.lo) + "–" + Fmt("%.2f", fr.hi) + ").",
          {"lockstep replay --mode free (" + fr.config + "), " + std::to_string(fr.traces.size()) + " replay(s): " + fr.traces.front() +
               (fr.traces.size() > 1 ? " …" : ""),
           std::to_string(fr.degenerate) + " degenerate of " + std::to_string(fr.runs) + " generations",
           "a rate whose interval lies near the recorded one (" + std::to_string(res.recorded_degenerate) + " of " +
               std::to_string(res.requests) + ") if the configuration does not matter, near 0 if it does"});
    }
    if (!res.verify.clean()) {
      say("No greedy free run under a verified-clean configuration was made: verify found defects in the recorded one, so "
          "whether greedy decoding alone degenerates is not tested.",
          {verify_run, std::to_string(res.defects.size()) + " defect(s)", "verify clean: then a greedy free run would test it"});
    }
  }

  // Nothing found.
  if (res.defects.empty()) {
    int64_t ops = 0;
    std::string list;
    for (const auto& o : chk.ops) {
      if (o.rows == 0) continue;
      ++ops;
      list += (list.empty() ? "" : ", ") + o.op + " (" + std::to_string(o.rows) + " rows, max error/budget " + Fmt("%.2g", o.max_ratio) + ")";
    }
    std::string nv;
    for (const auto& s : chk.not_verified) nv += (nv.empty() ? "" : "; ") + s;
    std::string text = "No defect found: " + std::to_string(ops) + " ops verified against their golden twins on " +
                       std::to_string(chk.rows) + " rows within budget: " + list + "; " +
                       (b.run ? std::to_string(b.rows_compared) + " rows bit-identical with each request alone"
                              : std::string("batch invariance not tested (one request)")) +
                       ". Not verified: " + (nv.empty() ? "nothing the trace holds" : nv) + ".";
    res.sentences.insert(res.sentences.begin(),
                         {text,
                          {verify_run + (b.run ? " and the alone-replay " + b.replay_trace : ""),
                           std::to_string(chk.rows) + " rows, " + std::to_string(chk.values) + " values, all within budget",
                           "some op's error above its budget at a (request, layer, position), or a row's bits changing alone"}});
  }
  std::string v;
  for (const auto& s : res.sentences) v += (v.empty() ? "" : " ") + s.text;
  res.verdict = v;
  return res;
}

}  // namespace lockstep::replayer
