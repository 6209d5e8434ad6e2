// cli/verify.cc — `lockstep verify run.h5`: every recorded op against its golden twin.
#include <cmath>
#include <cstdio>
#include <iostream>

#include <nlohmann/json.hpp>

#include "base/json_text.h"
#include "cli/commands.h"
#include "cli/progress.h"
#include "cli/table.h"
#include "replayer/verify_run.h"

namespace lockstep::cli {

namespace {
nlohmann::json Num(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }
}  // namespace

nlohmann::json LocationJson(const verify::Location& l) {
  nlohmann::json j{{"request", l.request},
                   {"layer", l.layer < 0 ? nlohmann::json(nullptr) : nlohmann::json(l.layer)},
                   {"position", l.position},
                   {"step", l.step},
                   {"tensor", l.tensor},
                   {"column", l.column < 0 ? nlohmann::json(nullptr) : nlohmann::json(l.column)},
                   {"measured", Num(l.measured)},
                   {"budget", Num(l.budget)}};
  if (!l.detail.empty()) j["detail"] = l.detail;
  return j;
}

nlohmann::json VerifyJson(const replayer::VerifyRunResult& r) {
  nlohmann::json ops = nlohmann::json::array();
  for (const auto& o : r.check.ops) {
    nlohmann::json j{{"op", o.op},
                     {"kernel_op", o.kernel_op},
                     {"variant", o.variant},
                     {"twin", o.what},
                     {"rows", o.rows},
                     {"values", o.values},
                     {"max_ratio", Num(o.max_ratio)},
                     {"max_ratio_infinite", std::isinf(o.max_ratio)},
                     {"max_error", Num(o.max_error)},
                     {"budget_at_max", Num(o.budget_at_max)},
                     {"failing_rows", o.failing_rows},
                     {"defect", o.failed},
                     {"first_failure", o.failed ? LocationJson(o.first) : nlohmann::json(nullptr)},
                     {"worst", o.rows > 0 ? LocationJson(o.worst) : nlohmann::json(nullptr)},
                     {"bias_t", o.rows > 0 ? Num(o.bias_t) : nlohmann::json(nullptr)},
                     {"bias_mean", o.rows > 0 ? Num(o.bias_mean) : nlohmann::json(nullptr)},
                     {"bias_defect", o.bias_failed},
                     {"not_checked", o.not_checked}};
    if (!o.not_checked_why.empty()) j["not_checked_why"] = o.not_checked_why;
    ops.push_back(j);
  }
  const auto& b = r.batch;
  return {{"trace", r.check.trace.string()},
          {"checked_trace", r.checked.string()},
          {"upgraded_from_summary", r.upgraded},
          {"upgrade", r.upgrade_detail.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.upgrade_detail)},
          {"kv_format", r.check.kv_format},
          {"clean", r.clean()},
          {"rows", r.check.rows},
          {"values", r.check.values},
          {"ops", ops},
          {"not_verified", r.check.not_verified},
          {"batch_invariance",
           b.run ? nlohmann::json{{"run", "every request alone (max_batch 1, teacher-forced): " + b.replay_trace},
                                  {"rows_compared", b.rows_compared},
                                  {"rows_differing", b.rows_differing},
                                  {"rows_missing", b.rows_missing},
                                  {"bit_identical", b.invariant},
                                  {"first_difference", b.invariant ? nlohmann::json(nullptr) : LocationJson(b.first)}}
                 : nlohmann::json(nullptr)}};
}

std::string RatioText(double r) { return std::isinf(r) ? "inf" : Format("%.3g", r); }

void PrintVerify(const replayer::VerifyRunResult& r) {
  if (r.upgraded) std::printf("summary-only trace: %s\n", r.upgrade_detail.c_str());
  Table t({"op", "variant", "rows", "max err/budget", "bias t", "verdict", "first failure (request, layer, position)"},
          {false, false, true, true, true, false, false});
  for (const auto& o : r.check.ops) {
    if (o.rows == 0) continue;
    std::string first = "-";
    if (o.failed) {
      first = "r" + std::to_string(o.first.request) + " L" + (o.first.layer < 0 ? std::string("-") : std::to_string(o.first.layer)) +
              " p" + std::to_string(o.first.position) + ": " + Format("%.3g", o.first.measured) + " vs " +
              Format("%.3g", o.first.budget) + (o.first.detail.empty() ? "" : " (" + o.first.detail + ")");
    }
    t.Add({o.op, o.variant.empty() ? "-" : o.variant, std::to_string(o.rows), RatioText(o.max_ratio), Format("%.1f", o.bias_t),
           o.failed ? "DEFECT" : o.bias_failed ? "BIASED" : "ok", first});
  }
  t.Print();
  for (const auto& n : r.check.not_verified) std::printf("not verified: %s\n", n.c_str());
  if (r.batch.run) {
    if (r.batch.invariant) {
      std::printf("batch invariance: %lld rows bit-identical when each request runs alone\n",
                  static_cast<long long>(r.batch.rows_compared));
    } else {
      std::printf("batch invariance: %lld of %lld rows differ when each request runs alone (%lld missing); first: %s, request %d, position %lld\n",
                  static_cast<long long>(r.batch.rows_differing), static_cast<long long>(r.batch.rows_compared),
                  static_cast<long long>(r.batch.rows_missing), r.batch.first.tensor.c_str(), r.batch.first.request,
                  static_cast<long long>(r.batch.first.position));
    }
  } else {
    std::printf("batch invariance: not checked (one request)\n");
  }
  std::printf("%s\n", r.clean() ? "verify: clean — every checked row within its op's budget" : "verify: DEFECTS found");
}

namespace {

struct VerifyArgs {
  std::string trace, model, work_dir;
  bool json = false, quiet = false, no_batch = false;
};

Status RunVerify(const VerifyArgs& a) {
  auto opened = traces::TraceReader::Open(a.trace);
  if (!opened.ok()) return Status::InvalidArgument(opened.status().message());
  auto& trace = *opened;
  replayer::VerifyRunOptions o;
  o.model_dir = a.model;
  o.work_dir = a.work_dir.empty() ? std::filesystem::path(a.trace).replace_extension(".verify") : std::filesystem::path(a.work_dir);
  o.batch_check = !a.no_batch;
  Progress bar(!a.quiet && !a.json, "", 0, "rows");
  if (!a.quiet && !a.json) {
    o.progress = [&](const std::string& s) {
      bar.Restart("verify: " + s, 0);
      if (!bar.enabled()) std::fprintf(stderr, "verify: %s\n", s.c_str());
    };
    o.row_progress = [&](int64_t done, int64_t total) {
      if (bar.enabled()) bar.SetTotal(total), bar.Update(done);
    };
  }
  auto result = replayer::VerifyRun(*trace, o);
  bar.Done();
  if (!result.ok()) return Status::InvalidArgument(result.status().message());
  if (a.json) {
    std::cout << JsonText(VerifyJson(*result), 2) << "\n";
  } else {
    PrintVerify(*result);
  }
  if (!result->clean()) ExitCode() = 3;
  return Status::Ok();
}

}  // namespace

void RegisterVerify(CLI::App& app, SetAction set_action) {
  auto a = std::make_shared<VerifyArgs>();
  CLI::App* cmd = app.add_subcommand("verify", "Check every recorded op against its golden twin (fp64, from the math) on its own recorded inputs");
  cmd->footer(
      "Each op (norms, q path, RoPE, the cache as stored, the indexer's top-k, attention over the request's\n"
      "own recorded keys, o_proj, residuals, routing, experts, final norm, LM head, sampler) is recomputed\n"
      "in fp64 on every row and its error compared with the budget its declared precision allows; a\n"
      "summary-only trace is first upgraded by an exact replay with full capture (hashes checked); then\n"
      "every request is replayed alone and must be bit-identical to its batched self.\n"
      "Exit: 0 clean, 3 defects found, 2 bad input.\n"
      "Example: lockstep verify run.h5 --json");
  cmd->add_option("trace", a->trace, "The recorded trace")->required();
  cmd->add_option("--model,-m", a->model, "Model directory (default: the trace's meta.model_dir)");
  cmd->add_option("--work-dir", a->work_dir, "Where replays' traces go (default: <trace>.verify/)");
  cmd->add_flag("--no-batch-check", a->no_batch, "Skip the alone-replay (batch invariance in bits)");
  cmd->add_flag("--json", a->json, "Machine-readable result");
  cmd->add_flag("--quiet,-q", a->quiet, "No progress lines");
  cmd->callback([a, set_action] { set_action([a] { return RunVerify(*a); }); });
}

}  // namespace lockstep::cli
