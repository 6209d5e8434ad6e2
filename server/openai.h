// server/openai.h — the OpenAI API's request and response shapes, kept apart from HTTP and
// from the scheduler: parse a /v1/completions or /v1/chat/completions body into what the
// engine needs, and write the JSON the clients expect. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"

namespace lockstep::server {

// An error as the API reports it: HTTP status + {"error":{"message","type","param","code"}}.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // "" → null
  std::string code;   // "" → null
  std::string Body() const;
};

struct Limits {
  int64_t max_prompt_tokens = 4096;
  int64_t max_tokens = 4096;      // per choice
  int64_t default_max_tokens = 16;
  int max_n = 8;
  int max_stop = 4;
};

struct ChatTemplate {
  // The DeepSeek chat format, which the embedded tiny model's tokenizer_config.json also uses:
  // bos, then "<｜User｜>content" / "<｜Assistant｜>content<｜end▁of▁sentence｜>" / system
  // content verbatim, then "<｜Assistant｜>". A Jinja interpreter is out of scope; a model
  // whose template is not this one is refused at start-up rather than templated wrongly.
  std::string bos = "<｜begin▁of▁sentence｜>";
  std::string eos = "<｜end▁of▁sentence｜>";
  std::string Apply(const nlohmann::json& messages) const;
};

struct GenerationRequest {
  bool chat = false;
  std::string model;
  std::string prompt_text;         // the text given (chat: after the template)
  std::vector<int32_t> prompt;
  int64_t max_tokens = 16;
  engine::SamplingParams sampling;
  int n = 1;
  std::vector<std::string> stop;
  int top_logprobs = -1;           // −1: no logprobs
  bool stream = false;
  bool include_usage = false;
  bool ignore_eos = false;         // lockstep extension (body "ignore_eos", as vLLM)
  std::string capture;             // "" | "summary" | "full": header or body {"lockstep":{"capture":…}}
};

// Parses `body`; `capture_header` is X-Lockstep-Capture's value ("" when absent).
std::optional<ApiError> ParseGenerationRequest(const std::string& body, bool chat, const std::string& capture_header,
                                              const engine::Tokenizer& tok, const ChatTemplate& tmpl,
                                              const Limits& limits, GenerationRequest* out);

}  // namespace lockstep::server
