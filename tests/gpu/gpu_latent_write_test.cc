// tests/gpu/gpu_latent_write_test.cc — the CUDA quantise-on-write of latent rows must produce
// exactly the bytes of engine::PagedKvCache::WriteLatent, in every format, for ordinary
// values and for the edges of the formats (NaN, ±Inf, ±0, subnormals, saturation, rounding
// ties, tile amax exactly 448·2^k), and must write nowhere else — but, when asked
// (LatentWriteParams::copy), the same bytes to a contiguous copy (the host mirror's).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/config.h"
#include "engine/kv_cache.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu/gpu_test_util.h"

namespace lockstep {
namespace {

using namespace gpu_testing;  // NOLINT

Result<engine::ModelConfig> Shapes(int64_t kv_lora, int64_t rope) {
  return engine::ModelConfig::FromJson(R"({"model_type":"deepseek_v3","num_hidden_layers":1,"kv_lora_rank":)" +
                                           std::to_string(kv_lora) + R"(,"qk_rope_head_dim":)" +
                                           std::to_string(rope) + "}",
                                       "config.json");
}

// Row kinds: 0 ordinary, 1..n edge patterns.
void FillRow(int kind, std::mt19937_64& rng, std::vector<float>& lat, std::vector<float>& rope) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::uniform_real_distribution<float> e(-20.0f, 20.0f);
  const float s = std::exp2(e(rng));
  for (auto& v : lat) v = g(rng) * s;
  for (auto& v : rope) v = g(rng) * s;
  const size_t C = lat.size();
  auto put = [&](size_t i, float v) {
    if (i < C) lat[i] = v;
  };
  switch (kind % 8) {
    case 0: break;
    case 1:  // tile 0 amax exactly 448·2^-3: scale 2^-3 exactly, 56 maps to 448
      for (size_t i = 0; i < std::min<size_t>(C, 128); ++i) lat[i] = std::fmod(lat[i], 50.0f);
      put(5, 56.0f);
      break;
    case 2:  // specials
      put(0, NAN);
      put(1, INFINITY);  // amax inf → scale 1 → saturates to 448
      put(2, -0.0f);
      put(130, -INFINITY);
      if (!rope.empty()) rope[0] = NAN;
      if (rope.size() > 1) rope[1] = -INFINITY;
      break;
    case 3:  // a whole tile of zeros (scale 1) and one of NaN (amax ignores NaN → 0 → scale 1)
      for (size_t i = 0; i < std::min<size_t>(C, 128); ++i) lat[i] = 0.0f;
      for (size_t i = 128; i < std::min<size_t>(C, 256); ++i) lat[i] = NAN;
      break;
    case 4:  // subnormals and the smallest amax: scale underflows to 0 in fp32 → x/0
      for (size_t i = 0; i < std::min<size_t>(C, 128); ++i) lat[i] = std::ldexp(1.0f, -149) * static_cast<float>(i % 3);
      for (size_t i = 128; i < std::min<size_t>(C, 256); ++i) lat[i] = std::ldexp(g(rng), -130);
      break;
    case 5:  // huge values near FLT_MAX
      for (size_t i = 0; i < std::min<size_t>(C, 128); ++i) lat[i] = 3.0e38f * (g(rng) > 0 ? 1.0f : -0.9f);
      break;
    case 6:  // e4m3 rounding ties: with amax 448 (scale 1) values at half steps
      for (size_t i = 0; i < std::min<size_t>(C, 128); ++i) {
        const float ties[] = {1.0625f, 1.1875f, 17.0f, 19.0f, 0.0009765625f, 0.0029296875f, 240.0f, 464.0f};
        lat[i] = ties[i % 8] * ((i / 8) % 2 ? -1.0f : 1.0f);
      }
      put(0, 448.0f);
      // bf16 ties in the rope: 1 + 2^-8 (tie → even, down) and 1 + 3·2^-8 (tie → even, up)
      if (!rope.empty()) rope[0] = 1.00390625f;
      if (rope.size() > 1) rope[1] = 1.01171875f;
      break;
    case 7:  // amax just above 448·2^k (scale doubles) and the fp8 subnormal range
      for (size_t i = 0; i < std::min<size_t>(C, 128); ++i) lat[i] = std::ldexp(static_cast<float>(i % 9), -9);
      put(3, std::nextafter(448.0f, 1000.0f));
      break;
  }
}

// WriteLatent's arguments for `rows` rows of C latent and R rope values (no copy).
cu::LatentWriteParams WriteParams(const float* latent, int64_t latent_stride, const float* rope, int64_t rope_stride,
                                  const int32_t* slots, uint8_t* cache, int64_t num_slots, int64_t rows, int64_t C,
                                  int64_t R, cu::LatentFormat format, int32_t* flag) {
  cu::LatentWriteParams p;
  p.latent = latent;
  p.latent_stride = latent_stride;
  p.rope = rope;
  p.rope_stride = rope_stride;
  p.slots = slots;
  p.cache = cache;
  p.num_slots = num_slots;
  p.rows = rows;
  p.kv_lora = C;
  p.rope_dim = R;
  p.format = format;
  p.error_flag = flag;
  return p;
}

void RunCase(int64_t C, int64_t R, engine::KvFormat format, uint64_t seed) {
  SCOPED_TRACE("kv_lora " + std::to_string(C) + " rope " + std::to_string(R) + " " +
               std::string(engine::KvFormatName(format)));
  const Result<engine::ModelConfig> cfg = Shapes(C, R);
  ASSERT_TRUE(cfg.ok()) << cfg.status().message();  // returns from this case only
  const int64_t page_size = 16, max_pages = 12, tokens = 150;
  engine::PagedKvCache cache(*cfg, format, page_size, max_pages);
  engine::SeqCache filler, seq;
  ASSERT_TRUE(cache.Reserve(&filler, 20).ok());  // so seq's pages are not 0, 1, 2, …
  ASSERT_TRUE(cache.Reserve(&seq, tokens).ok());
  const int64_t bpt = cache.latent_bytes_per_token();
  ASSERT_EQ(bpt, cu::LatentBytesPerToken(static_cast<cu::LatentFormat>(format), C, R));

  std::mt19937_64 rng(seed);
  std::vector<float> lat(tokens * C), rope(tokens * R);
  std::vector<int32_t> slots(tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<float> l(C), r(R);
    FillRow(static_cast<int>(t), rng, l, r);
    std::copy(l.begin(), l.end(), lat.begin() + t * C);
    std::copy(r.begin(), r.end(), rope.begin() + t * R);
    cache.WriteLatent(0, seq, t, l.data(), r.data());
    slots[t] = seq.pages[t / page_size] * page_size + t % page_size;
  }
  slots[tokens - 1] = -1;  // −1 = skip: the pool keeps its poison there

  const int64_t num_slots = max_pages * page_size;
  std::vector<uint8_t> pool(num_slots * bpt, 0xA5);
  auto dpool = Upload(pool), dlat = Upload(lat), drope = Upload(rope), dslots = Upload(slots);
  auto flag = Zeros<int32_t>(1);
  cu::LatentWriteParams p =
      WriteParams(dlat.as<float>(), C, drope.as<float>(), R, dslots.as<int32_t>(), dpool.as<uint8_t>(), num_slots,
                  tokens, C, R, static_cast<cu::LatentFormat>(format), flag.as<int32_t>());
  // The contiguous copy of the stored rows (the host mirror's): 4-byte rows only.
  const std::vector<uint8_t> copy_poison(tokens * bpt, 0x5A);
  auto dcopy = Upload(copy_poison);
  p.copy = dcopy.as<uint8_t>();
  if (bpt % 4 != 0) {
    const Status st = cu::WriteLatent(p);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("copy"), std::string::npos) << st.message();
    p.copy = nullptr;
  }
  LS_ASSERT_OK(cu::WriteLatent(p));
  LS_ASSERT_OK(cu::Synchronize());
  const std::vector<uint8_t> got = Download<uint8_t>(dpool, pool.size());
  EXPECT_EQ(Download<int32_t>(flag, 1)[0], 0);
  if (p.copy != nullptr) {
    const std::vector<uint8_t> copied = Download<uint8_t>(dcopy, copy_poison.size());
    for (int64_t t = 0; t < tokens; ++t) {
      const uint8_t* row = copied.data() + t * bpt;
      if (slots[t] < 0) {  // skipped: its copy row untouched
        EXPECT_TRUE(std::equal(row, row + bpt, copy_poison.begin())) << "skipped token " << t << "'s copy row changed";
      } else {
        EXPECT_EQ(0, std::memcmp(row, cache.TokenBytes(0, 0, seq, t), bpt)) << "copy of token " << t;
      }
    }
  }

  std::vector<bool> written(num_slots, false);
  int64_t mismatched_tokens = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    written[slots[t]] = true;
    const uint8_t* want = cache.TokenBytes(0, 0, seq, t);
    const uint8_t* have = got.data() + static_cast<int64_t>(slots[t]) * bpt;
    if (std::memcmp(want, have, bpt) != 0) {
      int64_t i = 0;
      while (want[i] == have[i]) ++i;
      if (mismatched_tokens++ < 5) {
        ADD_FAILURE() << "token " << t << " (row kind " << t % 8 << "): first differing byte " << i << " of " << bpt
                      << ": got 0x" << std::hex << int{have[i]} << ", want 0x" << int{want[i]} << std::dec;
      }
    }
  }
  EXPECT_EQ(mismatched_tokens, 0);
  for (int64_t s = 0; s < num_slots; ++s) {
    if (written[s]) continue;
    for (int64_t i = 0; i < bpt; ++i) {
      if (got[s * bpt + i] != 0xA5) {
        ADD_FAILURE() << "slot " << s << " was not a target but byte " << i << " changed";
        return;
      }
    }
  }
}

TEST(CudaLatentWrite, BytesEqualPagedKvCacheWriteLatent) {
  LS_REQUIRE_GPU();
  uint64_t seed = 1;
  for (engine::KvFormat f : {engine::KvFormat::kFp8E4m3, engine::KvFormat::kBf16, engine::KvFormat::kFp32}) {
    RunCase(512, 64, f, seed++);  // DeepSeek V3: 656 bytes per token in fp8
    RunCase(32, 8, f, seed++);    // the tiny test models
    RunCase(197, 6, f, seed++);   // a partial tile; scales and rope at odd offsets (rope must be even)
  }
}

// The decode step's latent-cache path in one kernel (WriteLatentPath) is RmsNorm, then Rope of
// the rope key, then WriteLatent, bit for bit: the normed latent, the rope key (in place), the
// cache bytes, the host mirror's copy and the error flag — in every format, at DeepSeek's
// 512 + 64 and the tiny models' 32 + 8, with a skipped row (slot −1) and a row whose position is
// out of range (RoPE skipped and flagged), each rope style.
TEST(CudaLatentWrite, FusedPathIsNormRopeThenWrite) {
  LS_REQUIRE_GPU();
  for (auto [C, R] : {std::pair<int64_t, int64_t>{512, 64}, {32, 8}}) {
    for (int f = 0; f < 3; ++f) {
      for (int st = 0; st < 3; ++st) {
        const auto format = static_cast<cu::LatentFormat>(f);
        const int64_t rows = 7, kvs = C + R + 3, max_pos = 40, num_slots = 16;
        const int64_t bpt = cu::LatentBytesPerToken(format, C, R);
        if (bpt % 4 != 0) continue;  // the mirror copy needs 4-byte rows (fp8 at 32 + 8: 52 bytes is fine)
        std::mt19937_64 rng(900 + 10 * C + f + 3 * st);
        std::normal_distribution<float> g(0.0f, 2.0f);
        std::vector<float> kv(rows * kvs), w(C), cs(max_pos * R / 2), sn(max_pos * R / 2);
        for (float& v : kv) v = g(rng);
        for (float& v : w) v = g(rng);
        for (float& v : cs) v = g(rng);
        for (float& v : sn) v = g(rng);
        kv[2 * kvs + 5] = NAN;
        const std::vector<int32_t> positions = {3, 0, 39, 40, 17, 8, 1};  // row 3: out of range
        const std::vector<int32_t> slots = {5, 0, 15, 7, -1, 2, 9};       // row 4: skipped
        auto dw = Upload(w), dcs = Upload(cs), dsn = Upload(sn), dpos = Upload(positions), dslots = Upload(slots);
        struct Out {
          std::vector<float> kv, latent;
          std::vector<uint8_t> pool, copy;
          int32_t flag;
        };
        auto run = [&](bool fused) {
          auto dkv = Upload(kv), dlat = Zeros<float>(rows * C), flag = Zeros<int32_t>(1);
          auto dpool = Upload(std::vector<uint8_t>(num_slots * bpt, 0xA5));
          auto dcopy = Upload(std::vector<uint8_t>(rows * bpt, 0x5A));
          cu::RmsNormParams n;
          n.x = dkv.as<float>();
          n.x_stride = kvs;
          n.weight = dw.as<float>();
          n.y = dlat.as<float>();
          n.y_stride = C;
          n.rows = rows;
          n.n = C;
          n.eps = 1e-6f;
          cu::RopeParams r;
          r.x = dkv.as<float>() + C;
          r.row_stride = kvs;
          r.head_stride = R;
          r.rows = rows;
          r.heads = 1;
          r.dim = R;
          r.positions = dpos.as<int32_t>();
          r.cos = dcs.as<float>();
          r.sin = dsn.as<float>();
          r.max_position = max_pos;
          r.style = static_cast<cu::RopeStyle>(st);
          r.error_flag = flag.as<int32_t>();
          cu::LatentWriteParams wp = WriteParams(dlat.as<float>(), C, dkv.as<float>() + C, kvs, dslots.as<int32_t>(),
                                                 dpool.as<uint8_t>(), num_slots, rows, C, R, format, flag.as<int32_t>());
          wp.copy = dcopy.as<uint8_t>();
          if (fused) {
            EXPECT_TRUE(cu::WriteLatentPath(n, r, wp).ok());
          } else {
            EXPECT_TRUE(cu::RmsNorm(n).ok());
            EXPECT_TRUE(cu::Rope(r).ok());
            EXPECT_TRUE(cu::WriteLatent(wp).ok());
          }
          EXPECT_TRUE(cu::Synchronize().ok());
          return Out{Download<float>(dkv, kv.size()), Download<float>(dlat, rows * C),
                     Download<uint8_t>(dpool, num_slots * bpt), Download<uint8_t>(dcopy, rows * bpt),
                     Download<int32_t>(flag, 1)[0]};
        };
        const Out want = run(false), got = run(true);
        const std::string what = std::to_string(C) + "+" + std::to_string(R) + " format " + std::to_string(f) +
                                 " rope style " + std::to_string(st);
        EXPECT_EQ(0, std::memcmp(got.kv.data(), want.kv.data(), kv.size() * 4)) << what << ": rope key";
        EXPECT_EQ(0, std::memcmp(got.latent.data(), want.latent.data(), rows * C * 4)) << what << ": latent";
        EXPECT_TRUE(got.pool == want.pool) << what << ": cache bytes";
        EXPECT_TRUE(got.copy == want.copy) << what << ": mirror copy";
        EXPECT_EQ(got.flag, want.flag) << what;
        EXPECT_EQ(got.flag, cu::kErrPosition) << what << ": row 3's position must be flagged";
        EXPECT_TRUE(std::isnan(got.latent[2 * C])) << what << ": the NaN must reach the latent to be a test";
      }
    }
  }
}

TEST(CudaLatentWrite, BytesPerTokenAgreeWithPagedKvCache) {  // no GPU needed
  for (auto [C, R] : std::vector<std::pair<int64_t, int64_t>>{{512, 64}, {32, 8}, {197, 6}, {128, 2}, {129, 2}}) {
    const Result<engine::ModelConfig> cfg = Shapes(C, R);
    ASSERT_TRUE(cfg.ok()) << cfg.status().message();
    for (engine::KvFormat f : {engine::KvFormat::kFp32, engine::KvFormat::kBf16, engine::KvFormat::kFp8E4m3}) {
      EXPECT_EQ(engine::PagedKvCache(*cfg, f, 1, 1).latent_bytes_per_token(),
                cu::LatentBytesPerToken(static_cast<cu::LatentFormat>(f), C, R))
          << engine::KvFormatName(f) << " " << C << "+" << R;
    }
  }
}

TEST(CudaLatentWrite, BadSlotIsFlaggedAndSkipped) {
  LS_REQUIRE_GPU();
  const int64_t C = 32, R = 8;
  const int64_t bpt = cu::LatentBytesPerToken(cu::LatentFormat::kFp8E4m3, C, R);
  std::vector<float> lat(2 * C, 1.0f), rope(2 * R, 1.0f);
  std::vector<int32_t> slots = {4, 0};  // 4 == num_slots
  std::vector<uint8_t> pool(4 * bpt, 0x11);
  auto dpool = Upload(pool), dlat = Upload(lat), drope = Upload(rope), dslots = Upload(slots);
  auto flag = Zeros<int32_t>(1);
  const cu::LatentWriteParams p = WriteParams(dlat.as<float>(), C, drope.as<float>(), R, dslots.as<int32_t>(),
                                              dpool.as<uint8_t>(), 4, 2, C, R, cu::LatentFormat::kFp8E4m3,
                                              flag.as<int32_t>());
  LS_ASSERT_OK(cu::WriteLatent(p));
  LS_ASSERT_OK(cu::Synchronize());
  EXPECT_EQ(Download<int32_t>(flag, 1)[0], cu::kErrSlot);
  const auto got = Download<uint8_t>(dpool, pool.size());
  for (int64_t i = bpt; i < 4 * bpt; ++i) ASSERT_EQ(got[i], 0x11) << i;
}

TEST(CudaLatentWrite, ValidationNamesTheField) {
  float f = 0;
  int32_t s = 0;
  uint8_t b = 0;
  const cu::LatentWriteParams p = WriteParams(&f, 4, &f, 1, &s, &b, 1, 1, 4, 2, cu::LatentFormat::kFp8E4m3, nullptr);
  Status st = cu::WriteLatent(p);
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(st.message().find("rope_stride"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace lockstep
