// cli/progress.cc — see progress.h.
#include "cli/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace lockstep::cli {

std::string HumanBytes(double v) {
  char b[64];
  if (!(v >= 0) || !std::isfinite(v)) return "?";
  if (v < 1e3) std::snprintf(b, sizeof b, "%.0f B", v);
  else if (v < 1e6) std::snprintf(b, sizeof b, "%.1f kB", v / 1e3);
  else if (v < 1e9) std::snprintf(b, sizeof b, "%.1f MB", v / 1e6);
  else std::snprintf(b, sizeof b, "%.2f GB", v / 1e9);
  return b;
}

std::string HumanDuration(double s) {
  if (!(s >= 0) || !std::isfinite(s)) return "?";
  char b[64];
  if (s < 60) {
    std::snprintf(b, sizeof b, "%.0f s", std::ceil(s));
  } else if (s < 3600) {
    const long m = static_cast<long>(s / 60);
    std::snprintf(b, sizeof b, "%ld min %02ld s", m, static_cast<long>(s) - 60 * m);
  } else {
    const long h = static_cast<long>(s / 3600);
    std::snprintf(b, sizeof b, "%ld h %02ld min", h, static_cast<long>(s / 60) - 60 * h);
  }
  return b;
}

Progress::Progress(bool enabled, std::string label, int64_t total, std::string unit)
    : on_(enabled && isatty(2)), label_(std::move(label)), unit_(std::move(unit)), total_(total),
      t0_(Clock::now()) {}

Progress::~Progress() { Done(); }

void Progress::Restart(std::string label, int64_t total) {
  Done();
  label_ = std::move(label);
  total_ = total;
  t0_ = Clock::now();
  last_ = {};
}

void Progress::Update(int64_t done, const std::string& extra, bool force) {
  if (!on_) return;
  const auto now = Clock::now();
  const bool final = total_ > 0 && done >= total_;  // the last state is always drawn
  if (!force && !final && drawn_ && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  const double s = std::chrono::duration<double>(now - t0_).count();
  const double rate = s > 0 ? done / s : 0;
  std::string line = label_;
  if (total_ > 0) {
    constexpr int kWidth = 24;
    const int fill = static_cast<int>(kWidth * std::clamp<int64_t>(done, 0, total_) / total_);
    line += " [" + std::string(fill, '#') + std::string(kWidth - fill, '.') + "] ";
    line += std::to_string(done) + "/" + std::to_string(total_) + " " + unit_;
  } else {
    line += " " + std::to_string(done) + " " + unit_;
  }
  char b[96];
  std::snprintf(b, sizeof b, "  %.1f %s/s", rate, unit_ == "tokens" ? "tok" : unit_.c_str());
  line += b;
  if (total_ > 0 && rate > 0 && done < total_) line += "  ETA " + HumanDuration((total_ - done) / rate);
  if (!extra.empty()) line += "  " + extra;
  // \r, the line, then clear to the end of the line (a shorter line leaves no tail behind).
  std::fprintf(stderr, "\r%s\x1b[K", line.c_str());
  std::fflush(stderr);
  drawn_ = true;
}

void Progress::Done() {
  if (on_ && drawn_) std::fprintf(stderr, "\n");
  drawn_ = false;
}

}  // namespace lockstep::cli
