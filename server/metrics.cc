// server/metrics.cc — see metrics.h.
#include "server/metrics.h"

#include <cstdio>

namespace lockstep::server {
namespace {

std::string Num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
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

std::string Metrics::Render(int64_t running, int64_t waiting, double kv_usage) const {
  std::string o;
  auto gauge = [&](const std::string& n, const char* help, double v) {
    Header(&o, n, "gauge", help);
    o += n + " " + Num(v) + "\n";
  };
  auto counter = [&](const std::string& n, const char* help, double v) {
    Header(&o, n, "counter", help);
    o += n + " " + Num(v) + "\n";
  };
  gauge("lockstep:num_requests_running", "Requests in the engine's batch.", static_cast<double>(running));
  gauge("lockstep:num_requests_waiting", "Requests queued for the batch.", static_cast<double>(waiting));
  gauge("lockstep:kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = full).", kv_usage);
  counter("lockstep:prompt_tokens_total", "Prompt tokens processed.", static_cast<double>(prompt_tokens.load()));
  counter("lockstep:generation_tokens_total", "Tokens generated.", static_cast<double>(generation_tokens.load()));
  Header(&o, "lockstep:time_to_first_token_seconds", "histogram", "Time from arrival to the first token.");
  ttft.Write("lockstep:time_to_first_token_seconds", &o);
  Header(&o, "lockstep:inter_token_latency_seconds", "histogram", "Time between two tokens of a request.");
  itl.Write("lockstep:inter_token_latency_seconds", &o);
  Header(&o, "lockstep:e2e_request_latency_seconds", "histogram", "Time from arrival to the last token.");
  e2e.Write("lockstep:e2e_request_latency_seconds", &o);
  {
    std::lock_guard<std::mutex> lock(mu_);
    Header(&o, "lockstep:request_success_total", "counter", "Requests finished, by finish reason.");
    for (const char* r : {"stop", "length", "abort"}) {
      auto it = finished_.find(r);
      o += std::string("lockstep:request_success_total{finished_reason=\"") + r + "\"} " +
           std::to_string(it == finished_.end() ? 0 : it->second) + "\n";
    }
    Header(&o, "lockstep:captures_total", "counter", "Requests captured as traces, by trigger.");
    for (const char* t : {"request", "admin", "degeneration"}) {
      auto it = captures_.find(t);
      o += std::string("lockstep:captures_total{trigger=\"") + t + "\"} " +
           std::to_string(it == captures_.end() ? 0 : it->second) + "\n";
    }
  }
  counter("lockstep:capture_verify_failures_total",
          "Captures whose offline re-run did not reproduce the live numbers.",
          static_cast<double>(capture_verify_failures.load()));
  counter("lockstep:degenerations_detected_total", "Finished generations the degeneration detector flagged.",
          static_cast<double>(degenerations.load()));
  gauge("lockstep:capture_bytes", "Bytes written to the capture directory by this server.",
        static_cast<double>(capture_bytes.load()));
  counter("lockstep:requests_rejected_total", "Requests answered 429 (over capacity).",
          static_cast<double>(rejected.load()));
  counter("lockstep:captures_refused_total", "Captures refused because the capture queue was full.",
          static_cast<double>(captures_refused.load()));
  gauge("lockstep:capture_queue_length", "Captures waiting behind the one running.",
        static_cast<double>(capture_queue.load()));
  return o;
}

}  // namespace lockstep::server
