// tests/test_util.h — helpers shared by the tests: fixture paths and reading reference tensors.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/safetensors.h"

namespace lockstep::testing {

// The source tree; $LOCKSTEP_SOURCE_DIR overrides it (test binaries copied to a GPU machine).
inline std::filesystem::path SourceDir() {
  if (const char* e = std::getenv("LOCKSTEP_SOURCE_DIR")) return e;
  return LOCKSTEP_SOURCE_DIR;
}
inline std::filesystem::path FixtureDir() { return SourceDir() / "tests" / "fixtures"; }

// The model fixtures made by tools/fixtures/make_model_fixtures.py (transformers' own classes).
inline std::vector<std::string> ModelFixtures() {
  std::vector<std::string> out;
  const auto dir = FixtureDir() / "models";
  if (!std::filesystem::exists(dir)) return out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.is_directory() && std::filesystem::exists(e.path() / "reference.safetensors")) {
      out.push_back(e.path().filename().string());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

inline std::vector<float> ReadF32(const engine::TensorView& t) {
  std::vector<float> v(t.numel());
  EXPECT_EQ(t.dtype, engine::DType::kF32) << t.name;
  std::memcpy(v.data(), t.data, v.size() * 4);
  return v;
}

inline std::vector<int32_t> ReadIds(const engine::TensorView& t) {
  std::vector<int32_t> v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (t.dtype == engine::DType::kI64) {
      int64_t x;
      std::memcpy(&x, t.data + 8 * i, 8);
      v[i] = static_cast<int32_t>(x);
    } else {
      int32_t x;
      std::memcpy(&x, t.data + 4 * i, 4);
      v[i] = x;
    }
  }
  return v;
}

// max|a − b| / max|b| over one row.
inline double RelMaxErr(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    num = std::max(num, std::fabs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::fabs(static_cast<double>(b[i])));
    if (std::isnan(a[i])) return INFINITY;
  }
  return den == 0 ? num : num / den;
}

// A transformers fixture's reference (tools/fixtures/make_model_fixtures.py): prompt ids, fp32
// prefill logits at every position, and 32 greedy decode steps (ids and logits).
struct Reference {
  std::vector<int32_t> prompt, decode_ids;
  std::vector<float> prefill, decode;
};
inline Reference LoadReference(const std::filesystem::path& dir) {
  auto ck = engine::SafetensorsFile::Open(dir / "reference.safetensors");
  EXPECT_TRUE(ck.ok()) << ck.status().message();
  Reference r;
  if (!ck.ok()) return r;
  const auto& t = (*ck)->tensors();
  r.prompt = ReadIds(t.at("prompt_ids"));
  r.decode_ids = ReadIds(t.at("decode_ids"));
  r.prefill = ReadF32(t.at("prefill_logits"));
  r.decode = ReadF32(t.at("decode_logits"));
  return r;
}

}  // namespace lockstep::testing
