// cli/replay.cc — `lockstep replay run.h5`: rerun a trace exactly or with one thing changed.
#include <cstdio>
#include <fstream>
#include <iostream>

#include "base/json_text.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/diff_report.h"
#include "cli/pack.h"
#include "cli/progress.h"
#include "kernels/registry.h"
#include "replayer/replay_session.h"
#include "traces/trace_pack.h"

namespace lockstep::cli {
namespace {

struct ReplayArgs {
  std::string trace, output, mode = "exact", model, html, kv_cache, fault, backend, capture;
  std::vector<std::string> kernels;
  std::optional<double> temperature, top_p, min_p;
  std::optional<int64_t> top_k, emulate_tp;
  bool graft = false, json = false, quiet = false, allow_model_mismatch = false;
  double rel_l2 = 1e-3, kl = 1e-3;
};

Status RunReplay(const ReplayArgs& a) {
  LS_ASSIGN_OR_RETURN(auto trace, OpenTrace(a.trace));
  // A pack from someone else's machine: the manifest, the version and the model are checked
  // first, and each difference is named on its own line before the one-line refusal.
  if (auto pack = traces::ReadPack(*trace); pack.ok() || pack.status().code() != Status::Code::kNotFound) {
    if (!pack.ok()) return pack.status();
    LS_ASSIGN_OR_RETURN(std::vector<std::string> diffs, PackChecks(*trace, a.model));
    size_t refused = 0;
    for (const auto& d : diffs) {
      const bool model_line = d.rfind("model fingerprint:", 0) == 0 || d.rfind("model config:", 0) == 0 ||
                              d.rfind("tokenizer:", 0) == 0;
      std::cerr << "lockstep: " << a.trace << ": " << d << (model_line && a.allow_model_mismatch ? " (allowed)" : "")
                << "\n";
      if (!(model_line && a.allow_model_mismatch)) ++refused;
    }
    if (refused > 0) {
      return Status::InvalidArgument(a.trace + ": " + std::to_string(refused) +
                                     " difference(s) between the pack and this machine (above); nothing replayed");
    }
  }
  replayer::ReplayOptions o;
  LS_ASSIGN_OR_RETURN(o.mode, replayer::ParseReplayMode(a.mode));
  if (!a.backend.empty()) o.overrides.backend = a.backend;
  if (!a.kv_cache.empty()) {
    LS_ASSIGN_OR_RETURN(auto f, engine::ParseKvFormat(a.kv_cache));
    o.overrides.kv_cache = f;
  }
  for (const auto& k : a.kernels) LS_RETURN_IF_ERROR(kernels::ParseKernelOverride(k, &o.overrides.kernels));
  if (!a.fault.empty()) o.overrides.fault = a.fault == "none" ? "" : a.fault;
  // Kernel and fault names are checked now, not after the model has loaded.
  if (!o.overrides.kernels.empty() || o.overrides.fault) {
    std::string backend = a.backend;
    if (backend.empty()) {
      auto it = trace->meta().find("backend");
      backend = it != trace->meta().end() ? it->second : "cpu";
    }
    LS_RETURN_IF_ERROR(
        kernels::Registry::Get().Resolve(o.overrides.kernels, backend, o.overrides.fault.value_or("")).status());
  }
  o.overrides.temperature = a.temperature;
  o.overrides.top_p = a.top_p;
  o.overrides.top_k = a.top_k;
  o.overrides.min_p = a.min_p;
  o.overrides.emulate_tp = a.emulate_tp;
  if (o.mode == replayer::ReplayMode::kExact && !o.overrides.empty()) {
    return Status::InvalidArgument("--mode exact replays the recorded configuration; with overrides use --mode forced or free");
  }
  if (a.graft && o.mode == replayer::ReplayMode::kFree) {
    return Status::InvalidArgument("--graft needs the recorded positions: use --mode forced (or exact)");
  }
  if (!a.capture.empty()) {
    LS_ASSIGN_OR_RETURN(auto m, recorder::CapturePolicy::ParseMode(a.capture));
    o.capture = m;
  }
  o.graft = a.graft;
  o.model_dir = a.model;
  o.allow_model_mismatch = a.allow_model_mismatch;
  o.thresholds.rel_l2 = a.rel_l2;
  o.thresholds.kl = a.kl;
  o.output = a.output.empty() ? std::filesystem::path(a.trace).replace_extension(".replay.h5") : std::filesystem::path(a.output);
  {
    std::error_code ec;
    if (std::filesystem::equivalent(o.output, a.trace, ec)) {
      return Status::InvalidArgument("--output " + o.output.string() + " is the trace being replayed; name another file");
    }
  }
  Progress bar(!a.quiet && !a.json, "replaying (" + a.mode + ")", 0);
  if (bar.enabled()) {
    o.progress = [&bar, started = false, label = "replaying (" + a.mode + ")"](int64_t done, int64_t total) mutable {
      if (!started) bar.Restart(label, total);  // the total is known once the trace is read
      started = true;
      bar.Update(done);
    };
  }
  LS_ASSIGN_OR_RETURN(replayer::ReplayResult r, replayer::Replay(*trace, o));
  bar.Done();
  const Detokenize detok = TokenizerFromTrace(trace->meta());
  if (a.json) {
    nlohmann::json j = DiffJson(r.diff, detok);
    j["mode"] = a.mode;
    j["overrides"] = o.overrides.Describe();
    j["graft"] = a.graft;
    j["replay_trace"] = o.output.string();
    j["deterministic"] = r.deterministic;
    j["verdict"] = r.verdict;
    std::cout << JsonText(j, 2) << "\n";
  } else {
    std::printf("%s\n", r.verdict.c_str());
    if (!(r.diff.identical && !r.diff.has_divergence)) {
      std::printf("\n");
      PrintDiffText(r.diff, detok, false);
    }
    std::printf("\nreplay trace: %s (%lld tokens in %.2f s)\n", o.output.c_str(), static_cast<long long>(r.run.tokens),
                r.run.run_s);
  }
  if (!a.html.empty()) {
    std::ofstream out(a.html, std::ios::binary);
    out << DiffHtml(r.diff, detok, "lockstep replay (" + a.mode + ", " + o.overrides.Describe() + "): " + a.trace);
    if (!out) return Status::IoError(a.html + ": cannot write the HTML report");
  }
  if (o.mode == replayer::ReplayMode::kExact && !r.deterministic) ExitCode() = 3;
  return Status::Ok();
}

}  // namespace

void RegisterReplay(CLI::App& app, SetAction set_action) {
  auto a = std::make_shared<ReplayArgs>();
  CLI::App* cmd = app.add_subcommand("replay", "Rerun a trace exactly, or with one thing changed, and compare");
  cmd->footer(
      "Modes:\n"
      "  exact   the recorded configuration; proves bit-exactness or names the first differing tensor\n"
      "          (exit code 3 when not deterministic)\n"
      "  forced  teacher forcing: the recorded tokens are fed, so every position lines up under the overrides\n"
      "  free    sample anew from the recorded seeds under the overrides; report where the text first differs\n"
      "Examples:\n"
      "  lockstep replay run.h5                                   # is the run reproducible?\n"
      "  lockstep replay run.h5 --mode forced --kv-cache bf16     # does the FP8 cache explain it?\n"
      "  lockstep replay gpu.h5 --mode forced --backend cpu       # on the CPU: bit for bit if gemm=*_dot\n"
      "  lockstep replay run.h5 --mode forced --kernel attn_decode=expanded --graft --html report.html\n"
      "  lockstep replay run.h5 --mode free --temperature 0.6");
  cmd->add_option("trace", a->trace, "The recorded trace")->required();
  cmd->add_option("--output,-o", a->output, "Trace of the replay (default: <trace>.replay.h5)");
  cmd->add_option("--mode", a->mode, "exact | forced | free")->check(CLI::IsMember({"exact", "forced", "free"}));
  cmd->add_option("--model,-m", a->model, "Model directory (default: the trace's meta.model_dir)");
  cmd->add_option("--backend", a->backend,
                  "Replay on another backend: cpu | cuda (record on the GPU, replay on the CPU reference, diff)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--kv-cache", a->kv_cache, "Override the KV-cache format: fp32 | bf16 | fp8_e4m3")
      ->check(CLI::IsMember({"fp32", "bf16", "fp8_e4m3"}));
  cmd->add_option("--kernel", a->kernels, "Override a kernel variant op=variant (repeatable)");
  cmd->add_option("--fault", a->fault, "Replay with a fault-zoo variant, or 'none' to remove the recorded one");
  cmd->add_option("--temperature", a->temperature, "Override the sampling temperature, in [0, 1e6]")
      ->check(NumberIn(0, 1e6, "[0, 1e6]"));
  cmd->add_option("--top-p", a->top_p, "Override top-p")->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--top-k", a->top_k, "Override top-k, 0 to 2^26")->check(WholeIn(0, uint64_t{1} << 26, "0 to 2^26"));
  cmd->add_option("--min-p", a->min_p, "Override min-p")->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--emulate-tp", a->emulate_tp,
                  "Replay as tensor parallelism over N ranks emulated on the replay's device (1 = none; default: "
                  "the recorded degree): does TP=N's summation order explain a divergence? (docs/parallelism.md)")
      ->check(WholeIn(1, 64, "1 to 64"));
  cmd->add_option("--capture", a->capture,
                  "Capture mode of the replay's trace: full | summary | none (default: the recording's); an exact "
                  "replay with full upgrades a summary trace, its hashes checked against the recording's")
      ->check(CLI::IsMember({"full", "summary", "none"}));
  cmd->add_flag("--graft", a->graft, "Every layer takes its input from the trace (local vs propagated error)");
  cmd->add_option("--rel-l2", a->rel_l2, "Relative L2 error above which an activation diverges")->check(kNonNegative);
  cmd->add_option("--kl", a->kl, "KL (nats) above which logits diverge")->check(kNonNegative);
  cmd->add_option("--html", a->html, "Also write a self-contained HTML report");
  cmd->add_flag("--json", a->json, "Machine-readable report");
  cmd->add_flag("--quiet,-q", a->quiet, "No progress bar");
  cmd->add_flag("--allow-model-mismatch", a->allow_model_mismatch, "Replay on a model whose fingerprint differs");
  cmd->callback([a, set_action] { set_action([a] { return RunReplay(*a); }); });
}

}  // namespace lockstep::cli
