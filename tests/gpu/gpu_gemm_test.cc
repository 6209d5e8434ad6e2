// tests/gpu/gpu_gemm_test.cc — cuBLASLt GEMM (fp32 pedantic and bf16→fp32) against an fp64
// product of the same inputs, NaN/Inf propagation against cpu::MatMulNT, bitwise
// determinism, and batch invariance of the pinned algorithm (the heuristic's is reported).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/numerics.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu/gpu_test_util.h"

namespace lockstep {
namespace {

using namespace gpu_testing;  // NOLINT

struct Operands {
  int64_t rows = 0, out = 0, in = 0;
  std::vector<float> x, w;          // exact values (bf16-representable for the bf16 variant)
  std::vector<uint16_t> xb, wb;     // bf16 bits (bf16 variant)
};

Operands MakeOperands(int64_t rows, int64_t out, int64_t in, bool bf16, uint64_t seed) {
  Operands o;
  o.rows = rows;
  o.out = out;
  o.in = in;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  o.x.resize(rows * in);
  o.w.resize(out * in);
  for (auto& v : o.x) v = g(rng);
  for (auto& v : o.w) v = g(rng) * 0.02f;
  if (bf16) {
    for (auto* vec : {&o.x, &o.w}) {
      auto& bits = vec == &o.x ? o.xb : o.wb;
      bits.resize(vec->size());
      for (size_t i = 0; i < vec->size(); ++i) {
        bits[i] = kernels::F32ToBf16((*vec)[i]);
        (*vec)[i] = kernels::Bf16ToF32(bits[i]);
      }
    }
  }
  return o;
}

std::vector<float> RunGpu(cu::Gemm& gemm, const Operands& o, bool bf16, int64_t rows) {
  cu::DeviceBuffer dx = bf16 ? Upload(std::vector<uint16_t>(o.xb.begin(), o.xb.begin() + rows * o.in))
                             : Upload(std::vector<float>(o.x.begin(), o.x.begin() + rows * o.in));
  cu::DeviceBuffer dw = bf16 ? Upload(o.wb) : Upload(o.w);
  auto dy = Zeros<float>(rows * o.out);
  cu::GemmParams p;
  p.rows = rows;
  p.out = o.out;
  p.in = o.in;
  p.x = dx.data();
  p.x_stride = o.in;
  p.w = dw.data();
  p.w_stride = o.in;
  p.y = dy.as<float>();
  p.y_stride = o.out;
  Status s = gemm.Run(p);
  EXPECT_TRUE(s.ok()) << s.message();
  s = cu::Synchronize();
  EXPECT_TRUE(s.ok()) << s.message();
  return Download<float>(dy, rows * o.out);
}

std::unique_ptr<cu::Gemm> MakeGemm(cu::GemmVariant v, bool pin) {
  cu::GemmOptions opt;
  opt.variant = v;
  opt.pin_algorithm = pin;
  auto g = cu::Gemm::Create(opt);
  EXPECT_TRUE(g.ok()) << g.status().message();
  return g.ok() ? std::move(g).value() : nullptr;
}

// |y − Σ x·w| ≤ γ·Σ|x·w|: any summation order of n products has error ≤ (n − 1)·u·Σ|terms|
// (plus the products' own rounding, u each; exact for bf16 inputs). Tensor-core fp32
// accumulation may truncate rather than round: the bf16 variant gets a factor 2.
void CheckAgainstFp64(const std::vector<float>& y, const Operands& o, bool bf16, const std::string& what) {
  std::vector<float> want(o.rows * o.out);
  std::vector<double> mag(o.rows * o.out);
  for (int64_t r = 0; r < o.rows; ++r) {
    for (int64_t j = 0; j < o.out; ++j) {
      double s = 0, a = 0;
      for (int64_t k = 0; k < o.in; ++k) {
        const double t = static_cast<double>(o.x[r * o.in + k]) * o.w[j * o.in + k];
        s += t;
        a += std::fabs(t);
      }
      want[r * o.out + j] = static_cast<float>(s);
      mag[r * o.out + j] = a;
    }
  }
  const double gamma = (bf16 ? 2.0 : 1.0) * static_cast<double>(o.in + 1) * kU32;
  EXPECT_TRUE(AllClose(
      y, want, [&](size_t i) { return gamma * mag[i] + kU32 * std::fabs(want[i]); }, what));
}

TEST(CudaGemm, MatchesFp64ProductWithinDerivedBound) {
  LS_REQUIRE_GPU();
  for (cu::GemmVariant v : {cu::GemmVariant::kFp32Pedantic, cu::GemmVariant::kBf16}) {
    const bool bf16 = v == cu::GemmVariant::kBf16;
    auto gemm = MakeGemm(v, true);
    ASSERT_NE(gemm, nullptr);
    struct S {
      int64_t rows, out, in;
    };
    for (S s : {S{1, 576, 7168}, S{37, 1536, 512}, S{64, 256, 2048}, S{3, 40, 64}}) {
      const Operands o = MakeOperands(s.rows, s.out, s.in, bf16, 7 * s.rows + s.in);
      const std::string what = std::string(bf16 ? "bf16" : "fp32") + " " + std::to_string(s.rows) + "x" +
                               std::to_string(s.out) + "x" + std::to_string(s.in);
      CheckAgainstFp64(RunGpu(*gemm, o, bf16, s.rows), o, bf16, what);
      auto d = gemm->Describe(s.rows, s.out, s.in);
      std::printf("  [%s] %s\n", what.c_str(), d.ok() ? d->c_str() : d.status().message().c_str());
    }
  }
}

TEST(CudaGemm, NanAndInfPositionsMatchCpuMatMul) {
  LS_REQUIRE_GPU();
  auto gemm = MakeGemm(cu::GemmVariant::kFp32Pedantic, true);
  ASSERT_NE(gemm, nullptr);
  Operands o = MakeOperands(6, 48, 256, false, 5);
  o.x[3 * 256 + 5] = NAN;       // row 3 all NaN
  o.w[7 * 256 + 2] = INFINITY;  // column 7 ±Inf (NaN where it meets row 3)
  o.x[4 * 256 + 2] = 0.0f;      // 0·Inf = NaN at (4, 7)
  std::vector<float> cpu(6 * 48);
  kernels::cpu::MatMulNT(o.x.data(), 6, o.w.data(), 48, 256, cpu.data());
  const std::vector<float> y = RunGpu(*gemm, o, false, 6);
  for (size_t i = 0; i < y.size(); ++i) {
    ASSERT_EQ(std::isnan(y[i]), std::isnan(cpu[i])) << "element " << i << ": GPU " << y[i] << ", CPU " << cpu[i];
    if (std::isinf(cpu[i])) {
      EXPECT_EQ(y[i], cpu[i]) << "element " << i;
    }
  }
}

TEST(CudaGemm, DeterministicAndPinnedAlgorithmIsBatchInvariant) {
  LS_REQUIRE_GPU();
  for (cu::GemmVariant v : {cu::GemmVariant::kFp32Pedantic, cu::GemmVariant::kBf16}) {
    const bool bf16 = v == cu::GemmVariant::kBf16;
    const std::string name = bf16 ? "bf16" : "fp32";
    const Operands o = MakeOperands(300, 1536, 7168, bf16, 11);
    auto pinned = MakeGemm(v, true);
    ASSERT_NE(pinned, nullptr);
    const std::vector<float> full = RunGpu(*pinned, o, bf16, 300);
    EXPECT_TRUE(BitwiseEqual(full, RunGpu(*pinned, o, bf16, 300), name + " run twice"));
    for (int64_t rows : {1, 2, 8, 64, 256}) {
      const std::vector<float> part = RunGpu(*pinned, o, bf16, rows);
      EXPECT_TRUE(BitwiseEqual(part, std::vector<float>(full.begin(), full.begin() + rows * o.out),
                               name + " pinned: rows 0.." + std::to_string(rows - 1) + " of a " +
                                   std::to_string(rows) + "-row batch vs of a 300-row batch"));
    }
    auto d1 = pinned->Describe(1, 1536, 7168), d300 = pinned->Describe(300, 1536, 7168);
    std::printf("  [%s pinned] rows 1: %s | rows 300: %s\n", name.c_str(), d1.ok() ? d1->c_str() : "?",
                d300.ok() ? d300->c_str() : "?");
    // The heuristic's choice per shape: deterministic; batch invariance is reported, not required.
    auto heur = MakeGemm(v, false);
    ASSERT_NE(heur, nullptr);
    const std::vector<float> h300 = RunGpu(*heur, o, bf16, 300);
    EXPECT_TRUE(BitwiseEqual(h300, RunGpu(*heur, o, bf16, 300), name + " heuristic run twice"));
    int invariant = 0, total = 0;
    for (int64_t rows : {1, 2, 8, 64, 256}) {
      const std::vector<float> part = RunGpu(*heur, o, bf16, rows);
      invariant += std::memcmp(part.data(), h300.data(), part.size() * sizeof(float)) == 0;
      ++total;
      auto d = heur->Describe(rows, 1536, 7168);
      std::printf("  [%s heuristic] rows %lld: %s — %s\n", name.c_str(), static_cast<long long>(rows),
                  d.ok() ? d->c_str() : "?",
                  std::memcmp(part.data(), h300.data(), part.size() * sizeof(float)) == 0 ? "same bits as 300 rows"
                                                                                          : "DIFFERENT bits");
    }
    std::printf("  [%s heuristic] batch-invariant for %d of %d row counts\n", name.c_str(), invariant, total);
  }
}

TEST(CudaGemm, ValidationNamesTheField) {
  if (cu::DeviceCount() == 0) GTEST_SKIP() << "Gemm::Create needs a device";
  auto gemm = MakeGemm(cu::GemmVariant::kFp32Pedantic, true);
  ASSERT_NE(gemm, nullptr);
  cu::GemmParams p;
  float f[4] = {};
  p.rows = 1;
  p.out = 2;
  p.in = 2;
  p.x = p.w = p.y = f;
  p.x_stride = 2;
  p.w_stride = 1;
  p.y_stride = 2;
  Status s = gemm->Run(p);
  EXPECT_EQ(s.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(s.message().find("w_stride"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace lockstep
