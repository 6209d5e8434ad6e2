// tests/gpu/gpu_engine_util.h — what the CUDA engine's tests share (gpu_engine_test.cc,
// gpu_engine_taps_test.cc): the engine options they start from, the embedded model loaded once,
// and a tap hook that keeps every tap. LS_REQUIRE_GPU comes from gpu_test_util.h.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/test_util.h"

namespace lockstep::gpu_testing {

// The CUDA backend with a cache format and a GEMM variant; pages of 16 tokens, 4096 tokens.
inline engine::EngineOptions Cuda(engine::KvFormat f = engine::KvFormat::kFp32, const std::string& gemm = "fp32") {
  engine::EngineOptions o;
  o.backend = "cuda";
  o.kv_format = f;
  o.page_size = 16;
  o.kv_cache_tokens = 4096;
  o.kernels = {{"gemm", gemm}};
  return o;
}

// models/lockstep-tiny-v32, loaded once per test binary.
inline std::shared_ptr<engine::Model> Tiny() {
  static std::shared_ptr<engine::Model> m = [] {
    auto r = engine::Model::Load(testing::SourceDir() / "models" / "lockstep-tiny-v32");
    EXPECT_TRUE(r.ok()) << r.status().message();
    return r.ok() ? *r : nullptr;
  }();
  return m;
}

// tests/fixtures/models/<name> (a failed load fails the test and returns null).
inline std::shared_ptr<engine::Model> Fixture(const char* name) {
  auto m = engine::Model::Load(testing::FixtureDir() / "models" / name);
  EXPECT_TRUE(m.ok()) << m.status().message();
  return m.ok() ? *m : nullptr;
}

// Records every tap of one request.
class TapRecorder : public engine::TapHook {
 public:
  struct Tensor {
    int64_t rows = 0, cols = 0;
    engine::TapDType dtype = engine::TapDType::kF32;
    std::vector<uint8_t> bytes;
  };
  std::map<std::string, Tensor> taps;  // name@position
  void OnTap(const engine::TapEvent& e) override {
    Tensor& t = taps[std::string(e.name) + "@" + std::to_string(e.position) + "#" + std::to_string(e.request_id)];
    t.rows = e.rows;
    t.cols = e.cols;
    t.dtype = e.dtype;
    const auto* p = static_cast<const uint8_t*>(e.data);
    t.bytes.assign(p, p + e.rows * e.cols * 4);
  }
};

}  // namespace lockstep::gpu_testing
