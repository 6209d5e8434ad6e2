// cli/degen.cc — `lockstep degen`: how often does generation degenerate, per setting?
//
// For each temperature, N samples per prompt (seeds --seed, --seed+1, …; one at temperature 0,
// where every seed gives the same tokens) run batched; each is
// judged by diff/degeneration.h: the repeated-suffix loop and distinct-n-gram collapse of the
// documented detector (docs/models.md), zstd compressibility of the text, and entropy collapse
// of the model's distribution over the tail. A table of rates per setting, or --json.
#include <cstdio>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "base/json_text.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/progress.h"
#include "cli/prompts.h"
#include "cli/table.h"
#include "diff/degeneration.h"
#include "recorder/record_session.h"

namespace lockstep::cli {
namespace {

using json = nlohmann::json;

struct DegenArgs {
  std::string model, prompt, prompts_file, prompt_ids;
  int64_t samples = 8;
  std::string temperatures = "0,0.6,1.0";
  bool json = false;
  bool quiet = false;
  std::string record_failures;
  EngineFlags flags;
};

struct Judged {
  std::string prompt_name;
  size_t prompt_index = 0;
  int64_t sample = 0;
  uint64_t seed = 0;
  std::vector<int32_t> tokens;
  std::string text;
  diff::Degeneration det;
  diff::TextSignals sig;
  bool degenerate = false;
  std::string finish_reason;
};

Result<std::vector<double>> ParseTemperatures(const std::string& s) {
  std::vector<double> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      const double t = std::stod(item, &used);
      if (used != item.size() || !(t >= 0) || t > 100) throw std::invalid_argument("");
      out.push_back(t);
    } catch (...) {
      return Status::InvalidArgument("--temperatures: '" + item + "' is not a temperature ≥ 0");
    }
  }
  if (out.empty()) return Status::InvalidArgument("--temperatures: empty list");
  return out;
}

Status RunDegen(DegenArgs& a) {
  // Everything that needs no model first: a typo must not wait for a load.
  LS_ASSIGN_OR_RETURN(std::vector<double> temps, ParseTemperatures(a.temperatures));
  LS_RETURN_IF_ERROR(a.flags.Validate());
  LS_RETURN_IF_ERROR(a.flags.RefuseRanks("degen"));
  LS_ASSIGN_OR_RETURN(std::vector<PromptSpec> specs, CollectPrompts(a.prompts_file, a.prompt, a.prompt_ids));
  if (a.samples <= 0) return Status::InvalidArgument("--samples: must be > 0");
  if (!a.record_failures.empty() && std::filesystem::exists(a.record_failures) &&
      !std::filesystem::is_directory(a.record_failures)) {
    return Status::InvalidArgument("--record-failures: " + a.record_failures + " exists and is not a directory");
  }
  LS_ASSIGN_OR_RETURN(LoadedModel m, LoadModel(a.model.empty() ? DefaultModelDir() : std::filesystem::path(a.model),
                                               a.quiet || a.json));
  LS_ASSIGN_OR_RETURN(engine::EngineOptions opts, a.flags.ToOptions());
  auto decode = [&](const std::vector<int32_t>& ids) {
    if (m.tokenizer) return m.tokenizer->Decode(ids);
    std::string s;
    for (int32_t t : ids) s += std::to_string(t) + " ";
    return s;
  };

  json report = json::array();
  Table table({"setting", "samples", "degenerate", "loop", "collapse", "zstd", "entropy", "mean distinct4",
               "mean H(tail)"},
              {false, true, true, true, true, true, true, true, true});
  const bool show = !a.quiet && !a.json;
  Progress progress(show, "", 0);
  for (double temp : temps) {
    LS_ASSIGN_OR_RETURN(auto eng, engine::Engine::Create(m.model, opts));
    std::vector<Judged> judged;
    // Greedy decoding is a function of the prompt alone: every seed gives the same tokens, so
    // one sample is the whole distribution (N copies would only weigh it N times).
    const int64_t samples = temp == 0 ? 1 : a.samples;
    for (size_t p = 0; p < specs.size(); ++p) {
      for (int64_t s = 0; s < samples; ++s) {
        LS_ASSIGN_OR_RETURN(engine::Request r, MakeRequest(specs[p], p, a.flags, m));
        r.sampling.temperature = temp;
        r.sampling.seed = a.flags.seed + static_cast<uint64_t>(p * samples + s);
        Judged j;
        j.prompt_name = specs[p].name;
        j.prompt_index = p;
        j.sample = s;
        j.seed = r.sampling.seed;
        judged.push_back(j);
        LS_RETURN_IF_ERROR(eng->AddRequest(std::move(r)).status());
      }
    }
    std::vector<std::vector<double>> entropies(judged.size());
    int64_t done_tokens = 0;  // generated so far, for the progress line
    eng->SetStepCallback([&](const engine::StepEvent& ev) {
      entropies[ev.request_id].push_back(diff::Entropy(eng->request(ev.request_id).last_logits));
      ++done_tokens;
    });
    const int64_t total = static_cast<int64_t>(judged.size()) * a.flags.max_tokens;  // at most
    progress.Restart(Format("T=%g, %lld sample%s", temp, static_cast<long long>(judged.size()),
                            judged.size() == 1 ? "" : "s"),
                     total);
    while (true) {
      LS_ASSIGN_OR_RETURN(bool more, eng->Step());
      if (!more) break;
      progress.Update(done_tokens);
    }
    progress.Done();
    int64_t n_deg = 0, n_loop = 0, n_col = 0, n_z = 0, n_ent = 0;
    double sum_distinct = 0, sum_h = 0;
    json per_sample = json::array();
    for (size_t i = 0; i < judged.size(); ++i) {
      Judged& j = judged[i];
      const auto& st = eng->request(static_cast<int64_t>(i));
      j.tokens = st.generated;
      j.finish_reason = st.finish_reason;
      j.text = decode(j.tokens);
      j.det = diff::DetectDegeneration(j.tokens);
      j.sig = diff::JudgeText(j.text, entropies[i]);
      j.degenerate = j.det.degenerate || j.sig.compressible || j.sig.entropy_collapse;
      n_deg += j.degenerate;
      n_loop += j.det.loop;
      n_col += j.det.collapse;
      n_z += j.sig.compressible;
      n_ent += j.sig.entropy_collapse;
      sum_distinct += j.det.distinct;
      sum_h += j.sig.tail_entropy;
      per_sample.push_back({{"prompt", j.prompt_name}, {"sample", j.sample}, {"seed", j.seed},
                         {"degenerate", j.degenerate}, {"loop", j.det.loop}, {"period", j.det.period},
                         {"periodic_len", j.det.periodic_len}, {"collapse", j.det.collapse},
                         {"distinct4", j.det.distinct}, {"zstd_ratio", j.sig.zstd_ratio},
                         {"compressible", j.sig.compressible}, {"tail_entropy", j.sig.tail_entropy},
                         {"entropy_collapse", j.sig.entropy_collapse}, {"tokens", j.tokens.size()},
                         {"finish_reason", j.finish_reason}, {"tail_text", Utf8Tail(j.text, 200)}});
    }
    const double n = static_cast<double>(judged.size());
    json setting = {{"temperature", temp},
                    {"samples", judged.size()},
                    {"greedy", temp == 0},
                    {"degenerate_rate", n_deg / n},
                    {"loop_rate", n_loop / n},
                    {"collapse_rate", n_col / n},
                    {"zstd_rate", n_z / n},
                    {"entropy_collapse_rate", n_ent / n},
                    {"mean_distinct4", sum_distinct / n},
                    {"mean_tail_entropy", sum_h / n},
                    {"kv_cache", a.flags.kv_cache},
                    {"kernels", eng->kernels()},
                    {"per_sample", per_sample}};
    // Traces of the degenerate samples: each is re-run alone with a recorder. Runs are
    // batch-invariant and sampling is a pure function of (seed, step), so the re-run must
    // reproduce the sample; a mismatch is reported, never silently kept.
    if (!a.record_failures.empty()) {
      std::filesystem::create_directories(a.record_failures);
      json files = json::array();
      int64_t to_record = 0, recorded_n = 0;
      for (const Judged& j : judged) to_record += j.degenerate;
      Progress rerun(show, Format("T=%g: recording the degenerate samples", temp), to_record, "traces");
      for (size_t i = 0; i < judged.size(); ++i) {
        const Judged& j = judged[i];
        if (!j.degenerate) continue;
        rerun.Update(recorded_n, "", /*force=*/true);
        LS_ASSIGN_OR_RETURN(auto reng, engine::Engine::Create(m.model, opts));
        engine::Request r = eng->request(static_cast<int64_t>(i)).request;
        recorder::RecordSessionOptions so;
        char name[128];
        std::snprintf(name, sizeof name, "degen-T%g-p%zu-s%lld.h5", temp, j.prompt_index, static_cast<long long>(j.sample));
        so.output = std::filesystem::path(a.record_failures) / name;
        so.policy.mode = recorder::CapturePolicy::Mode::kFull;
        so.flush_interval_s = 5.0;
        if (m.tokenizer) so.detokenize = [&m](const std::vector<int32_t>& ids) { return m.tokenizer->Decode(ids); };
        LS_ASSIGN_OR_RETURN(so.meta, ModelMeta(m));
        LS_RETURN_IF_ERROR(recorder::RecordRun(*reng, {{r, specs[j.prompt_index].text}}, so).status());
        const bool same = reng->request(0).generated == j.tokens;
        if (!same) {
          std::fprintf(stderr, "lockstep: WARNING: the re-run of %s did not reproduce the sample's tokens\n", name);
        }
        files.push_back({{"file", so.output.string()}, {"reproduced", same}});
        ++recorded_n;
      }
      rerun.Done();
      setting["recorded_failures"] = files;
      if (!a.json && !files.empty()) {
        std::fprintf(stderr, "lockstep: wrote %zu trace(s) of degenerate samples at T=%g to %s\n", files.size(), temp,
                     a.record_failures.c_str());
      }
    }
    report.push_back(setting);
    table.Add({Format("T=%g", temp), std::to_string(judged.size()) + (temp == 0 ? " (greedy)" : ""),
               Format("%.1f%%", 100 * n_deg / n), Format("%.1f%%", 100 * n_loop / n),
               Format("%.1f%%", 100 * n_col / n), Format("%.1f%%", 100 * n_z / n), Format("%.1f%%", 100 * n_ent / n),
               Format("%.3f", sum_distinct / n), Format("%.3f", sum_h / n)});
  }
  if (!a.json) {
    table.Print();
    std::printf(
        "\n"
        "degenerate: the share of samples where any of the four signals fired; loop, collapse, zstd and\n"
        "entropy: each signal's share (`lockstep degen --help` defines them). mean distinct4: distinct\n"
        "4-grams / all 4-grams of the tail (1 = no repeats); mean H(tail): the model's mean next-token\n"
        "entropy over the tail, nats. At temperature 0 every seed gives the same tokens: one greedy run\n"
        "per prompt.\n");
  }
  if (a.json) std::cout << JsonText(json{{"model", m.dir.string()}, {"settings", report}}, 2) << "\n";
  return Status::Ok();
}

}  // namespace

void RegisterDegen(CLI::App& app, SetAction set_action) {
  auto args = std::make_shared<DegenArgs>();
  args->flags.max_tokens = 256;
  CLI::App* cmd = app.add_subcommand("degen", "Measure how often generation degenerates, per sampling setting");
  cmd->footer(
      "Each sample is judged degenerate when any of these fire (window = last 128 tokens):\n"
      "  loop      a suffix that repeats with period ≤ 32 covers ≥ 50% of the window, or repeats ≥ 4 times\n"
      "            and covers ≥ 25% (a line seen four times in a row; docs/models.md)\n"
      "  collapse  distinct 4-grams / all 4-grams < 0.3\n"
      "  zstd      the text compresses below 0.15 of its size (≥ 256 bytes)\n"
      "  entropy   the model's mean next-token entropy over the last 64 steps < 0.1 nats\n"
      "Example: lockstep degen --prompt '<!DOCTYPE html>' --samples 16 --temperatures 0,0.6,1.0 --kv-cache fp8_e4m3");
  cmd->add_option("--model,-m", args->model, ModelOptionHelp());
  cmd->add_option("--prompt,-p", args->prompt, "Prompt text");
  cmd->add_option("--prompts", args->prompts_file, "JSONL file of prompts (see `lockstep generate --help`)");
  cmd->add_option("--prompt-ids", args->prompt_ids, "Prompt as comma-separated token ids");
  cmd->add_option("--samples", args->samples, "Samples per prompt and temperature, 1 to 2^20 (one at temperature 0: greedy runs are all alike)")
      ->check(WholeIn(1, 1 << 20, "1 to 2^20"));
  cmd->add_option("--temperatures", args->temperatures, "Comma-separated temperatures to compare");
  cmd->add_flag("--json", args->json, "Machine-readable report with every sample");
  cmd->add_flag("--quiet,-q", args->quiet, "No progress on stderr");
  cmd->add_option("--record-failures", args->record_failures,
                  "Write a full trace of every degenerate sample into this directory (re-run alone, verified)");
  args->flags.Register(cmd);
  cmd->callback([args, set_action] { set_action([args] { return RunDegen(*args); }); });
}

}  // namespace lockstep::cli
