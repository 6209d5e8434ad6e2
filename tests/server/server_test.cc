// tests/server/server_test.cc — `lockstep serve` end to end: one in-process server on
// ephemeral loopback ports, driven with cpp-httplib's client, on the embedded tiny model.
#include <gtest/gtest.h>
#include <httplib.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <future>
#include <mutex>
#include <set>
#include <fstream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "recorder/fingerprint.h"
#include "replayer/replay_session.h"
#include "server/http_server.h"
#include "server/scheduler.h"
#include "tests/test_util.h"
#include "traces/trace_reader.h"

namespace lockstep::server {
namespace {

using json = nlohmann::json;
constexpr const char* kToken = "test-admin-token";
constexpr const char* kLoopPrompt = "<!DOCTYPE html>\n<html>\n<head>\n<title>Counter</title>";

// Holds captures of requests named "held-…" at their start, until released: lets a test
// look at the server while a capture is in progress.
struct CaptureGate {
  std::mutex mu;
  std::condition_variable cv;
  bool hold = false;
  std::set<std::string> started;
  void OnStart(const std::string& id) {
    if (id.rfind("held-", 0) != 0) return;
    std::unique_lock<std::mutex> lock(mu);
    started.insert(id);
    cv.notify_all();
    cv.wait(lock, [&] { return !hold; });
  }
  bool WaitStarted(const std::string& id) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(60), [&] { return started.count(id) > 0; });
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu);
      hold = false;
    }
    cv.notify_all();
  }
};
CaptureGate g_gate;

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const auto dir = testing::SourceDir() / "models" / "lockstep-tiny-v32";
    auto model = engine::Model::Load(dir);
    ASSERT_TRUE(model.ok()) << model.status().message();
    auto tok = engine::Tokenizer::Load(dir / "tokenizer.json");
    ASSERT_TRUE(tok.ok()) << tok.status().message();
    capture_dir_ = new std::filesystem::path(std::filesystem::temp_directory_path() /
                                             ("lockstep-serve-test-" + std::to_string(::getpid())) / "caps");
    std::filesystem::remove_all(capture_dir_->parent_path());
    ServerOptions o;
    o.port = 0;
    o.admin_port = 0;
    o.model = *model;
    o.tokenizer = *tok;
    for (int64_t e : (*model)->config().eos_token_ids) o.eos_ids.push_back(static_cast<int32_t>(e));
    o.engine.max_batch = 8;
    o.engine.kv_cache_tokens = 1 << 14;
    o.capture_dir = *capture_dir_;
    o.admin_token = kToken;
    o.quiet = true;
    o.capture_queue = 2;
    o.on_capture_start = [](const std::string& id) { g_gate.OnStart(id); };
    auto fp = recorder::ModelFingerprint(dir);
    ASSERT_TRUE(fp.ok());
    o.trace_meta = {{"model_dir", std::filesystem::absolute(dir).string()}, {"model_fingerprint", *fp}};
    auto s = Server::Start(std::move(o));
    ASSERT_TRUE(s.ok()) << s.status().message();
    server_ = s->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    std::filesystem::remove_all(capture_dir_->parent_path());
    delete capture_dir_;
  }
  static httplib::Client Api() {
    httplib::Client c("127.0.0.1", server_->port());
    c.set_read_timeout(60, 0);
    return c;
  }
  static httplib::Client Admin() {
    httplib::Client c("127.0.0.1", server_->admin_port());
    c.set_read_timeout(60, 0);
    return c;
  }
  static json Complete(json body, httplib::Headers h = {}, std::string* request_id = nullptr) {
    auto r = Api().Post("/v1/completions", h, body.dump(), "application/json");
    EXPECT_TRUE(r) << "no response";
    if (!r) return {};
    EXPECT_EQ(r->status, 200) << r->body;
    if (request_id) *request_id = r->get_header_value("x-request-id");
    return json::parse(r->body);
  }
  static std::string Text(const json& j) { return j["choices"][0]["text"].get<std::string>(); }
  static Server* server_;
  static std::filesystem::path* capture_dir_;
};
Server* ServerTest::server_ = nullptr;
std::filesystem::path* ServerTest::capture_dir_ = nullptr;

TEST_F(ServerTest, HealthAndModelsOnBothListeners) {
  auto h = Admin().Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  auto m = Api().Get("/v1/models");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 200);
  EXPECT_EQ(json::parse(m->body)["data"][0]["object"], "model");
  EXPECT_FALSE(m->get_header_value("x-request-id").empty());
}

TEST_F(ServerTest, CompletionNonStreamingHasUsageAndRequestId) {
  std::string rid;
  json j = Complete({{"prompt", "<!DOCTYPE html>"}, {"max_tokens", 12}, {"temperature", 0}}, {}, &rid);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_FALSE(Text(j).empty());
  EXPECT_EQ(j["usage"]["completion_tokens"], 12);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(rid.rfind("req-", 0), 0u) << rid;
  // A caller's id is kept.
  std::string mine;
  Complete({{"prompt", "a"}, {"max_tokens", 2}}, {{"x-request-id", "my-id-1"}}, &mine);
  EXPECT_EQ(mine, "my-id-1");
}

TEST_F(ServerTest, StreamingEqualsNonStreamingAndEndsWithDone) {
  json body = {{"prompt", "<html>"}, {"max_tokens", 16}, {"temperature", 0.7}, {"seed", 3}};
  const std::string whole = Text(Complete(body));
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  auto r = Api().Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  std::string streamed;
  bool done = false, usage = false;
  std::istringstream in(r->body);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("data: ", 0) != 0) continue;
    const std::string data = line.substr(6);
    if (data == "[DONE]") {
      done = true;
      continue;
    }
    json c = json::parse(data);
    if (c.contains("usage")) usage = true;
    for (const auto& ch : c["choices"]) streamed += ch["text"].get<std::string>();
  }
  EXPECT_TRUE(done);
  EXPECT_TRUE(usage);
  EXPECT_EQ(streamed, whole);
}

TEST_F(ServerTest, ChatCompletion) {
  json body = {{"messages", json::array({{{"role", "user"}, {"content", "Write a page."}}})}, {"max_completion_tokens", 8}};
  auto r = Api().Post("/v1/chat/completions", body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
}

TEST_F(ServerTest, SameSeedSameText) {
  json body = {{"prompt", "<!DOCTYPE html>"}, {"max_tokens", 24}, {"temperature", 0.9}, {"seed", 11}};
  EXPECT_EQ(Text(Complete(body)), Text(Complete(body)));
}

// The engine is batch-invariant: a request's text does not depend on who shares its steps.
TEST_F(ServerTest, BatchInvariantThroughTheServer) {
  json body = {{"prompt", "<html>\n<body>"}, {"max_tokens", 24}, {"temperature", 0.8}, {"seed", 5}};
  const std::string alone = Text(Complete(body));
  std::vector<std::thread> others;
  for (int i = 0; i < 7; ++i) {
    others.emplace_back([i] {
      Complete({{"prompt", std::string(i + 1, 'x') + " <div>"}, {"max_tokens", 20 + i}, {"temperature", 1.0}, {"seed", 100 + i}});
    });
  }
  const std::string together = Text(Complete(body));
  for (auto& t : others) t.join();
  EXPECT_EQ(alone, together);
}

// Chunked prefill (--max-prefill-tokens 3): the same text as the unchunked server for the same
// seed, and a capture of a chunked request verifies and records where its chunks began.
TEST_F(ServerTest, ChunkedPrefillGivesTheSameTextAndVerifiedCaptures) {
  const auto dir = testing::SourceDir() / "models" / "lockstep-tiny-v32";
  auto tok = engine::Tokenizer::Load(dir / "tokenizer.json");
  ASSERT_TRUE(tok.ok());
  auto model = engine::Model::Load(dir);
  ASSERT_TRUE(model.ok());
  const auto caps = capture_dir_->parent_path() / "chunked-caps";
  ServerOptions o;
  o.port = 0;
  o.admin_port = 0;
  o.model = *model;
  o.tokenizer = *tok;
  for (int64_t e : (*model)->config().eos_token_ids) o.eos_ids.push_back(static_cast<int32_t>(e));
  o.engine.max_batch = 4;
  o.engine.max_prefill_tokens = 3;
  o.engine.kv_cache_tokens = 1 << 13;
  o.capture_dir = caps;
  o.admin_token = kToken;
  o.quiet = true;
  auto fp = recorder::ModelFingerprint(dir);
  ASSERT_TRUE(fp.ok());
  o.trace_meta = {{"model_dir", std::filesystem::absolute(dir).string()}, {"model_fingerprint", *fp}};
  auto chunked = Server::Start(std::move(o));
  ASSERT_TRUE(chunked.ok()) << chunked.status().message();
  httplib::Client c("127.0.0.1", (*chunked)->port());
  c.set_read_timeout(60, 0);
  const json body = {{"prompt", "<!DOCTYPE html>\n<html lang=\"en\">\n<head>"}, {"max_tokens", 16},
                     {"temperature", 0.8}, {"seed", 21}};
  auto r = c.Post("/v1/completions", {{"X-Lockstep-Capture", "full"}, {"X-Lockstep-Token", kToken},
                                      {"x-request-id", "chunked-1"}},
                  body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(Text(j), Text(Complete(body)));  // the unchunked fixture server
  const json& cap = j["lockstep"]["captures"][0];
  EXPECT_TRUE(cap["verified"].get<bool>()) << cap.dump();
  std::ifstream live(caps / "chunked-1.live.json");
  ASSERT_TRUE(live.good());
  const json lj = json::parse(live);
  ASSERT_TRUE(lj.contains("prompt_chunks")) << lj.dump().substr(0, 400);
  const auto chunks = lj["prompt_chunks"].get<std::vector<int64_t>>();
  ASSERT_GE(chunks.size(), 2u);
  EXPECT_EQ(chunks[0], 0);
  EXPECT_EQ(chunks[1], 3);
}

TEST_F(ServerTest, MalformedJsonIs400WithEnvelope) {
  auto r = Api().Post("/v1/completions", "{not json", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  json j = json::parse(r->body);
  EXPECT_TRUE(j["error"]["message"].is_string());
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  EXPECT_TRUE(j["error"].contains("param"));
  EXPECT_TRUE(j["error"].contains("code"));
  EXPECT_FALSE(r->get_header_value("x-request-id").empty());
  auto bad = Api().Post("/v1/completions", json{{"prompt", "a"}, {"temperature", "hot"}}.dump(), "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  EXPECT_EQ(json::parse(bad->body)["error"]["param"], "temperature");
}

TEST_F(ServerTest, CaptureNeedsTheToken) {
  auto r = Api().Post("/v1/completions", {{"X-Lockstep-Capture", "full"}}, json{{"prompt", "a"}, {"max_tokens", 2}}.dump(),
                      "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  auto a = Admin().Post("/admin/capture/whatever");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->status, 401);
}

TEST_F(ServerTest, CaptureHeaderWritesAVerifiedTraceThatReplaysExactly) {
  std::string rid;
  json j = Complete({{"prompt", "<html>"}, {"max_tokens", 10}, {"temperature", 0.8}, {"seed", 9}},
                    {{"X-Lockstep-Capture", "full"}, {"X-Lockstep-Token", kToken}, {"x-request-id", "cap-1"}}, &rid);
  ASSERT_EQ(rid, "cap-1");
  const json& cap = j["lockstep"]["captures"][0];
  ASSERT_TRUE(cap["verified"].get<bool>()) << cap.dump();
  const std::filesystem::path trace = cap["trace"].get<std::string>();
  EXPECT_EQ(trace.filename(), "cap-1.h5");
  struct stat st {};
  ASSERT_EQ(::stat(capture_dir_->c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700);

  auto reader = traces::TraceReader::Open(trace);
  ASSERT_TRUE(reader.ok()) << reader.status().message();
  ASSERT_EQ((*reader)->requests().size(), 1u);
  EXPECT_EQ((*reader)->requests()[0].name, "cap-1");  // the trace carries the request's id
  EXPECT_EQ((*reader)->requests()[0].generated_text, Text(j));
  replayer::ReplayOptions ro;
  ro.mode = replayer::ReplayMode::kExact;
  ro.output = trace.parent_path() / "cap-1.replay.h5";
  auto rep = replayer::Replay(**reader, ro);
  ASSERT_TRUE(rep.ok()) << rep.status().message();
  EXPECT_TRUE(rep->deterministic) << rep->verdict;

  // The admin call captures a request still in the ring.
  std::string later;
  Complete({{"prompt", "<div>"}, {"max_tokens", 6}}, {}, &later);
  auto a = Admin().Post("/admin/capture/" + later + "?mode=summary", {{"Authorization", std::string("Bearer ") + kToken}},
                        "", "application/json");
  ASSERT_TRUE(a);
  ASSERT_EQ(a->status, 200) << a->body;
  EXPECT_TRUE(json::parse(a->body)["verified"].get<bool>());
  auto missing = Admin().Post("/admin/capture/nope", {{"Authorization", std::string("Bearer ") + kToken}}, "", "application/json");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
}

// One HTTP/1.1 exchange over a raw socket, exactly the bytes given (cpp-httplib's client always
// sends a Content-Length; curl -X POST without -d sends none). Waits at most 10 s.
struct RawResponse {
  int status = 0;
  std::string body;
  double seconds = 0;
};
RawResponse RawExchange(int port, const std::string& request) {
  RawResponse out;
  const auto t0 = std::chrono::steady_clock::now();
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_GE(fd, 0);
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  EXPECT_EQ(::send(fd, request.data(), request.size(), 0), static_cast<ssize_t>(request.size()));
  std::string got;
  char buf[4096];
  for (;;) {  // the request says Connection: close, so the answer ends at EOF
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    got.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (got.rfind("HTTP/1.1 ", 0) == 0) out.status = std::atoi(got.c_str() + 9);
  const size_t at = got.find("\r\n\r\n");
  if (at != std::string::npos) out.body = got.substr(at + 4);
  return out;
}

// Issue 28: `serve --help`'s `curl -X POST -H "Authorization: Bearer …" …/admin/capture/ID`
// sends no body and no Content-Length. The HTTP layer used to read the connection to its end
// (30 s) and answer a bare 400 before the route ran, hiding its 401 and 404.
TEST_F(ServerTest, BodylessAdminPostAnswersAtOnceWithTheRealStatus) {
  std::string rid;
  Complete({{"prompt", "<p>"}, {"max_tokens", 4}}, {}, &rid);
  auto post = [](const std::string& path, const std::string& token, const std::string& extra = "") {
    return RawExchange(server_->admin_port(), "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: curl/7.88.1\r\n" +
                                                  "Accept: */*\r\nAuthorization: Bearer " + token + "\r\n" + extra +
                                                  "Connection: close\r\n\r\n");
  };
  for (const std::string extra : {"", "Content-Length: 0\r\n"}) {
    SCOPED_TRACE(extra.empty() ? "no Content-Length" : "Content-Length: 0");
    const RawResponse bad = post("/admin/capture/" + rid, "wrong-token", extra);
    EXPECT_EQ(bad.status, 401) << bad.body;
    EXPECT_EQ(json::parse(bad.body, nullptr, false)["error"]["type"], "authentication_error") << bad.body;
    const RawResponse unknown = post("/admin/capture/no-such-request", kToken, extra);
    EXPECT_EQ(unknown.status, 404) << unknown.body;
    EXPECT_EQ(json::parse(unknown.body, nullptr, false)["error"]["type"], "not_found_error") << unknown.body;
    const RawResponse path = post("/admin/no-such-endpoint", kToken, extra);
    EXPECT_EQ(path.status, 404) << path.body;
    EXPECT_EQ(json::parse(path.body, nullptr, false)["error"]["type"], "not_found_error") << path.body;
    for (const RawResponse* r : {&bad, &unknown, &path}) EXPECT_LT(r->seconds, 5.0) << "waited for a body";
  }
  const RawResponse ok = post("/admin/capture/" + rid + "?mode=summary", kToken);
  ASSERT_EQ(ok.status, 200) << ok.body;
  const json cap = json::parse(ok.body, nullptr, false);
  EXPECT_TRUE(cap["verified"].get<bool>()) << ok.body;
  EXPECT_EQ(cap["request_id"], rid);
  // A body-less POST to the API is a 400 naming the body, at once; a body over the limit a 413.
  const RawResponse empty = RawExchange(server_->port(), "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                                         "Connection: close\r\n\r\n");
  EXPECT_EQ(empty.status, 400) << empty.body;
  EXPECT_LT(empty.seconds, 5.0);
  EXPECT_EQ(json::parse(empty.body, nullptr, false)["error"]["type"], "invalid_request_error") << empty.body;
  auto big = Api().Post("/v1/completions", std::string(2 << 20, ' '), "application/json");
  ASSERT_TRUE(big);
  EXPECT_EQ(big->status, 413);
  EXPECT_NE(json::parse(big->body, nullptr, false)["error"]["message"].get<std::string>().find("--max-body-kb"),
            std::string::npos)
      << big->body;
}

TEST_F(ServerTest, DegenerationTriggerFiresOnALoopNotOnSampling) {
  const int64_t before = server_->metrics().degenerations.load();
  std::string loop_id, sampled_id;
  // Issue 28: 128 greedy tokens already end in five identical `@import` lines; the detector
  // used to wait for ~200.
  Complete({{"prompt", kLoopPrompt}, {"max_tokens", 128}, {"temperature", 0}, {"ignore_eos", true}}, {}, &loop_id);
  Complete({{"prompt", kLoopPrompt}, {"max_tokens", 256}, {"temperature", 0.6}, {"seed", 1}, {"ignore_eos", true}}, {},
           &sampled_id);
  EXPECT_EQ(server_->metrics().degenerations.load(), before + 1);
  const auto live = *capture_dir_ / (loop_id + ".live.json");
  for (int i = 0; i < 200 && !std::filesystem::exists(live); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_TRUE(std::filesystem::exists(live));
  std::ifstream in(live);
  json j = json::parse(in);
  EXPECT_EQ(j["trigger"], "degeneration");
  EXPECT_TRUE(j["verified"].get<bool>()) << j["detail"];
  EXPECT_FALSE(std::filesystem::exists(*capture_dir_ / (sampled_id + ".live.json")));
}

// Where promtool is: the one CMake found, else on PATH; empty when absent.
std::string Promtool() {
#ifdef LOCKSTEP_PROMTOOL
  if (std::filesystem::exists(LOCKSTEP_PROMTOOL)) return LOCKSTEP_PROMTOOL;
#endif
  if (const char* path = std::getenv("PATH")) {
    std::istringstream dirs(path);
    for (std::string d; std::getline(dirs, d, ':');) {
      if (!d.empty() && ::access((std::filesystem::path(d) / "promtool").c_str(), X_OK) == 0) return d + "/promtool";
    }
  }
  return "";
}

// Issue 28: names with `:` (promtool exit 3), `le="0.0050000000000000001"`, a growing byte
// count typed gauge. Now Prometheus' names and formatting, and promtool's lint must pass.
TEST_F(ServerTest, MetricsExposition) {
  Complete({{"prompt", "a"}, {"max_tokens", 3}});
  auto r = Admin().Get("/metrics");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  const std::string& m = r->body;
  for (const char* name :
       {"lockstep_num_requests_running ", "lockstep_num_requests_waiting ", "lockstep_kv_cache_usage_ratio ",
        "lockstep_prompt_tokens_total ", "lockstep_generation_tokens_total ",
        "lockstep_time_to_first_token_seconds_bucket{le=\"0.005\"} ", "lockstep_time_to_first_token_seconds_bucket{le=\"+Inf\"} ",
        "lockstep_inter_token_latency_seconds_count ", "lockstep_e2e_request_latency_seconds_sum ",
        "lockstep_request_success_total{finished_reason=\"length\"} ", "lockstep_captures_total{trigger=\"request\"} ",
        "\nlockstep_capture_verify_failures_total 0\n", "lockstep_degenerations_detected_total ",
        "# TYPE lockstep_capture_written_bytes_total counter\n", "lockstep_requests_rejected_total ",
        "lockstep_captures_refused_total ", "# TYPE lockstep_capture_queue_length gauge\n"}) {
    EXPECT_NE(m.find(name), std::string::npos) << name;
  }
  EXPECT_EQ(m.find("lockstep:"), std::string::npos) << "recording-rule names (`:`) are not for exporters";
  // Every bucket bound and value is the shortest text that reads back as the same double.
  std::istringstream lines(m);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t le = line.find("le=\"");
    if (le != std::string::npos) {
      const std::string bound = line.substr(le + 4, line.find('"', le + 4) - le - 4);
      if (bound != "+Inf") {
        char shortest[64];
        const double v = std::stod(bound);
        *std::to_chars(shortest, shortest + 63, v).ptr = 0;
        EXPECT_EQ(bound, shortest) << line;
      }
    }
    const std::string value = line.substr(line.rfind(' ') + 1);
    EXPECT_LE(value.size(), 24u) << "not the shortest form: " << line;
  }
  const std::string promtool = Promtool();
  if (promtool.empty()) {
    GTEST_SKIP() << "promtool not installed (Debian `prometheus`, tools/install-deps.sh): the exposition was not linted";
  }
  const auto file = capture_dir_->parent_path() / "metrics.txt";
  std::ofstream(file) << m;
  const std::string cmd = promtool + " check metrics < " + file.string() + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  const int rc = ::pclose(p);
  EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 0) << "promtool check metrics: exit " << WEXITSTATUS(rc) << "\n" << out;
  EXPECT_EQ(out, "") << "promtool's findings";
}

// Every tap row of a request is summarised live, and a capture checks the re-run's trace
// against those summaries (not only the logits and the sampler).
TEST_F(ServerTest, LiveRecordHoldsTapSummariesThatTheCaptureVerifies) {
  json j = Complete({{"prompt", "<body>"}, {"max_tokens", 6}, {"temperature", 0.8}, {"seed", 4}},
                    {{"X-Lockstep-Capture", "summary"}, {"X-Lockstep-Token", kToken}, {"x-request-id", "taps-1"}});
  const json& cap = j["lockstep"]["captures"][0];
  ASSERT_TRUE(cap["verified"].get<bool>()) << cap.dump();
  EXPECT_NE(cap["detail"].get<std::string>().find("tap rows verified"), std::string::npos) << cap["detail"];
  std::ifstream in(cap["live_record"].get<std::string>());
  const json live = json::parse(in);
  std::set<std::string> names;
  for (const auto& t : live["taps"]) names.insert(t["name"].get<std::string>());
  for (const char* want : {"embed", "layers.0.attn.out", "layers.4.resid_out", "layers.1.ffn.router.topk_ids", "logits"}) {
    EXPECT_TRUE(names.count(want)) << want;
  }
  // Prompt positions and every decode position (the last token is sampled, never fed back).
  auto reader = traces::TraceReader::Open(cap["trace"].get<std::string>());
  ASSERT_TRUE(reader.ok());
  const int64_t prompt = static_cast<int64_t>((*reader)->requests()[0].prompt.size());
  for (const auto& t : live["taps"]) {
    if (t["name"] == "layers.0.attn.out") {
      EXPECT_EQ(static_cast<int64_t>(t["positions"].size()), prompt + 6 - 1);
    }
  }
}

// While a capture runs (held at its start by the gate), the scheduler keeps serving: a
// streaming request runs to [DONE]. With the queue full (one running, 2 waiting) the next
// capture is refused at once with 503, and /metrics still answers.
TEST_F(ServerTest, CapturesRunBesideServingAndAFullQueueRefuses) {
  for (const char* id : {"held-1", "held-2", "held-3", "held-4"}) {
    Complete({{"prompt", "<p>"}, {"max_tokens", 8}, {"temperature", 0.5}, {"seed", 2}}, {{"x-request-id", id}});
  }
  g_gate.hold = true;
  auto admin_capture = [](std::string id) {
    auto r = Admin().Post("/admin/capture/" + id, {{"Authorization", std::string("Bearer ") + kToken}}, "",
                          "application/json");
    return r ? std::make_pair(r->status, r->body) : std::make_pair(-1, std::string());
  };
  auto first = std::async(std::launch::async, admin_capture, "held-1");
  ASSERT_TRUE(g_gate.WaitStarted("held-1"));
  auto second = std::async(std::launch::async, admin_capture, "held-2");
  auto third = std::async(std::launch::async, admin_capture, "held-3");
  for (int i = 0; i < 600 && server_->metrics().capture_queue.load() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(server_->metrics().capture_queue.load(), 2);
  const int64_t refused_before = server_->metrics().captures_refused.load();
  auto [status, body] = admin_capture("held-4");
  EXPECT_EQ(status, 503) << body;
  EXPECT_EQ(json::parse(body)["error"]["code"], "capture_queue_full");
  EXPECT_EQ(server_->metrics().captures_refused.load(), refused_before + 1);

  // Serving goes on while the capture is in progress.
  json body_s = {{"prompt", "<html>"}, {"max_tokens", 20}, {"temperature", 0.7}, {"seed", 3}, {"stream", true}};
  auto r = Api().Post("/v1/completions", body_s.dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_NE(r->body.find("data: [DONE]"), std::string::npos);
  EXPECT_EQ(first.wait_for(std::chrono::seconds(0)), std::future_status::timeout) << "the capture did not wait";
  auto m = Admin().Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 200);
  EXPECT_NE(m->body.find("\nlockstep_capture_queue_length 2\n"), std::string::npos);

  g_gate.Release();
  for (auto* f : {&first, &second, &third}) {
    auto [st, b] = f->get();
    ASSERT_EQ(st, 200) << b;
    EXPECT_TRUE(json::parse(b)["verified"].get<bool>()) << b;
  }
}

TEST_F(ServerTest, StreamingChunksCarryLogprobs) {
  json body = {{"prompt", "<html>"}, {"max_tokens", 12}, {"temperature", 0.9}, {"seed", 6}, {"logprobs", 2}, {"ignore_eos", true}};
  const json whole = Complete(body)["choices"][0]["logprobs"];
  body["stream"] = true;
  auto r = Api().Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(r);
  json joined = {{"tokens", json::array()}, {"token_logprobs", json::array()}, {"top_logprobs", json::array()},
                 {"text_offset", json::array()}};
  std::istringstream in(r->body);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("data: {", 0) != 0) continue;
    const json c = json::parse(line.substr(6));
    for (const auto& ch : c["choices"]) {
      if (ch["logprobs"].is_null()) continue;
      for (const char* k : {"tokens", "token_logprobs", "top_logprobs", "text_offset"}) {
        for (const auto& x : ch["logprobs"][k]) joined[k].push_back(x);
      }
    }
  }
  EXPECT_EQ(joined, whole);
  EXPECT_EQ(joined["tokens"].size(), 12u);
}

// The verification is not vacuous: a live record whose one tap row differs from what the
// re-run computes fails, naming the tap and position.
TEST(CaptureVerifyTest, ATapHashThatDiffersIsReported) {
  const auto dir = testing::SourceDir() / "models" / "lockstep-tiny-v32";
  auto model = engine::Model::Load(dir);
  ASSERT_TRUE(model.ok());
  std::promise<std::shared_ptr<const LiveRecord>> got;
  Scheduler::Options so;
  so.engine.kv_cache_tokens = 1 << 12;
  so.on_finished = [&](std::shared_ptr<const LiveRecord> r) { got.set_value(std::move(r)); };
  auto sched = Scheduler::Start(*model, so);
  ASSERT_TRUE(sched.ok());
  Submission sub;
  sub.id = "tamper-1";
  engine::Request req;
  req.prompt = {0, 17, 42, 99};
  req.max_new_tokens = 5;
  req.sampling.temperature = 0.8;
  req.sampling.seed = 12;
  sub.choices.push_back(req);
  (*sched)->Submit(sub);
  auto fut = got.get_future();
  ASSERT_EQ(fut.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  const auto live = fut.get();
  ASSERT_FALSE(live->taps.empty());

  CaptureOptions co;
  co.dir = std::filesystem::temp_directory_path() / ("lockstep-verify-test-" + std::to_string(::getpid()));
  co.engine = so.engine;
  auto ok = CaptureRequest(*model, *live, "admin", recorder::CapturePolicy::Mode::kSummary, co);
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_TRUE(ok->verified) << ok->detail;
  EXPECT_GT(ok->tap_rows, 0);

  LiveRecord bad = *live;
  LiveTap* t = nullptr;
  for (auto& x : bad.taps) {
    if (x.name == "layers.2.ffn.out") t = &x;
  }
  ASSERT_NE(t, nullptr);
  ASSERT_GT(t->rows.size(), 5u);
  t->rows[5].hash ^= 1;
  auto no = CaptureRequest(*model, bad, "admin", recorder::CapturePolicy::Mode::kSummary, co);
  ASSERT_TRUE(no.ok()) << no.status().message();
  EXPECT_FALSE(no->verified);
  EXPECT_NE(no->detail.find("tap layers.2.ffn.out position " + std::to_string(t->rows[5].position)), std::string::npos)
      << no->detail;
  std::filesystem::remove_all(co.dir);
}

}  // namespace
}  // namespace lockstep::server
