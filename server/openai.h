// server/openai.h — the OpenAI API's request and response shapes, kept apart from HTTP and
// from the scheduler: parse a /v1/completions or /v1/chat/completions body into what the
// engine needs, and write the JSON the clients expect. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
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

// The DeepSeek chat formats, built in (there is no Jinja interpreter). Each style renders
// what transformers' apply_chat_template(messages, add_generation_prompt=True) gives with the
// model's own template, for system/user/assistant text messages; tool calls and tool results
// are refused (400) rather than rendered approximately.
enum class ChatStyle {
  kNone,      // the model has no chat template: /v1/chat/completions answers 400
  kV2,        // DeepSeek-V2(-Lite)-Chat: "User: …\n\n", "Assistant: …<eos>", gen "Assistant:"
  kV3,        // DeepSeek-V3: systems joined by "\n\n" after bos, "<｜User｜>…", "<｜Assistant｜>…<｜end▁of▁sentence｜>"
  kV32,       // DeepSeek-V3.2 (encoding/encoding_dsv32.py, chat mode): "<｜User｜>…<｜Assistant｜></think>", "…<eos>"
  kEmbedded,  // the embedded tiny model's template: V3's markers, system text in place, no hoisting
};

struct ChatTemplate {
  ChatStyle style = ChatStyle::kEmbedded;
  std::string bos = "<｜begin▁of▁sentence｜>";  // tokenizer_config.json's bos_token / eos_token
  std::string eos = "<｜end▁of▁sentence｜>";

  // The prompt text for `messages` (OpenAI's shape; content a string or text parts), ending
  // where the assistant's reply begins. InvalidArgument for what the style cannot render.
  Result<std::string> Apply(const nlohmann::json& messages) const;

  // "deepseek-v2" | "deepseek-v3" | "deepseek-v3.2" | "lockstep-tiny" | "none".
  static std::string_view StyleName(ChatStyle s);
  static Result<ChatStyle> ParseStyle(std::string_view name);
  // The style of a model directory: `forced` (--chat-template) when not empty; else the one
  // whose template tokenizer_config.json's chat_template is (recognised by fingerprints of
  // the published templates, docs/server.md); no chat_template and model_type deepseek_v32
  // → V3.2 (DeepSeek ships that model with a Python encoder, not a template); no
  // chat_template otherwise → kNone. A template that is none of these is an error: serving
  // it with the wrong format would silently degrade every chat reply.
  static Result<ChatTemplate> Choose(const nlohmann::json& tokenizer_config, const std::string& model_type,
                                     const std::string& forced);
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
