// cli/diff_cmd.cc — `lockstep diff a.h5 b.h5`: where, and through which component, two runs part.
#include <fstream>
#include <iostream>

#include "base/json_text.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/diff_report.h"
#include "diff/trace_diff.h"
#include "traces/trace_reader.h"

namespace lockstep::cli {
namespace {

struct DiffArgs {
  std::string a, b, html;
  bool json = false, verbose = false, exact = false, allow_model_mismatch = false;
  double rel_l2 = 1e-3, kl = 1e-3;
};

Status RunDiff(const DiffArgs& x) {
  LS_ASSIGN_OR_RETURN(auto a, OpenTrace(x.a));
  LS_ASSIGN_OR_RETURN(auto b, OpenTrace(x.b));
  diff::DiffOptions o;
  o.thresholds.rel_l2 = x.rel_l2;
  o.thresholds.kl = x.kl;
  o.thresholds.exact = x.exact;
  o.allow_model_mismatch = x.allow_model_mismatch;
  LS_ASSIGN_OR_RETURN(diff::TraceDiffReport r, diff::CompareTraces(*a, *b, o));
  const Detokenize detok = TokenizerFromTrace(a->meta());
  if (x.json) {
    std::cout << JsonText(DiffJson(r, detok), 2) << "\n";
  } else {
    PrintDiffText(r, detok, x.verbose);
  }
  if (!x.html.empty()) {
    std::ofstream out(x.html, std::ios::binary);
    out << DiffHtml(r, detok, "lockstep diff: " + x.a + " vs " + x.b);
    if (!out) return Status::IoError(x.html + ": cannot write the HTML report");
  }
  // Scripts: 0 identical, 3 different (1 and 2 are errors).
  if (!(r.identical && !r.has_divergence)) ExitCode() = 3;
  return Status::Ok();
}

}  // namespace

void RegisterDiff(CLI::App& app, SetAction set_action) {
  auto x = std::make_shared<DiffArgs>();
  CLI::App* cmd = app.add_subcommand("diff", "Compare two traces layer by layer and token by token");
  cmd->footer(
      "Rows are aligned by request, position and tensor. A row diverges when its relative L2 error\n"
      "exceeds --rel-l2 (default 1e-3), its logits' KL exceeds --kl (1e-3) or the top-1 token changes,\n"
      "a NaN/Inf appears on one side only, or (with --exact) any bit differs. The first divergence is\n"
      "the earliest in causal order: engine step, position, layer, then the tap's place in the layer.\n"
      "Exit code: 0 identical, 3 different, 1/2 errors.\n"
      "Example: lockstep diff fp8.h5 bf16.h5 --html report.html");
  cmd->add_option("a", x->a, "Reference trace")->required();
  cmd->add_option("b", x->b, "Candidate trace")->required();
  cmd->add_flag("--json", x->json, "Machine-readable report");
  cmd->add_option("--html", x->html, "Also write a self-contained HTML report (heatmap, token strip)");
  cmd->add_flag("--verbose,-v", x->verbose, "List identical tensors too");
  cmd->add_flag("--exact", x->exact, "Any bit difference diverges");
  cmd->add_option("--rel-l2", x->rel_l2, "Relative L2 error above which an activation diverges")->check(kNonNegative);
  cmd->add_option("--kl", x->kl, "KL (nats) above which logits diverge")->check(kNonNegative);
  cmd->add_flag("--allow-model-mismatch", x->allow_model_mismatch, "Compare traces of different models anyway");
  cmd->callback([x, set_action] { set_action([x] { return RunDiff(*x); }); });
}

}  // namespace lockstep::cli
