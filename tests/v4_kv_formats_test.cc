// tests/v4_kv_formats_test.cc — DeepSeek-V4's KV-cache byte formats (kernels/v4_kv_formats.h).
//
// The sizes are checked by hand (584 / 1024 / 2048 B a token, a 64-token MODEL1 page of 37,440 B,
// 132 B indexer keys). Then against tools/fixtures/v4_kv_formats.py — an encoder written from
// FlashMLA's tests/quant.py MODEL1 layout and vLLM's indexer cache, sharing nothing with the C++ —
// whose file (CTest fixture v4_kv_formats_fixture) holds fp32 rows and the pages it encoded them
// to, on random rows and edge rows (zeros, ±0, values that flush, huge values, a NaN or an
// infinity in a tile, e4m3 ties, scales exactly at a power of two and just above it, bf16
// overflow): our pages must equal its pages byte for byte, pad bytes included, and our decode of
// them must be within each format's rounding bound of the inputs (NaN exactly where the format
// stores NaN).
#include <gtest/gtest.h>

#include <bit>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>

#include "engine/safetensors.h"
#include "kernels/cpu/numerics.h"
#include "kernels/v4_kv_formats.h"

namespace lockstep::kernels {
namespace {

TEST(V4KvFormats, SizesAsTheEnginesLayThemOut) {
  const V4RowShape v4;  // 512, 64
  EXPECT_EQ(v4.token_bytes(V4KvFormat::kFp8Model1), 584);
  EXPECT_EQ(v4.model1_data_bytes(), 576);
  EXPECT_EQ(v4.model1_scale_bytes(), 8);
  EXPECT_EQ(v4.tiles(), 7);
  EXPECT_EQ(v4.token_bytes(V4KvFormat::kBf16), 1024);
  EXPECT_EQ(v4.token_bytes(V4KvFormat::kFp32), 2048);
  EXPECT_EQ(v4.page_bytes(V4KvFormat::kFp8Model1, 64), 37440);  // 64·584 = 37376 → 65·576
  EXPECT_EQ(v4.page_bytes(V4KvFormat::kFp8Model1, 72), 72 * 584);  // already a multiple of 576
  EXPECT_EQ(v4.page_bytes(V4KvFormat::kBf16, 64), 65536);
  EXPECT_EQ(IndexKeyTokenBytes(V4IndexKeyFormat::kFp8, 128), 132);
  EXPECT_EQ(IndexKeyTokenBytes(V4IndexKeyFormat::kFp32, 128), 512);
  EXPECT_EQ(IndexKeyPageBytes(V4IndexKeyFormat::kFp8, 128, 64), 8448);
  EXPECT_TRUE(CheckV4RowShape(v4).ok());
  EXPECT_FALSE(CheckV4RowShape({64, 64}).ok());
  EXPECT_EQ(*ParseV4KvFormat("fp8_e4m3"), V4KvFormat::kFp8Model1);
  EXPECT_EQ(*ParseV4KvFormat("fp8_model1"), V4KvFormat::kFp8Model1);
  auto bad = ParseV4KvFormat("fp4", "--kv-cache");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(),
            "--kv-cache fp4: unknown DeepSeek-V4 KV-cache format (fp32, bf16, fp8_model1 — alias fp8_e4m3)");
  EXPECT_FALSE(ParseV4IndexKeyFormat("bf16").ok());
}

// Hand-computed MODEL1 token: the offsets of its parts inside a 2-token page.
TEST(V4KvFormats, Model1TokenByHand) {
  const V4RowShape s;
  std::vector<float> row(512, 0.0f);
  row[0] = 1.0f;     // tile 0: amax 1 → 1/448 → s = 2^−8 (2^−9 < 1/448 ≤ 2^−8); 1 / 2^−8 = 256 = e4m3 0x78
  row[64] = -448.0f; // tile 1: amax/448 = 1 → s = 1; −448 = 0xFE
  row[448] = 1.5f;   // rope: bf16 0x3FC0
  std::vector<uint8_t> page(static_cast<size_t>(s.page_bytes(V4KvFormat::kFp8Model1, 2)), 0xAA);
  EncodeV4Row(V4KvFormat::kFp8Model1, s, 2, 1, row.data(), page.data());
  EXPECT_EQ(page.size(), 1728u);  // 2·584 = 1168 → 3·576
  EXPECT_EQ(page[576 + 0], 0x78);
  EXPECT_EQ(page[576 + 64], 0xFE);
  EXPECT_EQ(page[576 + 1], 0x00);
  EXPECT_EQ(page[576 + 448], 0xC0);  // little-endian bf16 0x3FC0
  EXPECT_EQ(page[576 + 449], 0x3F);
  const size_t slot1 = 2 * 576 + 8;  // the scale slots follow both data parts
  EXPECT_EQ(page[slot1 + 0], 127 - 8);
  EXPECT_EQ(page[slot1 + 1], 127);
  EXPECT_EQ(page[slot1 + 2], 127 - 13);  // an all-zero tile: the 1e-4 floor, 2^−13
  EXPECT_EQ(page[slot1 + 7], 0);         // pad
  EXPECT_EQ(page[0], 0xAA);              // token 0's bytes untouched
  EXPECT_EQ(page[2 * 576], 0xAA);        // token 0's scale slot untouched
  std::vector<float> back(512);
  DecodeV4Row(V4KvFormat::kFp8Model1, s, 2, 1, page.data(), back.data());
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[64], -448.0f);
  EXPECT_EQ(back[448], 1.5f);
  // The exponent rules at their edges.
  const float p2 = 448.0f * std::ldexp(1.0f, -5);
  EXPECT_EQ(Model1TileExponent(&p2, 1), -5);
  const float above = std::nextafter(p2, 1e9f);
  EXPECT_EQ(Model1TileExponent(&above, 1), -4);
  const float nan = NAN;
  EXPECT_EQ(Model1TileExponent(&nan, 1), INT_MIN);
  const float tiny = 1e-30f;
  EXPECT_EQ(Model1TileExponent(&tiny, 1), -13);
  EXPECT_EQ(IndexKeyTileExponent(&tiny, 1), -22);  // ⌈log2(1e-4 / 448)⌉
}

class KvFile : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string path = std::string(LOCKSTEP_PY_FIXTURES) + "/v4_kv_formats.safetensors";
    auto f = engine::SafetensorsFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status().message() << " (written by CTest's v4_kv_formats_fixture: "
                        << "/usr/bin/python3 tools/fixtures/v4_kv_formats.py --out " << path << ")";
    file_ = f->release();
  }
  void SetUp() override { ASSERT_NE(file_, nullptr) << "the Python fixture file did not open"; }
  static void TearDownTestSuite() {
    delete file_;
    file_ = nullptr;
  }
  static const engine::TensorView& T(const std::string& name) {
    static const engine::TensorView kNone;
    auto it = file_->tensors().find(name);
    EXPECT_NE(it, file_->tensors().end()) << name;
    return it == file_->tensors().end() ? kNone : it->second;
  }
  struct Case {
    int64_t page_size, dim, rope, tokens, page_bytes;
    std::vector<float> rows;
    const uint8_t* py_pages;
  };
  static Case Load(const std::string& name) {
    Case c{};
    const engine::TensorView& shape = T(name + ".shape");
    int64_t sh[3] = {};
    if (shape.nbytes == sizeof(sh)) std::memcpy(sh, shape.data, sizeof(sh));
    c.page_size = sh[0];
    c.dim = sh[1];
    c.rope = sh[2];
    const engine::TensorView& rows = T(name + ".rows");
    c.tokens = rows.shape.empty() ? 0 : rows.shape[0];
    c.rows.resize(rows.nbytes / 4);
    if (rows.data != nullptr) std::memcpy(c.rows.data(), rows.data, rows.nbytes);
    const engine::TensorView& pages = T(name + ".pages");
    c.page_bytes = pages.shape.size() == 2 ? pages.shape[1] : 0;
    c.py_pages = pages.data;
    return c;
  }
  // Compares `mine` (all pages) with the Python pages; returns the number of differing bytes.
  static int64_t CompareBytes(const std::string& name, const std::vector<uint8_t>& mine, const uint8_t* py) {
    int64_t diffs = 0;
    for (size_t i = 0; i < mine.size(); ++i) {
      if (mine[i] != py[i] && ++diffs <= 5) {
        ADD_FAILURE() << name << " byte " << i << ": C++ 0x" << std::hex << int(mine[i]) << ", Python 0x" << int(py[i]);
      }
    }
    return diffs;
  }
  static engine::SafetensorsFile* file_;
};
engine::SafetensorsFile* KvFile::file_ = nullptr;

// |x − d| within the FP8 bound for scale exponent k (or NaN where the tile is NaN).
void ExpectFp8Bound(float x, float d, int k, const std::string& where) {
  if (k == INT_MIN) {
    EXPECT_TRUE(std::isnan(d)) << where;
    return;
  }
  const double s = std::ldexp(1.0, k);
  if (std::isinf(d) && !std::isinf(x)) {  // e4m3(x/s)·s rounded past fp32's largest (x near 3.4e38)
    EXPECT_GE(std::fabs(static_cast<double>(x)) * (1 + 1.0 / 16), std::numeric_limits<float>::max())
        << where << ": x " << x << " decoded " << d;
    EXPECT_EQ(std::signbit(x), std::signbit(d)) << where;
    return;
  }
  const double bound = std::max(std::ldexp(std::fabs(static_cast<double>(x)), -4), std::ldexp(s, -10));
  EXPECT_LE(std::fabs(static_cast<double>(x) - d), bound) << where << ": x " << x << " decoded " << d;
  if (x == 0.0f) {
    EXPECT_EQ(std::signbit(x), std::signbit(d)) << where << ": the sign of zero";
  }
}

void ExpectBf16Bound(float x, float d, const std::string& where) {
  if (std::isnan(x)) {
    EXPECT_TRUE(std::isnan(d)) << where;
  } else if (std::fabs(static_cast<double>(x)) >= std::ldexp(2.0 - 1.0 / 256, 127)) {  // bf16's largest + half an ulp: ±inf
    EXPECT_TRUE(std::isinf(d) && std::signbit(d) == std::signbit(x)) << where;
  } else {
    EXPECT_LE(std::fabs(static_cast<double>(x) - d), std::ldexp(std::fabs(static_cast<double>(x)), -8)) << where;
  }
}

TEST_F(KvFile, Model1PagesEqualThePythonEncodersBytes) {
  int nan_tiles = 0;
  for (const char* name : {"model1.v4", "model1.tiny", "model1.p3"}) {
    const Case c = Load(name);
    const V4RowShape s{c.dim, c.rope};
    ASSERT_EQ(s.page_bytes(V4KvFormat::kFp8Model1, c.page_size), c.page_bytes) << name << ": page size";
    const int64_t pages = c.tokens / c.page_size;
    std::vector<uint8_t> mine(static_cast<size_t>(pages * c.page_bytes), 0);
    for (int64_t t = 0; t < c.tokens; ++t) {
      EncodeV4Row(V4KvFormat::kFp8Model1, s, c.page_size, t % c.page_size, &c.rows[t * c.dim],
                  mine.data() + (t / c.page_size) * c.page_bytes);
    }
    EXPECT_EQ(CompareBytes(name, mine, c.py_pages), 0) << name;
    std::vector<float> d(static_cast<size_t>(c.dim));
    for (int64_t t = 0; t < c.tokens; ++t) {
      DecodeV4Row(V4KvFormat::kFp8Model1, s, c.page_size, t % c.page_size, mine.data() + (t / c.page_size) * c.page_bytes,
                  d.data());
      const float* x = &c.rows[t * c.dim];
      for (int64_t j = 0; j < s.tiles(); ++j) {
        const int64_t lo = j * kModel1Tile, hi = std::min(s.nope(), lo + kModel1Tile);
        const int k = Model1TileExponent(x + lo, hi - lo);
        nan_tiles += k == INT_MIN;
        for (int64_t i = lo; i < hi; ++i) ExpectFp8Bound(x[i], d[i], k, std::string(name) + " token " + std::to_string(t) + " value " + std::to_string(i));
      }
      for (int64_t i = s.nope(); i < c.dim; ++i) ExpectBf16Bound(x[i], d[i], std::string(name) + " rope " + std::to_string(i));
    }
  }
  EXPECT_GE(nan_tiles, 6) << "the edge rows' NaN and infinity tiles";
}

TEST_F(KvFile, Bf16PagesEqualThePythonEncodersBytes) {
  const Case c = Load("bf16.v4");
  const V4RowShape s{c.dim, c.rope};
  ASSERT_EQ(s.page_bytes(V4KvFormat::kBf16, c.page_size), c.page_bytes);
  std::vector<uint8_t> mine(static_cast<size_t>(c.tokens / c.page_size * c.page_bytes), 0);
  for (int64_t t = 0; t < c.tokens; ++t) {
    EncodeV4Row(V4KvFormat::kBf16, s, c.page_size, t % c.page_size, &c.rows[t * c.dim],
                mine.data() + (t / c.page_size) * c.page_bytes);
  }
  EXPECT_EQ(CompareBytes("bf16.v4", mine, c.py_pages), 0);
  std::vector<float> d(static_cast<size_t>(c.dim));
  for (int64_t t = 0; t < c.tokens; ++t) {
    DecodeV4Row(V4KvFormat::kBf16, s, c.page_size, t % c.page_size, mine.data() + (t / c.page_size) * c.page_bytes, d.data());
    for (int64_t i = 0; i < c.dim; ++i) ExpectBf16Bound(c.rows[t * c.dim + i], d[i], "bf16 token " + std::to_string(t));
  }
}

TEST_F(KvFile, IndexKeyPagesEqualThePythonEncodersBytes) {
  for (const char* name : {"index.v4", "index.tiny"}) {
    const Case c = Load(name);
    ASSERT_EQ(IndexKeyPageBytes(V4IndexKeyFormat::kFp8, c.dim, c.page_size), c.page_bytes) << name;
    std::vector<uint8_t> mine(static_cast<size_t>(c.tokens / c.page_size * c.page_bytes), 0);
    for (int64_t t = 0; t < c.tokens; ++t) {
      EncodeIndexKey(V4IndexKeyFormat::kFp8, c.dim, c.page_size, t % c.page_size, &c.rows[t * c.dim],
                     mine.data() + (t / c.page_size) * c.page_bytes);
    }
    EXPECT_EQ(CompareBytes(name, mine, c.py_pages), 0) << name;
    std::vector<float> d(static_cast<size_t>(c.dim));
    for (int64_t t = 0; t < c.tokens; ++t) {
      DecodeIndexKey(V4IndexKeyFormat::kFp8, c.dim, c.page_size, t % c.page_size,
                     mine.data() + (t / c.page_size) * c.page_bytes, d.data());
      const float* x = &c.rows[t * c.dim];
      for (int64_t lo = 0; lo < c.dim; lo += kIndexKeyTile) {
        const int64_t hi = std::min(c.dim, lo + kIndexKeyTile);
        const int k = IndexKeyTileExponent(x + lo, hi - lo);
        for (int64_t i = lo; i < hi; ++i) ExpectFp8Bound(x[i], d[i], k, std::string(name) + " token " + std::to_string(t));
      }
    }
  }
}

TEST(V4KvFormats, Fp32FormatsRoundTripExactly) {
  const V4RowShape s{32, 8};
  std::vector<float> row(32), back(32);
  for (int i = 0; i < 32; ++i) row[i] = std::ldexp(1.0f + i / 37.0f, i - 16) * (i % 2 ? -1.0f : 1.0f);
  row[5] = NAN;
  std::vector<uint8_t> page(static_cast<size_t>(s.page_bytes(V4KvFormat::kFp32, 4)));
  EncodeV4Row(V4KvFormat::kFp32, s, 4, 3, row.data(), page.data());
  DecodeV4Row(V4KvFormat::kFp32, s, 4, 3, page.data(), back.data());
  EXPECT_EQ(std::memcmp(row.data(), back.data(), 128), 0);
  std::vector<uint8_t> kp(static_cast<size_t>(IndexKeyPageBytes(V4IndexKeyFormat::kFp32, 32, 4)));
  EncodeIndexKey(V4IndexKeyFormat::kFp32, 32, 4, 2, row.data(), kp.data());
  DecodeIndexKey(V4IndexKeyFormat::kFp32, 32, 4, 2, kp.data(), back.data());
  EXPECT_EQ(std::memcmp(row.data(), back.data(), 128), 0);
  EXPECT_EQ(std::memcmp(kp.data() + 2 * 128, row.data(), 128), 0);  // token-major
}

}  // namespace
}  // namespace lockstep::kernels
