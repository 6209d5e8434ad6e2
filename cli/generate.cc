// cli/generate.cc — `lockstep generate`: run prompts through the engine, stream the text.
#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "base/json_text.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/prompts.h"

namespace lockstep::cli {
namespace {

using json = nlohmann::json;

struct GenerateArgs {
  std::string model;
  std::string prompt;
  std::string prompts_file;
  std::string prompt_ids;
  bool json = false;
  bool echo = false;
  bool quiet = false;
  bool random_weights = false;
  std::string prompt_logits;  // --prompt-logits FILE
  EngineFlags flags;
};

Status RunGenerate(GenerateArgs& a) {
  // Everything that needs no model first: a typo must not wait for a load.
  LS_RETURN_IF_ERROR(a.flags.Validate());
  LS_ASSIGN_OR_RETURN(std::vector<PromptSpec> specs, CollectPrompts(a.prompts_file, a.prompt, a.prompt_ids));
  LS_ASSIGN_OR_RETURN(LoadedModel m, LoadModel(a.model.empty() ? DefaultModelDir() : std::filesystem::path(a.model), a.quiet || a.json,
                                                a.random_weights));
  LS_ASSIGN_OR_RETURN(const std::string note, a.flags.ApplyGenerationConfig(m.dir));
  if (!note.empty() && !a.quiet && !a.json) std::cerr << "lockstep: " << note << "\n";
  LS_ASSIGN_OR_RETURN(engine::EngineOptions opts, a.flags.ToOptions());
  std::vector<engine::Request> requests;
  int64_t prompt_tokens = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    LS_ASSIGN_OR_RETURN(engine::Request r, MakeRequest(specs[i], i, a.flags, m));
    r.keep_logits = false;  // only tokens are printed: the device sampler's rows stay on the GPU
    r.all_prompt_logits = !a.prompt_logits.empty();
    prompt_tokens += static_cast<int64_t>(r.prompt.size());
    requests.push_back(std::move(r));
  }
  // --tp-ranks N: ranks 1 … N − 1 run beside this engine (rank 0). Nothing taps a generation: the
  // ranks need not gather the heads' tensors.
  opts.tp_gather_taps = false;
  LS_ASSIGN_OR_RETURN(RankedEngine ranked, CreateRankedEngine(m.model, opts, a.flags, requests));
  std::unique_ptr<engine::Engine> eng = std::move(ranked.engine);
  for (engine::Request& r : requests) LS_RETURN_IF_ERROR(eng->AddRequest(std::move(r)).status());

  // Stream a lone request's text as it comes; hold back an unfinished UTF-8 sequence.
  const bool stream = specs.size() == 1 && !a.json;
  size_t printed = 0;
  if (stream && a.echo) std::cout << (specs[0].text.empty() ? "" : specs[0].text) << std::flush;
  auto decode = [&](const std::vector<int32_t>& ids) {
    if (m.tokenizer) return m.tokenizer->Decode(ids);
    std::string s;
    for (size_t i = 0; i < ids.size(); ++i) s += (i ? " " : "") + std::to_string(ids[i]);
    return s;
  };
  int64_t generated = 0;
  auto t0 = std::chrono::steady_clock::now();
  std::optional<std::chrono::steady_clock::time_point> first_token;
  eng->SetStepCallback([&](const engine::StepEvent& ev) {
    ++generated;
    if (!first_token) first_token = std::chrono::steady_clock::now();
    if (!stream) return;
    std::string text = decode(eng->request(ev.request_id).generated);
    if (!ev.finished && text.size() >= 3 && text.compare(text.size() - 3, 3, "\xEF\xBF\xBD") == 0) return;
    if (text.size() > printed) {
      std::cout << text.substr(printed) << std::flush;
      printed = text.size();
    }
  });
  {
    const Status ran = eng->RunToCompletion();
    LS_RETURN_IF_ERROR(ranked.Finish(ran));
  }
  auto t1 = std::chrono::steady_clock::now();
  const double total_s = std::chrono::duration<double>(t1 - t0).count();
  const double decode_s = first_token ? std::chrono::duration<double>(t1 - *first_token).count() : 0;
  const int64_t decode_tokens = generated - static_cast<int64_t>(specs.size());

  if (stream) std::cout << "\n";
  if (!a.prompt_logits.empty()) {  // one JSON line a request: the logits at every prompt position
    std::ofstream out(a.prompt_logits);
    if (!out) return Status::IoError(a.prompt_logits + ": cannot write (--prompt-logits)");
    for (int64_t id = 0; id < eng->num_requests(); ++id) {
      const engine::RequestState& r = eng->request(id);
      const size_t V = static_cast<size_t>(m.model->config().vocab_size);
      json rows = json::array();
      for (size_t p = 0; p + 1 <= r.prompt_logits.size() / V; ++p) {
        rows.push_back(std::vector<float>(r.prompt_logits.begin() + p * V, r.prompt_logits.begin() + (p + 1) * V));
      }
      out << JsonText(json{{"id", r.request.name}, {"prompt_ids", r.request.prompt}, {"logits", rows}}) << "\n";
    }
    if (!out) return Status::IoError(a.prompt_logits + ": write failed (--prompt-logits)");
  }
  for (int64_t id = 0; id < eng->num_requests(); ++id) {
    const engine::RequestState& r = eng->request(id);
    if (a.json) {
      json j = {{"id", r.request.name},
                {"prompt_tokens", r.request.prompt.size()},
                {"completion", decode(r.generated)},
                {"completion_tokens", r.generated.size()},
                {"tokens", r.generated},
                {"finish_reason", r.finish_reason},
                {"seed", r.request.sampling.seed}};
      if (!specs[id].text.empty()) j["prompt"] = specs[id].text;
      std::cout << JsonText(j) << "\n";
    } else if (!stream) {
      std::cout << "=== request " << r.request.name << " (" << r.generated.size() << " tokens, " << r.finish_reason
                << ") ===\n"
                << decode(r.generated) << "\n";
    }
  }
  if (!a.quiet) {
    std::fprintf(stderr,
                 "lockstep: %lld prompt + %lld generated tokens in %.2f s; decode %.1f tokens/s (%lld requests, "
                 "kv-cache %s)\n",
                 static_cast<long long>(prompt_tokens), static_cast<long long>(generated), total_s,
                 decode_s > 0 ? decode_tokens / decode_s : 0.0, static_cast<long long>(specs.size()),
                 a.flags.kv_cache.c_str());
  }
  return Status::Ok();
}

}  // namespace

void RegisterGenerate(CLI::App& app, SetAction set_action) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate text from prompts and stream it");
  cmd->footer(
      "Examples:\n"
      "  lockstep generate --prompt '<!DOCTYPE html>' -n 128 --temperature 0.6 --seed 7\n"
      "  lockstep generate --prompts prompts.jsonl --kv-cache fp8_e4m3 --json\n"
      "JSONL lines: {\"prompt\": \"…\"} or {\"prompt_ids\": [1,2,3]}, optionally with id, max_tokens,\n"
      "temperature, top_p, top_k, min_p, seed. Requests run batched; each one's tokens are the same\n"
      "as if it ran alone.");
  cmd->add_option("--model,-m", args->model, ModelOptionHelp());
  cmd->add_option("--prompt,-p", args->prompt, "Prompt text");
  cmd->add_option("--prompts", args->prompts_file, "JSONL file of prompts");
  cmd->add_option("--prompt-ids", args->prompt_ids, "Prompt as comma-separated token ids");
  cmd->add_flag("--json", args->json, "One JSON object per request on stdout instead of text");
  cmd->add_option("--prompt-logits", args->prompt_logits,
                  "Write the logits at every prompt position to FILE (JSONL: id, prompt_ids, logits [T][vocab])");
  cmd->add_flag("--echo", args->echo, "Print the prompt before the streamed completion");
  cmd->add_flag("--quiet,-q", args->quiet, "No progress or statistics on stderr");
  cmd->add_flag("--random-weights", args->random_weights,
                "Only config.json (and tokenizer.json) are read; the GPU makes every weight from a fixed seed. "
                "For speed runs of published shapes without their checkpoints; needs --backend cuda");
  args->flags.Register(cmd);
  cmd->callback([args, set_action] { set_action([args] { return RunGenerate(*args); }); });
}

}  // namespace lockstep::cli
