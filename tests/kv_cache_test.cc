// tests/kv_cache_test.cc — the paged latent cache: byte layouts (hand-derived from FlashMLA's
// V3.2 "FP8 with scale" layout), quantisation rules, and page-table bookkeeping.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "engine/kv_cache.h"
#include "kernels/cpu/numerics.h"

namespace lockstep::engine {
namespace {

ModelConfig V3Shapes() {
  auto c = ModelConfig::FromJson(R"({"model_type":"deepseek_v3","num_hidden_layers":2,"first_k_dense_replace":2})",
                                 "config.json");
  EXPECT_TRUE(c.ok()) << c.status().message();
  return *c;
}

TEST(KvCache, Fp8LayoutIs656BytesForDeepSeekV3) {
  ModelConfig c = V3Shapes();
  PagedKvCache cache(c, KvFormat::kFp8E4m3, 64, 4);
  EXPECT_EQ(cache.latent_bytes_per_token(), 656);
  EXPECT_EQ(PagedKvCache(c, KvFormat::kBf16, 64, 1).latent_bytes_per_token(), 1152);
  EXPECT_EQ(PagedKvCache(c, KvFormat::kFp32, 64, 1).latent_bytes_per_token(), 2304);

  SeqCache seq;
  ASSERT_TRUE(cache.Reserve(&seq, 3).ok());
  std::vector<float> latent(512), rope(64);
  for (int i = 0; i < 512; ++i) latent[i] = (i < 128) ? 0.5f : (i < 256 ? 96.0f * (i % 3 == 0 ? -1 : 1) : 0.0f);
  latent[300] = 3.0f;  // tile 2 amax 3 → scale 2^ceil(log2(3/448)) = 2^-7
  for (int i = 0; i < 64; ++i) rope[i] = static_cast<float>(i) - 31.5f;
  cache.WriteLatent(1, seq, 2, latent.data(), rope.data());
  const uint8_t* b = cache.TokenBytes(1, 0, seq, 2);
  float scales[4];
  std::memcpy(scales, b + 512, 16);
  EXPECT_EQ(scales[0], std::ldexp(1.0f, -9));  // amax 0.5: 0.5/448 → 2^-9 (0.5/2^-9 = 256 ≤ 448)
  EXPECT_EQ(scales[1], 0.25f);                 // amax 96: 96/448 = 0.214 → 2^-2
  EXPECT_EQ(scales[2], std::ldexp(1.0f, -7));  // amax 3
  EXPECT_EQ(scales[3], 1.0f);                  // all zero
  EXPECT_EQ(b[0], kernels::F32ToFp8E4m3(256.0f));
  uint16_t r0;
  std::memcpy(&r0, b + 528, 2);
  EXPECT_EQ(r0, kernels::F32ToBf16(-31.5f));
  std::vector<float> lat2(512), rope2(64);
  cache.ReadLatent(1, seq, 2, lat2.data(), rope2.data());
  EXPECT_EQ(lat2[0], 0.5f);
  EXPECT_EQ(lat2[130], 96.0f);
  EXPECT_EQ(lat2[129], -96.0f);
  EXPECT_EQ(lat2[300], 3.0f);
  EXPECT_EQ(rope2[0], -31.5f);
}

TEST(KvCache, QuantisationErrorIsWithinHalfAStep) {
  ModelConfig c = V3Shapes();
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0, 2);
  for (KvFormat f : {KvFormat::kFp32, KvFormat::kBf16, KvFormat::kFp8E4m3}) {
    PagedKvCache cache(c, f, 16, 8);
    SeqCache seq;
    ASSERT_TRUE(cache.Reserve(&seq, 40).ok());
    std::vector<float> latent(512), rope(64), l2(512), r2(64);
    for (int t = 0; t < 40; ++t) {
      for (auto& v : latent) v = n(rng);
      for (auto& v : rope) v = n(rng);
      cache.WriteLatent(0, seq, t, latent.data(), rope.data());
      cache.ReadLatent(0, seq, t, l2.data(), r2.data());
      for (int i = 0; i < 512; ++i) {
        const float s = f == KvFormat::kFp8E4m3 ? Fp8TileScale(&latent[(i / 128) * 128], 128) : 1.0f;
        const float a = std::fabs(latent[i]) / s;
        // e4m3 has 3 mantissa bits: half a step is 2^(e-4) relative; bf16: 2^-8; fp32: exact.
        const double tol = f == KvFormat::kFp32 ? 0.0
                           : f == KvFormat::kBf16 ? std::fabs(latent[i]) * 0.00390625
                                                  : std::max(a * 0.0625, 0.5 * std::ldexp(1.0, -9)) * s;
        EXPECT_LE(std::fabs(l2[i] - latent[i]), tol + 1e-30) << KvFormatName(f) << " t=" << t << " i=" << i;
      }
      for (int i = 0; i < 64; ++i) {
        const double tol = f == KvFormat::kFp32 ? 0.0 : std::fabs(rope[i]) * 0.00390625;
        EXPECT_LE(std::fabs(r2[i] - rope[i]), tol) << KvFormatName(f);
      }
    }
  }
}

TEST(KvCache, PagesAreAllocatedLowestFirstAndReturned) {
  ModelConfig c = V3Shapes();
  PagedKvCache cache(c, KvFormat::kBf16, 4, 5);
  SeqCache a, b;
  ASSERT_TRUE(cache.Reserve(&a, 6).ok());   // 2 pages
  ASSERT_TRUE(cache.Reserve(&b, 9).ok());   // 3 pages
  EXPECT_EQ(a.pages, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(b.pages, (std::vector<int32_t>{2, 3, 4}));
  Status full = cache.Reserve(&a, 12);
  EXPECT_FALSE(full.ok());
  EXPECT_NE(full.message().find("KV cache full"), std::string::npos);
  EXPECT_EQ(a.pages.size(), 2u) << "a failed reserve leaves the sequence unchanged";
  cache.Release(&a);
  EXPECT_EQ(cache.free_pages(), 2);
  SeqCache d;
  ASSERT_TRUE(cache.Reserve(&d, 1).ok());
  EXPECT_EQ(d.pages, (std::vector<int32_t>{0}));
  // A reused page starts zeroed: no bytes of its previous owner leak.
  const uint8_t* z = cache.TokenBytes(0, 0, d, 0);
  for (int i = 0; i < cache.latent_bytes_per_token(); ++i) ASSERT_EQ(z[i], 0);
}

}  // namespace
}  // namespace lockstep::engine
