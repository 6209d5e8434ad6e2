// cli/prompts.h — the prompts a run takes: --prompt TEXT, --prompt-ids 1,2,3 and --prompts
// FILE.jsonl ({"prompt": "…"} or {"prompt_ids": […]}, optionally with id, max_tokens,
// temperature, top_p, top_k, min_p, seed), turned into engine requests. Used by `record`
// and every other command that runs prompts.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "cli/common.h"
#include "engine/engine.h"

namespace lockstep::cli {

struct PromptSpec {
  std::string name;
  std::string text;          // empty when given as ids
  std::vector<int32_t> ids;  // filled from text by the tokenizer when empty
  std::optional<int64_t> max_tokens;
  std::optional<double> temperature, top_p, min_p;
  std::optional<int64_t> top_k;
  std::optional<uint64_t> seed;
};

Result<std::vector<int32_t>> ParsePromptIds(const std::string& s, const std::string& where);
Result<std::vector<PromptSpec>> ReadPromptsFile(const std::string& path);
// --prompts first, then --prompt, then --prompt-ids; at least one.
Result<std::vector<PromptSpec>> CollectPrompts(const std::string& prompts_file, const std::string& prompt,
                                               const std::string& prompt_ids);
// Request i of the run: the flags' defaults, the line's overrides, seed = --seed + i unless
// the line gives one; the text tokenized when no ids were given.
Result<engine::Request> MakeRequest(PromptSpec& p, size_t index, const EngineFlags& flags, const LoadedModel& m);

}  // namespace lockstep::cli
