// tests/engine_test.cc — scheduling and batch invariance: a request's bits must not depend
// on what it is batched with (issue 2 acceptance: batch 1 vs batch 8).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "engine/engine.h"
#include "engine/tap_cols.h"
#include "kernels/cpu/ops.h"
#include "kernels/registry.h"
#include "test_util.h"

namespace lockstep::engine {
namespace {

struct Outcome {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<float>> logits;  // the last step's logits per request
};

Outcome Generate(std::shared_ptr<Model> m, const std::vector<std::vector<int32_t>>& prompts, int64_t max_batch,
                 double temperature, KvFormat kv = KvFormat::kFp32, uint64_t seed_base = 1000,
                 int64_t max_prefill_tokens = 0, std::vector<std::vector<float>>* prompt_logits = nullptr) {
  EngineOptions o;
  o.max_batch = max_batch;
  o.max_prefill_tokens = max_prefill_tokens;
  o.page_size = 8;
  o.kv_format = kv;
  auto e = Engine::Create(m, o);
  EXPECT_TRUE(e.ok());
  for (size_t i = 0; i < prompts.size(); ++i) {
    Request r;
    r.prompt = prompts[i];
    r.max_new_tokens = 12;
    r.sampling.temperature = temperature;
    r.sampling.top_p = 0.95;
    r.sampling.seed = seed_base + i;
    r.all_prompt_logits = prompt_logits != nullptr;
    EXPECT_TRUE((*e)->AddRequest(r).ok());
  }
  Status s = (*e)->RunToCompletion();
  EXPECT_TRUE(s.ok()) << s.message();
  Outcome run;
  for (int64_t i = 0; i < (*e)->num_requests(); ++i) {
    run.tokens.push_back((*e)->request(i).generated);
    run.logits.push_back((*e)->request(i).last_logits);
    if (prompt_logits != nullptr) prompt_logits->push_back((*e)->request(i).prompt_logits);
  }
  return run;
}

std::vector<std::vector<int32_t>> Prompts(int64_t vocab, int n) {
  std::mt19937 rng(11);
  std::vector<std::vector<int32_t>> out;
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> p(5 + 7 * i);  // ragged: 5..54 tokens
    for (auto& t : p) t = static_cast<int32_t>(rng() % vocab);
    out.push_back(p);
  }
  return out;
}

class BatchInvariance : public ::testing::TestWithParam<std::string> {};

TEST_P(BatchInvariance, SameBitsAtBatch1AndBatch8) {
  auto m = Model::Load(testing::FixtureDir() / "models" / GetParam());
  ASSERT_TRUE(m.ok()) << m.status().message();
  const auto prompts = Prompts((*m)->config().vocab_size, 8);
  for (double temp : {0.0, 0.9}) {
    Outcome together = Generate(*m, prompts, 8, temp);
    Outcome staggered = Generate(*m, prompts, 3, temp);  // requests join as others leave
    for (size_t i = 0; i < prompts.size(); ++i) {
      // Alone, with the seed it had in the batch.
      Outcome alone = Generate(*m, {prompts[i]}, 1, temp, KvFormat::kFp32, 1000 + i);
      EXPECT_EQ(together.tokens[i], alone.tokens[0]) << "request " << i << " temperature " << temp;
      EXPECT_EQ(staggered.tokens[i], alone.tokens[0]) << "request " << i << " temperature " << temp;
      ASSERT_EQ(together.logits[i].size(), alone.logits[0].size());
      EXPECT_EQ(0, std::memcmp(together.logits[i].data(), alone.logits[0].data(), alone.logits[0].size() * 4))
          << "request " << i << ": logits bits differ between batch 8 and batch 1";
    }
  }
}

// Chunked prefill (max_prefill_tokens): prompts fed over several steps, chunks cut anywhere —
// one-token chunks included — beside running decodes. Every prompt position's logits, the
// sampled tokens and the last logits are the bits of the unchunked run.
TEST_P(BatchInvariance, ChunkedPrefillChangesNoBits) {
  auto m = Model::Load(testing::FixtureDir() / "models" / GetParam());
  ASSERT_TRUE(m.ok()) << m.status().message();
  const auto prompts = Prompts((*m)->config().vocab_size, 6);
  std::vector<std::vector<float>> whole_prompt;
  const Outcome whole = Generate(*m, prompts, 4, 0.9, KvFormat::kFp32, 1000, 0, &whole_prompt);
  for (int64_t budget : {1, 7, 16}) {
    std::vector<std::vector<float>> chunked_prompt;
    const Outcome chunked = Generate(*m, prompts, 4, 0.9, KvFormat::kFp32, 1000, budget, &chunked_prompt);
    for (size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_EQ(chunked.tokens[i], whole.tokens[i]) << "request " << i << " budget " << budget;
      ASSERT_EQ(chunked_prompt[i].size(), whole_prompt[i].size()) << "request " << i << " budget " << budget;
      EXPECT_EQ(0, std::memcmp(chunked_prompt[i].data(), whole_prompt[i].data(), whole_prompt[i].size() * 4))
          << "request " << i << " budget " << budget << ": prompt logits differ when chunked";
      EXPECT_EQ(0, std::memcmp(chunked.logits[i].data(), whole.logits[i].data(), whole.logits[i].size() * 4))
          << "request " << i << " budget " << budget;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, BatchInvariance, ::testing::Values("v3_basic", "v32_sparse", "v2_lite_like"));

// gemm=fp32_dot / bf16_dot name the GPU's CPU-order GEMMs, *_heuristic its unpinned cuBLAS
// ones; on the CPU they are its own GEMMs (a GPU trace recorded with them replays on the CPU
// under the same name, at its precision): same bits as fp32 / bf16, and bf16 is not fp32.
// The last logits of prompt {5, 9, 13, 2, 7} and 3 tokens on `m` under `kernels` (taps to `hook`).
std::vector<float> LastLogits(const std::shared_ptr<Model>& m, const kernels::KernelChoice& kernels,
                              TapHook* hook = nullptr) {
  EngineOptions o;
  o.kernels = kernels;
  auto e = Engine::Create(m, o);
  EXPECT_TRUE(e.ok()) << e.status().message();
  if (!e.ok()) return {};
  (*e)->SetTapHook(hook);
  Request r;
  r.prompt = {5, 9, 13, 2, 7};
  r.max_new_tokens = 3;
  EXPECT_TRUE((*e)->AddRequest(r).ok());
  EXPECT_TRUE((*e)->RunToCompletion().ok());
  return (*e)->request(0).last_logits;
}

// Which of a run's kernel choices another backend cannot reproduce bit for bit: cuBLAS GEMMs
// and variants it lacks; none across one backend.
TEST(Kernels, BitsApartAcrossBackends) {
  using V = std::vector<std::string>;
  const kernels::KernelChoice gpu_shared = {{"gemm", "bf16_dot"},    {"attn_prefill", "absorbed"},
                                            {"attn_decode", "absorbed"}, {"norm", "lanes256"},
                                            {"indexer", "fp8_paged"},  {"kv_quant", "reference"}};
  EXPECT_EQ(kernels::BitsApartAcross(gpu_shared, "cuda", "cpu"), V{});
  EXPECT_EQ(kernels::BitsApartAcross(gpu_shared, "cpu", "cuda"), V{});
  kernels::KernelChoice cublas = gpu_shared;
  cublas["gemm"] = "fp32";
  EXPECT_EQ(kernels::BitsApartAcross(cublas, "cuda", "cpu"), V{"gemm=fp32"});
  cublas["gemm"] = "bf16_heuristic";
  EXPECT_EQ(kernels::BitsApartAcross(cublas, "cpu", "cuda"), V{"gemm=bf16_heuristic"});
  // The CPU's expanded prefill has no CUDA kernel; a name neither has is apart too.
  const kernels::KernelChoice cpu_default = {{"attn_prefill", "expanded"}, {"gemm", "fp32_dot"}, {"rope", "nope"}};
  EXPECT_EQ(kernels::BitsApartAcross(cpu_default, "cpu", "cuda"), (V{"attn_prefill=expanded", "rope=nope"}));
  EXPECT_EQ(kernels::BitsApartAcross(cpu_default, "cpu", "cpu"), V{});
}

TEST(Engine, DotGemmNamesAreTheCpuGemms) {
  auto m = Model::Load(testing::FixtureDir() / "models" / "v3_basic");
  ASSERT_TRUE(m.ok());
  auto run = [&](const std::string& gemm) { return LastLogits(*m, {{"gemm", gemm}}); };
  const auto f32 = run("fp32"), f32_dot = run("fp32_dot"), b16 = run("bf16"), b16_dot = run("bf16_dot");
  const auto f32_h = run("fp32_heuristic"), b16_h = run("bf16_heuristic");
  ASSERT_EQ(f32.size(), f32_dot.size());
  EXPECT_EQ(0, std::memcmp(f32.data(), f32_dot.data(), f32.size() * 4));
  ASSERT_EQ(f32.size(), f32_h.size());
  EXPECT_EQ(0, std::memcmp(f32.data(), f32_h.data(), f32.size() * 4));
  ASSERT_EQ(b16.size(), b16_dot.size());
  EXPECT_EQ(0, std::memcmp(b16.data(), b16_dot.data(), b16.size() * 4));
  ASSERT_EQ(b16.size(), b16_h.size());
  EXPECT_EQ(0, std::memcmp(b16.data(), b16_h.data(), b16.size() * 4));
  EXPECT_NE(0, std::memcmp(f32.data(), b16.data(), f32.size() * 4));
}

// norm=lanes256 reaches every RMSNorm of the forward: the attention norm's tap is
// cpu::RmsNormLanes256 of the embedding row (bit for bit), and the logits move off the default
// fp64 norm's bits by rounding only.
TEST(Engine, NormLanes256IsTheForwardsNorm) {
  auto m = Model::Load(testing::FixtureDir() / "models" / "v3_basic");
  ASSERT_TRUE(m.ok());
  struct Hook : TapHook {
    std::vector<float> attn_norm;
    void OnTap(const TapEvent& e) override {
      if (e.name == "layers.0.attn_norm" && e.position == 0 && attn_norm.empty()) {  // the first row: token 5
        const float* f = static_cast<const float*>(e.data);
        attn_norm.assign(f, f + e.cols);
      }
    }
  };
  Hook lanes, fp64;
  const std::vector<float> a = LastLogits(*m, {{"norm", "lanes256"}}, &lanes);
  const std::vector<float> b = LastLogits(*m, {{"norm", "fp64"}}, &fp64);
  const ModelConfig& c = (*m)->config();
  const std::vector<float> embed((*m)->weights().embed.row(5), (*m)->weights().embed.row(5) + c.hidden_size);
  std::vector<float> want(c.hidden_size);
  kernels::cpu::RmsNormLanes256(embed.data(), (*m)->weights().layers[0].input_norm.ptr(), 1, c.hidden_size,
                                c.rms_norm_eps, want.data());
  ASSERT_EQ(lanes.attn_norm.size(), want.size());
  EXPECT_EQ(0, std::memcmp(lanes.attn_norm.data(), want.data(), want.size() * 4));
  ASSERT_EQ(a.size(), b.size());
  EXPECT_NE(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << "norm=lanes256 changed nothing";
  float scale = 0, worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    scale = std::max(scale, std::fabs(b[i]));
    worst = std::max(worst, std::fabs(a[i] - b[i]));
  }
  EXPECT_LT(worst, 1e-3f * scale);
}

// Fp8Blocks::Quantize by hand: per 128 × 128 block, scale = amax / 448, values rounded to
// the nearest e4m3 (even on ties), an all-zero block's scale 1; dequantised = value × scale.
TEST(Fp8Weights, BlockQuantisationByHand) {
  // 130 × 129: four blocks (128 × 128, 128 × 1, 2 × 128, 2 × 1).
  const int64_t R = 130, C = 129;
  std::vector<float> m(R * C, 0.0f);
  m[0] = 1.0f;          // block (0, 0): amax 1 → scale 1/448; 1 → 448 (0x7e)
  m[1] = 0.5f;          // → 224 = 1.75 · 2^7 exactly (0x76)
  m[2] = 0.3f;          // → 134.4 → 128 (grid step 16 in [128, 256): 0x70)
  m[3] = -0.3125f;      // → −140 → −144, the nearer of −128 and −144 (0xf1)
  m[128] = -3.0f;       // block (0, 1): amax 3 → 448 (sign set: 0xFE)
  m[129 * C + 5] = 2e-3f;  // block (1, 0): amax 2e-3 → 448
  const Fp8Blocks f = Fp8Blocks::Quantize(m.data(), R, C);
  ASSERT_EQ(f.scales.size(), 4u);
  EXPECT_EQ(f.scales[0], 1.0f / 448.0f);
  EXPECT_EQ(f.scales[1], 3.0f / 448.0f);
  EXPECT_EQ(f.scales[2], 2e-3f / 448.0f);
  EXPECT_EQ(f.scales[3], 1.0f);  // all zero
  EXPECT_EQ(f.values[0], 0x7e);
  EXPECT_EQ(f.values[1], 0x76);
  EXPECT_EQ(f.values[2], 0x70);
  EXPECT_EQ(f.values[3], 0xf1);
  EXPECT_EQ(f.values[128], 0xfe);
  EXPECT_EQ(f.values[129 * C + 5], 0x7e);
  EXPECT_EQ(f.values[129 * C + 128], 0x00);
  EXPECT_EQ(f.value(0, 2), 128.0f * (1.0f / 448.0f));
  EXPECT_EQ(f.value(0, 3), -144.0f * (1.0f / 448.0f));
  EXPECT_EQ(f.value(0, 128), -448.0f * (3.0f / 448.0f));
}

// Every prompt position's logits of `prompt` on `m` with gemm=`gemm` (one token decoded after).
std::vector<float> PromptLogitsWithGemm(const std::shared_ptr<Model>& m, const std::string& gemm,
                                        const std::vector<int32_t>& prompt) {
  EngineOptions o;
  o.kernels = {{"gemm", gemm}};
  auto e = Engine::Create(m, o);
  EXPECT_TRUE(e.ok()) << gemm << ": " << e.status().message();
  if (!e.ok()) return {};
  Request r;
  r.prompt = prompt;
  r.max_new_tokens = 1;
  r.all_prompt_logits = true;  // the same inputs for every precision (no sampled token in between)
  EXPECT_TRUE((*e)->AddRequest(r).ok());
  EXPECT_TRUE((*e)->RunToCompletion().ok());
  return (*e)->request(0).prompt_logits;
}

// gemm=w8a8_dot's activation quantiser by hand: per tile of 128 values the scale is the power
// of two ≥ amax/448, values rounded to the nearest e4m3 (even on ties) and scaled back.
TEST(Fp8Activations, RoundTripByHand) {
  std::vector<float> x(130, 0.0f), y(130, -1.0f);
  x[0] = 0.1f;     // tile 0: amax 3 → scale 2^ceil(log2(3/448)) = 2^-7; 12.8 → 13 (step 1 in [8, 16))
  x[1] = 3.0f;     // 384, on the grid (step 32 in [256, 448])
  x[2] = -1.3f;    // −166.4 → −160 (step 16 in [128, 256): 160 is 6.4 away, 176 is 9.6)
  x[3] = 5e-4f;    // 0.064 → 0.0625 (step 2^-7 in [2^-4, 2^-3))
  x[4] = NAN;      // ignored by the amax, NaN out
  x[6] = 0.09765625f;  // 12.5: a tie between 12 and 13 → 12 (even mantissa)
  x[129] = 0.75f;  // tile 1 (two values): amax 0.75 → scale 2^-9; 384 exactly
  Fp8RoundTrip(x.data(), 130, y.data());
  EXPECT_EQ(y[0], 13.0f / 128.0f);
  EXPECT_EQ(y[1], 3.0f);
  EXPECT_EQ(y[2], -160.0f / 128.0f);
  EXPECT_EQ(y[3], 0.0625f / 128.0f);
  EXPECT_TRUE(std::isnan(y[4]));
  EXPECT_EQ(y[5], 0.0f);
  EXPECT_EQ(y[6], 12.0f / 128.0f);
  EXPECT_EQ(y[128], 0.0f);
  EXPECT_EQ(y[129], 0.75f);
  std::vector<float> zeros(128, 0.0f), out(128, 1.0f);
  Fp8RoundTrip(zeros.data(), 128, out.data());  // an all-zero tile keeps its zeros (scale 1)
  EXPECT_EQ(out, zeros);
}

// gemm=w8a8_dot runs fp8_dot's weights with the linear layers' inputs through FP8: its logits
// are not fp8_dot's (the activations moved them) and stay finite. (This random fixture is
// sensitive: FP8 weights alone move its logits by ~0.7 of their range, so no closeness to fp32
// is asserted; the GPU test compares the CPU's w8a8_dot with the GPU's.)
TEST(Fp8Activations, W8a8MovesTheLogitsBeyondFp8Weights) {
  auto basic = Model::Load(testing::FixtureDir() / "models" / "v3_basic");
  ASSERT_TRUE(basic.ok()) << basic.status().message();
  auto run = [&](const std::string& gemm) { return PromptLogitsWithGemm(*basic, gemm, {5, 9, 13, 2, 7, 11, 3}); };
  const auto f32 = run("fp32"), w8 = run("fp8_dot"), a8 = run("w8a8_dot");
  ASSERT_EQ(a8.size(), w8.size());
  for (float v : a8) ASSERT_TRUE(std::isfinite(v));
  const int64_t n = static_cast<int64_t>(a8.size());
  const double from_w8 = testing::RelMaxErr(a8.data(), w8.data(), n);
  const double from_f32 = testing::RelMaxErr(a8.data(), f32.data(), n);
  std::printf("  v3_basic prompt logits: w8a8_dot vs fp8_dot %.3g, vs fp32 %.3g (max|Δ|/max|ref|)\n", from_w8,
              from_f32);
  EXPECT_GT(from_w8, 1e-3);
}

// gemm=fp8_dot: an FP8 checkpoint runs on its own bytes and scales — its loaded fp32 weights are
// their exact dequantisation, so its logits are gemm=fp32's bit for bit — while any other
// checkpoint is quantised at load (its logits move by the quantisation, not more).
TEST(Fp8Weights, Fp8CheckpointKeepsItsBytesOthersAreQuantised) {
  auto run = [&](const std::shared_ptr<Model>& m, const std::string& gemm) {
    return PromptLogitsWithGemm(m, gemm, {5, 9, 13, 2, 7});
  };
  auto fp8 = Model::Load(testing::FixtureDir() / "models" / "v3_fp8");
  ASSERT_TRUE(fp8.ok()) << fp8.status().message();
  // The loader kept the checkpoint's FP8 form of q_a_proj, and `data` is its dequantisation.
  const Matrix& qa = (*fp8)->weights().layers[0].q_a_proj;
  ASSERT_NE(qa.fp8, nullptr);
  ASSERT_EQ(qa.fp8->values.size(), qa.data.size());
  for (int64_t r = 0; r < qa.rows; ++r) {
    for (int64_t c = 0; c < qa.cols; ++c) ASSERT_EQ(qa.data[r * qa.cols + c], qa.fp8->value(r, c));
  }
  EXPECT_EQ(&(*fp8)->Fp8Weights(), &(*fp8)->weights());
  const auto a = run(*fp8, "fp32"), b = run(*fp8, "fp8_dot");
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4));

  auto basic = Model::Load(testing::FixtureDir() / "models" / "v3_basic");
  ASSERT_TRUE(basic.ok());
  const ModelWeights& q = (*basic)->Fp8Weights();
  ASSERT_NE(q.layers[0].q_a_proj.fp8, nullptr);
  EXPECT_EQ(q.layers[0].input_norm.fp8, nullptr);  // norms, embeddings and routers stay fp32
  EXPECT_EQ(q.embed.fp8, nullptr);
  // e4m3 keeps 3 mantissa bits: round to nearest moves a normal value by ≤ 2^-4 of itself, so
  // the weights' relative L2 error is a few percent — and not zero.
  {
    const Matrix& w = (*basic)->weights().layers[0].q_a_proj;
    const Matrix& d = q.layers[0].q_a_proj;
    double num = 0, den = 0;
    for (size_t i = 0; i < w.data.size(); ++i) {
      num += (double(d.data[i]) - w.data[i]) * (double(d.data[i]) - w.data[i]);
      den += double(w.data[i]) * w.data[i];
    }
    const double rel = std::sqrt(num / den);
    std::printf("  v3_basic q_a_proj: FP8 relative L2 error %.4f\n", rel);
    EXPECT_GT(rel, 0.005);
    EXPECT_LT(rel, 0.0625);
  }
  const auto f32 = run(*basic, "fp32"), f8 = run(*basic, "fp8_dot"), b16 = run(*basic, "bf16");
  ASSERT_EQ(f32.size(), f8.size());
  const int64_t n = static_cast<int64_t>(f32.size());
  const double err = testing::RelMaxErr(f8.data(), f32.data(), n);
  const double err_bf16 = testing::RelMaxErr(b16.data(), f32.data(), n);
  std::printf("  v3_basic prompt logits against fp32: fp8_dot %.3g, bf16 %.3g (max|Δ|/max|ref|)\n", err, err_bf16);
  EXPECT_GT(err, 4 * err_bf16) << "e4m3 keeps 3 mantissa bits to bf16's 7";
}

// indexer=fp8_paged scores keys page by page and stops at a request's last page: the page size
// (5: partial pages everywhere; 16; 64: one page) and the batch change no bit, and it is not the
// reference indexer (FP8 q and k move the scores; with a prompt longer than index_topk the
// selection, and so the logits, move).
TEST(Engine, Fp8PagedIndexerDependsOnNeitherPageSizeNorBatch) {
  auto m = Model::Load(testing::FixtureDir() / "models" / "v32_sparse");
  ASSERT_TRUE(m.ok()) << m.status().message();
  ASSERT_LT((*m)->config().index_topk, 40);
  auto run = [&](const std::string& indexer, int64_t page_size, int64_t batch) {
    EngineOptions o;
    o.kernels = {{"indexer", indexer}};
    o.page_size = page_size;
    o.max_batch = batch;
    auto e = Engine::Create(*m, o);
    EXPECT_TRUE(e.ok()) << e.status().message();
    for (int i = 0; i < 3; ++i) {
      Request r;
      for (int j = 0; j < 40 + 7 * i; ++j) r.prompt.push_back((13 * j + 5 * i) % 200 + 3);
      r.max_new_tokens = 6;
      EXPECT_TRUE((*e)->AddRequest(r).ok());
    }
    EXPECT_TRUE((*e)->RunToCompletion().ok());
    std::vector<float> all;
    for (int i = 0; i < 3; ++i) {
      const auto& l = (*e)->request(i).last_logits;
      all.insert(all.end(), l.begin(), l.end());
    }
    return all;
  };
  const auto base = run("fp8_paged", 16, 1);
  for (auto [ps, b] : {std::pair<int64_t, int64_t>{5, 1}, {64, 1}, {16, 3}, {5, 3}}) {
    const auto other = run("fp8_paged", ps, b);
    ASSERT_EQ(other.size(), base.size());
    EXPECT_EQ(0, std::memcmp(other.data(), base.data(), base.size() * 4)) << "page size " << ps << " batch " << b;
  }
  const auto ref = run("reference", 16, 1);
  EXPECT_NE(0, std::memcmp(ref.data(), base.data(), base.size() * 4)) << "fp8_paged ran as the reference";
}

TEST(Engine, ChunkedPrefillReportsItsChunks) {
  auto m = Model::Load(testing::FixtureDir() / "models" / "v3_basic");
  ASSERT_TRUE(m.ok());
  EngineOptions o;
  o.max_prefill_tokens = 10;
  auto e = Engine::Create(*m, o);
  ASSERT_TRUE(e.ok());
  Request r;
  r.prompt.assign(25, 7);
  r.max_new_tokens = 3;
  ASSERT_TRUE((*e)->AddRequest(r).ok());
  std::vector<StepEvent> events;
  (*e)->SetStepCallback([&](const StepEvent& ev) { events.push_back(ev); });
  int steps = 0;
  while (true) {
    auto more = (*e)->Step();
    ASSERT_TRUE(more.ok());
    if (!*more) break;
    ++steps;
  }
  EXPECT_EQ(steps, 3 + 2);  // chunks of 10, 10, 5 (the last one samples), then 2 decode steps
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].prompt_chunks, (std::vector<int64_t>{0, 10, 20}));
  EXPECT_TRUE(events[1].prompt_chunks.empty());
  o.max_prefill_tokens = -1;
  EXPECT_FALSE(Engine::Create(*m, o).ok());
}

TEST(Engine, ReducedPrecisionCachesStayCloseButDiffer) {
  auto m = Model::Load(testing::FixtureDir() / "models" / "v3_basic");
  ASSERT_TRUE(m.ok()) << m.status().message();
  const auto prompts = Prompts((*m)->config().vocab_size, 2);
  Outcome f32 = Generate(*m, prompts, 2, 0.0, KvFormat::kFp32);
  for (KvFormat kv : {KvFormat::kBf16, KvFormat::kFp8E4m3}) {
    Outcome r = Generate(*m, {prompts[0]}, 1, 0.0, kv);
    // Compare the first generated step only (later steps may follow other tokens).
    EXPECT_NE(r.logits[0], f32.logits[0]) << KvFormatName(kv) << " should not be bit-identical to fp32";
  }
}

TEST(Engine, RejectsBadRequests) {
  auto m = Model::Load(testing::FixtureDir() / "models" / "v3_basic");
  ASSERT_TRUE(m.ok()) << m.status().message();
  auto e = Engine::Create(*m, EngineOptions{});
  ASSERT_TRUE(e.ok());
  Request r;
  EXPECT_FALSE((*e)->AddRequest(r).ok()) << "empty prompt";
  r.prompt = {1, 2, static_cast<int32_t>((*m)->config().vocab_size)};
  EXPECT_FALSE((*e)->AddRequest(r).ok()) << "token outside the vocabulary";
  r.prompt = {1, 2};
  r.max_new_tokens = (*m)->config().max_position_embeddings;
  EXPECT_FALSE((*e)->AddRequest(r).ok()) << "longer than max_position_embeddings";
  r.max_new_tokens = 4;
  r.sampling.top_p = 0;
  EXPECT_FALSE((*e)->AddRequest(r).ok()) << "top_p 0";
  EngineOptions bad;
  bad.kernels = {{"attn_decode", "nonsense"}};
  auto e2 = Engine::Create(*m, bad);
  ASSERT_FALSE(e2.ok());
  EXPECT_NE(e2.status().message().find("attn_decode"), std::string::npos);
}

}  // namespace
}  // namespace lockstep::engine

namespace lockstep::engine {
namespace {

// Records every tap event; checks names, shapes and order.
class Collect : public TapHook {
 public:
  void OnTap(const TapEvent& e) override {
    names.emplace_back(e.name);
    events.push_back({std::string(e.name), e.request_id, e.position, e.rows, e.cols});
    if (e.name == "logits") {
      const float* f = static_cast<const float*>(e.data);
      logits.assign(f, f + e.rows * e.cols);
    }
  }
  struct Ev {
    std::string name;
    int64_t request, position, rows, cols;
  };
  std::vector<std::string> names;
  std::vector<Ev> events;
  std::vector<float> logits;
};

TEST(Taps, EveryDocumentedTapFiresWithItsShape) {
  auto m = Model::Load(testing::FixtureDir() / "models" / "v32_sparse");
  ASSERT_TRUE(m.ok());
  const ModelConfig& c = (*m)->config();
  auto e = Engine::Create(*m, EngineOptions{});
  Collect tap;
  (*e)->SetTapHook(&tap);
  Request r;
  r.prompt = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4};
  r.max_new_tokens = 3;
  r.all_prompt_logits = true;
  ASSERT_TRUE((*e)->AddRequest(r).ok());
  ASSERT_TRUE((*e)->Step().ok());  // prefill
  std::map<std::string, std::pair<int64_t, int64_t>> shape;  // name → rows, cols
  for (const auto& ev : tap.events) shape[ev.name] = {ev.rows, ev.cols};
  const int64_t T = static_cast<int64_t>(r.prompt.size());
  EXPECT_EQ(shape["embed"], std::make_pair(T, c.hidden_size));
  EXPECT_EQ(shape["layers.0.attn.q"], std::make_pair(T, c.num_attention_heads * c.qk_head_dim()));
  EXPECT_EQ(shape["layers.0.attn.latent"], std::make_pair(T, c.kv_lora_rank));
  EXPECT_EQ(shape["layers.0.attn.k_rope"], std::make_pair(T, c.qk_rope_head_dim));
  EXPECT_EQ(shape["layers.1.indexer.topk"], std::make_pair(T, c.index_topk));
  EXPECT_EQ(shape["layers.1.ffn.router.topk_ids"], std::make_pair(T, c.num_experts_per_tok));
  EXPECT_EQ(shape["layers.1.resid_out"], std::make_pair(T, c.hidden_size));
  EXPECT_EQ(shape["logits"], std::make_pair(T, c.vocab_size));
  EXPECT_EQ(shape.count("layers.0.ffn.router.topk_ids"), 0u) << "layer 0 is dense";
  // Causal order within a step: layer 0's taps all come before layer 1's.
  auto first = [&](const std::string& n) { return std::find(tap.names.begin(), tap.names.end(), n) - tap.names.begin(); };
  EXPECT_LT(first("layers.0.resid_out"), first("layers.1.attn_norm"));
  EXPECT_LT(first("layers.1.resid_out"), first("final_norm"));
  EXPECT_EQ(tap.logits, (*e)->request(0).prompt_logits);
  // A decode step taps one row at the next position.
  tap.events.clear();
  ASSERT_TRUE((*e)->Step().ok());
  for (const auto& ev : tap.events) {
    EXPECT_EQ(ev.rows, 1) << ev.name;
    EXPECT_EQ(ev.position, T) << ev.name;
  }
}

}  // namespace
}  // namespace lockstep::engine

namespace lockstep::engine {
namespace {

TEST(Replay, ForcedTokensAreFedAndTheSamplersChoiceIsReported) {
  auto m = Model::Load(testing::FixtureDir() / "models" / "v3_basic");
  ASSERT_TRUE(m.ok());
  auto e = Engine::Create(*m, EngineOptions{});
  Request r;
  r.prompt = {5, 6, 7};
  r.max_new_tokens = 5;
  r.forced_tokens = {1, 2, 3};
  std::vector<StepEvent> evs;
  (*e)->SetStepCallback([&](const StepEvent& ev) { evs.push_back(ev); });
  ASSERT_TRUE((*e)->AddRequest(r).ok());
  ASSERT_TRUE((*e)->RunToCompletion().ok());
  const auto& g = (*e)->request(0).generated;
  ASSERT_EQ(g.size(), 5u);
  EXPECT_EQ(std::vector<int32_t>(g.begin(), g.begin() + 3), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_TRUE(evs[0].forced);
  EXPECT_FALSE(evs[3].forced);
  EXPECT_EQ(evs[3].token, evs[3].sample.token);
}

// Grafts every layer input from a recorded run: with the recording's own values the run is
// unchanged; with another run's values each layer restarts from them.
class Graft : public TapHook {
 public:
  std::map<std::string, std::vector<float>> recorded, seen;
  bool record = true;
  int overrides = 0;
  void OnTap(const TapEvent& e) override {
    if (e.dtype != TapDType::kF32) return;
    const float* f = static_cast<const float*>(e.data);
    auto& v = (record ? recorded : seen)[std::string(e.name) + "@" + std::to_string(e.position)];
    v.assign(f, f + e.rows * e.cols);
  }
  bool WantsOverride() const override { return !record; }
  bool Override(const TapEvent& e, void* data) override {
    auto it = recorded.find(std::string(e.name) + "@" + std::to_string(e.position));
    if (it == recorded.end()) return false;
    std::memcpy(data, it->second.data(), it->second.size() * 4);
    ++overrides;
    return true;
  }
};

TEST(Replay, GraftingFeedsEachLayerTheRecordedInput) {
  auto m = Model::Load(testing::FixtureDir() / "models" / "v3_basic");
  ASSERT_TRUE(m.ok());
  auto run = [&](Graft* g, const std::string& fault) {
    EngineOptions o;
    o.fault = fault;
    auto e = Engine::Create(*m, o);
    (*e)->SetTapHook(g);
    Request r;
    r.prompt = {5, 6, 7, 8, 9, 10, 11, 12};
    r.max_new_tokens = 1;
    r.all_prompt_logits = true;
    EXPECT_TRUE((*e)->AddRequest(r).ok());
    EXPECT_TRUE((*e)->RunToCompletion().ok());
    return (*e)->request(0).prompt_logits;
  };
  Graft g;
  auto clean = run(&g, "");
  g.record = false;
  auto grafted_clean = run(&g, "");
  EXPECT_EQ(clean, grafted_clean) << "grafting a run's own values changes nothing";
  EXPECT_EQ(g.overrides, 1 + 3) << "embed + one resid_out per layer";
  // A faulty softmax grafted onto clean inputs: each layer's computed output carries only that
  // layer's own error. Layer 0 sees the same input either way; later layers do not.
  Graft free_run;
  run(&free_run, "fault_no_max_fp16_sum");
  g.seen.clear();
  run(&g, "fault_no_max_fp16_sum");
  auto key = [](int l) { return "layers." + std::to_string(l) + ".resid_out@0"; };
  EXPECT_EQ(g.seen[key(0)], free_run.recorded[key(0)]);
  EXPECT_NE(g.seen[key(0)], g.recorded[key(0)]) << "the fault shows in layer 0's own output";
  EXPECT_NE(g.seen[key(2)], free_run.recorded[key(2)]) << "grafted layer 2 starts from the clean input";
}

}  // namespace
}  // namespace lockstep::engine

namespace lockstep::engine {
namespace {

// The tap table's widths (engine/tap.h `cols`, evaluated by TapCols) are the widths each family's
// forward emits: every event of a prefill and a decode step on five fixture models (V2, V3,
// V3.2, two V4 layouts) and one at emulated TP 2 — the widths verify checks a stranger's trace
// against.
TEST(Taps, TheTableWidthsAreWhatEveryFamilyEmits) {
  // (model, emulated TP degree): TP 2 adds the ranks' partials (`tp·H`).
  const std::vector<std::pair<std::filesystem::path, int64_t>> runs = {
      {testing::FixtureDir() / "models" / "v2_lite_like", 1}, {testing::FixtureDir() / "models" / "v3_basic", 1},
      {testing::FixtureDir() / "models" / "v32_sparse", 1},   {testing::FixtureDir() / "models_v4" / "v4_mixed", 1},
      {testing::FixtureDir() / "models_v4" / "v4_topk_select", 1}, {testing::FixtureDir() / "models" / "v3_basic", 2}};
  std::set<std::string> kinds;  // table entries seen
  for (const auto& [dir, tp] : runs) {
    auto m = Model::Load(dir);
    ASSERT_TRUE(m.ok()) << dir << ": " << m.status().message();
    const ModelConfig& c = (*m)->config();
    EngineOptions o;
    o.emulate_tp = tp;
    auto e = Engine::Create(*m, o);
    ASSERT_TRUE(e.ok()) << dir;
    Collect tap;
    (*e)->SetTapHook(&tap);
    Request r;
    for (int i = 0; i < 40; ++i) r.prompt.push_back(2 + (i * 7) % static_cast<int>(c.vocab_size - 2));
    r.max_new_tokens = 2;
    ASSERT_TRUE((*e)->AddRequest(r).ok());
    ASSERT_TRUE((*e)->Step().ok());
    ASSERT_TRUE((*e)->Step().ok());
    ASSERT_FALSE(tap.events.empty()) << dir;
    for (const auto& ev : tap.events) {
      const TapPoint* point = FindTapPoint(ev.name);
      ASSERT_NE(point, nullptr) << dir << ": " << ev.name << " is not in the tap table";
      EXPECT_EQ(TapCols(*point, c, tp), ev.cols) << dir << ": " << ev.name << " (table: " << point->cols << ")";
      kinds.insert(std::string(point->name));
    }
  }
  // Every entry of the table fired somewhere (a width no run checks would be a guess).
  for (const TapPoint& t : kLayerTaps) EXPECT_TRUE(kinds.count(std::string(t.name))) << t.name;
  for (const TapPoint& t : kModelTaps) EXPECT_TRUE(kinds.count(std::string(t.name))) << t.name;
}

}  // namespace
}  // namespace lockstep::engine
