// server/metrics.cc — see metrics.h.
#include "server/metrics.h"

#include <charconv>
#include <cmath>

namespace lockstep::server {
namespace {

// Prometheus' float formatting: the shortest text that reads back as the same double (Go's
// strconv.FormatFloat(v, 'g', -1, 64), what client_golang prints), `+Inf`/`-Inf`/`NaN`.
// 0.005 prints as 0.005, not %.17g's 0.0050000000000000001.
std::string Num(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

void Header(std::string* out, const std::string& name, const char* type, const char* help) {
  *out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

}  // namespace

void Histogram::Observe(double v) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::Write(const std::string& name, std::string* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    *out += name + "_bucket{le=\"" + Num(bounds_[i]) + "\"} " + std::to_string(cum) + "\n";
  }
  cum += counts_.back();
  *out += name + "_bucket{le=\"+Inf\"} " + std::to_string(cum) + "\n";
  *out += name + "_sum " + Num(sum_) + "\n";
  *out += name + "_count " + std::to_string(count_) + "\n";
}

// Buckets as vLLM's, so dashboards built for it read ours.
Metrics::Metrics()
    : ttft({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0}),
      itl({0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5}),
      e2e({0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0}) {}

void Metrics::CountFinished(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  ++finished_[reason];
}

void Metrics::CountCapture(const std::string& trigger) {
  std::lock_guard<std::mutex> lock(mu_);
  ++captures_[trigger];
}

// Names follow Prometheus' conventions (promtool check metrics passes): the `lockstep_`
// prefix, base units in the name (`_seconds`, `_bytes`, `_ratio`), `_total` on counters.
std::string Metrics::Render(int64_t running, int64_t waiting, double kv_usage) const {
  std::string o;
  auto gauge = [&](const std::string& n, const char* help, double v) {
    Header(&o, n, "gauge", help);
    o += n + " " + Num(v) + "\n";
  };
  auto counter = [&](const std::string& n, const char* help, int64_t v) {
    Header(&o, n, "counter", help);
    o += n + " " + std::to_string(v) + "\n";
  };
  gauge("lockstep_num_requests_running", "Requests in the engine's batch.", static_cast<double>(running));
  gauge("lockstep_num_requests_waiting", "Requests queued for the batch.", static_cast<double>(waiting));
  gauge("lockstep_kv_cache_usage_ratio", "Fraction of KV-cache pages in use (1 = full).", kv_usage);
  counter("lockstep_prompt_tokens_total", "Prompt tokens processed.", prompt_tokens.load());
  counter("lockstep_generation_tokens_total", "Tokens generated.", generation_tokens.load());
  Header(&o, "lockstep_time_to_first_token_seconds", "histogram", "Time from arrival to the first token.");
  ttft.Write("lockstep_time_to_first_token_seconds", &o);
  Header(&o, "lockstep_inter_token_latency_seconds", "histogram", "Time between two tokens of a request.");
  itl.Write("lockstep_inter_token_latency_seconds", &o);
  Header(&o, "lockstep_e2e_request_latency_seconds", "histogram", "Time from arrival to the last token.");
  e2e.Write("lockstep_e2e_request_latency_seconds", &o);
  {
    std::lock_guard<std::mutex> lock(mu_);
    Header(&o, "lockstep_request_success_total", "counter", "Requests finished, by finish reason.");
    for (const char* r : {"stop", "length", "abort"}) {
      auto it = finished_.find(r);
      o += std::string("lockstep_request_success_total{finished_reason=\"") + r + "\"} " +
           std::to_string(it == finished_.end() ? 0 : it->second) + "\n";
    }
    Header(&o, "lockstep_captures_total", "counter", "Requests captured as traces, by trigger.");
    for (const char* t : {"request", "admin", "degeneration"}) {
      auto it = captures_.find(t);
      o += std::string("lockstep_captures_total{trigger=\"") + t + "\"} " +
           std::to_string(it == captures_.end() ? 0 : it->second) + "\n";
    }
  }
  counter("lockstep_capture_verify_failures_total", "Captures whose offline re-run did not reproduce the live numbers.",
          capture_verify_failures.load());
  counter("lockstep_degenerations_detected_total", "Finished generations the degeneration detector flagged.",
          degenerations.load());
  counter("lockstep_capture_written_bytes_total", "Bytes of traces and sidecars written to the capture directory.",
          capture_bytes.load());
  counter("lockstep_requests_rejected_total", "Requests answered 429 (over capacity).", rejected.load());
  counter("lockstep_captures_refused_total", "Captures refused because the capture queue was full.",
          captures_refused.load());
  gauge("lockstep_capture_queue_length", "Captures waiting behind the one running.",
        static_cast<double>(capture_queue.load()));
  return o;
}

}  // namespace lockstep::server
