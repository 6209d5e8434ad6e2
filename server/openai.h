// server/openai.h — the OpenAI API's request and response shapes, kept apart from HTTP and
// from the scheduler: parse a /v1/completions or /v1/chat/completions body into what the
// engine needs, and write the JSON the clients expect. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"
#include "server/chat_template.h"

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

// How a chat becomes prompt text. A model whose tokenizer_config.json has a chat_template gets
// that template, rendered by jinja2 as transformers renders it (server/chat_template.h): the
// bytes vLLM and sglang gave the model. The built-in formats remain for what has no Jinja
// template — DeepSeek-V3.2 ships a Python encoder (encoding/encoding_dsv32.py) instead — and
// for --chat-template, which forces one (a host without Python's jinja2, say); each equals
// transformers' rendering of its model's template for system/user/assistant text messages
// (tests/server/chat_template_test.cc checks them against the same fixtures), and refuses
// tool calls and tool results (400) rather than approximating them.
enum class ChatStyle {
  kNone,      // the model has no chat template: /v1/chat/completions answers 400
  kJinja,     // tokenizer_config.json's chat_template, rendered by jinja2
  kV2,        // DeepSeek-V2(-Lite)-Chat: "User: …\n\n", "Assistant: …<eos>", gen "Assistant:"
  kV3,        // DeepSeek-V3: systems joined by "\n\n" after bos, "<｜User｜>…", "<｜Assistant｜>…<｜end▁of▁sentence｜>"
  kV32,       // DeepSeek-V3.2 (encoding/encoding_dsv32.py, chat mode): "<｜User｜>…<｜Assistant｜></think>", "…<eos>"
  kEmbedded,  // the embedded tiny model's template: V3's markers, system text in place, no hoisting
};

struct ChatTemplate {
  ChatStyle style = ChatStyle::kEmbedded;
  std::string bos = "<｜begin▁of▁sentence｜>";  // tokenizer_config.json's bos_token / eos_token
  std::string eos = "<｜end▁of▁sentence｜>";
  std::shared_ptr<const JinjaTemplate> jinja;  // kJinja: the compiled template (shared by copies)

  // The prompt text for `messages` (OpenAI's shape; content a string or text parts, which are
  // joined), `tools` (null: none) and `kwargs` (chat_template_kwargs: more template variables),
  // ending where the assistant's reply begins (add_generation_prompt). InvalidArgument for
  // what the template or style refuses; IoError when the Jinja renderer failed.
  Result<std::string> Render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                             const nlohmann::ordered_json& kwargs) const;
  // Render without tools or variables.
  Result<std::string> Apply(const nlohmann::json& messages) const;
  // Whether a request's tool definitions reach the prompt: only a Jinja template that reads
  // `tools` renders them (DeepSeek's V2–V3.1 templates render tool calls and results, not
  // definitions).
  bool RendersTools() const { return style == ChatStyle::kJinja && jinja && jinja->uses_tools(); }

  // "jinja" | "deepseek-v2" | "deepseek-v3" | "deepseek-v3.2" | "lockstep-tiny" | "none".
  static std::string_view StyleName(ChatStyle s);
  static Result<ChatStyle> ParseStyle(std::string_view name);
  // The chat format of a model directory: `forced` (--chat-template) when not empty; else
  // tokenizer_config.json's chat_template (a string, or the "default" entry of a list),
  // compiled by jinja2 (an error when Python or jinja2 is missing or the template does not
  // compile, naming what to install and --chat-template); no chat_template and model_type
  // deepseek_v32 → V3.2's built-in encoding; no chat_template otherwise → kNone.
  static Result<ChatTemplate> Choose(const nlohmann::json& tokenizer_config, const std::string& model_type,
                                     const std::string& forced, const JinjaOptions& jinja_options = {});
  // What transformers passes to a template besides the conversation: the named special
  // tokens of tokenizer_config.json (bos_token, eos_token, unk_token, sep_token, pad_token,
  // cls_token, mask_token; a string or an AddedToken's content), the ones that are set.
  static nlohmann::json SpecialTokens(const nlohmann::json& tokenizer_config);
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
  // vLLM's extensions, for importers that need ids, not text (python3 -m lockstep import openai):
  bool tokens_as_ids = false;      // "return_tokens_as_token_ids": logprobs' tokens read "token_id:N"
  bool return_token_ids = false;   // "return_token_ids": choices carry prompt_token_ids and token_ids
  std::string capture;             // "" | "summary" | "full": header or body {"lockstep":{"capture":…}}
};

// Parses `body`; `capture_header` is X-Lockstep-Capture's value ("" when absent).
std::optional<ApiError> ParseGenerationRequest(const std::string& body, bool chat, const std::string& capture_header,
                                              const engine::Tokenizer& tok, const ChatTemplate& tmpl,
                                              const Limits& limits, GenerationRequest* out);

}  // namespace lockstep::server
