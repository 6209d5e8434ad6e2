// server/openai.cc — see openai.h.
#include "base/json_text.h"
#include "server/openai.h"

#include <cmath>
#include <optional>

namespace lockstep::server {

using json = nlohmann::json;

std::string ApiError::Body() const {
  json e = {{"message", message},
            {"type", type},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}};
  return JsonText(json{{"error", e}});
}

namespace {

// o[key] when it is a string, else "" (for fields already checked, or optional ones).
template <typename Json>
std::string StringAt(const Json& o, const char* key) {
  return o.is_object() && o.contains(key) && o[key].is_string() ? o[key].template get<std::string>() : std::string();
}

// What Render takes of a message: an object with a string role, and content absent, null, a
// string, or an array of text parts {"type": "text", "text": "…"} — an image or other part is
// refused rather than dropped, which would change what the user asked.
template <typename Json>
Status CheckMessage(const Json& m) {
  if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
    return Status::InvalidArgument("each message needs a string 'role'");
  }
  if (!m.contains("content") || m["content"].is_null() || m["content"].is_string()) return Status::Ok();
  if (!m["content"].is_array()) {
    return Status::InvalidArgument("a message's 'content' must be a string or an array of text parts");
  }
  for (const auto& part : m["content"]) {
    if (!part.is_object() || StringAt(part, "type") != "text" || !part.contains("text") || !part["text"].is_string()) {
      return Status::InvalidArgument(
          "message content parts must be text parts ({\"type\": \"text\", \"text\": \"…\"}); this server "
          "takes no images, audio or files");
    }
  }
  return Status::Ok();
}

// A message's text (CheckMessage has passed): the string, or its text parts joined; null → "".
template <typename Json>
std::string Content(const Json& m) {
  std::string content;
  if (!m.contains("content")) return content;
  const auto& c = m["content"];
  if (c.is_string()) return c.template get<std::string>();
  if (c.is_array()) {
    for (const auto& part : c) content += StringAt(part, "text");
  }
  return content;
}

// The built-in formats (ChatStyle other than kJinja) on checked messages.
std::string RenderBuiltIn(ChatStyle style, const std::string& bos, const std::string& eos, const json& messages) {
  std::string s = bos;
  switch (style) {
    case ChatStyle::kV2:  // roles other than these three render nothing, as in the template
      for (const auto& m : messages) {
        const std::string role = StringAt(m, "role");
        if (role == "user") s += "User: " + Content(m) + "\n\n";
        else if (role == "assistant") s += "Assistant: " + Content(m) + eos;
        else if (role == "system") s += Content(m) + "\n\n";
      }
      return s + "Assistant:";
    case ChatStyle::kV3: {
      bool first = true;
      for (const auto& m : messages) {  // every system prompt, joined, right after bos
        if (StringAt(m, "role") != "system") continue;
        s += (first ? "" : "\n\n") + Content(m);
        first = false;
      }
      for (const auto& m : messages) {
        const std::string role = StringAt(m, "role");
        if (role == "user") s += "<｜User｜>" + Content(m);
        else if (role == "assistant") s += "<｜Assistant｜>" + Content(m) + "<｜end▁of▁sentence｜>";
      }
      return s + "<｜Assistant｜>";
    }
    case ChatStyle::kV32:  // chat (non-thinking) mode; the user turn opens the assistant's
      for (const auto& m : messages) {
        const std::string role = StringAt(m, "role");
        if (role == "system") s += Content(m);
        else if (role == "user") s += "<｜User｜>" + Content(m) + "<｜Assistant｜></think>";
        else if (role == "assistant") s += Content(m) + "<｜end▁of▁sentence｜>";
      }
      return s;
    case ChatStyle::kEmbedded:
      for (const auto& m : messages) {
        const std::string role = StringAt(m, "role");
        if (role == "user") s += "<｜User｜>" + Content(m);
        else if (role == "assistant") s += "<｜Assistant｜>" + Content(m) + "<｜end▁of▁sentence｜>";
        else s += Content(m);
      }
      return s + "<｜Assistant｜>";
    case ChatStyle::kNone:
    case ChatStyle::kJinja:
      break;
  }
  return s;
}

// A special token's text in tokenizer_config.json: a string, or an AddedToken {"content": …}.
std::optional<std::string> TokenText(const json& config, const char* key) {
  if (!config.is_object() || !config.contains(key)) return std::nullopt;
  const auto& v = config[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return std::nullopt;
}

}  // namespace

std::string_view ChatTemplate::StyleName(ChatStyle s) {
  switch (s) {
    case ChatStyle::kNone: return "none";
    case ChatStyle::kJinja: return "jinja";
    case ChatStyle::kV2: return "deepseek-v2";
    case ChatStyle::kV3: return "deepseek-v3";
    case ChatStyle::kV32: return "deepseek-v3.2";
    case ChatStyle::kEmbedded: return "lockstep-tiny";
  }
  return "?";
}

Result<ChatStyle> ChatTemplate::ParseStyle(std::string_view name) {
  for (ChatStyle s : {ChatStyle::kNone, ChatStyle::kV2, ChatStyle::kV3, ChatStyle::kV32, ChatStyle::kEmbedded}) {
    if (name == StyleName(s)) return s;
  }
  return Status::InvalidArgument("--chat-template '" + std::string(name) +
                                 "': expected deepseek-v2, deepseek-v3, deepseek-v3.2, lockstep-tiny or none (without "
                                 "the flag, tokenizer_config.json's chat_template is rendered)");
}

json ChatTemplate::SpecialTokens(const json& config) {
  json v = json::object();
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    if (auto text = TokenText(config, key)) v[key] = *text;
  }
  return v;
}

Result<ChatTemplate> ChatTemplate::Choose(const json& config, const std::string& model_type, const std::string& forced,
                                          const JinjaOptions& jinja_options) {
  ChatTemplate t;
  if (auto b = TokenText(config, "bos_token")) t.bos = *b;
  if (auto e = TokenText(config, "eos_token")) t.eos = *e;
  if (!forced.empty()) {
    LS_ASSIGN_OR_RETURN(t.style, ParseStyle(forced));
    return t;
  }
  std::string tmpl;
  if (config.is_object() && config.contains("chat_template")) {
    const auto& c = config["chat_template"];
    if (c.is_string()) {
      tmpl = c.get<std::string>();
    } else if (c.is_array()) {  // [{"name": "default", "template": …}, …]
      for (const auto& e : c) {
        if (StringAt(e, "name") == "default" && e.contains("template") && e["template"].is_string()) {
          tmpl = e["template"].get<std::string>();
        }
      }
    }
  }
  if (tmpl.empty()) {
    t.style = model_type == "deepseek_v32" ? ChatStyle::kV32 : ChatStyle::kNone;
    return t;
  }
  auto compiled = JinjaTemplate::Compile(tmpl, SpecialTokens(config), jinja_options);
  if (!compiled.ok()) {
    const std::string msg = compiled.status().message() +
                            " — the server renders a model's own chat template and will not guess one; to serve it "
                            "with a built-in format instead, pass --chat-template "
                            "deepseek-v2|deepseek-v3|deepseek-v3.2|lockstep-tiny (or none: completions only)";
    switch (compiled.status().code()) {
      case Status::Code::kNotFound: return Status::NotFound(msg);
      case Status::Code::kInvalidArgument: return Status::InvalidArgument(msg);
      default: return Status::IoError(msg);
    }
  }
  t.style = ChatStyle::kJinja;
  t.jinja = *compiled;
  return t;
}

Result<std::string> ChatTemplate::Render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                         const nlohmann::ordered_json& kwargs) const {
  if (style == ChatStyle::kNone) {
    return Status::InvalidArgument(
        "this model has no chat template: use /v1/completions, or start the server with --chat-template");
  }
  if (!messages.is_array()) return Status::InvalidArgument("'messages' must be an array");
  for (const auto& m : messages) LS_RETURN_IF_ERROR(CheckMessage(m));
  if (style == ChatStyle::kJinja) {
    if (!jinja) return Status::Internal("chat template not compiled");
    // What the template sees: each message as sent (tool_calls, reasoning_content, name, … in
    // the client's key order), text parts joined into one string.
    nlohmann::ordered_json conv = nlohmann::ordered_json::array();
    for (const auto& m : messages) {
      nlohmann::ordered_json c = m;
      if (m.contains("content") && m["content"].is_array()) c["content"] = Content(m);
      conv.push_back(std::move(c));
    }
    return jinja->Render(conv, tools, /*add_generation_prompt=*/true, kwargs);
  }
  if (!tools.is_null() && !(tools.is_array() && tools.empty())) {
    return Status::InvalidArgument("the " + std::string(StyleName(style)) +
                                   " chat format renders no tool definitions ('tools')");
  }
  if (!kwargs.is_null() && !kwargs.empty()) {
    return Status::InvalidArgument("'chat_template_kwargs' needs the model's own Jinja template; the " +
                                   std::string(StyleName(style)) + " format takes none");
  }
  for (const auto& m : messages) {
    const std::string role = StringAt(m, "role");
    if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
      return Status::InvalidArgument("tool calls are not supported by the " + std::string(StyleName(style)) +
                                     " chat format");
    }
    if (style != ChatStyle::kV2 && style != ChatStyle::kEmbedded && role != "system" && role != "user" &&
        role != "assistant") {
      return Status::InvalidArgument("message role '" + role + "' is not supported by the " +
                                     std::string(StyleName(style)) + " chat format (system, user, assistant)");
    }
  }
  return RenderBuiltIn(style, bos, eos, json::parse(messages.dump()));
}

Result<std::string> ChatTemplate::Apply(const json& messages) const {
  return Render(nlohmann::ordered_json::parse(messages.dump()), nullptr, nullptr);
}

namespace {

ApiError Bad(std::string msg, std::string param = "") {
  ApiError e;
  e.message = std::move(msg);
  e.param = std::move(param);
  return e;
}

// Reads an optional number field into `dst`, checking its type and range.
template <typename T>
std::optional<ApiError> Number(const json& j, const char* key, T* dst, double lo, double hi) {
  if (!j.contains(key) || j[key].is_null()) return std::nullopt;
  if (!j[key].is_number()) return Bad(std::string("'") + key + "' must be a number", key);
  const double v = j[key].get<double>();
  if (!(v >= lo && v <= hi)) {
    return Bad(std::string("'") + key + "' must be in [" + json(lo).dump() + ", " + json(hi).dump() + "]", key);
  }
  if constexpr (std::is_integral_v<T>) {
    if (v != std::floor(v)) return Bad(std::string("'") + key + "' must be an integer", key);
  }
  *dst = static_cast<T>(j[key].get<double>());
  if constexpr (std::is_integral_v<T>) *dst = j[key].get<T>();
  return std::nullopt;
}

// Reads an optional boolean field into `dst` (absent or null: `dst` unchanged); another type is
// a 400 naming `param`. `name` is how the message names the field.
std::optional<ApiError> Bool(const json& j, const char* key, bool* dst, const std::string& name, const char* param) {
  if (!j.contains(key) || j[key].is_null()) return std::nullopt;
  if (!j[key].is_boolean()) return Bad("'" + name + "' must be a boolean", param);
  *dst = j[key].get<bool>();
  return std::nullopt;
}

}  // namespace

std::optional<ApiError> ParseGenerationRequest(const std::string& body, bool chat, const std::string& capture_header,
                                              const engine::Tokenizer& tok, const ChatTemplate& tmpl,
                                              const Limits& limits, GenerationRequest* out) {
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad("the request body is not valid JSON");
  if (!j.is_object()) return Bad("the request body must be a JSON object");
  GenerationRequest& r = *out;
  r.chat = chat;
  if (j.contains("model") && !j["model"].is_null()) {
    if (!j["model"].is_string()) return Bad("'model' must be a string", "model");
    r.model = j["model"].get<std::string>();
  }
  if (chat) {
    if (!j.contains("messages") || !j["messages"].is_array() || j["messages"].empty()) {
      return Bad("'messages' must be a non-empty array", "messages");
    }
    // Tool definitions reach the prompt only through a template that renders them; anything
    // else would answer as if the tools had not been sent.
    const bool tools = j.contains("tools") && !j["tools"].is_null();
    if (tools) {
      if (!j["tools"].is_array()) return Bad("'tools' must be an array", "tools");
      if (!j["tools"].empty() && !tmpl.RendersTools()) {
        return Bad(tmpl.style == ChatStyle::kJinja
                       ? "'tools' is not supported: this model's chat template renders no tool definitions (it never "
                         "reads `tools`), so the model would not see them"
                       : "'tools' is not supported by the " + std::string(ChatTemplate::StyleName(tmpl.style)) +
                             " chat format",
                   "tools");
      }
    }
    const bool kwargs = j.contains("chat_template_kwargs") && !j["chat_template_kwargs"].is_null();
    if (kwargs) {
      if (!j["chat_template_kwargs"].is_object()) {
        return Bad("'chat_template_kwargs' must be an object", "chat_template_kwargs");
      }
      for (const char* reserved : {"messages", "tools", "documents", "add_generation_prompt"}) {
        if (j["chat_template_kwargs"].contains(reserved)) {
          return Bad(std::string("'chat_template_kwargs' must not set '") + reserved + "'", "chat_template_kwargs");
        }
      }
    }
    // The template sees the messages and tools in the order their keys were sent (a template
    // that prints JSON prints dict order), so read those again without nlohmann's key sorting.
    const auto ordered = nlohmann::ordered_json::parse(body, nullptr, /*allow_exceptions=*/false);
    auto text = tmpl.Render(ordered["messages"], tools ? ordered["tools"] : nlohmann::ordered_json(),
                            kwargs ? ordered["chat_template_kwargs"] : nlohmann::ordered_json());
    if (!text.ok()) {
      if (text.status().code() == Status::Code::kIoError) {
        ApiError e = Bad(text.status().message());
        e.status = 500;
        e.type = "server_error";
        return e;
      }
      return Bad(text.status().message(), "messages");
    }
    r.prompt_text = std::move(*text);
    // The template writes the BOS text itself (a one-turn chat is [0, <｜User｜>, …]), so the
    // tokenizer adds none, as apply_chat_template(tokenize=True) and vLLM encode a chat.
    r.prompt = tok.Encode(r.prompt_text, /*add_special_tokens=*/false);
  } else {
    if (!j.contains("prompt")) return Bad("'prompt' is required", "prompt");
    const json& p = j["prompt"];
    if (p.is_string()) {
      r.prompt_text = p.get<std::string>();
      r.prompt = tok.Encode(r.prompt_text, /*add_special_tokens=*/true);
    } else if (p.is_array() && !p.empty() && p[0].is_number_integer()) {
      for (const auto& t : p) {
        if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= tok.vocab_size()) {
          return Bad("'prompt' token ids must be integers in [0, vocab)", "prompt");
        }
        r.prompt.push_back(t.get<int32_t>());
      }
    } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
      r.prompt_text = p[0].get<std::string>();
      r.prompt = tok.Encode(r.prompt_text, true);
    } else {
      return Bad("'prompt' must be a string or an array of token ids (batched prompts are not supported)", "prompt");
    }
  }
  if (r.prompt.empty()) return Bad("the prompt is empty", chat ? "messages" : "prompt");
  if (static_cast<int64_t>(r.prompt.size()) > limits.max_prompt_tokens) {
    return Bad("the prompt has " + std::to_string(r.prompt.size()) + " tokens; this server takes at most " +
                   std::to_string(limits.max_prompt_tokens),
               chat ? "messages" : "prompt");
  }
  r.max_tokens = limits.default_max_tokens;
  const char* mt = chat && j.contains("max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  if (auto e = Number(j, mt, &r.max_tokens, 0, static_cast<double>(limits.max_tokens))) return e;
  if (auto e = Number(j, "temperature", &r.sampling.temperature, 0, 2)) return e;
  if (auto e = Number(j, "top_p", &r.sampling.top_p, 0, 1)) return e;
  if (j.contains("top_p") && r.sampling.top_p == 0) return Bad("'top_p' must be > 0", "top_p");
  if (j.contains("top_k") && j["top_k"].is_number() && j["top_k"].get<double>() == -1) j["top_k"] = 0;  // vLLM's "off"
  if (auto e = Number(j, "top_k", &r.sampling.top_k, 0, 1e9)) return e;
  if (auto e = Number(j, "min_p", &r.sampling.min_p, 0, 1)) return e;
  if (auto e = Number(j, "seed", &r.sampling.seed, 0, 1.8e19)) return e;
  if (auto e = Number(j, "n", &r.n, 1, limits.max_n)) return e;
  if (j.contains("stop") && !j["stop"].is_null()) {
    const json& s = j["stop"];
    if (s.is_string()) {
      r.stop.push_back(s.get<std::string>());
    } else if (s.is_array() && s.size() <= static_cast<size_t>(limits.max_stop)) {
      for (const auto& x : s) {
        if (!x.is_string()) return Bad("'stop' must be a string or an array of strings", "stop");
        r.stop.push_back(x.get<std::string>());
      }
    } else {
      return Bad("'stop' must be a string or at most " + std::to_string(limits.max_stop) + " strings", "stop");
    }
    for (const auto& s : r.stop) {
      if (s.empty()) return Bad("'stop' strings must not be empty", "stop");
    }
  }
  if (chat) {
    bool logprobs = false;
    if (auto e = Bool(j, "logprobs", &logprobs, "logprobs", "logprobs")) return e;
    if (logprobs) {
      r.top_logprobs = 0;
      if (auto e = Number(j, "top_logprobs", &r.top_logprobs, 0, 20)) return e;
    } else if (j.contains("top_logprobs") && !j["top_logprobs"].is_null()) {
      return Bad("'top_logprobs' needs 'logprobs': true", "top_logprobs");
    }
  } else if (j.contains("logprobs") && !j["logprobs"].is_null()) {
    if (auto e = Number(j, "logprobs", &r.top_logprobs, 0, 20)) return e;
  }
  if (auto e = Bool(j, "stream", &r.stream, "stream", "stream")) return e;
  if (j.contains("stream_options") && !j["stream_options"].is_null()) {
    const json& so = j["stream_options"];
    if (!so.is_object()) return Bad("'stream_options' must be an object", "stream_options");
    if (auto e = Bool(so, "include_usage", &r.include_usage, "stream_options.include_usage", "stream_options")) {
      return e;
    }
  }
  if (auto e = Bool(j, "ignore_eos", &r.ignore_eos, "ignore_eos", "ignore_eos")) return e;
  if (auto e = Bool(j, "return_tokens_as_token_ids", &r.tokens_as_ids, "return_tokens_as_token_ids",
                    "return_tokens_as_token_ids")) {
    return e;
  }
  if (auto e = Bool(j, "return_token_ids", &r.return_token_ids, "return_token_ids", "return_token_ids")) return e;
  r.capture = capture_header;
  if (j.contains("lockstep")) {
    const json& l = j["lockstep"];
    if (!l.is_object()) return Bad("'lockstep' must be an object", "lockstep");
    if (l.contains("capture")) {
      if (l["capture"].is_string()) r.capture = l["capture"].get<std::string>();
      else if (l["capture"].is_boolean()) r.capture = l["capture"].get<bool>() ? "summary" : "";
      else return Bad("'lockstep.capture' must be \"summary\", \"full\" or a boolean", "lockstep");
    }
  }
  if (!r.capture.empty() && r.capture != "summary" && r.capture != "full") {
    return Bad("capture must be \"summary\" or \"full\", not \"" + r.capture + "\"", "lockstep");
  }
  return std::nullopt;
}

}  // namespace lockstep::server
