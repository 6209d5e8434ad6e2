// tests/gpu/gpu_tensor_parallel_test.cc — tensor parallelism emulated on the CUDA backend
// (--emulate-tp N, engine/cuda_blocks.cc): under the CPU-bitwise variants (gemm=*_dot,
// absorbed prefill, norm=lanes256) a CUDA run at TP N is the CPU reference's run at TP N bit
// for bit — every prompt logit, the generated tokens and each rank's partials (attn.partials,
// ffn.partials) — on the fixture models and lockstep-tiny-v32, with bf16 and FP8 weights (FP8
// slices on and off the 128-column scale blocks), each all-reduce order and the collective
// fault; at TP N the tokens are TP 1's; run to run and alone vs batched bit for bit. Skips
// without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/tensor_parallel.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu/gpu_engine_util.h"

namespace lockstep {
namespace {

using engine::Engine;
using engine::EngineOptions;
using engine::Model;
using gpu_testing::TapRecorder;
namespace cu = kernels::cuda;

// Partials of a wide dynamic range (so each order rounds differently) whose fp32 sums in
// different orders part: the AllReduce kernel against engine::AllReduce, every order, bit for
// bit; and the orders do differ from each other on these inputs (the test can fail).
TEST(GpuTensorParallel, AllReduceKernelSumsInEachOrder) {
  LS_REQUIRE_GPU();
  for (int ranks : {2, 3, 8}) {
    const int64_t rows = 5, n = 37;
    std::vector<float> parts(rows * ranks * n);
    for (size_t i = 0; i < parts.size(); ++i) {
      parts[i] = static_cast<float>(std::sin(1.3 * static_cast<double>(i)) * std::pow(10.0, static_cast<double>(i % 7)));
    }
    auto dp = gpu_testing::Upload(parts);
    std::vector<std::vector<float>> outs;
    for (auto v : {kernels::AllReduce::kOrdered, kernels::AllReduce::kRing, kernels::AllReduce::kFaultRotateByRow}) {
      auto dy = gpu_testing::Zeros<float>(rows * n);
      cu::AllReduceParams ap;
      ap.partials = dp.as<const float>();
      ap.y = dy.as<float>();
      ap.y_stride = n;
      ap.rows = rows;
      ap.n = n;
      ap.ranks = ranks;
      ap.order = static_cast<cu::ReduceOrder>(v);
      LS_ASSERT_OK(cu::AllReduce(ap));
      std::vector<float> want(rows * n);
      engine::AllReduce(v, parts.data(), ranks, rows, n, want.data());
      const std::vector<float> got = gpu_testing::Download<float>(dy, rows * n);
      EXPECT_TRUE(gpu_testing::BitwiseEqual(got, want, "ranks " + std::to_string(ranks) + " order " +
                                                             std::to_string(static_cast<int>(v))));
      outs.push_back(got);
      // The same partials rank-major, as an all-gather leaves them ([ranks][rows][n]: bench_nccl's
      // layout over real GPUs): the same sums.
      std::vector<float> major(parts.size());
      for (int q = 0; q < ranks; ++q) {
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t i = 0; i < n; ++i) major[(q * rows + r) * n + i] = parts[(r * ranks + q) * n + i];
        }
      }
      auto dm = gpu_testing::Upload(major);
      ap.partials = dm.as<const float>();
      ap.rank_stride = rows * n;
      ap.row_stride = n;
      LS_ASSERT_OK(cu::AllReduce(ap));
      EXPECT_TRUE(gpu_testing::BitwiseEqual(gpu_testing::Download<float>(dy, rows * n), want, "rank-major"));
    }
    if (ranks >= 3) {
      EXPECT_NE(outs[0], outs[1]) << "ordered and ring agree on every element at " << ranks << " ranks";
      EXPECT_NE(outs[0], outs[2]) << "ordered and rotate-by-row agree on every element at " << ranks << " ranks";
    }
  }
}

struct Outcome {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<float>> prompt_logits;
};

struct Config {
  std::string backend = "cpu", gemm = "bf16_dot", allreduce, fault;
  int64_t tp = 1, max_batch = 8;
};

// Three prompts of 9, 30 and 41 tokens (one page, several pages, a chunk boundary), 6 new
// tokens each, every prompt logit kept.
std::vector<std::vector<int32_t>> Prompts(int64_t vocab) {
  std::vector<std::vector<int32_t>> ps;
  for (int r = 0; r < 3; ++r) {
    std::vector<int32_t> p;
    for (int i = 0; i < (r == 0 ? 9 : 19 + 11 * r); ++i) {
      p.push_back(static_cast<int32_t>(2 + (11 * i + 7 * r) % (vocab - 2)));
    }
    ps.push_back(p);
  }
  return ps;
}

Outcome Generate(const std::shared_ptr<Model>& m, const Config& cfg, const std::vector<std::vector<int32_t>>& prompts,
             engine::TapHook* hook = nullptr) {
  EngineOptions o;
  o.backend = cfg.backend;
  o.page_size = 16;
  o.kv_cache_tokens = 4096;
  o.max_batch = cfg.max_batch;
  o.emulate_tp = cfg.tp;
  o.kernels = {{"gemm", cfg.gemm}, {"attn_prefill", "absorbed"}, {"norm", "lanes256"}};
  if (!cfg.allreduce.empty()) o.kernels["allreduce"] = cfg.allreduce;
  o.fault = cfg.fault;
  auto e = Engine::Create(m, o);
  EXPECT_TRUE(e.ok()) << e.status().message();
  Outcome out;
  if (!e.ok()) return out;
  if (hook != nullptr) (*e)->SetTapHook(hook);
  for (const auto& p : prompts) {
    engine::Request r;
    r.prompt = p;
    r.max_new_tokens = 6;
    r.all_prompt_logits = true;
    EXPECT_TRUE((*e)->AddRequest(r).ok());
  }
  const Status st = (*e)->RunToCompletion();
  EXPECT_TRUE(st.ok()) << st.message();
  for (int64_t i = 0; i < (*e)->num_requests(); ++i) {
    out.tokens.push_back((*e)->request(i).generated);
    out.prompt_logits.push_back((*e)->request(i).prompt_logits);
  }
  return out;
}

// The number of prompt logits whose bits differ (every one when the shapes differ).
size_t LogitsApart(const Outcome& a, const Outcome& b) {
  if (a.prompt_logits.size() != b.prompt_logits.size()) return ~size_t{0};
  size_t n = 0;
  for (size_t i = 0; i < a.prompt_logits.size(); ++i) {
    if (a.prompt_logits[i].size() != b.prompt_logits[i].size()) return ~size_t{0};
    for (size_t j = 0; j < a.prompt_logits[i].size(); ++j) {
      n += std::memcmp(&a.prompt_logits[i][j], &b.prompt_logits[i][j], 4) != 0;
    }
  }
  return n;
}

// The largest |a − b| of a prompt-logits row over that row's largest |a|, over every row.
double WorstRelative(const Outcome& a, const Outcome& b, int64_t V) {
  double worst = 0;
  for (size_t r = 0; r < a.prompt_logits.size() && r < b.prompt_logits.size(); ++r) {
    for (size_t row = 0; (row + 1) * V <= a.prompt_logits[r].size() && (row + 1) * V <= b.prompt_logits[r].size(); ++row) {
      double mx = 0, d = 0;
      for (int64_t v = 0; v < V; ++v) {
        const double x = a.prompt_logits[r][row * V + v], y = b.prompt_logits[r][row * V + v];
        mx = std::max(mx, std::fabs(x));
        d = std::max(d, std::fabs(x - y));
      }
      worst = std::max(worst, d / std::max(mx, 1e-30));
    }
  }
  return worst;
}

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// CUDA at TP N against the CPU at TP N under one configuration: logits and tokens without a
// hook (the step buffers), and with a hook that keeps every tap (decode steps through the tap
// slab) each rank's partials and the blocks' outputs bit for bit.
void ExpectCpuBits(const std::shared_ptr<Model>& m, const std::string& what, Config cfg) {
  SCOPED_TRACE(what);
  const auto prompts = Prompts(m->config().vocab_size);
  cfg.backend = "cpu";
  TapRecorder cpu_taps;
  const Outcome want = Generate(m, cfg, prompts, &cpu_taps);
  cfg.backend = "cuda";
  const Outcome got = Generate(m, cfg, prompts);
  ASSERT_EQ(want.tokens.size(), prompts.size());
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(LogitsApart(got, want), 0u);
  TapRecorder gpu_taps;
  const Outcome tapped = Generate(m, cfg, prompts, &gpu_taps);
  EXPECT_EQ(LogitsApart(tapped, want), 0u) << "with taps";
  size_t partials = 0, compared = 0;
  for (const auto& [key, t] : cpu_taps.taps) {
    const std::string name = key.substr(0, key.find('@'));
    const bool part = EndsWith(name, ".attn.partials") || EndsWith(name, ".ffn.partials");
    if (!part && !EndsWith(name, ".attn.out") && !EndsWith(name, ".ffn.out") && !EndsWith(name, ".resid_out")) continue;
    auto it = gpu_taps.taps.find(key);
    ASSERT_NE(it, gpu_taps.taps.end()) << key << " not tapped on the GPU";
    EXPECT_EQ(it->second.cols, t.cols) << key;
    EXPECT_TRUE(it->second.bytes == t.bytes) << key << " differs in bits";
    partials += part;
    ++compared;
  }
  // Every layer's two partials at every step of the three requests.
  EXPECT_GE(partials, static_cast<size_t>(2 * m->config().num_hidden_layers * 3)) << compared << " taps compared";
  std::printf("  [%s] %zu taps (%zu partials) and %zu prompt logits bitwise the CPU's\n", what.c_str(), compared,
              partials, want.prompt_logits[0].size() + want.prompt_logits[1].size() + want.prompt_logits[2].size());
}

using gpu_testing::Fixture;

// The fixture models at the degrees their shapes split: dense and MoE layers, shared experts
// (v2_lite_like has two), the V3.2 indexer, and FP8 checkpoint weights whose rank slices
// start inside a 128-column scale block (v3_fp8: o_proj's 64 columns cut at 32, the MLP's 200
// at 100).
TEST(GpuTensorParallel, FixturesAreTheCpusBits) {
  LS_REQUIRE_GPU();
  struct Case {
    const char* model;
    int64_t tp;
    const char* gemm;
  };
  for (const Case& c : {Case{"v2_lite_like", 2, "bf16_dot"}, Case{"v3_basic", 2, "bf16_dot"},
                        Case{"v3_basic", 4, "fp8_dot"}, Case{"v32_sparse", 2, "bf16_dot"},
                        Case{"v3_fp8", 2, "fp8_dot"}, Case{"v3_fp8", 4, "w8a8_dot"}, Case{"v3_bf16", 2, "fp32_dot"}}) {
    auto m = Fixture(c.model);
    ASSERT_NE(m, nullptr);
    Config cfg;
    cfg.tp = c.tp;
    cfg.gemm = c.gemm;
    ExpectCpuBits(m, std::string(c.model) + " tp " + std::to_string(c.tp) + " gemm=" + c.gemm, cfg);
  }
}

// lockstep-tiny-v32 at TP 2 (FP8 slices on the scale blocks: 256 columns cut at 128) and TP 8,
// each all-reduce order (at 8 ranks they differ) and the collective-order fault.
TEST(GpuTensorParallel, TinyModelIsTheCpusBits) {
  LS_REQUIRE_GPU();
  Config cfg;
  cfg.tp = 2;
  cfg.gemm = "fp8_dot";
  ExpectCpuBits(gpu_testing::Tiny(), "tiny tp 2 fp8_dot", cfg);
  cfg.tp = 8;
  cfg.gemm = "bf16_dot";
  ExpectCpuBits(gpu_testing::Tiny(), "tiny tp 8 bf16_dot", cfg);
  cfg.allreduce = "ring";
  ExpectCpuBits(gpu_testing::Tiny(), "tiny tp 8 allreduce=ring", cfg);
  cfg.allreduce.clear();
  cfg.fault = "fault_rotate_by_row";
  ExpectCpuBits(gpu_testing::Tiny(), "tiny tp 8 fault_rotate_by_row", cfg);
}

// On the GPU alone, in fp32: TP 8 gives TP 1's greedy tokens (the sums' order moved some
// logits' bits, within fp32 rounding of each row's largest) and its own bits run to run — through
// the dot products (gemm=fp32_dot, the CPU's order) and through cuBLAS's pedantic fp32 GEMM over
// each rank's slice of columns (gemm=fp32: its bits are cuBLAS's, no CPU twin). Under the dot
// products each request alone gives the batched bits too (the ordered all-reduce).
TEST(GpuTensorParallel, TpEightKeepsTpOnesTokensAndItsOwnBits) {
  LS_REQUIRE_GPU();
  auto m = gpu_testing::Tiny();
  const auto prompts = Prompts(m->config().vocab_size);
  for (const char* gemm : {"fp32_dot", "fp32"}) {  // fp32 throughout: bf16 would magnify a last-bit move
    SCOPED_TRACE(std::string("gemm=") + gemm);
    Config cfg;
    cfg.backend = "cuda";
    cfg.gemm = gemm;
    const Outcome one = Generate(m, cfg, prompts);
    cfg.tp = 8;
    const Outcome a = Generate(m, cfg, prompts), b = Generate(m, cfg, prompts);
    ASSERT_EQ(a.tokens.size(), prompts.size());
    EXPECT_EQ(a.tokens, one.tokens);
    const size_t moved = LogitsApart(a, one);
    EXPECT_GT(moved, 0u) << "TP 8 summed in another order, yet no logit moved";
    EXPECT_EQ(LogitsApart(a, b), 0u) << "TP 8 run to run";
    const double worst = WorstRelative(one, a, m->config().vocab_size);
    EXPECT_LT(worst, 1e-4) << "TP 8 against TP 1, relative to each row's largest logit";
    std::printf("  [gemm=%s] TP 8 against TP 1 on the GPU: %zu prompt logits moved, worst %.3g of the row's largest\n",
                gemm, moved, worst);
    if (std::string(gemm) == "fp32_dot") {
      cfg.max_batch = 1;
      const Outcome alone = Generate(m, cfg, prompts);
      EXPECT_EQ(LogitsApart(alone, a), 0u) << "alone vs batched";
      EXPECT_EQ(alone.tokens, a.tokens);
    }
  }
}

}  // namespace
}  // namespace lockstep
