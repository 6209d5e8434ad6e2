// cli/bisect.cc — `lockstep bisect run.h5`: which component explains the divergence?
#include <unistd.h>

#include <cstdio>
#include <iostream>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/common.h"
#include "cli/progress.h"
#include "cli/table.h"
#include "replayer/bisect.h"

namespace lockstep::cli {
namespace {

struct BisectArgs {
  std::string trace, work_dir, model;
  bool json = false, quiet = false;
};

Status RunBisect(const BisectArgs& a) {
  LS_ASSIGN_OR_RETURN(auto trace, OpenTrace(a.trace));
  replayer::BisectOptions o;
  o.work_dir = a.work_dir.empty() ? std::filesystem::path(a.trace).replace_extension(".bisect") : std::filesystem::path(a.work_dir);
  o.model_dir = a.model;
  // One progress line a replay: which experiment, its tokens, rate and ETA.
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
    nlohmann::json comps = nlohmann::json::array();
    for (const auto& c : r.components) {
      comps.push_back({{"component", c.component}, {"recorded", c.recorded}, {"swapped_to", c.swapped_to},
                       {"explained", c.explained}, {"kl_to_reference", c.kl_to_reference},
                       {"first_divergence", c.has_divergence ? nlohmann::json{{"tensor", c.first.tensor},
                                                                              {"layer", c.first.layer},
                                                                              {"position", c.first.position},
                                                                              {"request", c.first.request},
                                                                              {"how", c.first.how}}
                                                             : nlohmann::json(nullptr)}});
    }
    std::cout << nlohmann::json{{"trace", a.trace},
                                {"reproducible", r.reproducible},
                                {"reproducible_detail", r.reproducible_detail},
                                {"batch_dependent", r.batch_dependent},
                                {"batch_detail", r.batch_detail},
                                {"reference", r.reference},
                                {"total_logit_kl", r.total_kl},
                                {"components", comps},
                                {"sampling", r.sampling_note},
                                {"verdict", r.verdict}}
                     .dump(2)
              << "\n";
    return Status::Ok();
  }
  std::printf("%s\n\n", r.verdict.c_str());
  std::printf("reproducible: %s\n", r.reproducible ? "yes (exact replay is bit-identical)" : r.reproducible_detail.c_str());
  if (!r.batch_detail.empty()) std::printf("batch: %s\n", r.batch_detail.c_str());
  if (!r.components.empty()) {
    std::printf("reference configuration: %s; logit KL of the recording against it: %.3g nats\n", r.reference.c_str(),
                r.total_kl);
    std::printf("\n");
    Table table({"component", "recorded → swapped", "explains", "first divergence (recording vs swap)"},
                {false, false, true, false});
    for (const auto& c : r.components) {
      table.Add({c.component, c.recorded + " → " + c.swapped_to, Format("%.0f%%", 100 * c.explained),
                 c.has_divergence ? c.first.tensor + " @ position " + std::to_string(c.first.position) : "none"});
    }
    table.Print();
  }
  return Status::Ok();
}

}  // namespace

void RegisterBisect(CLI::App& app, SetAction set_action) {
  auto a = std::make_shared<BisectArgs>();
  CLI::App* cmd = app.add_subcommand("bisect", "Find the component that explains a divergence, by replaying with one swap at a time");
  cmd->footer(
      "Steps: exact replay (reproducible?), every request alone (batch dependence), the reference\n"
      "configuration (fp32 cache, default kernels, no fault), then one replay per component with only it\n"
      "swapped, ranked by how much of the logit KL against the reference it removes; greedy recordings are\n"
      "also sampled at temperature 0.6. Replays are teacher-forced so positions line up.\n"
      "Example: lockstep bisect run.h5 --json");
  cmd->add_option("trace", a->trace, "The recorded trace")->required();
  cmd->add_option("--work-dir", a->work_dir, "Where the replays' traces go (default: <trace>.bisect/)");
  cmd->add_option("--model,-m", a->model, "Model directory (default: the trace's meta.model_dir)");
  cmd->add_flag("--json", a->json, "Machine-readable result");
  cmd->add_flag("--quiet,-q", a->quiet, "No progress lines");
  cmd->callback([a, set_action] { set_action([a] { return RunBisect(*a); }); });
}

}  // namespace lockstep::cli
