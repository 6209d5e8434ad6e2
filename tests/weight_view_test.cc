// tests/weight_view_test.cc — weights held as stored (issue 29): a view of each stored dtype
// reads exactly the fp32 values the loader's old fp32 copy held, and every product through a
// view — the CPU GEMM dequantising rows as it goes — is bit for bit the product over those old
// copies, for every gemm variant, on every fixture model and the embedded one.
//
// "The old copy" is written here from the formats' definitions, not with the kernels' code:
// bf16 and f16 widened by their bit layouts, e4m3 decoded from its fields (× the block's scale,
// one fp32 product), and gemm=bf16's copy rounded with F32ToBf16 as Model::Bf16Weights did.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>

#include "engine/engine.h"
#include "engine/model.h"
#include "engine/safetensors.h"
#include "engine/weights.h"
#include "kernels/cpu/numerics.h"
#include "kernels/cpu/ops.h"
#include "kernels/registry.h"
#include "test_util.h"

namespace lockstep::engine {
namespace {

using kernels::WeightDType;
using kernels::WeightRounding;
using kernels::WeightView;

// ---- The old copies, from the formats' definitions ------------------------------------------

float Bf16(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

float F16(uint16_t h) {  // sign, 5 exponent bits (bias 15), 10 mantissa bits
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 31) return m ? std::nanf("") : (s ? -INFINITY : INFINITY);
  v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return static_cast<float>(s ? -v : v);
}

float E4m3(uint8_t b) {  // e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return std::nanf("");
  const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return static_cast<float>(s ? -v : v);
}

// The fp32 values of a stored view, decoded from its bytes.
std::vector<float> OldCopy(const WeightView& w) {
  std::vector<float> out(w.size());
  for (int64_t r = 0; r < w.rows; ++r) {
    for (int64_t c = 0; c < w.cols; ++c) {
      const int64_t i = (w.row0 + r) * w.cols + c;
      float v = 0;
      switch (w.dtype) {
        case WeightDType::kF32: std::memcpy(&v, static_cast<const uint8_t*>(w.values) + 4 * i, 4); break;
        case WeightDType::kBf16: {
          uint16_t h;
          std::memcpy(&h, static_cast<const uint8_t*>(w.values) + 2 * i, 2);
          v = Bf16(h);
          break;
        }
        case WeightDType::kF16: {
          uint16_t h;
          std::memcpy(&h, static_cast<const uint8_t*>(w.values) + 2 * i, 2);
          v = F16(h);
          break;
        }
        case WeightDType::kFp8E4m3Blocks: {
          const int64_t scale_cols = (w.cols + w.block_cols - 1) / w.block_cols;
          float scale;
          std::memcpy(&scale,
                      static_cast<const uint8_t*>(w.scales) +
                          4 * (((w.row0 + r) / w.block_rows) * scale_cols + c / w.block_cols),
                      4);
          v = E4m3(static_cast<const uint8_t*>(w.values)[i]) * scale;
          break;
        }
        case WeightDType::kMxfp4:
        case WeightDType::kNvfp4:
          ADD_FAILURE() << "4-bit views are tests/fp4_test.cc's";  // no checkpoint of these models holds one
          break;
      }
      out[r * w.cols + c] = v;
    }
  }
  return out;
}

std::vector<float> RoundedToBf16(std::vector<float> v) {  // Model::Bf16Weights' copy
  for (float& x : v) x = kernels::Bf16ToF32(kernels::F32ToBf16(x));
  return v;
}

void ExpectSameBits(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
        << what << " element " << i << ": " << got[i] << " vs " << want[i];
  }
}

// ---- A hand-made checkpoint -----------------------------------------------------------------

class HandMadeCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("lockstep_weight_view_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  void Add(const std::string& name, const char* dtype, std::vector<int64_t> shape, const void* bytes, size_t n) {
    std::string sh;
    for (int64_t d : shape) {
      if (!sh.empty()) sh += ',';
      sh += std::to_string(d);
    }
    header_ += std::string(header_.size() > 1 ? "," : "") + "\"" + name + "\":{\"dtype\":\"" + dtype +
               "\",\"shape\":[" + sh + "],\"data_offsets\":[" + std::to_string(data_.size()) + "," +
               std::to_string(data_.size() + n) + "]}";
    data_.append(static_cast<const char*>(bytes), n);
  }
  std::unique_ptr<Checkpoint> Write() {
    std::string h = header_ + "}";
    while ((8 + h.size()) % 8 != 0) h += ' ';  // the data starts 8-aligned in the mapping
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((h.size() >> (8 * i)) & 0xff);
    std::ofstream(dir_ / "model.safetensors", std::ios::binary) << out << h << data_;
    auto ck = Checkpoint::Open(dir_);
    EXPECT_TRUE(ck.ok()) << ck.status().message();
    return ck.ok() ? std::move(*ck) : nullptr;
  }

  std::filesystem::path dir_;
  std::string header_ = "{", data_;
};

// Every stored dtype reads the values the old copy held — hand-derived ones first — in place
// where the file aligns the tensor (no copy of the weights), from an aligned copy where it
// does not; DecodeRows, one element at a time, sub-views of rows and gemm=bf16's rounding agree.
TEST_F(HandMadeCheckpoint, EachDTypeReadsTheOldCopysValues) {
  const float f32[6] = {1.0f, -0.0f, 3.5f, 1e-40f, INFINITY, -2.25f};
  Add("f32.weight", "F32", {2, 3}, f32, sizeof f32);  // offset 0
  // 1, −1, 3.140625, −123.5, 2^-133 (a subnormal), inf, −0, a signalling NaN
  const uint16_t bf16[8] = {0x3f80, 0xbf80, 0x4049, 0xc2f7, 0x0001, 0x7f80, 0x8000, 0x7f81};
  Add("bf16.weight", "BF16", {2, 4}, bf16, sizeof bf16);  // offset 24
  // 1, −2, 2^-24 (the smallest subnormal), 65504 (the largest finite), 0.333251953125
  const uint16_t f16[5] = {0x3c00, 0xc000, 0x0001, 0x7bff, 0x3555};
  Add("f16.weight", "F16", {1, 5}, f16, sizeof f16);  // offset 40
  const uint8_t pad = 0;
  Add("pad", "U8", {1}, &pad, 1);                         // offset 50: what follows is misaligned
  Add("bf16_odd.weight", "BF16", {1, 2}, bf16 + 2, 4);   // offset 51
  Add("f32_odd.weight", "F32", {1, 2}, f32 + 2, 8);      // offset 55
  // FP8 [130, 132]: four blocks of 128 × 128 (two of them partial), scales [2, 2].
  const int64_t R = 130, C = 132;
  std::vector<uint8_t> fp8(R * C);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) fp8[r * C + c] = static_cast<uint8_t>((r * 31 + c * 7) % 256);
  }
  fp8[0] = 0x38;              // 1 × 0.5
  fp8[128] = 0x7e;            // 448 × 2
  fp8[129 * C] = 0xb8;        // −1 × 0.25
  fp8[129 * C + 131] = 0x01;  // 2^-9 × 3
  fp8[1 * C + 1] = 0x7f;      // NaN
  Add("fp8.weight", "F8_E4M3", {R, C}, fp8.data(), fp8.size());  // offset 63
  const float scales[4] = {0.5f, 2.0f, 0.25f, 3.0f};
  Add("fp8.weight_scale_inv", "F32", {2, 2}, scales, sizeof scales);  // offset 17223: misaligned
  auto ck = Write();
  ASSERT_NE(ck, nullptr);

  struct Case {
    const char* name;
    WeightDType dtype;
    bool in_place;
    std::vector<float> hand;  // hand-derived leading values (NaN: any NaN)
  };
  const Case cases[] = {
      {"f32.weight", WeightDType::kF32, true, {1.0f, -0.0f, 3.5f, 1e-40f, INFINITY, -2.25f}},
      {"bf16.weight", WeightDType::kBf16, true, {1.0f, -1.0f, 3.140625f, -123.5f, std::ldexp(1.0f, -133), INFINITY, -0.0f, NAN}},
      {"f16.weight", WeightDType::kF16, true, {1.0f, -2.0f, std::ldexp(1.0f, -24), 65504.0f, 0.333251953125f}},
      {"bf16_odd.weight", WeightDType::kBf16, false, {3.140625f, -123.5f}},
      {"f32_odd.weight", WeightDType::kF32, false, {3.5f, 1e-40f}},
      {"fp8.weight", WeightDType::kFp8E4m3Blocks, true, {0.5f}},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    auto m = LoadMatrix(*ck, k.name);
    ASSERT_TRUE(m.ok()) << m.status().message();
    const WeightView& v = m->data;
    EXPECT_EQ(v.dtype, k.dtype);
    const TensorView* t = ck->Find(k.name);
    EXPECT_EQ(v.values == t->data, k.in_place) << "in place (no copy) exactly when the file aligns the tensor";
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.values) % (kernels::ElementBits(v.dtype) / 8), 0u);
    const std::vector<float> old = OldCopy(v);
    for (size_t i = 0; i < k.hand.size(); ++i) {
      if (std::isnan(k.hand[i])) {
        EXPECT_TRUE(std::isnan(old[i])) << i;
      } else {
        EXPECT_EQ(std::bit_cast<uint32_t>(old[i]), std::bit_cast<uint32_t>(k.hand[i])) << i;
      }
    }
    std::vector<float> one(v.size());
    for (size_t i = 0; i < v.size(); ++i) one[i] = v[static_cast<int64_t>(i)];
    ExpectSameBits(one, old, "operator[]");
    ExpectSameBits(m->Dequantized(), old, "DecodeRows");
    std::vector<float> rounded(v.size());
    v.DecodeRows(0, v.rows, rounded.data(), WeightRounding::kBf16);
    ExpectSameBits(rounded, RoundedToBf16(old), "DecodeRows, rounded to bf16");
    if (v.rows > 1) {
      const Matrix tail = m->Rows(1, v.rows - 1);
      ExpectSameBits(tail.Dequantized(), std::vector<float>(old.begin() + v.cols, old.end()), "Rows(1, …)");
    }
  }
  // The FP8 matrix's blocks, element by element: value × its block's scale.
  auto m = LoadMatrix(*ck, "fp8.weight");
  ASSERT_TRUE(m.ok());
  ASSERT_NE(m->fp8, nullptr);
  EXPECT_EQ(m->fp8->values.data(), ck->Find("fp8.weight")->data);
  EXPECT_EQ(m->data.at(0, 128), 896.0f);
  EXPECT_EQ(m->data.at(129, 0), -0.25f);
  EXPECT_EQ(m->data.at(129, 131), 0.005859375f);
  EXPECT_TRUE(std::isnan(m->data.at(1, 1)));
  std::vector<float> blocks(R * C);
  m->fp8->Dequantize(blocks.data());
  ExpectSameBits(blocks, OldCopy(m->data), "Fp8Blocks::Dequantize");
  // gemm=bf16 on a signalling bf16 NaN: the old copy's F32ToBf16 made it quiet (0x7fc1).
  auto b = LoadMatrix(*ck, "bf16.weight");
  ASSERT_TRUE(b.ok());
  float row1[4];
  b->data.DecodeRows(1, 1, row1, WeightRounding::kBf16);
  EXPECT_EQ(std::bit_cast<uint32_t>(row1[3]), 0x7fc10000u);
  // The Matrix keeps the mapping: it reads the same after the checkpoint is gone.
  const std::vector<float> before = m->Dequantized();
  ck.reset();
  ExpectSameBits(m->Dequantized(), before, "after the Checkpoint closed");
}

// DeepSeek's official spellings, through the loader every family uses (LoadConfiguredMatrix):
// FP8 with `<p>.scale` in F8_E8M0, MXFP4 and NVFP4 experts, hand-computed values, the logical
// shape, the companions marked used, and wrong tensors as one line naming them.
TEST_F(HandMadeCheckpoint, OfficialScalesAnd4BitFormatsLoadThroughTheConfiguredLoader) {
  // FP8 [2, 2] with one block; E8M0 scale byte 126 = 2^−1.
  const uint8_t fp8[4] = {0x38, 0xb8, 0x40, 0x00};  // 1, −1, 2, 0
  Add("a.weight", "F8_E4M3", {2, 2}, fp8, 4);
  const uint8_t e8m0 = 126;
  Add("a.scale", "F8_E8M0", {1, 1}, &e8m0, 1);
  // MXFP4 [1, 32]: codes 0..15 then 15..0 packed low nibble first, scale byte 128 = 2.
  uint8_t mx[16];
  for (int j = 0; j < 16; ++j) {
    const int lo = (2 * j) < 16 ? 2 * j : 31 - 2 * j, hi = (2 * j + 1) < 16 ? 2 * j + 1 : 30 - 2 * j;
    mx[j] = static_cast<uint8_t>(lo | (hi << 4));
  }
  Add("m.weight", "I8", {1, 16}, mx, 16);
  const uint8_t mscale = 128;
  Add("m.scale", "F8_E8M0", {1, 1}, &mscale, 1);
  // NVFP4 [1, 16]: code 2 (1.0) everywhere, block scale e4m3 0x40 (2), weight_scale_2 0.25.
  uint8_t nv[8];
  std::memset(nv, 0x22, 8);
  Add("n.weight", "U8", {1, 8}, nv, 8);
  const uint8_t nscale = 0x40;
  Add("n.weight_scale", "F8_E4M3", {1, 1}, &nscale, 1);
  const float s2 = 0.25f;
  Add("n.weight_scale_2", "F32", {}, &s2, 4);
  Add("n.input_scale", "F32", {}, &s2, 4);
  // A 4-bit weight whose scale tensor has the wrong shape.
  Add("bad.weight", "U8", {1, 16}, mx, 16);
  const uint8_t two[2] = {127, 127};
  Add("bad.scale", "F8_E8M0", {1, 2}, two, 2);
  auto ck = Write();
  ASSERT_NE(ck, nullptr);
  ModelConfig c;
  ModelWeights w;
  std::set<std::string> used;
  Matrix m;

  ASSERT_TRUE(LoadConfiguredMatrix(*ck, c, "a.weight", {2, 2}, &m, &w, &used).ok());
  ASSERT_NE(m.fp8, nullptr);
  EXPECT_EQ(m.data.at(0, 0), 0.5f);
  EXPECT_EQ(m.data.at(0, 1), -0.5f);
  EXPECT_EQ(m.data.at(1, 0), 1.0f);
  EXPECT_EQ(w.fp8_tensors, 1);

  ASSERT_TRUE(LoadConfiguredMatrix(*ck, c, "m.weight", {1, 32}, &m, &w, &used).ok());
  EXPECT_EQ(m.data.dtype, WeightDType::kMxfp4);
  const float e2m1[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int i = 0; i < 32; ++i) {
    const int code = i < 16 ? i : 31 - i;
    const float want = (code < 8 ? e2m1[code] : -e2m1[code - 8]) * 2.0f;
    EXPECT_EQ(std::bit_cast<uint32_t>(m.data.at(0, i)), std::bit_cast<uint32_t>(want)) << i;
  }
  ASSERT_TRUE(LoadConfiguredMatrix(*ck, c, "n.weight", {1, 16}, &m, &w, &used).ok());
  EXPECT_EQ(m.data.dtype, WeightDType::kNvfp4);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(m.data.at(0, i), 0.5f) << i;  // 1 × 2 × 0.25
  EXPECT_EQ(w.dtype_counts["MXFP4"], 1);
  EXPECT_EQ(w.dtype_counts["NVFP4"], 1);
  for (const char* n : {"a.weight", "a.scale", "m.weight", "m.scale", "n.weight", "n.weight_scale",
                        "n.weight_scale_2", "n.input_scale"}) {
    EXPECT_EQ(used.count(n), 1u) << n;
  }

  // The stored [1, 16] bytes are [1, 32] values: the config's [1, 16] is a wrong shape, said so.
  Status st = LoadConfiguredMatrix(*ck, c, "m.weight", {1, 16}, &m, &w, &used);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("tensor 'm.weight': shape [1, 16] (MXFP4: [1, 32] values, two a byte) but config.json implies [1, 16]"),
            std::string::npos) << st.message();
  st = LoadConfiguredMatrix(*ck, c, "bad.weight", {1, 32}, &m, &w, &used);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("tensor 'bad.scale': shape [1, 2], expected [1, 1] (MXFP4 block scales)"),
            std::string::npos) << st.message();
  EXPECT_EQ(st.message().find('\n'), std::string::npos);
}

// ---- Products through views against products over the old copies ----------------------------

std::vector<std::string> AllModelDirs() {
  std::vector<std::string> dirs;
  for (const auto& f : testing::ModelFixtures()) dirs.push_back((testing::FixtureDir() / "models" / f).string());
  dirs.push_back((testing::SourceDir() / "models" / "lockstep-tiny-v32").string());
  return dirs;
}

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// y = x·wᵀ through the view and over the old copy, for one row (the decode path), a block of
// four, and rows left over: the same bits.
void ExpectSameProducts(const WeightView& w, WeightRounding round, const std::vector<float>& old,
                        const std::string& what) {
  for (int64_t rows : {1, 3, 4, 6}) {
    const std::vector<float> x = Random(rows * w.cols, static_cast<uint32_t>(rows * 7919 + w.cols));
    std::vector<float> a(rows * w.rows), b(rows * w.rows);
    kernels::cpu::MatMulNT(x.data(), rows, w, round, a.data());
    kernels::cpu::MatMulNT(x.data(), rows, old.data(), w.rows, w.cols, b.data());
    ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << what << ", " << rows << " rows";
  }
}

// Every matrix of every checkpoint (each 2-D or stacked tensor), each weight transform a gemm
// variant applies — as stored (fp32, *_dot, *_heuristic; fp8_dot and w8a8_dot on an FP8
// checkpoint), rounded to bf16 (bf16, bf16_dot, bf16_heuristic), quantised to FP8 blocks
// (fp8_dot and w8a8_dot on any other checkpoint) — and views of some of its rows (the
// attention's W_UV slices, the fused experts).
TEST(WeightView, ProductsEqualProductsOverTheOldCopies) {
  int64_t matrices = 0;
  for (const std::string& dir : AllModelDirs()) {
    SCOPED_TRACE(dir);
    auto config = ModelConfig::Load(dir);
    ASSERT_TRUE(config.ok()) << config.status().message();
    auto ck = Checkpoint::Open(dir);
    ASSERT_TRUE(ck.ok()) << ck.status().message();
    for (const auto& [name, t] : (*ck)->tensors()) {
      if (t.shape.size() < 2 || name.ends_with("_scale_inv")) continue;
      auto m = LoadMatrix(**ck, name, config->fp8_block_rows > 0 ? config->fp8_block_rows : 128,
                          config->fp8_block_cols > 0 ? config->fp8_block_cols : 128);
      ASSERT_TRUE(m.ok()) << m.status().message();
      const WeightView& v = m->data;
      const std::vector<float> old = OldCopy(v);
      ExpectSameProducts(v, WeightRounding::kAsStored, old, name + " as stored");
      ExpectSameProducts(v, WeightRounding::kBf16, RoundedToBf16(old), name + " rounded to bf16");
      if (v.dtype != WeightDType::kFp8E4m3Blocks) {  // fp8_dot's quantisation (Model::Fp8Weights)
        const Fp8Blocks f = Fp8Blocks::Quantize(old.data(), v.rows, v.cols);
        std::vector<float> deq(v.size());
        f.Dequantize(deq.data());
        const Matrix q = Matrix::FromFp8(std::make_shared<const Fp8Blocks>(
            Fp8Blocks::Quantize(m->Dequantized().data(), v.rows, v.cols)));
        ExpectSameProducts(q.data, WeightRounding::kAsStored, deq, name + " quantised to FP8");
      }
      if (v.rows >= 3) {
        const Matrix mid = m->Rows(1, v.rows - 2);
        const std::vector<float> old_mid(old.begin() + v.cols, old.end() - v.cols);
        ExpectSameProducts(mid.data, WeightRounding::kAsStored, old_mid, name + " rows 1 …");
        ExpectSameProducts(mid.data, WeightRounding::kBf16, RoundedToBf16(old_mid), name + " rows 1 …, bf16");
      }
      ++matrices;
    }
  }
  EXPECT_GT(matrices, 400);
}

// ---- Whole runs: the model over views against the model over the old copies ----------------

// `w` with every matrix replaced by an fp32 copy of its old values (rounded to bf16 where
// gemm=bf16's copy was): the representation the engine computed with before views.
ModelWeights OldFp32Weights(const ModelWeights& w, bool bf16) {
  ModelWeights old = w;
  auto fp32 = [](Matrix& m, bool round) {
    if (m.empty()) return;
    std::vector<float> v = OldCopy(m.data);
    if (round) v = RoundedToBf16(std::move(v));
    std::shared_ptr<const Fp8Blocks> fp8 = m.fp8;
    m = Matrix::Fp32(std::move(v), m.rows, m.cols);
    m.fp8 = fp8;  // an FP8 checkpoint's forms, as the old loader kept them beside the fp32 copy
  };
  fp32(old.embed, false);
  fp32(old.final_norm, false);
  for (auto& L : old.layers) {
    for (Matrix* m : {&L.input_norm, &L.post_attn_norm, &L.q_a_norm, &L.kv_a_norm, &L.indexer.k_norm_w,
                      &L.indexer.k_norm_b, &L.router, &L.router_bias}) {
      fp32(*m, false);
    }
  }
  ForEachProductMatrix(old, [&](Matrix& m) { fp32(m, bf16); });
  return old;
}

struct RunResult {
  std::vector<float> prompt_logits, last_logits;
  std::vector<int32_t> generated;
};

RunResult Generate(const std::shared_ptr<Model>& m, const kernels::KernelChoice& kernels) {
  EngineOptions o;
  o.kernels = kernels;
  auto e = Engine::Create(m, o);
  EXPECT_TRUE(e.ok()) << e.status().message();
  if (!e.ok()) return {};
  Request r;
  const int64_t V = m->config().vocab_size;
  for (int32_t t : {5, 9, 13, 2, 7, 11, 3, 17, 1, 4}) r.prompt.push_back(static_cast<int32_t>(t % V));
  r.max_new_tokens = 4;
  r.all_prompt_logits = true;
  EXPECT_TRUE((*e)->AddRequest(r).ok());
  EXPECT_TRUE((*e)->RunToCompletion().ok());
  const RequestState& s = (*e)->request(0);
  return {s.prompt_logits, s.last_logits, s.generated};
}

// Every CPU gemm variant, with the expanded and the absorbed attention forms in prefill and in
// decode: the prompt's logits, the generated tokens and the last logits are the old copies'
// run's, bit for bit.
TEST(WeightView, RunsEqualRunsOverTheOldCopies) {
  std::vector<std::string> gemms;
  for (const auto& v : kernels::Registry::Get().variants()) {
    // mxfp4_dot / nvfp4_dot hold DeepSeek-V4's routed experts (kernels/fp4.h; tests/fp4_test.cc):
    // they declare model_types, and these models' engines refuse them, checked below.
    const bool fp4 = v.name == "mxfp4_dot" || v.name == "nvfp4_dot";
    if (fp4) EXPECT_EQ(v.model_types, std::vector<std::string>{"deepseek_v4"}) << v.op << "=" << v.name;
    if (v.op == "gemm" && v.backend == "cpu" && !v.fault && !fp4) gemms.push_back(v.name);
  }
  ASSERT_GE(gemms.size(), 6u);
  for (const std::string& dir : AllModelDirs()) {
    auto views = Model::Load(dir);
    ASSERT_TRUE(views.ok()) << views.status().message();
    for (const char* fp4 : {"mxfp4_dot", "nvfp4_dot"}) {
      EngineOptions o;
      o.kernels = {{"gemm", fp4}};
      auto e = Engine::Create(*views, o);
      ASSERT_FALSE(e.ok()) << dir << " gemm=" << fp4 << " ran at another precision";
      EXPECT_NE(e.status().message().find("--kernel gemm=" + std::string(fp4) + ": runs on model_type deepseek_v4; this model is "),
                std::string::npos)
          << e.status().message();
    }
    auto old32 = Model::FromParts((*views)->config(), OldFp32Weights((*views)->weights(), false));
    auto old16 = Model::FromParts((*views)->config(), OldFp32Weights((*views)->weights(), true));
    ASSERT_TRUE(old32.ok() && old16.ok());
    for (const std::string& gemm : gemms) {
      const bool bf16 = gemm.rfind("bf16", 0) == 0;  // the variants Model::Bf16Weights served
      for (const kernels::KernelChoice& attn :
           {kernels::KernelChoice{}, kernels::KernelChoice{{"attn_prefill", "absorbed"}, {"attn_decode", "expanded"}}}) {
        kernels::KernelChoice k = attn;
        k["gemm"] = gemm;
        const std::string what = dir + " gemm=" + gemm + (attn.empty() ? "" : " prefill absorbed, decode expanded");
        const RunResult a = Generate(*views, k), b = Generate(bf16 ? *old16 : *old32, k);
        ASSERT_FALSE(a.prompt_logits.empty()) << what;
        ASSERT_EQ(a.prompt_logits.size(), b.prompt_logits.size()) << what;
        EXPECT_EQ(0, std::memcmp(a.prompt_logits.data(), b.prompt_logits.data(), a.prompt_logits.size() * 4)) << what;
        EXPECT_EQ(a.generated, b.generated) << what;
        ASSERT_EQ(a.last_logits.size(), b.last_logits.size()) << what;
        EXPECT_EQ(0, std::memcmp(a.last_logits.data(), b.last_logits.data(), a.last_logits.size() * 4)) << what;
      }
    }
  }
}

}  // namespace
}  // namespace lockstep::engine
