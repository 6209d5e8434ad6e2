// cli/serve.cc — `lockstep serve`: the OpenAI-compatible server (server/http_server.h,
// docs/server.md). Loads the model, builds the server's options from the flags and serves
// until SIGINT/SIGTERM.
#include <csignal>
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

server::Server* g_server = nullptr;
void OnSignal(int) {
  // stop() only flips flags and shuts sockets down: safe enough from a handler for a CLI.
  if (g_server) std::thread([] { g_server->Stop(); }).detach();
}

Status RunServe(ServeArgs& a) {
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
  o.admin_token = a.admin_token;
  if (!a.admin_token_file.empty()) {
    std::ifstream in(a.admin_token_file);
    if (!in) return Status::NotFound(a.admin_token_file + ": cannot read the admin token file");
    std::getline(in, o.admin_token);
    if (o.admin_token.empty()) return Status::InvalidArgument(a.admin_token_file + ": the admin token file is empty");
  }
  LS_ASSIGN_OR_RETURN(o.trace_meta, ModelMeta(m));
  LS_ASSIGN_OR_RETURN(auto srv, server::Server::Start(std::move(o)));
  g_server = srv.get();
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  // One write: scripts read this line to find the ports (std::cerr is unbuffered, so a chain of
  // << would reach them in pieces).
  std::cerr << ("lockstep serve: API on http://" + a.host + ":" + std::to_string(srv->port()) +
                "/v1, health/metrics/admin on http://" + a.host + ":" + std::to_string(srv->admin_port()) + "\n")
            << std::flush;
  srv->Wait();
  g_server = nullptr;
  return Status::Ok();
}

}  // namespace

void RegisterServe(CLI::App& app, SetAction set_action) {
  auto a = std::make_shared<ServeArgs>();
  CLI::App* cmd = app.add_subcommand("serve", "Serve an OpenAI-compatible API that records every request and captures failing ones");
  cmd->footer(
      "Examples:\n"
      "  lockstep serve                                  # embedded tiny model on 127.0.0.1:8000\n"
      "  lockstep serve --capture-dir caps --admin-token-file tok.txt\n"
      "  curl -s localhost:8000/v1/completions -d '{\"prompt\":\"<!DOCTYPE html>\",\"max_tokens\":32}'\n"
      "  curl -s -X POST -H \"Authorization: Bearer $(cat tok.txt)\" localhost:8001/admin/capture/<x-request-id>\n"
      "Every request is recorded cheaply (inputs, seed, batch per step, a hash of every logits row, every\n"
      "tap row's summary and hash) in a ring of --ring-mb. A capture (header X-Lockstep-Capture: full|summary\n"
      "with X-Lockstep-Token, the admin call, or the degeneration detector) re-runs the request offline, on\n"
      "a capture thread beside serving, into <capture-dir>/<id>.h5 and checks every token and tap hash\n"
      "against the live record; one that does not verify is reported loudly.\n"
      "See docs/server.md.");
  cmd->add_option("--model,-m", a->model, "Model directory (HF layout); default: the embedded tiny model");
  cmd->add_option("--model-name", a->model_name, "Name /v1/models lists (default: the directory's name)");
  cmd->add_option("--host", a->host, "Address to bind; 127.0.0.1 by default (the API has no authentication)");
  cmd->add_option("--port", a->port, "API port (0 = any free port)")->check(CLI::Range(0, 65535));
  cmd->add_option("--admin-port", a->admin_port, "Port for /health, /metrics and /admin/* (0 = any free port)")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--max-concurrent", a->max_concurrent, "Generation requests in flight; more are answered 429")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--max-prompt-tokens", a->max_prompt_tokens, "Longest prompt accepted")->check(kPositive);
  cmd->add_option("--max-tokens-limit", a->max_tokens_limit, "Largest max_tokens accepted")->check(kPositive);
  cmd->add_option("--default-max-tokens", a->default_max_tokens, "max_tokens when a request gives none")
      ->check(kPositive);
  cmd->add_option("--max-n", a->max_n, "Largest n (choices per request)")->check(CLI::Range(1, 64));
  cmd->add_option("--max-body-kb", a->max_body_kb, "Largest request body")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--capture-dir", a->capture_dir, "Where captures go (created 0700); without it captures are refused");
  cmd->add_option("--admin-token", a->admin_token, "Token for /admin/* and capture requests (visible in ps; prefer the file)");
  cmd->add_option("--admin-token-file", a->admin_token_file, "File whose first line is the admin token");
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
