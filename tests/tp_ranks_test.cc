// tests/tp_ranks_test.cc — tensor parallelism over real ranks on the CPU reference
// (EngineOptions::tp_ranks, docs/parallelism.md "the rank mode"): N engines, one a thread, each
// computing only its shard — its heads' q, attention and o_proj columns, its slice of the MLPs,
// its block of experts — and gathering the partials through a collective (kernels/collective.h),
// give emulated TP N's bits: every prompt logit, the tokens, and rank 0's taps (the gathered
// partials, the heads' q and outputs in whole rows). Ranks whose steps differ fail, not hang.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "kernels/collective.h"
#include "test_util.h"
#include "tp_ranks_util.h"

namespace lockstep::engine {
namespace {

using tp_testing::LogitsApart;
using tp_testing::Outcome;
constexpr int64_t kNewTokens = 5;

struct Taps : TapHook {
  std::map<std::string, std::vector<uint8_t>> rows;  // name@position#request → bytes
  void OnTap(const TapEvent& e) override {
    const std::string key = std::string(e.name) + "@" + std::to_string(e.position) + "#" + std::to_string(e.request_id);
    const auto* p = static_cast<const uint8_t*>(e.data);
    rows[key].assign(p, p + e.rows * e.cols * TapDTypeSize(e.dtype));
  }
};

std::vector<std::vector<int32_t>> Prompts(int64_t vocab) {
  std::vector<std::vector<int32_t>> ps;
  for (int r = 0; r < 3; ++r) {
    std::vector<int32_t> p;
    for (int i = 0; i < 9 + 5 * r; ++i) p.push_back(static_cast<int32_t>(2 + (13 * i + 5 * r) % (vocab - 2)));
    ps.push_back(p);
  }
  return ps;
}

void ExpectEmulationsBits(const std::filesystem::path& dir, int n, const std::string& gemm) {
  SCOPED_TRACE(dir.filename().string() + " at " + std::to_string(n) + " ranks, gemm=" + gemm);
  auto m = Model::Load(dir);
  ASSERT_TRUE(m.ok()) << m.status().message();
  const auto prompts = Prompts((*m)->config().vocab_size);
  EngineOptions o;
  o.page_size = 8;
  o.kernels["gemm"] = gemm;
  EngineOptions emu = o;
  emu.emulate_tp = n;
  Taps want_taps, got_taps;
  const Outcome want = tp_testing::Run(*m, emu, prompts, &want_taps, kNewTokens);
  ASSERT_TRUE(want.status.ok()) << want.status.message();
  const std::vector<Outcome> got = tp_testing::RunRanks(
      *m, o, n, [&](int) { return prompts; }, &got_taps, kNewTokens);
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(got[r].status.ok()) << "rank " << r << ": " << got[r].status.message();
    EXPECT_EQ(got[r].tokens, want.tokens) << "rank " << r;
    EXPECT_EQ(LogitsApart(got[r], want), 0u) << "rank " << r << ": prompt logits differ from the emulation's";
  }
  // Rank 0's taps: the gathered partials and the heads' tensors in whole rows, the emulation's.
  size_t compared = 0;
  for (const auto& [key, bytes] : want_taps.rows) {
    const std::string name = key.substr(0, key.find('@'));
    auto it = got_taps.rows.find(key);
    ASSERT_NE(it, got_taps.rows.end()) << key << " not tapped by rank 0";
    EXPECT_TRUE(it->second == bytes) << key << " differs from the emulation's";
    ++compared;
  }
  EXPECT_EQ(got_taps.rows.size(), want_taps.rows.size());
  EXPECT_GT(compared, static_cast<size_t>(10 * (*m)->config().num_hidden_layers));
}

TEST(TpRanks, FixturesGiveTheEmulationsBits) {
  for (const char* name : {"v2_lite_like", "v3_basic", "v32_sparse", "v3_fp8"}) {
    ExpectEmulationsBits(testing::FixtureDir() / "models" / name, 2, "fp32");
  }
  ExpectEmulationsBits(testing::FixtureDir() / "models" / "v3_basic", 4, "bf16");
}

TEST(TpRanks, TinyModelAtEightRanks) {
  ExpectEmulationsBits(testing::SourceDir() / "models" / "lockstep-tiny-v32", 8, "fp32");
}

// gemm=w8a8_dot rounds a row-parallel product's input through FP8 per 128 values from the
// start of what a rank holds: lockstep-tiny-v32's shared expert (96 intermediate columns, 48 a
// rank at TP 2) has a tile that a whole row's rounding would put across both ranks' slices.
TEST(TpRanks, W8a8RoundsEachRanksSliceOnItsOwn) {
  ExpectEmulationsBits(testing::SourceDir() / "models" / "lockstep-tiny-v32", 2, "w8a8_dot");
}

// Ranks given different work meet a collective with different sizes: every rank fails with
// an error naming it, none waits forever; a rank that fails at creation aborts the others.
TEST(TpRanks, RanksThatDisagreeFailInsteadOfHanging) {
  auto m = Model::Load(testing::FixtureDir() / "models" / "v3_basic");
  ASSERT_TRUE(m.ok());
  const auto prompts = Prompts((*m)->config().vocab_size);
  EngineOptions o;
  o.page_size = 8;
  auto outs = tp_testing::RunRanks(
      *m, o, 2,
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
  o.emulate_tp = 3;  // neither 1 nor the group's 2: refused at creation, and the group aborted
  outs = tp_testing::RunRanks(
      *m, o, 2, [&](int) { return prompts; }, nullptr, kNewTokens);
  for (int r = 0; r < 2; ++r) EXPECT_FALSE(outs[r].status.ok()) << "rank " << r;
}

}  // namespace
}  // namespace lockstep::engine
