// cli/prompts.cc — see prompts.h.
#include "cli/prompts.h"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace lockstep::cli {

using json = nlohmann::json;

Result<std::vector<int32_t>> ParsePromptIds(const std::string& s, const std::string& where) {
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
  if (ids.empty()) return Status::InvalidArgument(where + ": no token ids");
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
    // A number in its range, else an error naming the field.
    auto num = [&](const char* k, auto* dst, const FieldRange& r) -> Status {
      if (!field(k)) return Status::Ok();
      if (!InRange(j[k], r)) {
        return Status::InvalidArgument(where + ": field '" + k + "' must be " + r.text + ", not " + j[k].dump());
      }
      *dst = j[k].get<typename std::remove_reference_t<decltype(*dst)>::value_type>();
      return Status::Ok();
    };
    LS_RETURN_IF_ERROR(num("max_tokens", &p.max_tokens, kMaxTokensRange));
    LS_RETURN_IF_ERROR(num("temperature", &p.temperature, kTemperatureRange));
    LS_RETURN_IF_ERROR(num("top_p", &p.top_p, kTopPRange));
    LS_RETURN_IF_ERROR(num("min_p", &p.min_p, kMinPRange));
    LS_RETURN_IF_ERROR(num("top_k", &p.top_k, kTopKRange));
    LS_RETURN_IF_ERROR(num("seed", &p.seed, kSeedRange));
    out.push_back(std::move(p));
  }
  if (out.empty()) return Status::InvalidArgument(path + ": no prompts");
  return out;
}

Result<std::vector<PromptSpec>> CollectPrompts(const std::string& prompts_file, const std::string& prompt,
                                               const std::string& prompt_ids) {
  std::vector<PromptSpec> specs;
  if (!prompts_file.empty()) {
    LS_ASSIGN_OR_RETURN(specs, ReadPromptsFile(prompts_file));
  }
  if (!prompt.empty()) {
    PromptSpec p;
    p.name = std::to_string(specs.size());
    p.text = prompt;
    specs.push_back(p);
  }
  if (!prompt_ids.empty()) {
    PromptSpec p;
    p.name = std::to_string(specs.size());
    LS_ASSIGN_OR_RETURN(p.ids, ParsePromptIds(prompt_ids, "--prompt-ids"));
    specs.push_back(p);
  }
  if (specs.empty()) return Status::InvalidArgument("no prompt: give --prompt TEXT, --prompts FILE.jsonl or --prompt-ids");
  return specs;
}

Result<engine::Request> MakeRequest(PromptSpec& p, size_t index, const EngineFlags& flags, const LoadedModel& m) {
  if (p.ids.empty()) {
    if (!m.tokenizer) {
      return Status::NotFound(m.dir.string() + ": no tokenizer.json, so prompts must be given as --prompt-ids");
    }
    p.ids = m.tokenizer->Encode(p.text, /*add_special_tokens=*/!flags.no_special_tokens);
  }
  engine::Request r;
  r.name = p.name;
  r.prompt = p.ids;
  r.max_new_tokens = p.max_tokens.value_or(flags.max_tokens);
  r.sampling = flags.Sampling();
  if (!p.seed && flags.seed > UINT64_MAX - index) {
    return Status::InvalidArgument("prompt " + std::to_string(index) + " ('" + p.name + "'): --seed " +
                                   std::to_string(flags.seed) + " + " + std::to_string(index) +
                                   " passes 2^64 - 1; give a smaller --seed (or a \"seed\" field)");
  }
  r.sampling.seed = flags.seed + index;
  if (p.temperature) r.sampling.temperature = *p.temperature;
  if (p.top_p) r.sampling.top_p = *p.top_p;
  if (p.top_k) r.sampling.top_k = *p.top_k;
  if (p.min_p) r.sampling.min_p = *p.min_p;
  if (p.seed) r.sampling.seed = *p.seed;
  if (!flags.ignore_eos) r.stop_tokens = m.eos_ids;
  return r;
}

}  // namespace lockstep::cli
