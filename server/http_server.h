// server/http_server.h — `lockstep serve`: an OpenAI-compatible HTTP server over the
// Scheduler that records every request cheaply (server/live_record.h) and captures failing
// ones as verified traces (server/capture.h). docs/server.md describes the API.
//
// Two listeners: the API (POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
// GET /health) and the admin one (GET /health, GET /metrics, POST /admin/capture/{id}), each
// with its own worker pool, so that health checks and metrics never wait behind streams.
//
// Lifetime: Start binds both ports and serves on background threads until Stop or the
// destructor. Thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/status.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/tokenizer.h"
#include "recorder/capture_policy.h"
#include "server/capture.h"
#include "server/capture_queue.h"
#include "server/metrics.h"
#include "server/openai.h"

namespace httplib {
class Server;
}

namespace lockstep::server {

class Scheduler;
class RequestRing;

struct ServerOptions {
  std::string host = "127.0.0.1";  // loopback unless asked: the API has no authentication
  int port = 8000;                 // 0: any free port (tests)
  int admin_port = 8001;           // 0: any free port
  std::string model_name = "lockstep";  // what /v1/models lists and responses name
  std::shared_ptr<engine::Model> model;
  std::shared_ptr<const engine::Tokenizer> tokenizer;  // required: the API speaks text
  std::vector<int32_t> eos_ids;
  ChatTemplate chat_template;
  engine::EngineOptions engine;
  Limits limits;
  int max_concurrent = 64;         // generation requests in flight; more → 429
  size_t max_body_bytes = 1 << 20;
  std::filesystem::path capture_dir;  // empty: captures refused
  std::string admin_token;            // empty: /admin/* and capture triggers refused
  bool capture_redact = false;
  size_t ring_bytes = 64 << 20;
  bool record = true;  // false (--no-record): no live records, so no captures and no degeneration check
  bool tap_summaries = true;  // with record: per-tap summaries in every record (--no-tap-summaries: off)
  // Captures wait here behind the one running (server/capture_queue.h); more are refused (503).
  size_t capture_queue = 8;
  // Tests: called on the capture thread with the request id before each re-run starts.
  std::function<void(const std::string&)> on_capture_start;
  bool capture_on_degeneration = true;
  int64_t degeneration_min_tokens = 64;  // shorter generations are not judged
  recorder::CapturePolicy::Mode degeneration_capture_mode = recorder::CapturePolicy::Mode::kSummary;
  std::map<std::string, std::string> trace_meta;  // model fingerprint, build, … into every trace
  bool quiet = false;
};

class Server {
 public:
  static Result<std::unique_ptr<Server>> Start(ServerOptions options);
  ~Server();
  void Stop();  // idempotent; may run on any thread, also while another thread is in Wait
  void Wait();  // until Stop (from another thread or a signal handler's helper) or a listener ends
  int port() const { return port_; }
  int admin_port() const { return admin_port_; }
  const Metrics& metrics() const { return metrics_; }

  // Captures a request still in the ring (the admin endpoint, the tests): queues it for the
  // capture thread and blocks the caller (not the scheduler) until the trace is written and
  // verified. `*refused` (when given) says the queue was full and nothing was queued.
  Result<CaptureResult> Capture(const std::string& request_id, const std::string& trigger,
                                recorder::CapturePolicy::Mode mode, bool* refused = nullptr);

 private:
  explicit Server(ServerOptions options);
  void Routes();
  void OnFinished(std::shared_ptr<const class LiveRecord> rec);
  Result<CaptureResult> RunCapture(const class LiveRecord& rec, const std::string& trigger,
                                   recorder::CapturePolicy::Mode mode);  // capture thread
  bool Authorized(const std::string& authorization, const std::string& token_header) const;

  ServerOptions opts_;
  CaptureOptions capture_opts_;
  Metrics metrics_;
  std::unique_ptr<RequestRing> ring_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<CaptureQueue> captures_;  // destroyed before the scheduler (Stop)
  std::unique_ptr<httplib::Server> api_, admin_;
  std::thread api_thread_, admin_thread_;  // joined by Stop only
  std::mutex stop_mu_;                      // one Stop at a time
  std::mutex wait_mu_;
  std::condition_variable wait_cv_;
  bool stopped_ = false;                    // under wait_mu_
  std::atomic<bool> api_ended_{false}, admin_ended_{false};  // its listener loop returned
  int port_ = 0, admin_port_ = 0;
  std::atomic<int> inflight_{0};
  std::atomic<uint64_t> next_id_{0};
  uint64_t id_salt_ = 0;
  friend struct Handlers;
};

}  // namespace lockstep::server
