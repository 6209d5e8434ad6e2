// bench/bench_args.h — what the benchmarks' flag parsing shares: a whole number or a number read
// from a flag's value within a range, or a one-line error naming the benchmark, the flag and the
// range (no exception escapes).
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace lockstep::bench {

// *out = v as an integer in [min, max]; false (after a line on stderr) when v is not one.
inline bool ParseInt(const char* bench, const std::string& flag, const std::string& v, int64_t min, int64_t max,
                     int64_t* out) {
  errno = 0;
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || end == nullptr || *end != '\0' || errno == ERANGE || x < min || x > max) {
    std::fprintf(stderr, "%s: %s: expected a whole number in [%lld, %lld], got '%s'\n", bench, flag.c_str(),
                 static_cast<long long>(min), static_cast<long long>(max), v.c_str());
    return false;
  }
  *out = x;
  return true;
}

// *out = v as a finite number in [min, max]; false (after a line on stderr) when v is not one.
inline bool ParseNumber(const char* bench, const std::string& flag, const std::string& v, double min, double max,
                        double* out) {
  errno = 0;
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || end == nullptr || *end != '\0' || errno == ERANGE || !(x >= min && x <= max)) {
    std::fprintf(stderr, "%s: %s: expected a number in [%g, %g], got '%s'\n", bench, flag.c_str(), min, max,
                 v.c_str());
    return false;
  }
  *out = x;
  return true;
}

}  // namespace lockstep::bench
