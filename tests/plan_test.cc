// tests/plan_test.cc — the typed kernel plan: every registry variant of every backend has its
// plan value (a registry entry without one would make Engine::Create fail), the defaults and
// overrides resolve to the values the forward passes switch on, and faults are values of their
// op like any other variant.
#include <gtest/gtest.h>

#include <set>

#include "kernels/plan.h"
#include "kernels/registry.h"

namespace lockstep::kernels {
namespace {

TEST(KernelPlan, EveryRegistryVariantHasAPlanValue) {
  std::set<std::pair<std::string, int>> seen;
  for (const KernelVariant& v : Registry::Get().variants()) {
    const int value = PlanValue(v.op, v.name);
    EXPECT_GE(value, 0) << v.op << "=" << v.name << " (" << v.backend << ") has no row in kernels/plan.cc";
    seen.insert({v.op, value});
  }
  // Distinct names of one op are distinct values.
  for (const KernelVariant& a : Registry::Get().variants()) {
    for (const KernelVariant& b : Registry::Get().variants()) {
      if (a.op == b.op && a.name != b.name) EXPECT_NE(PlanValue(a.op, a.name), PlanValue(b.op, b.name));
    }
  }
  EXPECT_EQ(PlanValue("gemm", "no_such_variant"), -1);
  EXPECT_EQ(PlanValue("no_such_op", "fp32"), -1);
}

TEST(KernelPlan, EveryBackendsDefaultsAndEveryVariantResolve) {
  for (const char* backend : {"cpu", "cuda"}) {
    auto defaults = Registry::Get().Resolve({}, backend);
    ASSERT_TRUE(defaults.ok()) << defaults.status().message();
    auto plan = KernelPlan::From(*defaults);
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    for (const KernelVariant& v : Registry::Get().variants()) {
      if (v.backend != backend) continue;
      auto choice = v.fault ? Registry::Get().Resolve({}, backend, v.name) : Registry::Get().Resolve({{v.op, v.name}}, backend);
      ASSERT_TRUE(choice.ok()) << v.op << "=" << v.name << ": " << choice.status().message();
      auto p = KernelPlan::From(*choice);
      ASSERT_TRUE(p.ok()) << p.status().message();
      EXPECT_NE(p->Describe().find(v.op + "=" + v.name), std::string::npos) << p->Describe();
    }
  }
}

TEST(KernelPlan, GemmVariantsMeanWhatTheirNamesSay) {
  auto plan_of = [](const char* gemm) { return *KernelPlan::From(*Registry::Get().Resolve({{"gemm", gemm}}, "cuda")); };
  EXPECT_TRUE(plan_of("bf16").bf16() && !plan_of("bf16").dot() && plan_of("bf16").pinned_algorithm());
  EXPECT_TRUE(plan_of("bf16_dot").bf16() && plan_of("bf16_dot").dot());
  EXPECT_TRUE(plan_of("bf16_heuristic").bf16() && !plan_of("bf16_heuristic").pinned_algorithm());
  EXPECT_TRUE(!plan_of("fp32").bf16() && !plan_of("fp32").dot() && !plan_of("fp32").fp8_weights());
  EXPECT_TRUE(plan_of("fp32_dot").dot() && !plan_of("fp32_dot").bf16());
  EXPECT_TRUE(plan_of("fp8_dot").fp8_weights() && plan_of("fp8_dot").dot() && !plan_of("fp8_dot").w8a8());
  EXPECT_TRUE(plan_of("w8a8_dot").fp8_weights() && plan_of("w8a8_dot").w8a8());
  EXPECT_FALSE(plan_of("fp32_heuristic").pinned_algorithm());
  EXPECT_FALSE(plan_of("fp8_dot").fp4_experts());
}

// The 4-bit expert formats are CPU gemm variants (the CUDA backend has no kernels for them yet,
// so it refuses the names rather than running something else).
TEST(KernelPlan, Fp4ExpertVariants) {
  for (const char* g : {"mxfp4_dot", "nvfp4_dot"}) {
    auto p = *KernelPlan::From(*Registry::Get().Resolve({{"gemm", g}}, "cpu"));
    EXPECT_TRUE(p.fp4_experts() && p.dot() && !p.bf16() && !p.fp8_weights() && !p.w8a8()) << g;
    EXPECT_NE(p.Describe().find(std::string("gemm=") + g), std::string::npos);
    auto cuda = Registry::Get().Resolve({{"gemm", g}}, "cuda");
    ASSERT_FALSE(cuda.ok()) << g;
    EXPECT_NE(cuda.status().message().find("unknown variant"), std::string::npos) << cuda.status().message();
  }
  EXPECT_EQ((*KernelPlan::From(*Registry::Get().Resolve({{"gemm", "mxfp4_dot"}}, "cpu"))).gemm, Gemm::kMxfp4Dot);
  EXPECT_EQ((*KernelPlan::From(*Registry::Get().Resolve({{"gemm", "nvfp4_dot"}}, "cpu"))).gemm, Gemm::kNvfp4Dot);
}

TEST(KernelPlan, AFaultIsAValueOfItsOp) {
  auto p = *KernelPlan::From(*Registry::Get().Resolve({}, "cpu", "fault_decode_wrong_interleave"));
  EXPECT_EQ(p.rope, Rope::kFaultDecodeWrongInterleave);
  EXPECT_EQ(p.gemm, Gemm::kFp32);  // everything else at its default
  auto q = *KernelPlan::From(*Registry::Get().Resolve({}, "cpu", "fault_fp8_no_clamp"));
  EXPECT_EQ(q.kv_quant, KvQuant::kFaultFp8NoClamp);
}

TEST(KernelPlan, AnUnknownNameIsAnInternalError) {
  auto p = KernelPlan::From({{"gemm", "fp4"}});
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("gemm=fp4"), std::string::npos);
}

}  // namespace
}  // namespace lockstep::kernels
