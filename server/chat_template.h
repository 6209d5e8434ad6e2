// server/chat_template.h — a model's own Jinja chat template (tokenizer_config.json's
// chat_template), rendered by the engine transformers renders it with, so that the prompt text
// is byte for byte what vLLM or sglang (both call transformers' apply_chat_template) gave the
// model in the deployment being debugged.
//
// The renderer is Python's jinja2 in a child process: ImmutableSandboxedEnvironment with
// trim_blocks and lstrip_blocks, jinja2.ext.loopcontrols, the `generation` tag, the tojson
// filter without HTML escaping and the raise_exception / strftime_now globals, exactly as
// transformers' _compile_jinja_template builds it (docs/server.md, "Chat templates", says why
// this engine and not a C++ one). The child runs `python3 -I` (no user site, no current
// directory on sys.path) under an address-space limit; a render that outlives its timeout is
// killed and the child restarted for the next one. Messages and tools go over in the order the
// client wrote their keys, as json.loads would read them, because templates that print JSON
// (`tools | tojson`) print keys in dict order.
//
// Thread-safety: Render may be called from any number of threads; they take turns on the one
// child (a render is tens of microseconds of Python for a DeepSeek template).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace lockstep::server {

struct JinjaOptions {
  std::string python;                  // the interpreter; "" → $LOCKSTEP_PYTHON, else python3 on PATH
  int timeout_ms = 10000;              // per render (and for start-up and compilation)
  int64_t memory_limit_mb = 2048;      // RLIMIT_AS of the child
};

class JinjaTemplate {
 public:
  // Starts a renderer, compiles `source` there and keeps both for Render. `variables` are the
  // names transformers passes to every render besides the conversation (its
  // special_tokens_map: bos_token, eos_token, …), a JSON object. Errors: no such interpreter,
  // no jinja2 in it (both say what to install), a template that does not compile (jinja2's
  // message, with its line).
  static Result<std::shared_ptr<JinjaTemplate>> Compile(const std::string& source, const nlohmann::json& variables,
                                                        const JinjaOptions& options = {});

  // compiled.render(messages=…, tools=… (null → None), documents=None, add_generation_prompt=…,
  // **variables, **kwargs). InvalidArgument when the template raises (raise_exception, a
  // TypeError on a message it cannot concatenate, …), with the exception's message;
  // IoError when the renderer died or timed out (it is restarted on the next call).
  Result<std::string> Render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                             bool add_generation_prompt, const nlohmann::ordered_json& kwargs) const;

  // Whether the template reads `tools` (jinja2.meta.find_undeclared_variables, as transformers
  // uses it): a template that does not cannot render tool definitions.
  bool uses_tools() const { return uses_tools_; }
  const std::string& source() const { return source_; }
  const std::string& engine_version() const { return engine_version_; }  // "jinja2 3.1.2, Python 3.11.2"

  ~JinjaTemplate();
  JinjaTemplate(const JinjaTemplate&) = delete;
  JinjaTemplate& operator=(const JinjaTemplate&) = delete;

 private:
  JinjaTemplate() = default;
  // Starts the child and compiles; mu_ held (or not yet shared).
  Status StartLocked() const;
  void StopLocked() const;
  // One request line out, one reply line back, within the timeout.
  Result<nlohmann::json> ExchangeLocked(const std::string& line) const;

  std::string source_;
  std::string variables_;  // JSON text
  JinjaOptions options_;
  mutable bool uses_tools_ = false;
  mutable std::string engine_version_;

  mutable std::mutex mu_;
  mutable int pid_ = -1;
  mutable int fd_ = -1;
  mutable std::string pending_;  // bytes read past the last reply line
};

}  // namespace lockstep::server
