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

std::string ChatTemplate::Apply(const json& messages) const {
  std::string s = bos;
  for (const auto& m : messages) {
    const std::string role = m.value("role", "");
    std::string content;
    if (m.contains("content") && m["content"].is_string()) {
      content = m["content"].get<std::string>();
    } else if (m.contains("content") && m["content"].is_array()) {  // [{type:"text", text:…}]
      for (const auto& part : m["content"]) {
        if (part.is_object() && part.value("type", "") == "text") content += part.value("text", "");
      }
    }
    if (role == "user") {
      s += "<｜User｜>" + content;
    } else if (role == "assistant") {
      s += "<｜Assistant｜>" + content + eos;
    } else {
      s += content;
    }
  }
  return s + "<｜Assistant｜>";
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

}  // namespace

std::optional<ApiError> ParseGenerationRequest(const std::string& body, bool chat, const std::string& capture_header,
                                              const engine::Tokenizer& tok, const ChatTemplate& tmpl,
                                              const Limits& limits, GenerationRequest* out) {
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad("the request body is not valid JSON");
  if (!j.is_object()) return Bad("the request body must be a JSON object");
  GenerationRequest& r = *out;
  r.chat = chat;
  r.model = j.value("model", "");
  if (chat) {
    if (!j.contains("messages") || !j["messages"].is_array() || j["messages"].empty()) {
      return Bad("'messages' must be a non-empty array", "messages");
    }
    for (const auto& m : j["messages"]) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
        return Bad("each message needs a string 'role'", "messages");
      }
    }
    r.prompt_text = tmpl.Apply(j["messages"]);
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
    if (j.contains("logprobs") && !j["logprobs"].is_null() && !j["logprobs"].is_boolean()) {
      return Bad("'logprobs' must be a boolean", "logprobs");
    }
    if (j.value("logprobs", false)) {
      r.top_logprobs = 0;
      if (auto e = Number(j, "top_logprobs", &r.top_logprobs, 0, 20)) return e;
    } else if (j.contains("top_logprobs") && !j["top_logprobs"].is_null()) {
      return Bad("'top_logprobs' needs 'logprobs': true", "top_logprobs");
    }
  } else if (j.contains("logprobs") && !j["logprobs"].is_null()) {
    if (auto e = Number(j, "logprobs", &r.top_logprobs, 0, 20)) return e;
  }
  if (j.contains("stream") && !j["stream"].is_null() && !j["stream"].is_boolean()) {
    return Bad("'stream' must be a boolean", "stream");
  }
  r.stream = j.value("stream", false);
  if (j.contains("stream_options") && j["stream_options"].is_object()) {
    r.include_usage = j["stream_options"].value("include_usage", false);
  }
  if (j.contains("ignore_eos") && j["ignore_eos"].is_boolean()) r.ignore_eos = j["ignore_eos"].get<bool>();
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
