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

// indexer=fp8_paged's key stream: index_head_dim e4m3 values then a power-of-two scale per 128
// (132 bytes for V3.2's 128), by hand; read back it is the FP8 round trip of the key; without
// the option it stays 512 bytes of fp32 whatever the latent's format.
TEST(KvCache, Fp8IndexKeysAre132BytesForDeepSeekV32) {
  auto c = ModelConfig::FromJson(
      R"({"model_type":"deepseek_v32","num_hidden_layers":1,"first_k_dense_replace":1,"index_head_dim":128,
          "index_n_heads":64,"index_topk":2048,"q_lora_rank":1536})",
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status().message();
  ASSERT_TRUE(c->has_indexer());
  PagedKvCache plain(*c, KvFormat::kFp8E4m3, 64, 2);
  ASSERT_EQ(plain.streams(0).size(), 2u);
  EXPECT_EQ(plain.streams(0)[1].bytes_per_token, 512);
  PagedKvCache cache(*c, KvFormat::kBf16, 64, 2, /*fp8_index_keys=*/true);
  EXPECT_EQ(cache.streams(0)[1].bytes_per_token, 132);
  SeqCache seq;
  ASSERT_TRUE(cache.Reserve(&seq, 70).ok());
  std::vector<float> key(128);
  for (int i = 0; i < 128; ++i) key[i] = 0.01f * static_cast<float>(i) - 0.3f;
  key[7] = 5.0f;  // amax 5 → scale 2^ceil(log2(5/448)) = 2^-6
  cache.WriteIndexKey(0, seq, 67, key.data());  // second page
  const uint8_t* b = cache.TokenBytes(0, 1, seq, 67);
  float scale;
  std::memcpy(&scale, b + 128, 4);
  EXPECT_EQ(scale, std::ldexp(1.0f, -6));
  EXPECT_EQ(b[7], kernels::F32ToFp8E4m3(320.0f));  // 5 / 2^-6 = 320, on the e4m3 grid
  std::vector<float> back(128);
  cache.ReadIndexKey(0, seq, 67, back.data());
  std::vector<uint8_t> row(Fp8RowBytes(128));
  QuantizeFp8Row(key.data(), 128, row.data());
  EXPECT_EQ(0, std::memcmp(row.data(), b, row.size()));  // the cache stores QuantizeFp8Row's row
  for (int i = 0; i < 128; ++i) {
    EXPECT_EQ(back[i], kernels::Fp8E4m3ToF32(b[i]) * scale) << i;
    EXPECT_LE(std::fabs(back[i] - key[i]), std::ldexp(std::fabs(key[i]), -4) + std::ldexp(scale, -10)) << i;
  }
  EXPECT_EQ(back[7], 5.0f);
}

// Fp8RowDot by hand and against an exact integer sum: per tile the e4m3 products summed in
// fp64 are exact (so the order cannot matter), times the two scales; tiles in ascending order.
TEST(KvCache, Fp8RowDotIsTheExactSumOfTheProducts) {
  // Hand case: a = [1, 2, -0.5] · 2^-3, b = [4, 0.25, 8] · 2^1 → (4 + 0.5 − 4) · 2^-2 = 0.125.
  const float a[3] = {0.125f, 0.25f, -0.0625f}, b[3] = {8.0f, 0.5f, 16.0f};
  std::vector<uint8_t> ra(Fp8RowBytes(3)), rb(Fp8RowBytes(3));
  QuantizeFp8Row(a, 3, ra.data());
  QuantizeFp8Row(b, 3, rb.data());
  EXPECT_EQ(Fp8RowDot(ra.data(), rb.data(), 3), 0.125);
  // Random 128-value rows spanning many binades (subnormal e4m3 values too): the fp64 sum equals
  // the exact sum of the products as integers in units of 2^-18, and reversing the order of
  // the products changes nothing.
  std::mt19937_64 rng(5);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (int rep = 0; rep < 200; ++rep) {
    std::vector<float> x(128), y(128);
    for (int i = 0; i < 128; ++i) {
      x[i] = g(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
      y[i] = g(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
    }
    std::vector<uint8_t> rx(Fp8RowBytes(128)), ry(Fp8RowBytes(128));
    QuantizeFp8Row(x.data(), 128, rx.data());
    QuantizeFp8Row(y.data(), 128, ry.data());
    __int128 exact = 0;
    double reversed = 0;
    for (int i = 127; i >= 0; --i) {
      const double p = double(kernels::Fp8E4m3ToF32(rx[i])) * double(kernels::Fp8E4m3ToF32(ry[i]));
      exact += static_cast<__int128>(std::ldexp(p, 18));  // an integer: checked below
      ASSERT_EQ(std::ldexp(p, 18), std::floor(std::ldexp(p, 18))) << "product not on the 2^-18 grid";
      reversed += p;
    }
    float sx, sy;
    std::memcpy(&sx, rx.data() + 128, 4);
    std::memcpy(&sy, ry.data() + 128, 4);
    const double want = std::ldexp(static_cast<double>(exact), -18) * (double(sx) * double(sy));
    EXPECT_EQ(Fp8RowDot(rx.data(), ry.data(), 128), want) << rep;
    EXPECT_EQ(reversed * (double(sx) * double(sy)), want) << rep;
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
