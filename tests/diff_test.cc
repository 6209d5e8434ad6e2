// tests/diff_test.cc — the comparison oracle and the degeneration detector on hand-computed cases.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "diff/degeneration.h"
#include "diff/metrics.h"

namespace lockstep::diff {
namespace {

TEST(CompareRows, HandComputed) {
  std::vector<float> ref = {3, 4, 0}, cand = {3, 4, 0};
  TensorDiff d = CompareRows(cand, ref);
  EXPECT_TRUE(d.bit_equal);
  EXPECT_EQ(d.rel_l2, 0);
  EXPECT_EQ(d.sqnr_db, INFINITY);
  cand = {3, 4.5f, 0};  // error (0, .5, 0), ‖ref‖ = 5
  d = CompareRows(cand, ref);
  EXPECT_FALSE(d.bit_equal);
  EXPECT_DOUBLE_EQ(d.max_abs, 0.5);
  EXPECT_EQ(d.max_abs_index, 1);
  EXPECT_DOUBLE_EQ(d.rel_l2, 0.1);
  EXPECT_NEAR(d.sqnr_db, 20.0, 1e-12);  // 10·log10(25 / 0.25)
  EXPECT_NEAR(d.cosine, (9 + 18) / (5 * std::sqrt(9 + 20.25)), 1e-12);
  std::vector<float> zero = {-0.0f}, pzero = {0.0f};
  EXPECT_FALSE(CompareRows(zero, pzero).bit_equal) << "bit equality sees the sign of zero";
  std::vector<float> nan = {NAN, 1}, fin = {1, 1};
  d = CompareRows(nan, fin);
  EXPECT_EQ(d.nonfinite_mismatch, 1);
  EXPECT_TRUE(Diverges(d, Thresholds{}));
}

TEST(CompareLogits, KlTopOneAndChosenProbability) {
  std::vector<float> ref = {std::log(0.5f), std::log(0.5f)}, cand = {std::log(0.25f), std::log(0.75f)};
  LogitDiff d = CompareLogits(cand, ref, 0);
  // KL(p‖q) = .5 ln(.5/.25) + .5 ln(.5/.75)
  EXPECT_NEAR(d.kl, 0.5 * std::log(2.0) + 0.5 * std::log(2.0 / 3.0), 1e-7);
  EXPECT_EQ(d.top1_ref, 0);  // tie: lowest id
  EXPECT_EQ(d.top1_cand, 1);
  EXPECT_FALSE(d.top1_agree);
  EXPECT_NEAR(d.chosen_prob_ref, 0.5, 1e-7);
  EXPECT_NEAR(d.chosen_prob_cand, 0.25, 1e-7);
  EXPECT_EQ(CompareLogits(ref, ref, 1).kl, 0);
}

TEST(Degeneration, LoopsCollapsesAndHealthyText) {
  std::vector<int32_t> healthy;
  for (int i = 0; i < 200; ++i) healthy.push_back((i * 7919) % 1000);
  Degeneration h = DetectDegeneration(healthy);
  EXPECT_FALSE(h.degenerate);
  // "</div>" spam: a 3-token period filling the tail.
  std::vector<int32_t> spam(healthy.begin(), healthy.begin() + 100);
  for (int i = 0; i < 100; ++i) spam.push_back(500 + i % 3);
  Degeneration s = DetectDegeneration(spam);
  EXPECT_TRUE(s.loop);
  EXPECT_EQ(s.period, 3);
  EXPECT_EQ(s.periodic_len, 100 + 0) << "the periodic run is exactly the 100 spam tokens";
  EXPECT_TRUE(s.degenerate);
  // A loop too long to be periodic (period 40 > 32) still collapses distinct 4-grams.
  std::vector<int32_t> longloop;
  for (int i = 0; i < 200; ++i) longloop.push_back(i % 40);
  Degeneration l = DetectDegeneration(longloop);
  EXPECT_FALSE(l.loop);
  EXPECT_NEAR(l.distinct, 40.0 / 125.0, 1e-12);
  EXPECT_FALSE(l.collapse) << "0.32 ≥ 0.3";
  // Period exactly half the window covers it.
  std::vector<int32_t> half;
  for (int i = 0; i < 128; ++i) half.push_back(i < 64 ? i : 1000 + (i % 2));
  EXPECT_TRUE(DetectDegeneration(half).loop);
}

TEST(Degeneration, CompressibilityAndEntropy) {
  std::string prose;  // random letters: incompressible beyond the alphabet's entropy
  std::mt19937 rng(6);
  for (int i = 0; i < 400; ++i) prose += static_cast<char>('a' + rng() % 26);
  std::string spam;
  for (int i = 0; i < 60; ++i) spam += "</div>";
  EXPECT_GT(ZstdRatio(prose), 0.5);
  EXPECT_LT(ZstdRatio(spam), 0.15);
  // Entropy of a uniform distribution over 4 is ln 4; of a one-hot, 0.
  std::vector<float> uni(4, 0.0f), hot = {100, 0, 0, 0};
  EXPECT_NEAR(Entropy(uni), std::log(4.0), 1e-12);
  EXPECT_NEAR(Entropy(hot), 0.0, 1e-30);
  std::vector<double> ent(100, 0.01);
  TextSignals t = JudgeText(spam, ent);
  EXPECT_TRUE(t.compressible);
  EXPECT_TRUE(t.entropy_collapse);
  ent.assign(100, 2.0);
  EXPECT_FALSE(JudgeText(prose, ent).entropy_collapse);
}

}  // namespace
}  // namespace lockstep::diff
