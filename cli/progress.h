// cli/progress.h — the one progress line of long commands (record, replay, degen, bisect):
// "label [#####.....] 120/256 tokens  41.3 tok/s  ETA 3 s  extra", redrawn in place at most
// ten times a second on stderr, only when stderr is a terminal and the command is not quiet.
// Not thread-safe: call from the thread that runs the work.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace lockstep::cli {

class Progress {
 public:
  // `unit` names what is counted ("tokens"); `total` ≤ 0: unknown (no bar, no ETA).
  Progress(bool enabled, std::string label, int64_t total, std::string unit = "tokens");
  ~Progress();
  // A new phase: resets the count, the rate and the ETA.
  void Restart(std::string label, int64_t total);
  // The total, once known (a replay learns it from the trace), without resetting the clock.
  void SetTotal(int64_t total) { total_ = total; }
  // `done` of `total` so far; `extra` is printed after the ETA ("12.3 MB captured").
  void Update(int64_t done, const std::string& extra = "", bool force = false);
  // Ends the line (the next output starts on a fresh one). Idempotent.
  void Done();
  bool enabled() const { return on_; }

 private:
  using Clock = std::chrono::steady_clock;
  bool on_;
  bool drawn_ = false;
  std::string label_, unit_;
  int64_t total_;
  Clock::time_point t0_, last_;
};

// "812 B", "3.4 MB", "1.2 GB" (decimal units, as the record summary prints).
std::string HumanBytes(double bytes);

// "3 s", "2 min 05 s", "1 h 02 min": an ETA or duration a person reads at a glance.
std::string HumanDuration(double seconds);

}  // namespace lockstep::cli
