// cli/generate.cc — `lockstep generate`: run prompts through the engine, stream the text.
#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/common.h"

namespace lockstep::cli {
namespace {

using json = nlohmann::json;

struct PromptSpec {
  std::string name;
  std::string text;          // empty when given as ids
  std::vector<int32_t> ids;  // filled from text by the tokenizer when empty
  std::optional<int64_t> max_tokens;
  std::optional<double> temperature, top_p, min_p;
  std::optional<int64_t> top_k;
  std::optional<uint64_t> seed;
};

Result<std::vector<int32_t>> ParseIds(const std::string& s, const std::string& where) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      long v = std::stol(item, &used);
      if (used != item.size() || v < 0 || v > INT32_MAX) throw std::out_of_range("");
      ids.push_back(static_cast<int32_t>(v));
    } catch (...) {
      return Status::InvalidArgument(where + ": '" + item + "' is not a token id");
    }
  }
  return ids;
}

Result<std::vector<PromptSpec>> ReadPromptsFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound(path + ": cannot open");
  std::vector<PromptSpec> out;
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(lineno);
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return Status::InvalidArgument(where + ": not a JSON object");
    PromptSpec p;
    p.name = std::to_string(out.size());
    auto field = [&](const char* k) { return j.contains(k) && !j[k].is_null(); };
    if (field("id")) p.name = j["id"].is_string() ? j["id"].get<std::string>() : j["id"].dump();
    if (field("prompt")) {
      if (!j["prompt"].is_string()) return Status::InvalidArgument(where + ": field 'prompt' must be a string");
      p.text = j["prompt"].get<std::string>();
    } else if (field("prompt_ids")) {
      if (!j["prompt_ids"].is_array()) return Status::InvalidArgument(where + ": field 'prompt_ids' must be an array");
      for (const auto& v : j["prompt_ids"]) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX) {
          return Status::InvalidArgument(where + ": field 'prompt_ids' must hold token ids");
        }
        p.ids.push_back(v.get<int32_t>());
      }
    } else {
      return Status::InvalidArgument(where + ": needs a 'prompt' or 'prompt_ids' field");
    }
    auto num = [&](const char* k, auto* dst) -> Status {
      if (!field(k)) return Status::Ok();
      if (!j[k].is_number()) return Status::InvalidArgument(where + ": field '" + k + "' must be a number");
      using T = typename std::remove_reference_t<decltype(*dst)>::value_type;
      *dst = j[k].get<T>();
      return Status::Ok();
    };
    LS_RETURN_IF_ERROR(num("max_tokens", &p.max_tokens));
    LS_RETURN_IF_ERROR(num("temperature", &p.temperature));
    LS_RETURN_IF_ERROR(num("top_p", &p.top_p));
    LS_RETURN_IF_ERROR(num("min_p", &p.min_p));
    LS_RETURN_IF_ERROR(num("top_k", &p.top_k));
    LS_RETURN_IF_ERROR(num("seed", &p.seed));
    out.push_back(std::move(p));
  }
  if (out.empty()) return Status::InvalidArgument(path + ": no prompts");
  return out;
}

struct GenerateArgs {
  std::string model;
  std::string prompt;
  std::string prompts_file;
  std::string prompt_ids;
  bool json = false;
  bool echo = false;
  bool quiet = false;
  bool no_special = false;
  EngineFlags flags;
};

Status RunGenerate(GenerateArgs& a) {
  LS_ASSIGN_OR_RETURN(LoadedModel m, LoadModel(a.model.empty() ? DefaultModelDir() : std::filesystem::path(a.model), a.quiet || a.json));
  const std::string note = a.flags.ApplyGenerationConfig(m.dir);
  if (!note.empty() && !a.quiet && !a.json) std::cerr << "lockstep: " << note << "\n";
  std::vector<PromptSpec> specs;
  if (!a.prompts_file.empty()) {
    LS_ASSIGN_OR_RETURN(specs, ReadPromptsFile(a.prompts_file));
  }
  if (!a.prompt.empty()) {
    PromptSpec p;
    p.name = std::to_string(specs.size());
    p.text = a.prompt;
    specs.push_back(p);
  }
  if (!a.prompt_ids.empty()) {
    PromptSpec p;
    p.name = std::to_string(specs.size());
    LS_ASSIGN_OR_RETURN(p.ids, ParseIds(a.prompt_ids, "--prompt-ids"));
    specs.push_back(p);
  }
  if (specs.empty()) return Status::InvalidArgument("no prompt: give --prompt TEXT, --prompts FILE.jsonl or --prompt-ids");

  LS_ASSIGN_OR_RETURN(engine::EngineOptions opts, a.flags.ToOptions());
  LS_ASSIGN_OR_RETURN(auto eng, engine::Engine::Create(m.model, opts));
  int64_t prompt_tokens = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    PromptSpec& p = specs[i];
    if (p.ids.empty()) {
      if (!m.tokenizer) {
        return Status::NotFound(m.dir.string() + ": no tokenizer.json, so prompts must be given as --prompt-ids");
      }
      p.ids = m.tokenizer->Encode(p.text, /*add_special_tokens=*/!a.no_special);
    }
    engine::Request r;
    r.name = p.name;
    r.prompt = p.ids;
    r.max_new_tokens = p.max_tokens.value_or(a.flags.max_tokens);
    r.sampling = a.flags.Sampling();
    r.sampling.seed = a.flags.seed + i;
    if (p.temperature) r.sampling.temperature = *p.temperature;
    if (p.top_p) r.sampling.top_p = *p.top_p;
    if (p.top_k) r.sampling.top_k = *p.top_k;
    if (p.min_p) r.sampling.min_p = *p.min_p;
    if (p.seed) r.sampling.seed = *p.seed;
    if (!a.flags.ignore_eos) r.stop_tokens = m.eos_ids;
    prompt_tokens += static_cast<int64_t>(r.prompt.size());
    LS_RETURN_IF_ERROR(eng->AddRequest(std::move(r)).status());
  }

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
  LS_RETURN_IF_ERROR(eng->RunToCompletion());
  auto t1 = std::chrono::steady_clock::now();
  const double total_s = std::chrono::duration<double>(t1 - t0).count();
  const double decode_s = first_token ? std::chrono::duration<double>(t1 - *first_token).count() : 0;
  const int64_t decode_tokens = generated - static_cast<int64_t>(specs.size());

  if (stream) std::cout << "\n";
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
      std::cout << j.dump() << "\n";
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
  cmd->add_option("--model,-m", args->model, "Model directory (HF layout); default: the embedded tiny model");
  cmd->add_option("--prompt,-p", args->prompt, "Prompt text");
  cmd->add_option("--prompts", args->prompts_file, "JSONL file of prompts");
  cmd->add_option("--prompt-ids", args->prompt_ids, "Prompt as comma-separated token ids");
  cmd->add_flag("--json", args->json, "One JSON object per request on stdout instead of text");
  cmd->add_flag("--echo", args->echo, "Print the prompt before the streamed completion");
  cmd->add_flag("--quiet,-q", args->quiet, "No progress or statistics on stderr");
  cmd->add_flag("--no-special-tokens", args->no_special,
                "Encode prompts without the tokenizer's template (no BOS); the default adds it, like transformers");
  args->flags.Register(cmd);
  cmd->callback([args, set_action] { set_action([args] { return RunGenerate(*args); }); });
}

}  // namespace lockstep::cli
