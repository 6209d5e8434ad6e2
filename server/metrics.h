// server/metrics.h — the server's Prometheus metrics, written directly in the text exposition
// format (version 0.0.4): a handful of counters and histograms need no client library.
// Thread-safe.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace lockstep::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void Observe(double v);
  // Appends `name_bucket{le=…}`, `name_sum`, `name_count` lines.
  void Write(const std::string& name, std::string* out) const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative); last = +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

class Metrics {
 public:
  Metrics();
  std::atomic<int64_t> prompt_tokens{0}, generation_tokens{0}, capture_verify_failures{0}, degenerations{0},
      capture_bytes{0}, rejected{0}, captures_refused{0}, capture_queue{0};
  Histogram ttft, itl, e2e;
  void CountFinished(const std::string& reason);
  void CountCapture(const std::string& trigger);
  // The whole exposition; gauges are passed in by the caller, who knows the scheduler.
  std::string Render(int64_t running, int64_t waiting, double kv_usage) const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, uint64_t> finished_, captures_;
};

}  // namespace lockstep::server
