// tests/gpu/gpu_sampler_test.cc — the CUDA sampler must choose the CPU sampler's token
// (engine::Sampler::Sample, docs/sampling.md) for the same logits and parameters: thousands
// of seeded random rows over vocabularies from 1 to DeepSeek's 129280, every filter
// combination, ties, NaN and −∞ logits; plus determinism and batch invariance.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu/gpu_test_util.h"

namespace lockstep {
namespace {

using namespace gpu_testing;  // NOLINT

struct Batch {
  int64_t vocab = 0;
  std::vector<float> logits;  // [rows, vocab]
  std::vector<cu::SampleRequest> reqs;
};

Batch MakeBatch(int64_t rows, int64_t vocab, uint64_t seed) {
  Batch b;
  b.vocab = vocab;
  b.logits.resize(rows * vocab);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const double temps[] = {0.0, 0.3, 0.7, 1.0, 1.5};
  const int64_t top_ks[] = {0, 1, 2, 40, 1000, vocab + 5};
  const double top_ps[] = {1.0, 0.95, 0.5, 0.0};
  const double min_ps[] = {0.0, 0.05, 0.5};
  const float sigmas[] = {0.5f, 2.0f, 8.0f};
  for (int64_t r = 0; r < rows; ++r) {
    float* l = &b.logits[r * vocab];
    const float sigma = sigmas[rng() % 3];
    const int kind = static_cast<int>(rng() % 10);
    for (int64_t i = 0; i < vocab; ++i) {
      float v = g(rng) * sigma;
      if (kind == 1) v = std::round(v * 2.0f) / 2.0f;  // coarse grid: many exactly tied logits
      if (kind == 2 && rng() % 50 == 0) v = NAN;
      if (kind == 3 && rng() % 10 == 0) v = -INFINITY;
      if (kind == 4) v = 1.25f;                         // all equal
      if (kind == 5 && i % 2 == 0) v = -0.0f;           // −0 ties +0
      if (kind == 5 && i % 2 == 1) v = i < vocab / 2 ? 0.0f : -1.0f;
      l[i] = v;
    }
    if (kind == 6) {
      for (int64_t i = 0; i < vocab; ++i) l[i] = -INFINITY;  // nothing finite
    }
    if (kind == 7) {
      for (int64_t i = 0; i < vocab; ++i) l[i] = NAN;
    }
    cu::SampleRequest q;
    q.temperature = temps[rng() % 5];
    q.top_k = top_ks[rng() % 6];
    q.top_p = top_ps[rng() % 4];
    q.min_p = min_ps[rng() % 3];
    q.seed = rng();
    q.step = rng() % 3 == 0 ? rng() : rng() % 4096;
    b.reqs.push_back(q);
  }
  return b;
}

std::vector<cu::SampleOutput> RunGpu(const Batch& b, bool all_greedy = false) {
  const int64_t rows = static_cast<int64_t>(b.reqs.size());
  auto dl = Upload(b.logits), dr = Upload(b.reqs);
  auto dout = Zeros<cu::SampleOutput>(rows);
  auto ws = cu::DeviceBuffer::Allocate(cu::SamplerWorkspaceBytes(rows, b.vocab));
  EXPECT_TRUE(ws.ok()) << ws.status().message();
  cu::SamplerParams p;
  p.batch = rows;
  p.vocab = b.vocab;
  p.logits = dl.as<float>();
  p.logits_stride = b.vocab;
  p.requests = dr.as<cu::SampleRequest>();
  p.out = dout.as<cu::SampleOutput>();
  p.workspace = ws->data();
  p.workspace_bytes = ws->size();
  p.all_greedy = all_greedy;
  Status s = cu::Sample(p);
  EXPECT_TRUE(s.ok()) << s.message();
  s = cu::Synchronize();
  EXPECT_TRUE(s.ok()) << s.message();
  return Download<cu::SampleOutput>(dout, rows);
}

// Same token, candidates, draw and counter; the probability w/S may differ by CUDA's double
// exp vs glibc's (≤ 1 ulp each weight): S's relative difference is at most one ulp per
// summed weight, so (candidates + 4)·2^-52 relative bounds it.
int64_t Compare(const Batch& b, const std::vector<cu::SampleOutput>& got, const std::string& what) {
  int64_t mismatches = 0;
  for (size_t r = 0; r < b.reqs.size(); ++r) {
    const cu::SampleRequest& q = b.reqs[r];
    engine::SamplingParams sp;
    sp.temperature = q.temperature;
    sp.top_k = q.top_k;
    sp.top_p = q.top_p;
    sp.min_p = q.min_p;
    sp.seed = q.seed;
    const engine::SampleResult want = engine::Sampler::Sample(
        std::span<const float>(&b.logits[r * b.vocab], static_cast<size_t>(b.vocab)), sp, q.step);
    const cu::SampleOutput& g = got[r];
    const double ptol = (static_cast<double>(want.candidates) + 4) * std::ldexp(1.0, -52) * want.probability;
    const bool same = g.token == want.token && g.candidates == want.candidates && g.counter == want.counter &&
                      std::memcmp(&g.uniform, &want.uniform, sizeof(double)) == 0 &&
                      ((std::isnan(g.probability) && std::isnan(want.probability)) ||  // nothing finite
                       std::fabs(g.probability - want.probability) <= ptol);
    if (!same && mismatches++ < 5) {
      ADD_FAILURE() << what << " row " << r << " (T=" << q.temperature << " top_k=" << q.top_k << " top_p=" << q.top_p
                    << " min_p=" << q.min_p << " seed=" << q.seed << " step=" << q.step << "): GPU token " << g.token
                    << " p=" << g.probability << " u=" << g.uniform << " cand=" << g.candidates << "; CPU token "
                    << want.token << " p=" << want.probability << " u=" << want.uniform
                    << " cand=" << want.candidates;
    }
  }
  return mismatches;
}

TEST(CudaSampler, ChoosesTheCpuSamplersTokens) {
  LS_REQUIRE_GPU();
  struct Shape {
    int64_t rows, vocab;
  };
  uint64_t seed = 1;
  int64_t rows_total = 0;
  for (Shape s : {Shape{2000, 256}, Shape{400, 32000}, Shape{24, 129280}, Shape{50, 1}, Shape{100, 3}}) {
    const Batch b = MakeBatch(s.rows, s.vocab, seed++);
    const auto got = RunGpu(b);
    EXPECT_EQ(Compare(b, got, "vocab " + std::to_string(s.vocab)), 0);
    rows_total += s.rows;
  }
  std::printf("  [sampler] %lld rows compared\n", static_cast<long long>(rows_total));
}

// A batch the caller declares all greedy skips the sort and still picks the CPU's argmax
// (ties to the lowest id, NaN never; the batches draw such rows); a row that breaks the
// declaration gets token −1, never a token from unsorted keys.
TEST(CudaSampler, AllGreedyBatchesSkipTheSort) {
  LS_REQUIRE_GPU();
  // (Vocabularies about the argmax's 4096-logit parts: one part, a part and one logit, many.)
  for (int64_t vocab : {int64_t{3}, int64_t{4096}, int64_t{4097}, int64_t{32000}, int64_t{102400}, int64_t{129280}}) {
    Batch b = MakeBatch(vocab > 100000 ? 40 : 200, vocab, 500 + vocab);
    for (auto& q : b.reqs) q.temperature = 0.0;
    const auto got = RunGpu(b, /*all_greedy=*/true);
    EXPECT_EQ(Compare(b, got, "all greedy, vocab " + std::to_string(vocab)), 0);
    b.reqs[1].temperature = 0.7;
    const auto broken = RunGpu(b, true);
    EXPECT_EQ(broken[1].token, -1);
    EXPECT_EQ(std::memcmp(&broken[0], &got[0], sizeof(cu::SampleOutput)), 0);
  }
}

// The sampler's running sums, formed in parallel passes (one per 4096 weights, binade the
// sum crosses and rounding tie), against the serial fp64 chain on the host, bit for bit: the
// sums, where they settle, and the settled tail. The weights draw the cases the passes treat
// apart: exact ties (few-bit dyadic weights), sums crossing many binades (all ones), a sum
// that settles inside and at the edges of a pass, zeros, subnormal sums, unsorted weights.
TEST(CudaSampler, RunningSumsAreTheSerialChainsBits) {
  LS_REQUIRE_GPU();
  auto chain = [](const std::vector<double>& w, int32_t* settled) {
    std::vector<double> pre(w.size());
    double s = 0;
    size_t i = 0;
    for (; i < w.size(); ++i) {
      if (s + w[i] == s) break;
      s += w[i];
      pre[i] = s;
    }
    *settled = static_cast<int32_t>(i);
    for (; i < w.size(); ++i) pre[i] = s;
    return pre;
  };
  std::mt19937_64 rng(77);
  std::vector<std::pair<std::string, std::vector<double>>> cases;
  auto sorted_desc = [](std::vector<double> w) {
    std::sort(w.begin(), w.end(), std::greater<double>());
    return w;
  };
  cases.push_back({"one weight", {1.0}});
  cases.push_back({"two", {1.0, 0.3}});
  cases.push_back({"zeros after three", {1.0, 0.5, 0.25, 0.0, 0.0, 0.0}});
  cases.push_back({"all ones", std::vector<double>(100000, 1.0)});
  for (int64_t n : {4095, 4096, 4097, 8193, 102400, 129280}) {
    for (double sigma : {0.05, 1.0, 4.0, 30.0}) {  // flat (nothing settles) … peaked (settles early)
      std::normal_distribution<double> g(0.0, sigma);
      std::vector<double> l(static_cast<size_t>(n));
      for (double& v : l) v = static_cast<float>(g(rng));
      std::sort(l.begin(), l.end(), std::greater<double>());
      std::vector<double> w(l.size());
      for (size_t i = 0; i < l.size(); ++i) w[i] = std::exp((l[i] - l[0]) / 0.8);
      cases.push_back({"exp weights n=" + std::to_string(n) + " sigma=" + std::to_string(sigma), w});
    }
  }
  {
    // Four significant bits over 2^0 … 2^-60: against the running sum's ulp many end in
    // exactly .5 (ties to even) and the sum crosses binades repeatedly.
    std::vector<double> w(60000);
    for (double& v : w) v = std::ldexp(1.0 + static_cast<double>(rng() % 8) / 8.0, -static_cast<int>(rng() % 61));
    w[0] = 2.0;
    cases.push_back({"dyadic ties", sorted_desc(w)});
    std::vector<double> h(20000);
    for (double& v : h) v = std::ldexp(static_cast<double>(rng() % 4 + 1), -54);  // 2^-54 … 2^-52: ties at 1
    h[0] = 1.0;
    cases.push_back({"half-ulp steps at 1", sorted_desc(h)});
  }
  {
    std::vector<double> w(5000);
    for (double& v : w) v = std::ldexp(static_cast<double>(rng() % 64), -1074);  // subnormal steps
    w[0] = std::ldexp(1.0, -1070);
    cases.push_back({"subnormal sums", sorted_desc(w)});
  }
  {
    std::vector<double> w(30000);
    std::uniform_real_distribution<double> u01(0.0, 1.0);
    for (double& v : w) v = u01(rng);
    w[0] = 1.0;
    cases.push_back({"unsorted", w});  // the rule is the chain's: the first addition that changes nothing
  }
  int64_t weights = 0;
  for (const auto& [name, w] : cases) {
    SCOPED_TRACE(name);
    int32_t want_settled = -1;
    const std::vector<double> want = chain(w, &want_settled);
    auto dw = Upload(w);
    auto dpre = Zeros<double>(w.size());
    auto dset = Zeros<int32_t>(1);
    Status s = cu::SequentialPrefixSums(dw.as<double>(), static_cast<int64_t>(w.size()), dpre.as<double>(),
                                        dset.as<int32_t>());
    ASSERT_TRUE(s.ok()) << s.message();
    ASSERT_TRUE(cu::Synchronize().ok());
    const std::vector<double> got = Download<double>(dpre, w.size());
    EXPECT_EQ(Download<int32_t>(dset, 1)[0], want_settled);
    size_t bad = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      if (std::memcmp(&got[i], &want[i], 8) != 0 && bad++ < 3) {
        ADD_FAILURE() << "sum " << i << ": " << std::hexfloat << got[i] << " against the chain's " << want[i];
      }
    }
    EXPECT_EQ(bad, 0u);
    weights += static_cast<int64_t>(w.size());
  }
  EXPECT_FALSE(cu::SequentialPrefixSums(nullptr, 0, nullptr, nullptr).ok());
  std::printf("  [sampler] %zu weight lists, %lld running sums compared\n", cases.size(),
              static_cast<long long>(weights));
}

TEST(CudaSampler, DeterministicAndBatchInvariant) {
  LS_REQUIRE_GPU();
  const Batch b = MakeBatch(64, 32000, 99);
  const auto a1 = RunGpu(b), a2 = RunGpu(b);
  for (size_t r = 0; r < a1.size(); ++r) {
    EXPECT_EQ(std::memcmp(&a1[r], &a2[r], sizeof(cu::SampleOutput)), 0) << "row " << r << " run twice";
  }
  for (int64_t r : {0, 17, 63}) {
    Batch one;
    one.vocab = b.vocab;
    one.logits.assign(b.logits.begin() + r * b.vocab, b.logits.begin() + (r + 1) * b.vocab);
    one.reqs = {b.reqs[r]};
    const auto s = RunGpu(one);
    EXPECT_EQ(std::memcmp(&s[0], &a1[r], sizeof(cu::SampleOutput)), 0) << "row " << r << " alone vs in a batch of 64";
  }
}

TEST(CudaSampler, ValidationNamesTheField) {
  cu::SamplerParams p;
  float f = 0;
  cu::SampleRequest q;
  cu::SampleOutput o;
  p.batch = 1;
  p.vocab = 10;
  p.logits = &f;
  p.logits_stride = 5;
  p.requests = &q;
  p.out = &o;
  Status s = cu::Sample(p);
  EXPECT_EQ(s.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(s.message().find("logits_stride"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace lockstep
