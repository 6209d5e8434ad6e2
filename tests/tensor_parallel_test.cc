// tests/tensor_parallel_test.cc — tensor parallelism emulated on one device (--emulate-tp,
// engine/tensor_parallel.h): the all-reduce orders on hand-computed sums, a rank's slice product
// against the same product over a copied-out slice, and whole runs — TP 2 on the fixture models
// and TP 8 on lockstep-tiny-v32 give TP 1's tokens with logits within fp32 rounding, run to run
// and batched or alone bit for bit; the ring order depends on the batch; refusals name the field.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "engine/engine.h"
#include "engine/tensor_parallel.h"
#include "kernels/cpu/ops.h"
#include "test_util.h"

namespace lockstep::engine {
namespace {

// Three ranks' partials of one element, 1, 1e8 and −1e8: in fp32 (1 + 1e8) − 1e8 = 0 (1e8 + 1
// rounds to 1e8), while (1e8 − 1e8) + 1 = 1 — the order is visible in the result.
TEST(AllReduce, EachVariantSumsInItsOrder) {
  // [rows 2][ranks 3][cols 1]
  const std::vector<float> p = {1.0f, 1e8f, -1e8f, 1.0f, 1e8f, -1e8f};
  float y[2];
  AllReduce(kernels::AllReduce::kOrdered, p.data(), 3, 2, 1, y);
  EXPECT_EQ(y[0], 0.0f);  // rank 0, 1, 2
  EXPECT_EQ(y[1], 0.0f);
  AllReduce(kernels::AllReduce::kFaultRotateByRow, p.data(), 3, 2, 1, y);
  EXPECT_EQ(y[0], 0.0f);  // row 0 from rank 0
  EXPECT_EQ(y[1], 1.0f);  // row 1 from rank 1: (1e8 − 1e8) + 1
  // Ring: 2 elements in 3 chunks of 1; element e from rank (e + 1) mod 3.
  AllReduce(kernels::AllReduce::kRing, p.data(), 3, 2, 1, y);
  EXPECT_EQ(y[0], 1.0f);  // from rank 1: (1e8 − 1e8) + 1
  EXPECT_EQ(y[1], 0.0f);  // from rank 2: (−1e8 + 1) rounds to −1e8, + 1e8
}

// A rank's slice product is the product over a copy of the slice, bit for bit, for weights as
// stored in fp32 and for a bf16-rounded product.
TEST(RowParallel, ASliceIsTheProductOfTheCopiedSlice) {
  const int64_t rows = 3, out = 5, in = 40, k0 = 16, k1 = 40;
  std::vector<float> x(rows * in), w(out * in);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37 * static_cast<double>(i)) * 3;
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::cos(0.11 * static_cast<double>(i));
  kernels::WeightView wv;
  wv.rows = out;
  wv.cols = in;
  wv.values = w.data();
  for (auto round : {kernels::WeightRounding::kAsStored, kernels::WeightRounding::kBf16}) {
    std::vector<float> y(rows * out), xs(rows * (k1 - k0)), ws(out * (k1 - k0)), want(rows * out);
    kernels::cpu::MatMulNTCols(x.data(), rows, wv, round, k0, k1, y.data(), out);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(&xs[r * (k1 - k0)], &x[r * in + k0], (k1 - k0) * 4);
    for (int64_t j = 0; j < out; ++j) {
      for (int64_t k = k0; k < k1; ++k) {
        float v = w[j * in + k];
        if (round == kernels::WeightRounding::kBf16) v = kernels::Bf16ToF32(kernels::F32ToBf16(v));
        ws[j * (k1 - k0) + k - k0] = v;
      }
    }
    kernels::cpu::MatMulNT(xs.data(), rows, ws.data(), out, k1 - k0, want.data());
    EXPECT_EQ(0, std::memcmp(y.data(), want.data(), y.size() * 4)) << static_cast<int>(round);
  }
}

struct Run {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<float>> prompt_logits;
};

Run Generate(const std::shared_ptr<Model>& m, int64_t tp, const std::vector<std::vector<int32_t>>& prompts,
             int64_t max_batch, const std::string& allreduce = "") {
  EngineOptions o;
  o.emulate_tp = tp;
  o.max_batch = max_batch;
  o.page_size = 8;
  if (!allreduce.empty()) o.kernels["allreduce"] = allreduce;
  auto e = Engine::Create(m, o);
  EXPECT_TRUE(e.ok()) << e.status().message();
  Run run;
  if (!e.ok()) return run;
  for (const auto& p : prompts) {
    Request r;
    r.prompt = p;
    r.max_new_tokens = 8;
    r.all_prompt_logits = true;
    EXPECT_TRUE((*e)->AddRequest(r).ok());
  }
  EXPECT_TRUE((*e)->RunToCompletion().ok());
  for (int64_t i = 0; i < (*e)->num_requests(); ++i) {
    run.tokens.push_back((*e)->request(i).generated);
    run.prompt_logits.push_back((*e)->request(i).prompt_logits);
  }
  return run;
}

std::vector<std::vector<int32_t>> PromptsFor(int64_t vocab) {
  std::vector<std::vector<int32_t>> ps;
  for (int r = 0; r < 3; ++r) {
    std::vector<int32_t> p;
    for (int i = 0; i < 9 + 4 * r; ++i) p.push_back(static_cast<int32_t>(2 + (11 * i + 7 * r) % (vocab - 2)));
    ps.push_back(p);
  }
  return ps;
}

bool SameBits(const Run& a, const Run& b) {
  if (a.tokens != b.tokens || a.prompt_logits.size() != b.prompt_logits.size()) return false;
  for (size_t i = 0; i < a.prompt_logits.size(); ++i) {
    if (a.prompt_logits[i].size() != b.prompt_logits[i].size() ||
        std::memcmp(a.prompt_logits[i].data(), b.prompt_logits[i].data(), a.prompt_logits[i].size() * 4) != 0) {
      return false;
    }
  }
  return true;
}

// Emulated TP N against TP 1 on one model: the same greedy tokens; every prompt logit within
// fp32 rounding of TP 1's (1e-4 of the row's largest magnitude: the parity tests' bound); some
// logit's bits moved (it did sum in another order); TP N run to run and alone vs batched bit
// for bit (the ordered all-reduce's order does not depend on the batch).
void CheckModel(const std::filesystem::path& dir, int64_t tp) {
  SCOPED_TRACE(dir.string() + " tp " + std::to_string(tp));
  auto m = Model::Load(dir);
  ASSERT_TRUE(m.ok()) << m.status().message();
  const auto prompts = PromptsFor((*m)->config().vocab_size);
  const Run one = Generate(*m, 1, prompts, 8);
  const Run tpn = Generate(*m, tp, prompts, 8);
  ASSERT_EQ(one.tokens.size(), prompts.size());
  EXPECT_EQ(one.tokens, tpn.tokens);
  bool moved = false;
  for (size_t r = 0; r < prompts.size(); ++r) {
    ASSERT_EQ(one.prompt_logits[r].size(), tpn.prompt_logits[r].size());
    const int64_t V = (*m)->config().vocab_size;
    for (size_t row = 0; row * V < one.prompt_logits[r].size(); ++row) {
      double mx = 0, d = 0;
      for (int64_t v = 0; v < V; ++v) {
        const float a = one.prompt_logits[r][row * V + v], b = tpn.prompt_logits[r][row * V + v];
        mx = std::max(mx, std::fabs(static_cast<double>(a)));
        d = std::max(d, std::fabs(static_cast<double>(a) - b));
        moved |= std::memcmp(&a, &b, 4) != 0;
      }
      EXPECT_LE(d, 1e-4 * mx) << "request " << r << " position " << row;
    }
  }
  EXPECT_TRUE(moved) << "TP " << tp << " gave TP 1's bits exactly: no sum was split";
  EXPECT_TRUE(SameBits(tpn, Generate(*m, tp, prompts, 8))) << "run to run";
  EXPECT_TRUE(SameBits(tpn, Generate(*m, tp, prompts, 1))) << "alone vs batched";
}

TEST(EmulatedTp, Tp2OnTheFixtureModels) {
  for (const char* name : {"v2_lite_like", "v3_basic", "v32_sparse", "v3_fp8"}) {
    CheckModel(testing::FixtureDir() / "models" / name, 2);
  }
}

TEST(EmulatedTp, Tp8OnTheTinyModel) { CheckModel(testing::SourceDir() / "models" / "lockstep-tiny-v32", 8); }

// The ring order sums a row from a rank that depends on where the row sits in the step's
// buffer: batched and alone differ in bits (what bisect's batch check exists to see).
TEST(EmulatedTp, TheRingOrderDependsOnTheBatch) {
  auto m = Model::Load(testing::SourceDir() / "models" / "lockstep-tiny-v32");
  ASSERT_TRUE(m.ok());
  const auto prompts = PromptsFor((*m)->config().vocab_size);
  EXPECT_FALSE(SameBits(Generate(*m, 8, prompts, 8, "ring"), Generate(*m, 8, prompts, 1, "ring")));
}

TEST(EmulatedTp, RefusalsNameTheField) {
  auto m = Model::Load(testing::FixtureDir() / "models" / "v3_basic");  // 4 heads
  ASSERT_TRUE(m.ok());
  EngineOptions o;
  o.emulate_tp = 3;
  auto e = Engine::Create(*m, o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("num_attention_heads 4"), std::string::npos) << e.status().message();
  o.emulate_tp = 65;
  EXPECT_FALSE(Engine::Create(*m, o).ok());
  o.emulate_tp = 2;
  o.backend = "cuda";
  // The CUDA backend emulates TP too: without a GPU it fails for that reason, never for the TP.
  auto c = Engine::Create(*m, o);
  if (!c.ok()) EXPECT_EQ(c.status().message().find("--emulate-tp"), std::string::npos) << c.status().message();
  auto v4 = Model::Load(testing::FixtureDir() / "models_v4" / "v4_mixed");
  ASSERT_TRUE(v4.ok());
  EngineOptions o4;
  o4.emulate_tp = 2;
  auto e4 = Engine::Create(*v4, o4);
  ASSERT_FALSE(e4.ok());
  EXPECT_NE(e4.status().message().find("DeepSeek-V4"), std::string::npos) << e4.status().message();
}

}  // namespace
}  // namespace lockstep::engine
