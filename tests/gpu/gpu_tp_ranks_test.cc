// tests/gpu/gpu_tp_ranks_test.cc — the CUDA backend's rank mode (EngineOptions::tp_ranks with
// --backend cuda; docs/parallelism.md "The rank mode on the GPU"): N engines on one GPU, one a
// thread, each holding only its weight shard — its heads' rows of q_b / kv_b / W_UKᵀ and o_proj
// columns, its slice of every MLP, its block of routed experts (the other ranks' slots skipped
// by ExpertGemm) — and gathering the partials through the group's collective, give emulated TP
// N's bits on the same GPU: every rank's prompt logits and tokens, and rank 0's taps (the
// gathered partials, the heads' tensors in whole rows). The loopback twin of a run over N GPUs.
// Skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "kernels/collective.h"
#include "tests/gpu/gpu_engine_util.h"
#include "tests/tp_ranks_util.h"

namespace lockstep {
namespace {

using engine::Engine;
using engine::EngineOptions;
using engine::Model;
using gpu_testing::TapRecorder;
using tp_testing::LogitsApart;
using tp_testing::Outcome;
constexpr int64_t kNewTokens = 6;

// Three prompts of 9, 30 and 41 tokens (several pages), 6 new tokens each.
std::vector<std::vector<int32_t>> Prompts(int64_t vocab) {
  std::vector<std::vector<int32_t>> ps;
  for (int r = 0; r < 3; ++r) {
    std::vector<int32_t> p;
    for (int i = 0; i < (r == 0 ? 9 : 19 + 11 * r); ++i)
      p.push_back(static_cast<int32_t>(2 + (11 * i + 7 * r) % (vocab - 2)));
    ps.push_back(p);
  }
  return ps;
}

EngineOptions Options(const std::string& gemm) {
  EngineOptions o = gpu_testing::Cuda(engine::KvFormat::kFp32, gemm);
  o.kernels["attn_prefill"] = "absorbed";
  return o;
}

// How two taps differ: how many values, the first (row, col), the largest gap, and whether the
// rank blocks of a row (rows == ranks, or cols in `ranks` blocks) are the other's in another order.
std::string Apart(const TapRecorder::Tensor& got, const TapRecorder::Tensor& want, int ranks) {
  if (got.bytes.size() != want.bytes.size() || got.rows != want.rows || got.cols != want.cols) {
    return "shapes " + std::to_string(got.rows) + "x" + std::to_string(got.cols) + " vs " + std::to_string(want.rows) +
           "x" + std::to_string(want.cols);
  }
  const size_t n = got.bytes.size() / 4;
  std::vector<float> g(n), w(n);
  std::memcpy(g.data(), got.bytes.data(), n * 4);
  std::memcpy(w.data(), want.bytes.data(), n * 4);
  size_t diff = 0, first = n;
  double gap = 0;
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(&g[i], &w[i], 4) != 0) {
      ++diff;
      if (first == n) first = i;
      gap = std::max(gap, static_cast<double>(std::fabs(g[i] - w[i])));
    }
  }
  std::string out = std::to_string(diff) + " of " + std::to_string(n) + " values (" + std::to_string(got.rows) + "x" +
                    std::to_string(got.cols) + "), first at row " + std::to_string(first / got.cols) + " col " +
                    std::to_string(first % got.cols) + ", largest gap " + std::to_string(gap);
  // Rank blocks permuted? Blocks of cols / ranks along each row (or rows when rows == ranks).
  const bool by_rows = got.rows == ranks;
  const int64_t block = by_rows ? got.cols : got.cols / ranks;
  if (by_rows || got.cols % ranks == 0) {
    const int64_t rows = by_rows ? 1 : got.rows;
    const int64_t stride = by_rows ? 0 : got.cols;
    std::string perm;
    for (int64_t r = 0; r < rows && perm.size() < 200; ++r) {
      for (int q = 0; q < ranks; ++q) {
        int match = -1;
        for (int p = 0; p < ranks && match < 0; ++p) {
          if (std::memcmp(&g[r * stride + q * block], &w[r * stride + p * block], block * 4) == 0) match = p;
        }
        if (match != q)
          perm += " row " + std::to_string(r) + " block " + std::to_string(q) + "=want " + std::to_string(match) + ";";
      }
    }
    out += perm.empty() ? "; every rank block in place" : "; blocks:" + perm;
  }
  return out;
}

void ExpectEmulationsBits(const std::shared_ptr<Model>& m, const std::string& what, int n, const std::string& gemm) {
  SCOPED_TRACE(what + " at " + std::to_string(n) + " ranks, gemm=" + gemm);
  ASSERT_NE(m, nullptr);
  const auto prompts = Prompts(m->config().vocab_size);
  EngineOptions emu = Options(gemm);
  emu.emulate_tp = n;
  TapRecorder want_taps, got_taps;
  const Outcome want = tp_testing::Run(m, emu, prompts, &want_taps, kNewTokens);
  ASSERT_TRUE(want.status.ok()) << want.status.message();
  const std::vector<Outcome> got = tp_testing::RunRanks(
      m, Options(gemm), n, [&](int) { return prompts; }, &got_taps, kNewTokens);
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(got[r].status.ok()) << "rank " << r << ": " << got[r].status.message();
    EXPECT_EQ(got[r].tokens, want.tokens) << "rank " << r;
    EXPECT_EQ(LogitsApart(got[r], want), 0u) << "rank " << r << ": prompt logits differ from the emulation's";
  }
  size_t compared = 0, partials = 0;
  for (const auto& [key, t] : want_taps.taps) {
    auto it = got_taps.taps.find(key);
    ASSERT_NE(it, got_taps.taps.end()) << key << " not tapped by rank 0";
    EXPECT_EQ(it->second.cols, t.cols) << key;
    EXPECT_TRUE(it->second.bytes == t.bytes) << key << " differs from the emulation's: " << Apart(it->second, t, n);
    ++compared;
    partials += key.find(".partials@") != std::string::npos;
  }
  EXPECT_EQ(got_taps.taps.size(), want_taps.taps.size());
  EXPECT_GE(partials, static_cast<size_t>(2 * m->config().num_hidden_layers * 3));
  std::printf(
      "  [%s, %d ranks, gemm=%s] %zu taps (%zu partials) and every rank's prompt logits: the emulation's bits\n",
      what.c_str(), n, gemm.c_str(), compared, partials);
}

using gpu_testing::Fixture;

// Dense and MoE layers, shared experts, the V3.2 indexer; FP8 checkpoint weights whose rank
// slices start inside a 128-column scale block (v3_fp8: each rank's shard decoded to fp32, as
// the emulation decodes the slice); the dot products (the CPU's order) and cuBLAS (gemm=fp32,
// the backend's default: a rank's q_b and gate_up have fewer output rows than the whole).
TEST(GpuTpRanks, FixturesGiveTheEmulationsBits) {
  LS_REQUIRE_GPU();
  ExpectEmulationsBits(Fixture("v2_lite_like"), "v2_lite_like", 2, "bf16_dot");
  ExpectEmulationsBits(Fixture("v3_basic"), "v3_basic", 2, "fp32");
  ExpectEmulationsBits(Fixture("v3_basic"), "v3_basic", 4, "fp8_dot");
  ExpectEmulationsBits(Fixture("v32_sparse"), "v32_sparse", 2, "bf16_dot");
  ExpectEmulationsBits(Fixture("v3_fp8"), "v3_fp8", 2, "fp8_dot");
}

TEST(GpuTpRanks, TinyModel) {
  LS_REQUIRE_GPU();
  ExpectEmulationsBits(gpu_testing::Tiny(), "lockstep-tiny-v32", 2, "fp8_dot");
  ExpectEmulationsBits(gpu_testing::Tiny(), "lockstep-tiny-v32", 8, "bf16_dot");
  ExpectEmulationsBits(gpu_testing::Tiny(), "lockstep-tiny-v32", 8, "fp32");
}

// gemm=w8a8_dot: a rank rounds its slice of a row-parallel input through FP8 in tiles of 128
// from the slice's start; the tiny model's shared expert (48 of 96 intermediate columns a rank)
// is where a whole row's tiles would differ, in the rows whose two halves' amaxes fall in
// different binades (the emulation rounds each rank's slice the same way).
TEST(GpuTpRanks, TinyModelW8a8) {
  LS_REQUIRE_GPU();
  ExpectEmulationsBits(gpu_testing::Tiny(), "lockstep-tiny-v32", 2, "w8a8_dot");
}

// Ranks given different work fail with an error naming the collective instead of waiting.
TEST(GpuTpRanks, RanksThatDisagreeFailInsteadOfHanging) {
  LS_REQUIRE_GPU();
  auto m = Fixture("v3_basic");
  ASSERT_NE(m, nullptr);
  const auto prompts = Prompts(m->config().vocab_size);
  auto outs = tp_testing::RunRanks(
      m, Options("bf16_dot"), 2,
      [&](int r) {
        auto p = prompts;
        if (r == 1) p[0].push_back(3);  // one more prompt token: another step shape
        return p;
      },
      nullptr, kNewTokens);
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(outs[r].status.ok()) << "rank " << r << " finished although the ranks' steps differ";
    EXPECT_NE(outs[r].status.message().find("collective"), std::string::npos) << outs[r].status.message();
  }
}

}  // namespace
}  // namespace lockstep
