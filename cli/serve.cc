// cli/serve.cc — `lockstep serve`: the OpenAI-compatible server (server/http_server.h,
// docs/server.md). Loads the model, builds the server's options from the flags and serves
// until SIGINT/SIGTERM.
#include <pthread.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "base/version.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "server/http_server.h"

namespace lockstep::cli {
namespace {

struct ServeArgs {
  std::string model, host = "127.0.0.1", model_name, capture_dir, admin_token, admin_token_file;
  int port = 8000, admin_port = 8001, max_concurrent = 64;
  int64_t max_prompt_tokens = 4096, max_tokens_limit = 4096, default_max_tokens = 16;
  int max_n = 8;
  int64_t ring_mb = 64, max_body_kb = 1024;
  int capture_queue = 8;
  std::string chat_template;
  bool redact = false, no_degeneration_capture = false, quiet = false, no_record = false, no_tap_summaries = false;
  EngineFlags flags;
};

// The admin token from --admin-token-file: its first line, without surrounding whitespace
// (a trailing \r, the newline `base64` writes). Read before the model loads, so that a
// missing file fails at once and says how to make one.
Result<std::string> ReadTokenFile(const std::string& path) {
  const std::string make = "head -c 32 /dev/urandom | base64 > " + path;
  std::ifstream in(path);
  if (!in) {
    return Status::NotFound(path + ": cannot read the admin token file (" + std::strerror(errno) +
                            "); create one with: " + make);
  }
  std::string token;
  std::getline(in, token);
  const auto space = [](unsigned char c) { return std::isspace(c) != 0; };
  while (!token.empty() && space(token.back())) token.pop_back();
  size_t lead = 0;
  while (lead < token.size() && space(token[lead])) ++lead;
  token.erase(0, lead);
  if (token.empty()) {
    return Status::InvalidArgument(path + ": the admin token file's first line is empty; write a secret into it: " + make);
  }
  return token;
}

Status RunServe(ServeArgs& a) {
  LS_RETURN_IF_ERROR(a.flags.RefuseRanks("serve"));  // before the load
  std::string token_from_file;
  if (!a.admin_token_file.empty()) {
    LS_ASSIGN_OR_RETURN(token_from_file, ReadTokenFile(a.admin_token_file));
  }
  LS_ASSIGN_OR_RETURN(LoadedModel m, LoadModel(a.model.empty() ? DefaultModelDir() : std::filesystem::path(a.model), a.quiet));
  if (!m.tokenizer) return Status::NotFound(m.dir.string() + ": no tokenizer.json; the server speaks text");
  server::ServerOptions o;
  o.host = a.host;
  o.port = a.port;
  o.admin_port = a.admin_port;
  o.model_name = a.model_name.empty() ? m.dir.filename().string() : a.model_name;
  o.model = m.model;
  o.tokenizer = m.tokenizer;
  o.eos_ids = m.eos_ids;
  {
    std::ifstream in(m.dir / "tokenizer_config.json");
    const auto config = nlohmann::json::parse(in, nullptr, false);
    auto t = server::ChatTemplate::Choose(config, m.model->config().model_type, a.chat_template);
    if (!t.ok()) return Status::InvalidArgument(m.dir.string() + ": " + t.status().message());
    o.chat_template = *t;
    if (!a.quiet) {
      std::cerr << "lockstep serve: chat format " << server::ChatTemplate::StyleName(o.chat_template.style)
                << (a.chat_template.empty() ? " (from tokenizer_config.json)" : " (--chat-template)") << "\n";
    }
  }
  LS_ASSIGN_OR_RETURN(o.engine, a.flags.ToOptions());
  o.limits.max_prompt_tokens = a.max_prompt_tokens;
  o.limits.max_tokens = a.max_tokens_limit;
  o.limits.default_max_tokens = a.default_max_tokens;
  o.limits.max_n = a.max_n;
  o.max_concurrent = a.max_concurrent;
  o.max_body_bytes = static_cast<size_t>(a.max_body_kb) << 10;
  o.capture_dir = a.capture_dir;
  o.capture_redact = a.redact;
  o.ring_bytes = static_cast<size_t>(a.ring_mb) << 20;
  o.capture_on_degeneration = !a.no_degeneration_capture;
  o.record = !a.no_record;
  o.tap_summaries = !a.no_tap_summaries;
  o.capture_queue = static_cast<size_t>(a.capture_queue);
  o.quiet = a.quiet;
  o.admin_token = a.admin_token_file.empty() ? a.admin_token : token_from_file;
  LS_ASSIGN_OR_RETURN(o.trace_meta, ModelMeta(m));
  // SIGINT/SIGTERM are taken by one thread with sigwait, not by a handler: blocked here, before
  // the server starts its threads (which inherit the mask), so no thread of the server is
  // interrupted and a second signal (`timeout` sends its TERM to the child and then to the
  // group) cannot reach a server already being destroyed.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  LS_ASSIGN_OR_RETURN(auto srv, server::Server::Start(std::move(o)));
  std::atomic<bool> done{false};
  std::thread stopper([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    if (!done.load()) srv->Stop();
  });
  // One write: scripts read this line to find the ports (std::cerr is unbuffered, so a chain of
  // << would reach them in pieces).
  std::cerr << ("lockstep serve: API on http://" + a.host + ":" + std::to_string(srv->port()) +
                "/v1, health/metrics/admin on http://" + a.host + ":" + std::to_string(srv->admin_port()) + "\n")
            << std::flush;
  srv->Wait();  // until a signal's Stop, or a listener ended on its own
  done = true;
  pthread_kill(stopper.native_handle(), SIGTERM);  // wakes its sigwait if no signal came
  stopper.join();
  srv->Stop();
  return Status::Ok();
}

}  // namespace

void RegisterServe(CLI::App& app, SetAction set_action) {
  auto a = std::make_shared<ServeArgs>();
  CLI::App* cmd = app.add_subcommand("serve", "Serve an OpenAI-compatible API that records every request and captures failing ones");
  cmd->footer(
      "Examples (tests/server/serve_docs_test.sh runs them as printed):\n"
      "  lockstep serve                                  # embedded tiny model on 127.0.0.1:8000\n"
      "  head -c 32 /dev/urandom | base64 > token.txt    # the admin token: any secret, the file's first line\n"
      "  lockstep serve --capture-dir caps --admin-token-file token.txt\n"
      "  curl -s localhost:8000/v1/completions -H 'x-request-id: first' -d '{\"prompt\":\"<!DOCTYPE html>\",\"max_tokens\":32}'\n"
      "  curl -s -X POST -H \"Authorization: Bearer $(cat token.txt)\" localhost:8001/admin/capture/first\n"
      "The last call captures the request named by its x-request-id (any id a response carried) into\n"
      "caps/first.h5 and answers {trace, live_record, verified, detail}; 401 for a wrong token, 404 for\n"
      "an id no longer in the ring.\n"
      "Every request is recorded cheaply (inputs, seed, batch per step, a hash of every logits row, every\n"
      "tap row's summary and hash) in a ring of --ring-mb. A capture (header X-Lockstep-Capture: full|summary\n"
      "with X-Lockstep-Token, the admin call, or the degeneration detector) re-runs the request offline, on\n"
      "a capture thread beside serving, into <capture-dir>/<id>.h5 and checks every token and tap hash\n"
      "against the live record; one that does not verify is reported loudly.\n"
      "See docs/server.md.");
  cmd->add_option("--model,-m", a->model, ModelOptionHelp());
  cmd->add_option("--model-name", a->model_name, "Name /v1/models lists (default: the directory's name)");
  cmd->add_option("--host", a->host, "Address to bind; 127.0.0.1 by default (the API has no authentication)");
  cmd->add_option("--port", a->port, "API port (0 = any free port)")->check(CLI::Range(0, 65535));
  cmd->add_option("--admin-port", a->admin_port, "Port for /health, /metrics and /admin/* (0 = any free port)")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--max-concurrent", a->max_concurrent, "Generation requests in flight; more are answered 429")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--max-prompt-tokens", a->max_prompt_tokens, "Longest prompt accepted, 1 to 2^26")
      ->check(WholeIn(1, kMaxTokensFlag, "1 to 2^26"));
  cmd->add_option("--max-tokens-limit", a->max_tokens_limit, "Largest max_tokens accepted, 1 to 2^26")
      ->check(WholeIn(1, kMaxTokensFlag, "1 to 2^26"));
  cmd->add_option("--default-max-tokens", a->default_max_tokens, "max_tokens when a request gives none, 1 to 2^26")
      ->check(WholeIn(1, kMaxTokensFlag, "1 to 2^26"));
  cmd->add_option("--max-n", a->max_n, "Largest n (choices per request)")->check(CLI::Range(1, 64));
  cmd->add_option("--max-body-kb", a->max_body_kb, "Largest request body")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--capture-dir", a->capture_dir, "Where captures go (created 0700); without it captures are refused");
  cmd->add_option("--admin-token", a->admin_token, "Token for /admin/* and capture requests (visible in ps; prefer the file)");
  cmd->add_option("--admin-token-file", a->admin_token_file,
                  "File whose first line is the admin token (make one: head -c 32 /dev/urandom | base64 > token.txt)");
  cmd->add_flag("--capture-redact", a->redact, "Captures store token ids without text");
  cmd->add_option("--ring-mb", a->ring_mb, "Memory for the records of recent requests (oldest evicted)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_flag("--no-degeneration-capture", a->no_degeneration_capture,
                "Count degenerate generations in /metrics but do not capture them");
  cmd->add_flag("--no-record", a->no_record,
                "Keep no live records (no captures, no degeneration check): to measure what recording costs");
  cmd->add_flag("--no-tap-summaries", a->no_tap_summaries,
                "Records keep inputs, sampling and logits hashes but no per-tap summaries (captures then verify "
                "tokens and logits only)");
  cmd->add_option("--capture-queue", a->capture_queue,
                  "Captures that may wait behind the one running; more are refused (503)")
      ->check(CLI::Range(0, 1024));
  cmd->add_option("--chat-template", a->chat_template,
                  "Chat format: deepseek-v2|deepseek-v3|deepseek-v3.2|lockstep-tiny|none (default: recognised from "
                  "tokenizer_config.json; an unknown template refuses to start)");
  cmd->add_flag("--quiet,-q", a->quiet, "Log only errors and failed verifications");
  a->flags.Register(cmd);
  cmd->callback([a, set_action] { set_action([a] { return RunServe(*a); }); });
}

}  // namespace lockstep::cli
