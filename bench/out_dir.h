// bench/out_dir.h — the benchmarks' --out folder: created if missing, or a one-line error.
#pragma once

#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>

namespace lockstep::bench {

// Creates `dir` (and its parents); on failure prints "<program>: --out <dir>: …" and returns false.
inline bool MakeOutDir(const char* program, const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) std::fprintf(stderr, "%s: --out %s: cannot create the folder (%s)\n", program, dir.c_str(), ec.message().c_str());
  return !ec;
}

}  // namespace lockstep::bench
