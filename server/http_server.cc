// server/http_server.cc — see http_server.h.
#include "base/json_text.h"
#include "server/http_server.h"

#include <httplib.h>

#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <tuple>
#include <cctype>
#include <cstdlib>
#include <memory>
#include <chrono>
#include <future>
#include <iostream>
#include <random>

#include <nlohmann/json.hpp>

#include "diff/degeneration.h"
#include "server/live_record.h"
#include "server/scheduler.h"

namespace lockstep::server {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kReplacement = "\xEF\xBF\xBD";  // U+FFFD: an incomplete UTF-8 tail

void SendError(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(e.Body(), "application/json");
}

ApiError Err(int status, std::string message, std::string type, std::string code = "") {
  ApiError e;
  e.status = status;
  e.message = std::move(message);
  e.type = std::move(type);
  e.code = std::move(code);
  return e;
}

int64_t UnixNow() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// One choice's text as it grows: the decoded tokens, minus what must be held back (an
// incomplete UTF-8 character, a possible start of a stop string), cut at a stop string.
struct ChoiceText {
  std::vector<int32_t> tokens;
  std::string emitted;  // sent (streaming) so far
  std::string text;     // the current visible text
  bool finished = false;
  bool stopped_by_string = false;
  std::string finish_reason;
  std::vector<double> logprobs;
  std::vector<std::vector<std::pair<int32_t, double>>> top;

  // Returns the newly visible text.
  std::string Add(const engine::Tokenizer& tok, const std::vector<std::string>& stops, bool final) {
    std::string full = tok.Decode(tokens, /*skip_special_tokens=*/true);
    size_t hold = 0;
    for (const auto& s : stops) {
      const size_t from = text.size() > s.size() ? text.size() - s.size() : 0;
      const size_t at = full.find(s, from);
      if (at != std::string::npos) {
        full.resize(at);
        stopped_by_string = true;
        final = true;
        break;
      }
      hold = std::max(hold, s.size() - 1);
    }
    if (!final) {
      if (full.size() >= 3 && full.compare(full.size() - 3, 3, kReplacement) == 0) hold = std::max<size_t>(hold, 3);
      const size_t visible = full.size() > hold ? full.size() - hold : 0;
      full.resize(std::max(visible, emitted.size()));
    }
    text = full;
    if (text.size() < emitted.size() || text.compare(0, emitted.size(), emitted) != 0) return "";
    std::string delta = text.substr(emitted.size());
    emitted = text;
    return delta;
  }
};

// HTTP/1.1 (RFC 9112 §6.3): a request with neither Content-Length nor Transfer-Encoding has
// no body. cpp-httplib 0.11 instead reads such a POST's body to the end of the connection,
// before any route: `curl -X POST …/admin/capture/ID` (no -d) waited for the 30 s read timeout
// and got a bare 400, which hid the route's own 401 (bad token) and 404 (unknown id). So every
// POST route takes a content-reader handler, which the library calls before it reads
// anything, and reads a body only when the request announces one.
using BodyHandler = std::function<void(const httplib::Request&, httplib::Response&, const std::string& body)>;

bool AnnouncesBody(const httplib::Request& req) {
  std::string te = req.get_header_value("Transfer-Encoding");
  std::transform(te.begin(), te.end(), te.begin(), [](unsigned char c) { return std::tolower(c); });
  if (te.find("chunked") != std::string::npos) return true;
  // The library reads Content-Length with strtoull as well: what it reads as 0 has no body.
  return std::strtoull(req.get_header_value("Content-Length").c_str(), nullptr, 10) > 0;
}

httplib::Server::HandlerWithContentReader WithBody(BodyHandler handler) {
  return [handler = std::move(handler)](const httplib::Request& req, httplib::Response& res,
                                        const httplib::ContentReader& read) {
    std::string body;
    if (AnnouncesBody(req)) {
      bool ok = false;
      const bool multipart = req.is_multipart_form_data();
      if (multipart) {  // read (and drop) it, so that the connection stays in step
        ok = read([](const httplib::MultipartFormData&) { return true; }, [](const char*, size_t) { return true; });
      } else {
        ok = read([&body](const char* data, size_t n) {
          body.append(data, n);
          return true;
        });
      }
      if (!ok) {  // the library set 413 (over --max-body-kb) or 400
        const bool big = res.status == 413;
        return SendError(res, Err(big ? 413 : 400,
                                  big ? "the request body is larger than the server's limit (--max-body-kb)"
                                      : "the request body could not be read",
                                  "invalid_request_error"));
      }
      if (multipart) return SendError(res, Err(400, "the request body must be JSON, not multipart/form-data", "invalid_request_error"));
    }
    handler(req, res, body);
  };
}

std::string NewRequestId(uint64_t salt, uint64_t n) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "req-%08llx%08llx", static_cast<unsigned long long>(salt & 0xffffffffu),
                static_cast<unsigned long long>(n));
  return buf;
}

}  // namespace

Server::Server(ServerOptions options) : opts_(std::move(options)) {}

Server::~Server() { Stop(); }

// Stop runs once at a time (stop_mu_) and is the only one that joins the listener threads:
// `lockstep serve` calls it from a signal's helper thread while its main thread is in Wait and
// then again from the destructor. (Wait used to join the same threads as Stop: a SIGTERM
// could leave the main thread joining a thread Stop had joined already, forever.)
void Server::Stop() {
  std::lock_guard<std::mutex> stopping(stop_mu_);
  // cpp-httplib's stop() does nothing before the listener's loop has started: wait for it
  // (or for the loop to have ended on its own), or a Stop right after Start would join forever.
  const std::array<std::tuple<httplib::Server*, std::thread*, std::atomic<bool>*>, 2> listeners = {
      std::tuple{api_.get(), &api_thread_, &api_ended_}, std::tuple{admin_.get(), &admin_thread_, &admin_ended_}};
  for (auto [srv, thread, ended] : listeners) {
    if (!srv) continue;
    while (thread->joinable() && !srv->is_running() && !ended->load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    srv->stop();
  }
  if (api_thread_.joinable()) api_thread_.join();
  if (admin_thread_.joinable()) admin_thread_.join();
  captures_.reset();  // finishes the capture in progress; queued ones are answered "stopping"
  scheduler_.reset();
  {
    std::lock_guard<std::mutex> lock(wait_mu_);
    stopped_ = true;
  }
  wait_cv_.notify_all();
}

void Server::Wait() {
  std::unique_lock<std::mutex> lock(wait_mu_);
  wait_cv_.wait(lock, [this] { return stopped_ || api_ended_.load() || admin_ended_.load(); });
}

Result<std::unique_ptr<Server>> Server::Start(ServerOptions options) {
  if (!options.model) return Status::InvalidArgument("serve: no model");
  if (!options.tokenizer) return Status::InvalidArgument("serve: the model directory has no tokenizer.json");
  std::unique_ptr<Server> s(new Server(std::move(options)));
  ServerOptions& o = s->opts_;
  if (!o.capture_dir.empty()) LS_RETURN_IF_ERROR(MakePrivateDir(o.capture_dir));
  s->capture_opts_.dir = o.capture_dir;
  s->capture_opts_.engine = o.engine;
  s->capture_opts_.trace_meta = o.trace_meta;
  s->capture_opts_.redact = o.capture_redact;
  auto tok = o.tokenizer;
  s->capture_opts_.detokenize = [tok](const std::vector<int32_t>& ids) { return tok->Decode(ids); };
  s->ring_ = std::make_unique<RequestRing>(o.ring_bytes);
  s->id_salt_ = std::random_device{}();

  Scheduler::Options so;
  so.engine = o.engine;
  so.record = o.record;
  so.tap_summaries = o.tap_summaries;
  Server* self = s.get();
  so.on_finished = [self](std::shared_ptr<const LiveRecord> rec) { self->OnFinished(std::move(rec)); };
  LS_ASSIGN_OR_RETURN(s->scheduler_, Scheduler::Start(o.model, so));
  s->captures_ = std::make_unique<CaptureQueue>(o.capture_queue);

  s->api_ = std::make_unique<httplib::Server>();
  s->admin_ = std::make_unique<httplib::Server>();
  // Streams hold a worker each for their whole life: the pool must outnumber the streams
  // admitted, or admitted requests would queue invisibly behind them.
  const size_t api_workers = static_cast<size_t>(o.max_concurrent) + 8;
  s->api_->new_task_queue = [api_workers] { return new httplib::ThreadPool(api_workers); };
  // Admin workers: 4 for /health and /metrics, plus one per capture that may be waiting for
  // its verdict (running + queued), so that waiting captures never starve /metrics.
  const size_t admin_workers = 4 + o.capture_queue + 1;
  s->admin_->new_task_queue = [admin_workers] { return new httplib::ThreadPool(admin_workers); };
  // cpp-httplib listens with a backlog of 5 (CPPHTTPLIB_LISTEN_BACKLOG, compiled into Debian's
  // library): 64 clients connecting at once overflow it and the kernel resets some of them
  // (seen on the 16-core GPU machine). The socket-options hook sees each listening socket
  // before bind; after bind a second listen() raises the backlog (Linux applies it).
  auto listen_fds = std::make_shared<std::array<int, 2>>(std::array<int, 2>{-1, -1});
  int which = 0;
  for (auto* srv : {s->api_.get(), s->admin_.get()}) {
    srv->set_socket_options([listen_fds, which](int sock) {
      int yes = 1;
      setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
      (*listen_fds)[which] = sock;
    });
    ++which;
    srv->set_tcp_nodelay(true);
    srv->set_payload_max_length(o.max_body_bytes);
    srv->set_read_timeout(30, 0);
  }
  s->Routes();
  s->port_ = o.port == 0 ? s->api_->bind_to_any_port(o.host) : (s->api_->bind_to_port(o.host, o.port) ? o.port : -1);
  if (s->port_ <= 0) return Status::IoError("serve: cannot listen on " + o.host + ":" + std::to_string(o.port));
  s->admin_port_ =
      o.admin_port == 0 ? s->admin_->bind_to_any_port(o.host) : (s->admin_->bind_to_port(o.host, o.admin_port) ? o.admin_port : -1);
  if (s->admin_port_ <= 0) {
    return Status::IoError("serve: cannot listen on " + o.host + ":" + std::to_string(o.admin_port) + " (admin)");
  }
  for (int fd : *listen_fds) {
    if (fd >= 0) ::listen(fd, SOMAXCONN);
  }
  // A listener that ends on its own (not through Stop) wakes Wait, whose caller then stops.
  auto listen = [self](httplib::Server* srv, std::atomic<bool>* ended) {
    srv->listen_after_bind();
    {
      std::lock_guard<std::mutex> lock(self->wait_mu_);
      ended->store(true);
    }
    self->wait_cv_.notify_all();
  };
  s->api_thread_ = std::thread(listen, s->api_.get(), &s->api_ended_);
  s->admin_thread_ = std::thread(listen, s->admin_.get(), &s->admin_ended_);
  return s;
}

bool Server::Authorized(const std::string& authorization, const std::string& token_header) const {
  if (opts_.admin_token.empty()) return false;
  auto eq = [](const std::string& a, const std::string& b) {  // constant time in the length of b
    if (a.size() != b.size()) return false;
    unsigned char d = 0;
    for (size_t i = 0; i < a.size(); ++i) d |= static_cast<unsigned char>(a[i] ^ b[i]);
    return d == 0;
  };
  if (!token_header.empty() && eq(token_header, opts_.admin_token)) return true;
  const std::string bearer = "Bearer ";
  return authorization.rfind(bearer, 0) == 0 && eq(authorization.substr(bearer.size()), opts_.admin_token);
}

void Server::OnFinished(std::shared_ptr<const LiveRecord> rec) {
  // Scheduler thread: keep it cheap.
  metrics_.CountFinished(rec->finish_reason);
  if (!opts_.record) return;
  ring_->Add(rec);
  if (static_cast<int64_t>(rec->steps.size()) < opts_.degeneration_min_tokens) return;
  const std::vector<int32_t> toks = rec->tokens();
  if (!diff::DetectDegeneration(toks).degenerate) return;
  ++metrics_.degenerations;
  if (!opts_.quiet) std::cerr << "lockstep serve: request " << rec->id << " degenerated (loop or collapse)\n";
  if (!opts_.capture_on_degeneration || opts_.capture_dir.empty()) return;
  // On the capture thread; this one goes back to stepping at once.
  const bool queued = captures_->Submit(
      {[this, rec] { (void)RunCapture(*rec, "degeneration", opts_.degeneration_capture_mode); }, nullptr});
  metrics_.capture_queue = static_cast<int64_t>(captures_->queued());
  if (!queued) {
    ++metrics_.captures_refused;
    std::cerr << "lockstep serve: degeneration capture of " << rec->id << " refused: the capture queue is full ("
              << captures_->max_queued() << " waiting)\n";
  }
}

Result<CaptureResult> Server::RunCapture(const LiveRecord& rec, const std::string& trigger,
                                         recorder::CapturePolicy::Mode mode) {
  metrics_.capture_queue = static_cast<int64_t>(captures_->queued());
  if (opts_.on_capture_start) opts_.on_capture_start(rec.id);
  auto r = CaptureRequest(scheduler_->model(), rec, trigger, mode, capture_opts_);
  if (!r.ok()) {
    std::cerr << "lockstep serve: capture of " << rec.id << " failed: " << r.status().message() << "\n";
    return r;
  }
  metrics_.CountCapture(trigger);
  metrics_.capture_bytes += static_cast<int64_t>(r->bytes);
  if (!r->verified) {
    ++metrics_.capture_verify_failures;
    std::cerr << "lockstep serve: *** CAPTURE DID NOT VERIFY *** request " << rec.id << " (" << trigger
              << "): the offline re-run differs from the live run at " << r->detail << "; trace " << r->trace.string()
              << " is NOT the live request's numbers\n";
  } else if (!opts_.quiet) {
    std::cerr << "lockstep serve: captured " << rec.id << " (" << trigger << ", " << r->mode << ") to "
              << r->trace.string() << ": " << r->detail << "\n";
  }
  return r;
}

Result<CaptureResult> Server::Capture(const std::string& request_id, const std::string& trigger,
                                      recorder::CapturePolicy::Mode mode, bool* refused) {
  if (refused) *refused = false;
  if (opts_.capture_dir.empty()) return Status::Unsupported("captures are off: start the server with --capture-dir");
  if (!opts_.record) return Status::Unsupported("captures are off: the server runs with --no-record");
  auto rec = ring_->Find(request_id);
  if (!rec) return Status::NotFound("request '" + request_id + "' is not in the ring (unknown, or evicted)");
  auto promise = std::make_shared<std::promise<Result<CaptureResult>>>();
  auto fut = promise->get_future();
  const bool queued = captures_->Submit(
      {[this, rec, trigger, mode, promise] { promise->set_value(RunCapture(*rec, trigger, mode)); },
       [promise] { promise->set_value(Status::Internal("the server is stopping; the capture did not run")); }});
  metrics_.capture_queue = static_cast<int64_t>(captures_->queued());
  if (!queued) {
    ++metrics_.captures_refused;
    if (refused) *refused = true;
    return Status::Unsupported("the capture queue is full (one running, " + std::to_string(captures_->max_queued()) +
                               " waiting): capture '" + request_id + "' again later, while it is still in the ring");
  }
  return fut.get();
}

namespace {

json CaptureJson(const Result<CaptureResult>& r) {
  if (!r.ok()) return {{"error", r.status().message()}};
  return {{"request_id", r->request_id}, {"trace", r->trace.string()}, {"live_record", r->live_json.string()},
          {"mode", r->mode},           {"verified", r->verified},     {"detail", r->detail}};
}

// OpenAI's logprobs objects for tokens [from, to) of a choice: chat's {"content": [{token,
// logprob, bytes, top_logprobs}]}, completions' {tokens, token_logprobs, top_logprobs,
// text_offset} with offsets counted from `offset` (the text before token `from`). A streaming
// chunk carries the tokens that arrived since the previous chunk; the non-streaming body, all.
// With `ids` (vLLM's return_tokens_as_token_ids) every token reads "token_id:N": one piece of
// text can be several tokens, and an importer needs the ids.
json LogprobsJson(const engine::Tokenizer& tok, const ChoiceText& c, bool chat, int top_n, size_t from, size_t to,
                  size_t* offset, bool ids) {
  auto piece = [&](int32_t id) { return ids ? "token_id:" + std::to_string(id) : tok.Decode(std::vector<int32_t>{id}); };
  auto bytes = [](const std::string& p) {
    json b = json::array();
    for (unsigned char ch : p) b.push_back(static_cast<int>(ch));
    return b;
  };
  to = std::min({to, c.logprobs.size(), c.tokens.size()});
  if (chat) {
    json content = json::array();
    for (size_t i = from; i < to; ++i) {
      json top = json::array();
      for (const auto& [id, lp] : c.top[i]) {
        const std::string p = piece(id);
        top.push_back({{"token", p}, {"logprob", lp}, {"bytes", bytes(p)}});
      }
      const std::string p = piece(c.tokens[i]);
      content.push_back({{"token", p}, {"logprob", c.logprobs[i]}, {"bytes", bytes(p)}, {"top_logprobs", top}});
    }
    return {{"content", content}};
  }
  json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  for (size_t i = from; i < to; ++i) {
    const std::string p = piece(c.tokens[i]);
    tokens.push_back(p);
    lps.push_back(c.logprobs[i]);
    offsets.push_back(*offset);
    *offset += p.size();
    json t = json::object();
    for (const auto& [id, lp] : c.top[i]) t[piece(id)] = lp;
    tops.push_back(top_n > 0 ? t : json(nullptr));
  }
  return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

}  // namespace

void Server::Routes() {
  auto with_id = [this](const httplib::Request& req, httplib::Response& res) {
    std::string id = req.get_header_value("x-request-id");
    if (!SafeRequestId(id)) id = NewRequestId(id_salt_, next_id_++);
    res.set_header("x-request-id", id);
    return id;
  };
  auto health = [with_id](const httplib::Request& req, httplib::Response& res) {
    with_id(req, res);
    res.set_content("{\"status\":\"ok\"}", "application/json");
  };
  api_->Get("/health", health);
  admin_->Get("/health", health);
  for (auto* srv : {api_.get(), admin_.get()}) {
    srv->set_error_handler([with_id](const httplib::Request& req, httplib::Response& res) {
      with_id(req, res);
      if (!res.body.empty()) return;
      const bool nf = res.status == 404;
      SendError(res, Err(res.status, nf ? "no such endpoint: " + req.method + " " + req.path : "HTTP error " + std::to_string(res.status),
                         nf ? "not_found_error" : "invalid_request_error"));
    });
    srv->set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
      SendError(res, Err(500, "internal error", "server_error"));
    });
  }

  api_->Get("/v1/models", [this, with_id](const httplib::Request& req, httplib::Response& res) {
    with_id(req, res);
    json m = {{"id", opts_.model_name},
              {"object", "model"},
              {"created", UnixNow()},
              {"owned_by", "lockstep"},
              {"max_model_len", opts_.model->config().max_position_embeddings}};
    res.set_content(JsonText(json{{"object", "list"}, {"data", json::array({m})}}), "application/json");
  });

  auto generate = [this, with_id](bool chat) {
    return [this, with_id, chat](const httplib::Request& req, httplib::Response& res, const std::string& body) {
      const std::string rid = with_id(req, res);
      const auto t_arrive = Clock::now();
      GenerationRequest g;
      if (auto e = ParseGenerationRequest(body, chat, req.get_header_value("X-Lockstep-Capture"), *opts_.tokenizer,
                                          opts_.chat_template, opts_.limits, &g)) {
        return SendError(res, *e);
      }
      if (!g.capture.empty()) {
        if (opts_.capture_dir.empty() || !opts_.record) {
          return SendError(res, Err(400, opts_.record ? "captures are off: the server was started without --capture-dir"
                                                      : "captures are off: the server runs with --no-record",
                                    "invalid_request_error", "capture_disabled"));
        }
        if (!Authorized("", req.get_header_value("X-Lockstep-Token"))) {
          return SendError(res, Err(401, "a capture needs the admin token in X-Lockstep-Token",
                                    "authentication_error", "invalid_token"));
        }
      }
      if (inflight_.fetch_add(1) >= opts_.max_concurrent) {
        --inflight_;
        ++metrics_.rejected;
        res.set_header("Retry-After", "1");
        return SendError(res, Err(429, "the server is at capacity (" + std::to_string(opts_.max_concurrent) +
                                           " requests in flight); retry later",
                                  "rate_limit_error", "over_capacity"));
      }
      Submission sub;
      sub.id = rid;
      sub.prompt_text = opts_.capture_redact ? "" : g.prompt_text;
      sub.top_logprobs = g.top_logprobs;
      for (int i = 0; i < g.n; ++i) {
        engine::Request r;
        r.prompt = g.prompt;
        r.max_new_tokens = g.max_tokens;
        r.sampling = g.sampling;
        r.sampling.seed = g.sampling.seed + static_cast<uint64_t>(i);  // n choices: seed, seed+1, …
        if (!g.ignore_eos) r.stop_tokens = opts_.eos_ids;
        sub.choices.push_back(std::move(r));
      }
      metrics_.prompt_tokens += static_cast<int64_t>(g.prompt.size()) * g.n;
      auto stream = scheduler_->Submit(std::move(sub));
      const std::string object_id = (chat ? "chatcmpl-" : "cmpl-") + rid;
      const int64_t created = UnixNow();
      const std::string model_name = g.model.empty() ? opts_.model_name : g.model;

      // State shared by both paths; `pump` reads one event and updates it. Returns false when
      // every choice has finished.
      struct State {
        std::vector<ChoiceText> choices;
        int open = 0;
        int64_t completion_tokens = 0;
        Clock::time_point last_token;
        bool first = true;
        std::string error;
      };
      auto st = std::make_shared<State>();
      st->choices.resize(g.n);
      st->open = g.n;
      auto pump = [this, st, stream, g, t_arrive](std::vector<std::pair<int, std::string>>* deltas) {
        TokenEvent ev;
        if (!stream->Next(&ev, std::chrono::milliseconds(100))) return true;
        ChoiceText& c = st->choices[ev.index];
        if (c.finished) return st->open > 0;
        if (!ev.error.empty()) st->error = ev.error;
        if (ev.token >= 0) {
          const auto now = Clock::now();
          if (st->first) {
            metrics_.ttft.Observe(std::chrono::duration<double>(now - t_arrive).count());
            st->first = false;
          } else {
            metrics_.itl.Observe(std::chrono::duration<double>(now - st->last_token).count());
          }
          st->last_token = now;
          ++metrics_.generation_tokens;
          ++st->completion_tokens;
          c.tokens.push_back(ev.token);
          if (g.top_logprobs >= 0) {
            c.logprobs.push_back(ev.logprob);
            c.top.push_back(ev.top_logprobs);
          }
        }
        std::string d = c.Add(*opts_.tokenizer, g.stop, ev.finished);
        if (c.stopped_by_string && !ev.finished) {
          stream->Cancel(ev.index);  // the engine stops it at the next step boundary
          ev.finished = true;
        }
        if (ev.finished) {
          c.finished = true;
          c.finish_reason = c.stopped_by_string ? "stop" : ev.finish_reason == "abort" ? "stop" : ev.finish_reason;
          if (ev.finish_reason == "error") c.finish_reason = "error";
          --st->open;
        }
        if (deltas && (!d.empty() || ev.finished)) deltas->emplace_back(ev.index, d);
        return st->open > 0;
      };
      auto usage = [st, g]() {
        return json{{"prompt_tokens", static_cast<int64_t>(g.prompt.size())},
                    {"completion_tokens", st->completion_tokens},
                    {"total_tokens", static_cast<int64_t>(g.prompt.size()) + st->completion_tokens}};
      };
      auto captures = [this, g, rid]() {
        json out = json::array();
        if (g.capture.empty()) return out;
        const auto mode = g.capture == "full" ? recorder::CapturePolicy::Mode::kFull : recorder::CapturePolicy::Mode::kSummary;
        for (int i = 0; i < g.n; ++i) {
          const std::string id = g.n == 1 ? rid : rid + "-" + std::to_string(i);
          out.push_back(CaptureJson(Capture(id, "request", mode)));
        }
        return out;
      };
      auto done = [this, t_arrive]() {
        metrics_.e2e.Observe(std::chrono::duration<double>(Clock::now() - t_arrive).count());
        --inflight_;
      };

      if (!g.stream) {
        while (pump(nullptr)) {
        }
        done();
        if (!st->error.empty()) return SendError(res, Err(400, st->error, "invalid_request_error"));
        json choices = json::array();
        for (int i = 0; i < g.n; ++i) {
          const ChoiceText& c = st->choices[i];
          size_t offset = 0;
          json lp = g.top_logprobs >= 0
                        ? LogprobsJson(*opts_.tokenizer, c, chat, g.top_logprobs, 0, c.tokens.size(), &offset, g.tokens_as_ids)
                        : json(nullptr);
          if (chat) {
            choices.push_back({{"index", i},
                               {"message", {{"role", "assistant"}, {"content", c.text}}},
                               {"logprobs", lp},
                               {"finish_reason", c.finish_reason}});
          } else {
            choices.push_back({{"index", i}, {"text", c.text}, {"logprobs", lp}, {"finish_reason", c.finish_reason}});
          }
          if (g.return_token_ids) {
            choices.back()["prompt_token_ids"] = g.prompt;
            choices.back()["token_ids"] = c.tokens;
          }
        }
        json body = {{"id", object_id},
                     {"object", chat ? "chat.completion" : "text_completion"},
                     {"created", created},
                     {"model", model_name},
                     {"choices", choices},
                     {"usage", usage()}};
        if (!g.capture.empty()) body["lockstep"] = {{"captures", captures()}};
        res.set_content(JsonText(body), "application/json");
        return;
      }

      res.set_header("Cache-Control", "no-cache");
      res.set_chunked_content_provider(
          "text/event-stream",
          [=, this](size_t, httplib::DataSink& sink) {
            auto send = [&](const json& j) {
              const std::string line = "data: " + JsonText(j) + "\n\n";
              return sink.write(line.data(), line.size());
            };
            auto chunk = [&](json choices) {
              return json{{"id", object_id},
                          {"object", chat ? "chat.completion.chunk" : "text_completion"},
                          {"created", created},
                          {"model", model_name},
                          {"choices", std::move(choices)}};
            };
            bool ok = true;
            if (chat) {  // the role comes first, as OpenAI sends it
              json first = json::array();
              for (int i = 0; i < g.n; ++i) {
                first.push_back({{"index", i}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr},
                                 {"finish_reason", nullptr}});
              }
              ok = send(chunk(first));
            }
            bool more = true;
            // Per choice: tokens whose logprobs went out, and the text offset they reached.
            std::vector<size_t> lp_sent(g.n, 0), lp_offset(g.n, 0);
            while (ok && more) {
              std::vector<std::pair<int, std::string>> deltas;
              more = pump(&deltas);
              if (!sink.is_writable()) ok = false;
              for (const auto& [i, d] : deltas) {
                if (!ok) break;
                const ChoiceText& c = st->choices[i];
                json fr = c.finished ? json(c.finish_reason) : json(nullptr);
                json lp = nullptr;
                if (g.top_logprobs >= 0 && c.tokens.size() > lp_sent[i]) {  // the tokens since the last chunk
                  lp = LogprobsJson(*opts_.tokenizer, c, chat, g.top_logprobs, lp_sent[i], c.tokens.size(), &lp_offset[i],
                                    g.tokens_as_ids);
                  lp_sent[i] = c.tokens.size();
                }
                json ch = chat ? json{{"index", i}, {"delta", {{"content", d}}}, {"logprobs", lp}, {"finish_reason", fr}}
                               : json{{"index", i}, {"text", d}, {"logprobs", lp}, {"finish_reason", fr}};
                ok = send(chunk(json::array({ch})));
              }
            }
            if (!ok) {  // client gone: free its batch slots at the next step
              stream->Cancel(-1);
              while (pump(nullptr)) {
              }
              done();
              sink.done();
              return false;
            }
            if (!st->error.empty()) {
              ApiError e = Err(400, st->error, "invalid_request_error");
              const std::string line = "data: " + e.Body() + "\n\n";
              sink.write(line.data(), line.size());
            }
            if (g.include_usage) {
              json u = chunk(json::array());
              u["usage"] = usage();
              send(u);
            }
            if (!g.capture.empty()) {
              json c = chunk(json::array());
              c["lockstep"] = {{"captures", captures()}};
              send(c);
            }
            // Out of flight before [DONE]: a client that sends its next request on [DONE] must
            // not find this one still counted against --max-concurrent (a spurious 429).
            done();
            const std::string end = "data: [DONE]\n\n";
            sink.write(end.data(), end.size());
            sink.done();
            return true;
          });
    };
  };
  api_->Post("/v1/completions", WithBody(generate(false)));
  api_->Post("/v1/chat/completions", WithBody(generate(true)));

  admin_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_.Render(scheduler_->running(), scheduler_->waiting(), scheduler_->kv_cache_usage()),
                    "text/plain; version=0.0.4; charset=utf-8");
  });
  // The body, if any, is ignored: `curl -X POST` with no -d is the documented call.
  admin_->Post(R"(/admin/capture/([A-Za-z0-9._-]+))", WithBody([this, with_id](const httplib::Request& req,
                                                                                httplib::Response& res, const std::string&) {
    with_id(req, res);
    if (!Authorized(req.get_header_value("Authorization"), req.get_header_value("X-Lockstep-Token"))) {
      return SendError(res, Err(401, opts_.admin_token.empty() ? "admin calls are off: start the server with --admin-token"
                                                                : "admin calls need the token (Authorization: Bearer …)",
                                "authentication_error", "invalid_token"));
    }
    const std::string id = req.matches[1];
    auto mode = recorder::CapturePolicy::Mode::kFull;
    if (req.has_param("mode") && req.get_param_value("mode") == "summary") mode = recorder::CapturePolicy::Mode::kSummary;
    bool refused = false;
    auto r = Capture(id, "admin", mode, &refused);
    if (refused) {
      res.set_header("Retry-After", "1");
      return SendError(res, Err(503, r.status().message(), "server_error", "capture_queue_full"));
    }
    if (!r.ok()) {
      const bool nf = r.status().code() == Status::Code::kNotFound;
      return SendError(res, Err(nf ? 404 : 400, r.status().message(), nf ? "not_found_error" : "invalid_request_error"));
    }
    res.set_content(JsonText(CaptureJson(r)), "application/json");
  }));

  // Any other POST/PUT/PATCH/DELETE: 404 at once, body or not (registered last: the library
  // tries content-reader routes in order, before it would read a body for the others).
  for (auto* srv : {api_.get(), admin_.get()}) {
    auto not_found = WithBody([with_id](const httplib::Request& req, httplib::Response& res, const std::string&) {
      with_id(req, res);
      SendError(res, Err(404, "no such endpoint: " + req.method + " " + req.path, "not_found_error"));
    });
    srv->Post(".*", not_found);
    srv->Put(".*", not_found);
    srv->Patch(".*", not_found);
    srv->Delete(".*", not_found);
  }
}

}  // namespace lockstep::server
