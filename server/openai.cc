// server/openai.cc — see openai.h.
#include "server/openai.h"

#include <cmath>

namespace lockstep::server {

using json = nlohmann::json;

std::string ApiError::Body() const {
  json e = {{"message", message},
            {"type", type},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}};
  return json{{"error", e}}.dump();
}

namespace {

// Where the fingerprints come from: the chat_template strings of the published
// tokenizer_config.json files (as the JSON decodes them, so "\n" below is Jinja's escape, a
// backslash and an n). A template matches a style when it holds every `needles` string and
// none of `absent`.
struct Fingerprint {
  ChatStyle style;
  std::vector<std::string> needles, absent;
};

const std::vector<Fingerprint>& Fingerprints() {
  static const std::vector<Fingerprint> f = {
      // deepseek-ai/DeepSeek-V2-Chat, DeepSeek-V2-Lite-Chat.
      {ChatStyle::kV2,
       {R"({{ 'User: ' + message['content'] + '\n\n' }})", R"({{ 'Assistant: ' + message['content'] + eos_token }})",
        R"({{ message['content'] + '\n\n' }})", R"({{ 'Assistant:' }})"},
       {}},
      // deepseek-ai/DeepSeek-V3 (and -Base): system prompts hoisted after bos; R1 and V3.1
      // (with <think>) and V3-0324 (whose user turn closes with <｜Assistant｜>) are not it.
      {ChatStyle::kV3,
       {"is_first_sp", R"(ns.system_prompt + '\n\n' + message['content'])", "{{'<｜User｜>' + message['content']}}",
        "{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}",
        "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"},
       {"<think>", "</think>", "thinking"}},
  };
  return f;
}

// models/lockstep-tiny-v32/tokenizer_config.json's template, exactly.
constexpr const char* kEmbeddedTemplate =
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}<｜User｜>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<｜Assistant｜>{{ message['content'] }}<｜end▁of▁sentence｜>{% else %}"
    "{{ message['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}";

// o[key] when it is a string, else "" (for fields already checked, or optional ones).
std::string StringAt(const nlohmann::json& o, const char* key) {
  return o.is_object() && o.contains(key) && o[key].is_string() ? o[key].get<std::string>() : std::string();
}

// What Apply renders of a message: an object with a string role, and content absent, null, a
// string, or an array of text parts {"type": "text", "text": "…"} — an image or other part is
// refused rather than dropped, which would change what the user asked.
Status CheckMessage(const nlohmann::json& m) {
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
std::string Content(const nlohmann::json& m) {
  std::string content;
  if (!m.contains("content")) return content;
  const auto& c = m["content"];
  if (c.is_string()) return c.get<std::string>();
  if (c.is_array()) {
    for (const auto& part : c) content += StringAt(part, "text");
  }
  return content;
}

}  // namespace

std::string_view ChatTemplate::StyleName(ChatStyle s) {
  switch (s) {
    case ChatStyle::kNone: return "none";
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
                                 "': expected deepseek-v2, deepseek-v3, deepseek-v3.2, lockstep-tiny or none");
}

Result<ChatTemplate> ChatTemplate::Choose(const nlohmann::json& config, const std::string& model_type,
                                          const std::string& forced) {
  ChatTemplate t;
  if (config.is_object()) {
    // bos_token / eos_token: a string, or an AddedToken object {"content": …}.
    auto token = [&](const char* key, std::string* out) {
      if (!config.contains(key)) return;
      const auto& v = config[key];
      if (v.is_string()) *out = v.get<std::string>();
      else if (v.is_object() && v.contains("content") && v["content"].is_string()) *out = v["content"].get<std::string>();
    };
    token("bos_token", &t.bos);
    token("eos_token", &t.eos);
  }
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
  if (tmpl == kEmbeddedTemplate) {
    t.style = ChatStyle::kEmbedded;
    return t;
  }
  for (const Fingerprint& f : Fingerprints()) {
    bool match = true;
    for (const auto& n : f.needles) match = match && tmpl.find(n) != std::string::npos;
    for (const auto& a : f.absent) match = match && tmpl.find(a) == std::string::npos;
    if (match) {
      t.style = f.style;
      return t;
    }
  }
  return Status::InvalidArgument(
      "tokenizer_config.json's chat_template is not one lockstep serve has built in (DeepSeek V2, V3, V3.2, the "
      "embedded tiny model's) and there is no Jinja interpreter; rather than format every chat request wrongly, the "
      "server refuses to start. If one of the built-in formats is your model's, name it with --chat-template "
      "deepseek-v2|deepseek-v3|deepseek-v3.2|lockstep-tiny (or --chat-template none: completions only)");
}

Result<std::string> ChatTemplate::Apply(const json& messages) const {
  if (style == ChatStyle::kNone) {
    return Status::InvalidArgument(
        "this model has no chat template: use /v1/completions, or start the server with --chat-template");
  }
  if (!messages.is_array()) return Status::InvalidArgument("'messages' must be an array");
  for (const auto& m : messages) {
    LS_RETURN_IF_ERROR(CheckMessage(m));
    const std::string role = StringAt(m, "role");
    if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
      return Status::InvalidArgument("tool calls are not supported by this server's chat format");
    }
    if (style != ChatStyle::kV2 && style != ChatStyle::kEmbedded && role != "system" && role != "user" &&
        role != "assistant") {
      return Status::InvalidArgument("message role '" + role + "' is not supported (system, user, assistant)");
    }
  }
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
      break;
  }
  return Status::Internal("unknown chat style");
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
    auto text = tmpl.Apply(j["messages"]);  // (which checks each message's role and content)
    if (!text.ok()) return Bad(text.status().message(), "messages");
    r.prompt_text = std::move(*text);
    r.prompt = tok.Encode(r.prompt_text, /*add_special_tokens=*/false);  // the template has the bos
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
