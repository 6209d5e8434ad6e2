// server/chat_template.cc — see chat_template.h.
#include "server/chat_template.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

extern char** environ;

namespace lockstep::server {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

// The renderer, run as `python3 -I -c kRenderer <memory limit in MiB>`. It speaks one JSON
// object per line on stdin/stdout (ASCII, so that no byte of a message can end a line early):
//   → {"template": source, "variables": {…}}   ← {"ok": true, "uses_tools": b, "engine": "…"} | {"error": "…"}
//   → {"messages": […], "tools": … | null, "add_generation_prompt": b, "kwargs": {…}}
//                                                ← {"text": "…"} | {"error": "…"}
// The environment is transformers' (src/transformers/utils/chat_template_utils.py,
// _cached_compile_jinja_template, and render_jinja_template's render call), line for line
// where it decides the output: the same sandbox class and options, the same extensions (the
// AssistantTracker's `generation` tag renders its body unchanged when no tracker is active,
// which is apply_chat_template's default), the same tojson, raise_exception and strftime_now.
constexpr const char* kRenderer = R"PY(
import json
import sys


def main():
    if len(sys.argv) > 1 and int(sys.argv[1]) > 0:
        try:
            import resource
            limit = int(sys.argv[1]) << 20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ImportError, ValueError, OSError):
            pass
    rd = sys.stdin.buffer
    wr = sys.stdout.buffer

    def reply(obj):
        wr.write(json.dumps(obj, ensure_ascii=True).encode("ascii") + b"\n")
        wr.flush()

    try:
        import jinja2
        import jinja2.ext
        import jinja2.meta
        import jinja2.nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        reply({"error": "no jinja2 for %s (%s)" % (sys.executable, e), "missing_jinja2": True})
        return
    from datetime import datetime

    class AssistantTracker(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation_support(self, context, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    def describe(e):
        if isinstance(e, jinja2.exceptions.TemplateSyntaxError):
            return "TemplateSyntaxError at line %s: %s" % (e.lineno, e.message)
        return "%s: %s" % (type(e).__name__, e)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now

    first = rd.readline()
    if not first:
        return
    request = json.loads(first)
    try:
        source = request["template"]
        template = env.from_string(source)
        uses_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
    except Exception as e:
        reply({"error": describe(e)})
        return
    variables = request.get("variables") or {}
    reply({"ok": True, "uses_tools": uses_tools,
           "engine": "jinja2 %s, Python %s" % (jinja2.__version__, sys.version.split()[0])})
    for line in rd:
        try:
            r = json.loads(line)
            kwargs = dict(variables)
            kwargs.update(r.get("kwargs") or {})
            text = template.render(messages=r["messages"], tools=r.get("tools"), documents=None,
                                   add_generation_prompt=bool(r["add_generation_prompt"]), **kwargs)
            reply({"text": text})
        except Exception as e:
            reply({"error": describe(e)})


main()
)PY";

std::string Interpreter(const JinjaOptions& o) {
  if (!o.python.empty()) return o.python;
  if (const char* env = std::getenv("LOCKSTEP_PYTHON"); env != nullptr && *env != '\0') return env;
  return "python3";
}

}  // namespace

Result<std::shared_ptr<JinjaTemplate>> JinjaTemplate::Compile(const std::string& source, const json& variables,
                                                              const JinjaOptions& options) {
  if (!variables.is_object()) return Status::InvalidArgument("chat template variables must be a JSON object");
  std::shared_ptr<JinjaTemplate> t(new JinjaTemplate());
  t->source_ = source;
  t->variables_ = variables.dump(-1, ' ', false, json::error_handler_t::replace);
  t->options_ = options;
  std::lock_guard<std::mutex> lock(t->mu_);
  LS_RETURN_IF_ERROR(t->StartLocked());
  return t;
}

JinjaTemplate::~JinjaTemplate() {
  std::lock_guard<std::mutex> lock(mu_);
  StopLocked();
}

void JinjaTemplate::StopLocked() const {
  if (fd_ >= 0) {
    ::close(fd_);  // the child reads EOF and leaves its loop
    fd_ = -1;
  }
  if (pid_ > 0) {
    // It has nothing left to do; do not wait for it to notice.
    ::kill(pid_, SIGKILL);
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
  }
  pending_.clear();
}

Status JinjaTemplate::StartLocked() const {
  StopLocked();
  const std::string python = Interpreter(options_);
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    return Status::IoError(std::string("chat template renderer: socketpair: ") + std::strerror(errno));
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, sv[1], 0);  // dup2 clears CLOEXEC on 0 and 1
  posix_spawn_file_actions_adddup2(&fa, sv[1], 1);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  const std::string limit = std::to_string(options_.memory_limit_mb);
  std::vector<char*> argv = {const_cast<char*>(python.c_str()), const_cast<char*>("-I"), const_cast<char*>("-c"),
                             const_cast<char*>(kRenderer), const_cast<char*>(limit.c_str()), nullptr};
  pid_t pid = -1;
  const int rc = ::posix_spawnp(&pid, python.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(sv[1]);
  if (rc != 0) {
    ::close(sv[0]);
    return Status::NotFound("chat template renderer: cannot run " + python + " (" + std::strerror(rc) +
                            "); rendering tokenizer_config.json's chat_template needs Python 3 with jinja2 (Debian: "
                            "apt-get install python3-jinja2; another interpreter: LOCKSTEP_PYTHON=/path/to/python3)");
  }
  pid_ = pid;
  fd_ = sv[0];
  json hello = {{"template", source_}, {"variables", json::parse(variables_)}};
  auto r = ExchangeLocked(hello.dump(-1, ' ', false, json::error_handler_t::replace));
  if (!r.ok()) {
    StopLocked();
    return Status::IoError("chat template renderer (" + python + "): " + r.status().message() +
                               "; rendering tokenizer_config.json's chat_template needs Python 3 with jinja2 (Debian: "
                               "apt-get install python3-jinja2)");
  }
  const json& reply = *r;
  if (reply.contains("error")) {
    const std::string e = reply["error"].is_string() ? reply["error"].get<std::string>() : reply["error"].dump();
    StopLocked();
    if (reply.value("missing_jinja2", false)) {
      return Status::NotFound("chat template renderer: " + e + "; install it (Debian: apt-get install python3-jinja2) "
                              "or point LOCKSTEP_PYTHON at an interpreter that has it");
    }
    return Status::InvalidArgument("tokenizer_config.json's chat_template does not compile: " + e);
  }
  uses_tools_ = reply.value("uses_tools", false);
  engine_version_ = reply.value("engine", std::string());
  return Status::Ok();
}

Result<json> JinjaTemplate::ExchangeLocked(const std::string& line) const {
  if (fd_ < 0) return Status::IoError("the renderer is not running");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.timeout_ms);
  std::string out = line;
  out += '\n';
  size_t sent = 0;
  while (sent < out.size()) {
    const ssize_t n = ::send(fd_, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::IoError(std::string("the renderer went away (") + std::strerror(errno) + ")");
    sent += static_cast<size_t>(n);
  }
  for (;;) {
    const size_t nl = pending_.find('\n');
    if (nl != std::string::npos) {
      json reply = json::parse(pending_.substr(0, nl), nullptr, /*allow_exceptions=*/false);
      pending_.erase(0, nl + 1);
      if (reply.is_discarded() || !reply.is_object()) return Status::Internal("the renderer answered garbage");
      return reply;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return Status::IoError("no answer within " + std::to_string(options_.timeout_ms) + " ms");
    }
    pollfd p{fd_, POLLIN, 0};
    const int pr = ::poll(&p, 1, static_cast<int>(left.count()));
    if (pr < 0 && errno == EINTR) continue;
    if (pr < 0) return Status::IoError(std::string("poll: ") + std::strerror(errno));
    if (pr == 0) continue;  // the deadline check above reports it
    char buf[65536];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::IoError("the renderer exited");
    pending_.append(buf, static_cast<size_t>(n));
  }
}

Result<std::string> JinjaTemplate::Render(const ordered_json& messages, const ordered_json& tools,
                                          bool add_generation_prompt, const ordered_json& kwargs) const {
  ordered_json request = {{"messages", messages},
                          {"tools", tools},
                          {"add_generation_prompt", add_generation_prompt},
                          {"kwargs", kwargs.is_null() ? ordered_json::object() : kwargs}};
  const std::string line = request.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ < 0) LS_RETURN_IF_ERROR(StartLocked());  // the last render killed it
  auto reply = ExchangeLocked(line);
  if (!reply.ok()) {
    StopLocked();  // a timed-out render may still be running: kill it, start afresh next time
    return Status::IoError("chat template renderer: " + reply.status().message());
  }
  if (reply->contains("text") && (*reply)["text"].is_string()) return (*reply)["text"].get<std::string>();
  const json& e = (*reply)["error"];
  return Status::InvalidArgument("the chat template raised " + (e.is_string() ? e.get<std::string>() : e.dump()));
}

}  // namespace lockstep::server
