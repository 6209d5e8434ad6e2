// tests/gpu/gpu_engine_test.cc — the CUDA backend end to end (issue 6).
//
//   * every transformers fixture model (tests/fixtures/models): prefill logits at every
//     position and 32 greedy decode steps within the engine's 1e-4 tolerance of transformers'
//     fp32 logits, identical greedy tokens, for fp32, bf16 and FP8 caches;
//   * the embedded model: transformers' 128 greedy tokens;
//   * bit-identical logits run to run, at batch 1 vs batch 8 with staggered arrivals, and
//     under chunked vs whole prefill of the neighbours;
//   * the GPU's variants are the CPU's bits; graphs, the side stream, overlapped launches and
//     chunked prefill change none; the device sampler picks the host sampler's tokens;
//   * the taps (same names and shapes as the CPU backend, values close, summaries and the
//     cache rows of the recorder's captures): gpu_engine_taps_test.cc.
// Skips (not passes) without a GPU.
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <tuple>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"
#include "tests/gpu/gpu_engine_util.h"
#include "tests/test_util.h"
#include "traces/row_summary.h"

namespace lockstep {
namespace {

using engine::Engine;
using engine::EngineOptions;
using engine::Model;

using gpu_testing::Cuda;
using gpu_testing::TapRecorder;
using gpu_testing::Tiny;

using testing::LoadReference;
using testing::Reference;

class GpuModelReference : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(GpuModelReference, MatchesTransformers) {
  LS_REQUIRE_GPU();
  const auto& [name, cache] = GetParam();
  const auto dir = testing::FixtureDir() / "models" / name;
  auto model = Model::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status().message();
  const int64_t V = (*model)->config().vocab_size;
  Reference ref = LoadReference(dir);
  auto fmt = engine::ParseKvFormat(cache);
  ASSERT_TRUE(fmt.ok());
  auto eng = Engine::Create(*model, Cuda(*fmt));
  ASSERT_TRUE(eng.ok()) << eng.status().message();
  engine::Request req;
  req.prompt = ref.prompt;
  req.max_new_tokens = static_cast<int64_t>(ref.decode_ids.size());
  req.all_prompt_logits = true;
  std::vector<std::vector<float>> step_logits;
  (*eng)->SetStepCallback([&](const engine::StepEvent& ev) {
    step_logits.push_back((*eng)->request(ev.request_id).last_logits);
  });
  ASSERT_TRUE((*eng)->AddRequest(req).ok());
  const Status st = (*eng)->RunToCompletion();
  ASSERT_TRUE(st.ok()) << st.message();
  const auto& r = (*eng)->request(0);
  // fp32 cache: the engine's own tolerance against transformers. Quantised caches change the
  // numbers by design; there the bound is the CPU backend's own error with that cache, ×2.
  double tol = 1e-4;
  if (*fmt != engine::KvFormat::kFp32) {
    EngineOptions cpu;
    cpu.kv_format = *fmt;
    cpu.page_size = 16;
    auto ce = Engine::Create(*model, cpu);
    ASSERT_TRUE(ce.ok());
    ASSERT_TRUE((*ce)->AddRequest(req).ok());
    ASSERT_TRUE((*ce)->RunToCompletion().ok());
    double cpu_err = 0;
    for (size_t p = 0; p < ref.prompt.size(); ++p) {
      cpu_err = std::max(cpu_err, testing::RelMaxErr(&(*ce)->request(0).prompt_logits[p * V], &ref.prefill[p * V], V));
    }
    tol = std::max(1e-4, 2 * cpu_err);
  }
  double worst = 0;
  for (size_t p = 0; p < ref.prompt.size(); ++p) {
    const double e = testing::RelMaxErr(&r.prompt_logits[p * V], &ref.prefill[p * V], V);
    ASSERT_FALSE(std::isnan(e)) << name << " prefill position " << p << ": NaN";
    worst = std::max(worst, e);
    EXPECT_LE(e, tol) << name << " prefill position " << p;
  }
  ASSERT_EQ(step_logits.size(), ref.decode_ids.size());
  if (*fmt == engine::KvFormat::kFp32) {
    for (size_t i = 0; i < ref.decode_ids.size(); ++i) {
      const double e = testing::RelMaxErr(step_logits[i].data(), &ref.decode[i * V], V);
      worst = std::max(worst, e);
      EXPECT_LE(e, tol) << name << " decode step " << i;
      EXPECT_EQ(r.generated[i], ref.decode_ids[i]) << name << " greedy token at decode step " << i;
    }
  }
  std::printf("[ %s / cuda / %s cache ] worst max|Δ|/max|ref| = %.3g (bound %.3g)\n", name.c_str(), cache.c_str(),
              worst, tol);
}

std::vector<std::tuple<std::string, std::string>> Params() {
  std::vector<std::tuple<std::string, std::string>> out;
  for (const auto& m : testing::ModelFixtures()) {
    for (const char* c : {"fp32", "bf16", "fp8_e4m3"}) out.emplace_back(m, c);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GpuModelReference, ::testing::ValuesIn(Params()),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

TEST(GpuEngine, TinyModelGreedyMatchesTransformersFor128Steps) {
  LS_REQUIRE_GPU();
  auto model = Tiny();
  ASSERT_TRUE(model);
  auto ref = engine::SafetensorsFile::Open(testing::FixtureDir() / "tiny_reference.safetensors");
  ASSERT_TRUE(ref.ok());
  const auto& t = (*ref)->tensors();
  // cuBLAS fp32 and the CPU-order fp32 GEMM (gemm=fp32_dot) alike.
  for (int p = 0; p < 4; ++p) {
    const std::string gemm = p < 2 ? "fp32" : "fp32_dot";
    const std::string pre = "prompt" + std::to_string(p % 2);
    SCOPED_TRACE("gemm=" + gemm);
    const auto prompt = testing::ReadIds(t.at(pre + "_ids"));
    const auto want = testing::ReadIds(t.at(pre + "_decode_ids"));
    auto eng = Engine::Create(model, Cuda(engine::KvFormat::kFp32, gemm));
    ASSERT_TRUE(eng.ok()) << eng.status().message();
    engine::Request r;
    r.prompt = prompt;
    r.max_new_tokens = static_cast<int64_t>(want.size());
    ASSERT_TRUE((*eng)->AddRequest(r).ok());
    const Status st = (*eng)->RunToCompletion();
    ASSERT_TRUE(st.ok()) << st.message();
    const auto& got = (*eng)->request(0).generated;
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(got[i], want[i]) << pre << ": first differing greedy token at step " << i;
    }
  }
}

// Eight prompts of different lengths, sampled at T 0.8: every step's logits per request.
using Logits = std::map<int64_t, std::vector<std::vector<float>>>;
Logits RunBatch(const EngineOptions& o, int64_t max_batch, bool stagger, std::vector<std::vector<int32_t>>* tokens,
               std::vector<std::vector<uint8_t>>* cache_rows = nullptr) {
  EngineOptions eo = o;
  eo.max_batch = max_batch;
  auto eng = Engine::Create(Tiny(), eo);
  EXPECT_TRUE(eng.ok()) << eng.status().message();
  Logits out;
  if (cache_rows != nullptr) {
    // Every layer's stored bytes of every new row, as the host mirror holds them.
    (*eng)->SetForwardCallback([&](std::span<const engine::Segment> segs, const engine::PagedKvCache& cache) {
      for (const auto& g : segs) {
        for (size_t j = 0; j < g.tokens.size(); ++j) {
          for (int64_t l = 0; l < Tiny()->config().num_hidden_layers; ++l) {
            for (size_t st = 0; st < cache.streams(l).size(); ++st) {
              const uint8_t* b = cache.TokenBytes(l, st, *g.cache, g.start_pos + static_cast<int64_t>(j));
              cache_rows->emplace_back(b, b + cache.streams(l)[st].bytes_per_token);
            }
          }
        }
      }
    });
  }
  (*eng)->SetStepCallback(
      [&](const engine::StepEvent& ev) { out[ev.request_id].push_back((*eng)->request(ev.request_id).last_logits); });
  auto add = [&](int i) {
    engine::Request r;
    for (int j = 0; j < 5 + 7 * i; ++j) r.prompt.push_back(static_cast<int32_t>((97 * i + 31 * j) % 6000 + 3));
    r.max_new_tokens = 12;
    r.sampling.temperature = 0.8;
    r.sampling.seed = 1000 + i;
    EXPECT_TRUE((*eng)->AddRequest(r).ok());
  };
  int added = 0;
  if (!stagger) {
    for (; added < 8; ++added) add(added);
    EXPECT_TRUE((*eng)->RunToCompletion().ok());
  } else {
    // One new request per step: prefills land in batches of running decodes.
    while (true) {
      if (added < 8) add(added++);
      auto more = (*eng)->Step();
      EXPECT_TRUE(more.ok()) << more.status().message();
      if (!more.ok() || (!*more && added == 8)) break;
    }
  }
  tokens->clear();
  for (int64_t i = 0; i < (*eng)->num_requests(); ++i) tokens->push_back((*eng)->request(i).generated);
  return out;
}

bool Bitwise(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// Every request's logits at every step, bit for bit; the first difference named.
::testing::AssertionResult SameLogits(const Logits& a, const Logits& b) {
  if (a.size() != b.size()) {
    return ::testing::AssertionFailure() << a.size() << " requests against " << b.size();
  }
  for (const auto& [id, steps] : a) {
    const auto it = b.find(id);
    if (it == b.end()) return ::testing::AssertionFailure() << "request " << id << " missing";
    if (steps.size() != it->second.size()) {
      return ::testing::AssertionFailure() << "request " << id << ": " << steps.size() << " steps against "
                                           << it->second.size();
    }
    for (size_t s = 0; s < steps.size(); ++s) {
      if (!Bitwise(steps[s], it->second[s])) return ::testing::AssertionFailure() << "request " << id << " step " << s;
    }
  }
  return ::testing::AssertionSuccess();
}

// Two engine settings that must not change a bit: the staggered batch under each gives the
// same logits at every step and the same tokens.
void ExpectSameRuns(const EngineOptions& x, const EngineOptions& y) {
  std::vector<std::vector<int32_t>> a, b;
  const Logits lx = RunBatch(x, 4, true, &a);
  const Logits ly = RunBatch(y, 4, true, &b);
  EXPECT_TRUE(SameLogits(lx, ly));
  EXPECT_EQ(a, b);
}

TEST(GpuEngine, DeterministicAndBatchInvariant) {
  LS_REQUIRE_GPU();
  for (const char* gemm : {"fp32", "bf16", "fp32_dot", "bf16_dot", "fp8_dot", "w8a8_dot"}) {
    for (auto fmt : {engine::KvFormat::kFp32, engine::KvFormat::kFp8E4m3}) {
      SCOPED_TRACE(std::string("gemm=") + gemm + " cache=" + std::string(engine::KvFormatName(fmt)));
      std::vector<std::vector<int32_t>> t_alone, t_again, t_batch, t_stagger;
      const Logits alone = RunBatch(Cuda(fmt, gemm), 1, false, &t_alone);
      const Logits again = RunBatch(Cuda(fmt, gemm), 1, false, &t_again);
      const Logits batch = RunBatch(Cuda(fmt, gemm), 8, false, &t_batch);
      const Logits stagger = RunBatch(Cuda(fmt, gemm), 8, true, &t_stagger);
      ASSERT_EQ(alone.size(), 8u);
      for (const auto& [id, steps] : alone) {
        ASSERT_EQ(steps.size(), 12u);
        for (size_t s = 0; s < steps.size(); ++s) {
          EXPECT_TRUE(Bitwise(steps[s], again.at(id)[s])) << "run to run: request " << id << " step " << s;
          EXPECT_TRUE(Bitwise(steps[s], batch.at(id)[s])) << "batch 1 vs 8: request " << id << " step " << s;
          EXPECT_TRUE(Bitwise(steps[s], stagger.at(id)[s])) << "batch 1 vs staggered: request " << id << " step " << s;
        }
      }
      EXPECT_EQ(t_alone, t_batch);
      EXPECT_EQ(t_alone, t_stagger);
    }
  }
}

// Decode steps replayed from a CUDA graph give the bits of the same steps launched one by one.
TEST(GpuEngine, GraphsChangeNoBits) {
  LS_REQUIRE_GPU();
  // bf16_dot: the step's independent branches (latent-cache path, shared experts) run on a
  // second stream, forked and joined inside the graph.
  for (const char* gemm : {"bf16", "bf16_dot", "fp8_dot", "w8a8_dot"}) {
    SCOPED_TRACE(std::string("gemm=") + gemm);
    std::vector<std::vector<int32_t>> a, b;
    std::vector<std::vector<uint8_t>> rows_a, rows_b;
    EngineOptions no_graphs = Cuda(engine::KvFormat::kFp8E4m3, gemm);
    no_graphs.device.cuda_graphs = false;
    const Logits plain = RunBatch(no_graphs, 4, false, &a, &rows_a);
    const Logits graphed = RunBatch(Cuda(engine::KvFormat::kFp8E4m3, gemm), 4, false, &b, &rows_b);
    // The cache rows mirrored to the host (a recorder's view) are the same with graphs.
    ASSERT_EQ(rows_a.size(), rows_b.size());
    EXPECT_GT(rows_a.size(), 0u);
    EXPECT_TRUE(rows_a == rows_b) << "mirrored cache bytes differ between graphed and plain steps";
    EXPECT_TRUE(SameLogits(plain, graphed));
    EXPECT_EQ(a, b);
  }
}

// The step's independent branches on a second stream (the default) give the bits of one stream,
// with the CPU-order GEMMs and with cuBLAS (the side stream has its own workspace); under
// w8a8_dot both streams read the FP8-rounded inputs and round the shared experts' own.
TEST(GpuEngine, SideStreamChangesNoBits) {
  LS_REQUIRE_GPU();
  for (const char* gemm : {"bf16", "bf16_dot", "w8a8_dot"}) {
    SCOPED_TRACE(std::string("gemm=") + gemm);
    EngineOptions one = Cuda(engine::KvFormat::kFp8E4m3, gemm);
    one.device.side_stream = false;
    ExpectSameRuns(one, Cuda(engine::KvFormat::kFp8E4m3, gemm));
  }
}

// Kernels scheduled while the one before them finishes (the default on sm_90: a GEMV's weights
// stream in early, everything else waits for the previous kernel) give the bits of strictly
// serial launches, in graphs and out of them. A kernel that read an activation before its wait
// would see the previous step's or layer's values here.
TEST(GpuEngine, OverlappedLaunchChangesNoBits) {
  LS_REQUIRE_GPU();
  for (const char* gemm : {"bf16", "bf16_dot", "fp8_dot", "w8a8_dot"}) {
    for (const bool graphs : {true, false}) {
      SCOPED_TRACE(std::string("gemm=") + gemm + (graphs ? " graphs" : " no graphs"));
      EngineOptions serial = Cuda(engine::KvFormat::kFp8E4m3, gemm);
      serial.device.overlapped_launch = false;
      serial.device.cuda_graphs = graphs;
      EngineOptions overlapped = Cuda(engine::KvFormat::kFp8E4m3, gemm);
      overlapped.device.cuda_graphs = graphs;
      ExpectSameRuns(serial, overlapped);
    }
  }
}

// A request's prompt logits (every position) under `o`, decoding `decode` tokens after it.
std::vector<float> PromptLogits(const std::shared_ptr<Model>& m, const EngineOptions& o,
                                const std::vector<int32_t>& prompt, int64_t decode,
                                std::vector<int32_t>* tokens = nullptr) {
  auto e = Engine::Create(m, o);
  EXPECT_TRUE(e.ok()) << e.status().message();
  engine::Request r;
  r.prompt = prompt;
  r.max_new_tokens = decode;
  r.all_prompt_logits = true;
  EXPECT_TRUE((*e)->AddRequest(r).ok());
  const Status st = (*e)->RunToCompletion();
  EXPECT_TRUE(st.ok()) << st.message();
  if (tokens != nullptr) *tokens = (*e)->request(0).generated;
  return (*e)->request(0).prompt_logits;
}

// The fixture `name` under gemm=`gemm` on the GPU is the CPU engine's gemm=`gemm` within the
// engine's tolerance, while the CPU's `gemm` moved the logits from its `baseline` far more (so
// the comparison can tell the variant from the baseline).
void ExpectGpuGemmIsTheCpus(const char* name, const char* gemm, const char* baseline,
                            const kernels::KernelChoice& cpu_kernels = {}) {
  auto model = Model::Load(testing::FixtureDir() / "models" / name);
  ASSERT_TRUE(model.ok()) << model.status().message();
  std::vector<int32_t> prompt;
  for (int j = 0; j < 24; ++j) prompt.push_back(static_cast<int32_t>((37 * j + 11) % (*model)->config().vocab_size));
  EngineOptions cpu;
  cpu.page_size = 16;
  cpu.kernels = cpu_kernels;
  cpu.kernels["gemm"] = gemm;
  const auto want = PromptLogits(*model, cpu, prompt, 2);
  cpu.kernels["gemm"] = baseline;
  const auto base = PromptLogits(*model, cpu, prompt, 2);
  const auto got = PromptLogits(*model, Cuda(engine::KvFormat::kFp32, gemm), prompt, 2);
  ASSERT_EQ(got.size(), want.size());
  const int64_t total = static_cast<int64_t>(want.size());
  const double err = testing::RelMaxErr(got.data(), want.data(), total);
  const double moved = testing::RelMaxErr(want.data(), base.data(), total);
  EXPECT_LE(err, 1e-4) << name << " gemm=" << gemm;
  EXPECT_GT(moved, 100 * err) << name << ": the GPU's gemm=" << gemm << " is not the CPU's";
  std::printf("  [%s] cuda %s vs cpu %s %.3g; cpu %s vs %s %.3g\n", name, gemm, gemm, err, gemm, baseline, moved);
}

// gemm=fp8_dot on the GPU is the CPU's gemm=fp8_dot: FP8 bytes and block scales (the
// checkpoint's, or the host's quantisation) dequantised in the kernels. The FP8 checkpoint
// fixture against transformers (its reference ran on the dequantised weights) within the
// engine's tolerance, greedy tokens equal; quantised bf16/fp32 checkpoints against the CPU
// engine's fp8_dot within that tolerance, while quantising moved the logits far more.
TEST(GpuEngine, Fp8WeightsAreTheCpusFp8Weights) {
  LS_REQUIRE_GPU();
  {
    const auto dir = testing::FixtureDir() / "models" / "v3_fp8";
    auto model = Model::Load(dir);
    ASSERT_TRUE(model.ok()) << model.status().message();
    const Reference ref = LoadReference(dir);
    const int64_t V = (*model)->config().vocab_size;
    std::vector<int32_t> tokens;
    const auto got = PromptLogits(*model, Cuda(engine::KvFormat::kFp32, "fp8_dot"), ref.prompt,
                                  static_cast<int64_t>(ref.decode_ids.size()), &tokens);
    double worst = 0;
    for (size_t p = 0; p < ref.prompt.size(); ++p) {
      worst = std::max(worst, testing::RelMaxErr(&got[p * V], &ref.prefill[p * V], V));
    }
    EXPECT_LE(worst, 1e-4) << "v3_fp8 prefill, gemm=fp8_dot on the GPU";
    EXPECT_EQ(tokens, ref.decode_ids);
    std::printf("  [v3_fp8 / cuda fp8_dot] worst prefill max|Δ|/max|ref| vs transformers = %.3g\n", worst);
  }
  for (const char* name : {"v3_basic", "v2_lite_like", "v32_sparse"}) ExpectGpuGemmIsTheCpus(name, "fp8_dot", "fp32");
}

// gemm=bf16_dot on the GPU is the CPU's gemm=bf16_dot with the GPU's attention form (absorbed
// prefill, the CUDA backend's only one): every product reads bf16 weights and bf16 activations,
// the MLA absorptions' too. Within the engine's tolerance (on the H200: the same bits), with the
// CPU's own norm and with the GPU's (norm=lanes256), while bf16 moved the logits away from fp32
// far more. Before the CPU rounded q_nope and the attention output for its absorptions the two
// were 0.61 and 0.014 apart: as far as bf16 is from fp32.
// (SameVariantsGiveTheCpusBits below asks for the same bits, v32_sparse too.)
TEST(GpuEngine, Bf16DotIsTheCpusBf16Dot) {
  LS_REQUIRE_GPU();
  for (const char* name : {"v3_basic", "v2_lite_like"}) {
    ExpectGpuGemmIsTheCpus(name, "bf16_dot", "fp32", {{"attn_prefill", "absorbed"}});
    ExpectGpuGemmIsTheCpus(name, "bf16_dot", "fp32", {{"attn_prefill", "absorbed"}, {"norm", "lanes256"}});
  }
}

// Under the same variants a GPU run is the CPU reference's run bit for bit: with the GPU's
// attention form and order named on the CPU too (absorbed prefill; the absorbed attention is
// cpu::MlaAttend, the kernels' splits, tiles and online softmax, and both exponentiate with
// ExpF) and its norm (norm=lanes256), every prompt logit of 70 prompt tokens (three tiles of
// keys, three splits) and the generated tokens are the same — dense and sparse attention, bf16
// and FP8 weights, an fp32 and an FP8 latent cache.
TEST(GpuEngine, SameVariantsGiveTheCpusBits) {
  LS_REQUIRE_GPU();
  for (const char* name : {"v3_basic", "v2_lite_like", "v32_sparse"}) {
    auto model = Model::Load(testing::FixtureDir() / "models" / name);
    ASSERT_TRUE(model.ok()) << model.status().message();
    std::vector<int32_t> prompt;
    for (int j = 0; j < 70; ++j) prompt.push_back(static_cast<int32_t>((37 * j + 11) % (*model)->config().vocab_size));
    for (const char* gemm : {"bf16_dot", "fp8_dot"}) {
      for (engine::KvFormat f : {engine::KvFormat::kFp32, engine::KvFormat::kFp8E4m3}) {
        EngineOptions cpu;
        cpu.page_size = 16;
        cpu.kv_format = f;
        cpu.kernels = {{"gemm", gemm}, {"attn_prefill", "absorbed"}, {"norm", "lanes256"}};
        std::vector<int32_t> want_tokens, got_tokens;
        const auto want = PromptLogits(*model, cpu, prompt, 3, &want_tokens);
        const auto got = PromptLogits(*model, Cuda(f, gemm), prompt, 3, &got_tokens);
        ASSERT_EQ(got.size(), want.size());
        size_t differ = 0, first = 0;
        for (size_t i = 0; i < want.size(); ++i) {
          if (std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i]) && differ++ == 0) first = i;
        }
        const std::string what = std::string(name) + " gemm=" + gemm + " cache " + std::string(engine::KvFormatName(f));
        EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << want.size() << " prompt logits differ, first "
                              << first << " (GPU " << got[first] << ", CPU " << want[first]
                              << "), rel max err " << testing::RelMaxErr(got.data(), want.data(), got.size());
        EXPECT_EQ(got_tokens, want_tokens) << what;
        std::printf("  [%s] %zu of %zu prompt logits differ in bits\n", what.c_str(), differ, want.size());
      }
    }
  }
}

// gemm=w8a8_dot on the GPU is the CPU's: fp8_dot's weights with the linear layers' inputs
// through FP8 (the Fp8RoundTrip kernel, bitwise the CPU's quantiser) — within the engine's
// tolerance of the CPU engine's w8a8_dot, while the activations' quantisation moved the logits
// away from fp8_dot's far more.
TEST(GpuEngine, Fp8ActivationsAreTheCpusFp8Activations) {
  LS_REQUIRE_GPU();
  for (const char* name : {"v3_basic", "v2_lite_like", "v32_sparse", "v3_fp8"}) {
    ExpectGpuGemmIsTheCpus(name, "w8a8_dot", "fp8_dot");
  }
}

// Sampling on the GPU (the default) picks the host sampler's tokens with the same draws and
// candidate counts, for greedy, temperature, top-k, top-p and min-p rows in one batch, with
// chunked prefills (only a prompt's last chunk samples) and a request keeping every prompt
// logit (its sampled row is gathered from among others). The probabilities may differ in the
// last bits (CUDA's exp against glibc's: docs/sampling.md).
TEST(GpuEngine, DeviceSamplerPicksTheHostSamplersTokens) {
  LS_REQUIRE_GPU();
  struct Run {
    std::map<int64_t, std::vector<engine::StepEvent>> events;
  };
  auto run = [&](bool device) {
    EngineOptions o = Cuda(engine::KvFormat::kFp8E4m3, "bf16");
    o.device.device_sampler = device;
    o.max_batch = 8;
    o.max_prefill_tokens = 16;
    auto eng = Engine::Create(Tiny(), o);
    EXPECT_TRUE(eng.ok()) << eng.status().message();
    Run out;
    (*eng)->SetStepCallback([&](const engine::StepEvent& ev) { out.events[ev.request_id].push_back(ev); });
    const engine::SamplingParams kinds[] = {
        {0.0, 0, 1.0, 0.0, 1},    {0.8, 0, 0.9, 0.0, 2},  {1.0, 50, 1.0, 0.0, 3},  {0.6, 0, 1.0, 0.05, 4},
        {1.3, 20, 0.5, 0.0, 5},   {0.7, 40, 0.95, 0.02, 6}, {2.0, 0, 1.0, 0.0, 7}, {0.9, 1, 1.0, 0.0, 8},
    };
    for (int i = 0; i < 8; ++i) {
      engine::Request r;
      for (int j = 0; j < 9 + 11 * i; ++j) r.prompt.push_back(static_cast<int32_t>((131 * i + 17 * j) % 6000 + 3));
      r.max_new_tokens = 10;
      r.sampling = kinds[i];
      r.all_prompt_logits = i == 3;
      EXPECT_TRUE((*eng)->AddRequest(r).ok());
    }
    const Status st = (*eng)->RunToCompletion();
    EXPECT_TRUE(st.ok()) << st.message();
    return out;
  };
  const Run host = run(false), gpu = run(true);
  ASSERT_EQ(host.events.size(), 8u);
  ASSERT_EQ(gpu.events.size(), 8u);
  int64_t events = 0;
  for (const auto& [id, want] : host.events) {
    const auto& got = gpu.events.at(id);
    ASSERT_EQ(got.size(), want.size()) << "request " << id;
    for (size_t s = 0; s < want.size(); ++s) {
      SCOPED_TRACE("request " + std::to_string(id) + " token " + std::to_string(s));
      EXPECT_FALSE(want[s].sampled_on_device);
      EXPECT_TRUE(got[s].sampled_on_device);
      EXPECT_EQ(got[s].sample.token, want[s].sample.token);
      EXPECT_EQ(got[s].sample.uniform, want[s].sample.uniform);
      EXPECT_EQ(got[s].sample.counter, want[s].sample.counter);
      EXPECT_EQ(got[s].sample.candidates, want[s].sample.candidates);
      EXPECT_NEAR(got[s].sample.probability, want[s].sample.probability, 1e-12 * want[s].sample.probability);
      ++events;
    }
  }
  EXPECT_EQ(events, 80);
}

// Request::keep_logits off: a row the device sampled stays on the GPU (last_logits empty at
// every step but an all_prompt_logits prefill's), the other requests' rows in the same steps
// are the bits of a run that copies every row, and the tokens do not change. The host sampler
// still gets its rows.
TEST(GpuEngine, LogitsNobodyReadsStayOnTheDevice) {
  LS_REQUIRE_GPU();
  struct Run {
    std::map<int64_t, std::vector<std::vector<float>>> logits;
    std::vector<std::vector<int32_t>> tokens;
    std::vector<float> prompt_logits;  // request 4's (all_prompt_logits)
  };
  auto kept = [](int i) { return i % 3 == 0; };
  auto run = [&](bool device, bool all_kept) {
    EngineOptions o = Cuda(engine::KvFormat::kFp8E4m3, "bf16");
    o.device.device_sampler = device;
    o.max_batch = 8;
    o.max_prefill_tokens = 16;  // prompt chunks beside decodes: runs of kept rows with gaps
    auto eng = Engine::Create(Tiny(), o);
    EXPECT_TRUE(eng.ok()) << eng.status().message();
    Run out;
    (*eng)->SetStepCallback(
        [&](const engine::StepEvent& ev) { out.logits[ev.request_id].push_back((*eng)->request(ev.request_id).last_logits); });
    for (int i = 0; i < 8; ++i) {
      engine::Request r;
      for (int j = 0; j < 9 + 11 * i; ++j) r.prompt.push_back(static_cast<int32_t>((131 * i + 17 * j) % 6000 + 3));
      r.max_new_tokens = 10;
      r.sampling = {0.8, 0, 0.95, 0.0, static_cast<uint64_t>(40 + i)};
      r.all_prompt_logits = i == 4;
      r.keep_logits = all_kept || kept(i);
      EXPECT_TRUE((*eng)->AddRequest(r).ok());
    }
    const Status st = (*eng)->RunToCompletion();
    EXPECT_TRUE(st.ok()) << st.message();
    for (int64_t i = 0; i < (*eng)->num_requests(); ++i) out.tokens.push_back((*eng)->request(i).generated);
    out.prompt_logits = (*eng)->request(4).prompt_logits;
    return out;
  };
  const Run all = run(true, true), some = run(true, false), host = run(false, false);
  const int64_t V = Tiny()->config().vocab_size;
  EXPECT_EQ(some.tokens, all.tokens);
  EXPECT_EQ(host.tokens, all.tokens);
  ASSERT_EQ(all.logits.size(), 8u);
  for (const auto& [id, want] : all.logits) {
    SCOPED_TRACE("request " + std::to_string(id));
    const auto& got = some.logits.at(id);
    ASSERT_EQ(got.size(), want.size());
    for (size_t s = 0; s < want.size(); ++s) {
      ASSERT_EQ(static_cast<int64_t>(want[s].size()), V);
      // Request 4's first token comes from its all_prompt_logits prefill: every row copied.
      if (kept(static_cast<int>(id)) || (id == 4 && s == 0)) {
        EXPECT_TRUE(Bitwise(got[s], want[s])) << "token " << s;
      } else {
        EXPECT_TRUE(got[s].empty()) << "token " << s << ": " << got[s].size() << " logits came back";
      }
      EXPECT_TRUE(Bitwise(host.logits.at(id)[s], want[s])) << "host sampler, token " << s;
    }
  }
  ASSERT_FALSE(all.prompt_logits.empty());
  EXPECT_TRUE(Bitwise(some.prompt_logits, all.prompt_logits));
}

// Chunked prefill on the GPU: prompts fed 5 tokens per step beside running decodes give the
// bits of whole-prompt prefill (every row is its own absorbed query, whatever the chunking).
TEST(GpuEngine, ChunkedPrefillChangesNoBits) {
  LS_REQUIRE_GPU();
  EngineOptions chunked = Cuda(engine::KvFormat::kFp8E4m3, "bf16");
  chunked.max_prefill_tokens = 5;
  ExpectSameRuns(Cuda(engine::KvFormat::kFp8E4m3, "bf16"), chunked);
}

// Engines over the same Model share one copy of the device weights (a server's capture re-runs
// beside its live engine). What this checks: a second engine over the model gives the first's
// bits, also after the first (which made the weights) is gone. That the copy is not made twice
// is not observable from here.
TEST(GpuEngine, SecondEngineOverAModelGivesTheSameBitsAfterTheFirstIsGone) {
  LS_REQUIRE_GPU();
  auto run = [](Engine& e) {
    engine::Request r;
    for (int j = 0; j < 12; ++j) r.prompt.push_back(static_cast<int32_t>(31 * j % 5000 + 7));
    r.max_new_tokens = 6;
    r.sampling.temperature = 0.7;
    r.sampling.seed = 5;
    EXPECT_TRUE(e.AddRequest(r).ok());
    const Status st = e.RunToCompletion();
    EXPECT_TRUE(st.ok()) << st.message();
    return e.request(e.num_requests() - 1).last_logits;
  };
  auto first = Engine::Create(Tiny(), Cuda(engine::KvFormat::kFp32, "bf16"));
  ASSERT_TRUE(first.ok()) << first.status().message();
  auto second = Engine::Create(Tiny(), Cuda(engine::KvFormat::kFp32, "bf16"));
  ASSERT_TRUE(second.ok()) << second.status().message();
  const auto a = run(**first);
  first->reset();  // the second engine keeps the shared weights alive
  const auto b = run(**second);
  EXPECT_TRUE(Bitwise(a, b));
}

// The heuristic cuBLAS variant is deterministic but not batch-invariant; the test documents
// that the difference is real on this GPU (or reports that it was not observed).
TEST(GpuEngine, HeuristicGemmIsDeterministic) {
  LS_REQUIRE_GPU();
  std::vector<std::vector<int32_t>> a, b, c;
  const Logits x = RunBatch(Cuda(engine::KvFormat::kFp32, "fp32_heuristic"), 8, false, &a);
  const Logits y = RunBatch(Cuda(engine::KvFormat::kFp32, "fp32_heuristic"), 8, false, &b);
  const Logits z = RunBatch(Cuda(engine::KvFormat::kFp32, "fp32_heuristic"), 1, false, &c);
  int differ = 0;
  for (const auto& [id, steps] : x) {
    for (size_t s = 0; s < steps.size(); ++s) {
      EXPECT_TRUE(Bitwise(steps[s], y.at(id)[s])) << "request " << id << " step " << s;
      differ += !Bitwise(steps[s], z.at(id)[s]);
    }
  }
  std::printf("fp32_heuristic: %d of %d step logits differ between batch 8 and batch 1\n", differ, 8 * 12);
}

// --kernel indexer=hadamard and indexer=fp8_paged on the GPU are the CPU's: the same keys
// selected at every sparse layer and step (the indexer top-k taps, bytes equal), logits within
// the taps' bound. fp8_paged's keys are stored as FP8 rows (the host mirror holds the GPU's
// bytes: a power-of-two scale after each 128 values) and its bits depend neither on the batch
// nor on arrival order.
TEST(GpuEngine, HadamardAndFp8IndexersSelectTheCpusKeys) {
  LS_REQUIRE_GPU();
  for (const char* variant : {"hadamard", "fp8_paged"}) {
    SCOPED_TRACE(std::string("indexer=") + variant);
    std::vector<std::vector<uint8_t>> key_rows;
    auto run = [&](EngineOptions o, TapRecorder* rec, bool gpu) {
      o.kernels["indexer"] = variant;
      auto eng = Engine::Create(Tiny(), o);
      EXPECT_TRUE(eng.ok()) << eng.status().message();
      (*eng)->SetTapHook(rec);
      if (gpu) {
        (*eng)->SetForwardCallback([&](std::span<const engine::Segment> segs, const engine::PagedKvCache& cache) {
          for (const auto& g : segs) {
            for (int64_t l = 0; l < Tiny()->config().num_hidden_layers; ++l) {
              if (cache.streams(l).size() < 2) continue;
              const uint8_t* b = cache.TokenBytes(l, 1, *g.cache, g.start_pos);
              key_rows.emplace_back(b, b + cache.streams(l)[1].bytes_per_token);
            }
          }
        });
      }
      engine::Request r;
      for (int j = 0; j < 70; ++j) r.prompt.push_back(static_cast<int32_t>(29 * j % 5000 + 10));
      r.max_new_tokens = 8;
      EXPECT_TRUE((*eng)->AddRequest(r).ok());
      const Status st = (*eng)->RunToCompletion();
      EXPECT_TRUE(st.ok()) << st.message();
      return (*eng)->request(0).last_logits;
    };
    EngineOptions cpu;
    cpu.page_size = 16;
    cpu.kv_cache_tokens = 4096;
    TapRecorder g, c;
    const auto gl = run(Cuda(engine::KvFormat::kFp32, "fp32_dot"), &g, true);
    const auto cl = run(cpu, &c, false);
    int selections = 0;
    for (const auto& [name, ct] : c.taps) {
      if (name.find("indexer") == std::string::npos || ct.dtype != engine::TapDType::kI32) continue;
      auto it = g.taps.find(name);
      ASSERT_NE(it, g.taps.end()) << name;
      EXPECT_EQ(it->second.bytes, ct.bytes) << name;
      ++selections;
    }
    EXPECT_GT(selections, 8);
    ASSERT_EQ(gl.size(), cl.size());
    EXPECT_LE(testing::RelMaxErr(gl.data(), cl.data(), static_cast<int64_t>(cl.size())), 1e-4);
    const int64_t di = Tiny()->config().index_head_dim;
    ASSERT_FALSE(key_rows.empty());
    for (const auto& row : key_rows) {
      if (std::string(variant) == "fp8_paged") {
        ASSERT_EQ(static_cast<int64_t>(row.size()), di + 4);  // 32 e4m3 values and one scale
        float scale;
        std::memcpy(&scale, row.data() + di, 4);
        int e;
        EXPECT_EQ(std::frexp(scale, &e), 0.5f) << "scale " << scale << " is not a power of two";
      } else {
        ASSERT_EQ(static_cast<int64_t>(row.size()), di * 4);
      }
    }
  }
  // fp8_paged: batch 1, batch 8 and staggered arrivals give the same bits.
  EngineOptions o = Cuda(engine::KvFormat::kFp8E4m3, "bf16_dot");
  o.kernels["indexer"] = "fp8_paged";
  std::vector<std::vector<int32_t>> t1, t8;
  const Logits alone = RunBatch(o, 1, false, &t1);
  const Logits stagger = RunBatch(o, 8, true, &t8);
  for (const auto& [id, steps] : alone) {
    for (size_t st = 0; st < steps.size(); ++st) {
      EXPECT_TRUE(Bitwise(steps[st], stagger.at(id)[st])) << "request " << id << " step " << st;
    }
  }
  EXPECT_EQ(t1, t8);
}

// The router's logits (RowDots) are cpu::Dot's bits, for any row count and odd lengths: the
// staged kernel (n % 4 = 0: tiles of 2048, rows in fours, a 4-value last tile; weights
// requested before the wait or after) and the other.
TEST(GpuEngine, RowDotsIsCpuDotBitwise) {
  LS_REQUIRE_GPU();
  namespace cu = kernels::cuda;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto [rows, outs, n] : {std::tuple<int64_t, int64_t, int64_t>{1, 64, 2048}, {64, 64, 2048}, {3, 5, 37},
                               {17, 160, 7168}, {2, 3, 15}, {6, 7, 2052}}) {
    std::vector<float> x(rows * n), w(outs * n), y(rows * outs);
    for (float& v : x) v = nd(rng);
    for (float& v : w) v = nd(rng);
    auto dx = cu::DeviceBuffer::Allocate(x.size() * 4);
    auto dw = cu::DeviceBuffer::Allocate(w.size() * 4);
    auto dy = cu::DeviceBuffer::Allocate(y.size() * 4);
    ASSERT_TRUE(dx.ok() && dw.ok() && dy.ok());
    ASSERT_TRUE(dx->CopyFromHost(x.data(), x.size() * 4).ok());
    ASSERT_TRUE(dw->CopyFromHost(w.data(), w.size() * 4).ok());
    cu::RowDotsParams p;
    p.x = dx->as<float>();
    p.x_stride = n;
    p.w = dw->as<float>();
    p.w_stride = n;
    p.y = dy->as<float>();
    p.y_stride = outs;
    p.rows = rows;
    p.outs = outs;
    p.n = n;
    for (bool fixed : {false, true}) {  // the first weight tile requested before the wait, or after
      p.w_fixed = fixed;
      ASSERT_TRUE(dy->CopyFromHost(std::vector<float>(y.size(), NAN).data(), y.size() * 4).ok());
      ASSERT_TRUE(cu::RowDots(p).ok());
      ASSERT_TRUE(dy->CopyToHost(y.data(), y.size() * 4).ok());
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t o = 0; o < outs; ++o) {
          const float want = kernels::cpu::Dot(&x[r * n], &w[o * n], n);
          ASSERT_EQ(std::memcmp(&want, &y[r * outs + o], 4), 0)
              << "row " << r << " out " << o << " n " << n << " w_fixed " << fixed;
        }
      }
    }
  }
}

TEST(GpuEngine, RefusesWhatItCannotRun) {
  LS_REQUIRE_GPU();
  EngineOptions o = Cuda();
  o.fault = "fault_fp8_no_clamp";
  auto e = Engine::Create(Tiny(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("runs on --backend cpu only"), std::string::npos) << e.status().message();
  o = Cuda();
  o.kernels["attn_decode"] = "expanded";
  e = Engine::Create(Tiny(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("attn_decode"), std::string::npos) << e.status().message();
}

}  // namespace
}  // namespace lockstep
