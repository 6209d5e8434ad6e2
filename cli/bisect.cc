// cli/bisect.cc — `lockstep bisect run.h5`: verified defects first, then the configuration
// questions, each an experiment; every sentence with its evidence (--json).
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <iostream>

#include <nlohmann/json.hpp>

#include "base/json_text.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/progress.h"
#include "cli/table.h"
#include "replayer/bisect.h"

namespace lockstep::cli {

nlohmann::json LocationJson(const verify::Location& l);          // cli/verify.cc
nlohmann::json VerifyJson(const replayer::VerifyRunResult& r);  // cli/verify.cc

namespace {

nlohmann::json Num(double v) { return std::isfinite(v) && v >= 0 ? nlohmann::json(v) : nlohmann::json(nullptr); }

struct BisectArgs {
  std::string trace, work_dir, model;
  bool json = false, quiet = false, no_swaps = false;
  int seeds = 8;
  double temperature = -1;
};

Status RunBisect(const BisectArgs& a) {
  LS_ASSIGN_OR_RETURN(auto trace, OpenTrace(a.trace));
  replayer::BisectOptions o;
  o.work_dir = a.work_dir.empty() ? std::filesystem::path(a.trace).replace_extension(".bisect") : std::filesystem::path(a.work_dir);
  o.model_dir = a.model;
  o.seeds = a.seeds;
  o.temperature = a.temperature;
  o.configuration = !a.no_swaps;
  Progress bar(!a.quiet && !a.json, "", 0);
  int experiment = 0;
  if (!a.quiet && !a.json) {
    o.progress = [&](const std::string& s) {
      bar.Restart("bisect " + std::to_string(++experiment) + ": " + s, 0);
      if (!bar.enabled()) std::fprintf(stderr, "bisect: %s\n", s.c_str());
    };
    o.replay_progress = [&](int64_t done, int64_t total) {
      if (bar.enabled()) bar.SetTotal(total), bar.Update(done);
    };
  }
  auto result = replayer::Bisect(*trace, o);
  bar.Done();
  LS_ASSIGN_OR_RETURN(replayer::BisectResult r, std::move(result));
  if (a.json) {
    nlohmann::json defects = nlohmann::json::array(), swaps = nlohmann::json::array(), free = nlohmann::json::array(),
                   sentences = nlohmann::json::array();
    for (const auto& d : r.defects) {
      defects.push_back({{"op", d.op},
                         {"kernels", d.kernels},
                         {"first", LocationJson(d.first)},
                         {"failing_rows", d.failing_rows},
                         {"rows", d.rows},
                         {"failing_prompt_rows", d.failing_prefill_rows},
                         {"prompt_rows", d.prefill_rows},
                         {"bias", d.bias}});
    }
    for (const auto& s : r.swaps) {
      swaps.push_back({{"op", s.op}, {"from", s.from}, {"to", s.to}, {"trace", s.trace},
                       {"mean_logit_kl", Num(s.mean_logit_kl)}, {"max_logit_kl", Num(s.max_logit_kl)},
                       {"first_divergence", s.diverges ? nlohmann::json{{"tensor", s.first.tensor}, {"request", s.first.request},
                                                                        {"position", s.first.position}}
                                                       : nlohmann::json(nullptr)}});
    }
    for (const auto& f : r.free_runs) {
      free.push_back({{"config", f.config}, {"runs", f.runs}, {"degenerate", f.degenerate}, {"rate", f.rate},
                      {"interval95", {f.lo, f.hi}}, {"traces", f.traces}});
    }
    for (const auto& s : r.sentences) {
      sentences.push_back({{"text", s.text},
                           {"evidence", {{"run", s.evidence.run}, {"measured", s.evidence.measured}, {"otherwise", s.evidence.otherwise}}}});
    }
    std::cout << JsonText(nlohmann::json{{"trace", a.trace},
                                {"reproducible", r.reproducible},
                                {"reproducible_detail", r.reproducible_detail},
                                {"defects", defects},
                                {"no_defect_found", r.defects.empty()},
                                {"verify", VerifyJson(r.verify)},
                                {"swaps", swaps},
                                {"recorded_degenerate", r.recorded_degenerate},
                                {"free_runs", free},
                                {"evidence", sentences},
                                {"verdict", r.verdict}},
                          2)
              << "\n";
    return Status::Ok();
  }
  for (const auto& s : r.sentences) std::printf("%s\n", s.text.c_str());
  if (!r.defects.empty()) {
    std::printf("\n");
    Table t({"defect", "kernels", "first (request, layer, position)", "measured", "budget", "rows over"},
            {false, false, false, true, true, true});
    for (const auto& d : r.defects) {
      t.Add({d.op, d.kernels,
             "r" + std::to_string(d.first.request) + " L" + (d.first.layer < 0 ? std::string("-") : std::to_string(d.first.layer)) +
                 " p" + std::to_string(d.first.position),
             Format("%.3g", d.first.measured), Format("%.3g", d.first.budget),
             std::to_string(d.failing_rows) + "/" + std::to_string(d.rows)});
    }
    t.Print();
  }
  std::printf("\n(each sentence's experiment: --json, field `evidence`)\n");
  return Status::Ok();
}

}  // namespace

void RegisterBisect(CLI::App& app, SetAction set_action) {
  auto a = std::make_shared<BisectArgs>();
  CLI::App* cmd = app.add_subcommand("bisect", "Find what is wrong in a run: verified defects first, then configuration experiments");
  cmd->footer(
      "Steps: exact replay (reproducible?); verify — every op against its golden twin on the recorded inputs,\n"
      "and every request alone against its batched self in bits (the defects: op, variant, request, layer,\n"
      "position, error vs budget); every op with alternatives swapped to each other variant and the KV format\n"
      "both ways (teacher-forced, logit KL vs the recording); when a recorded request degenerates, free runs\n"
      "(greedy under a verified-clean configuration, and --seeds seeds at the recommended temperature) as\n"
      "rates with 95% intervals. Every verdict sentence has its experiment in --json `evidence`.\n"
      "Example: lockstep bisect run.h5 --json");
  cmd->add_option("trace", a->trace, "The recorded trace")->required();
  cmd->add_option("--work-dir", a->work_dir, "Where the replays' traces go (default: <trace>.bisect/)");
  cmd->add_option("--model,-m", a->model, "Model directory (default: the trace's meta.model_dir)");
  cmd->add_option("--seeds", a->seeds, "Seeded free runs when a request degenerates")->check(CLI::Range(1, 1000));
  cmd->add_option("--temperature", a->temperature,
                  "Temperature of the seeded free runs (default: generation_config.json's, else 0.6)");
  cmd->add_flag("--no-swaps", a->no_swaps, "Skip the configuration experiments (variant and KV-format swaps)");
  cmd->add_flag("--json", a->json, "Machine-readable result");
  cmd->add_flag("--quiet,-q", a->quiet, "No progress lines");
  cmd->callback([a, set_action] { set_action([a] { return RunBisect(*a); }); });
}

}  // namespace lockstep::cli
