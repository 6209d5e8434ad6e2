// tests/fp4_formats_test.cc — the C++ 4-bit expert formats against the independent Python codec.
//
// tools/fixtures/fp4_formats.py (numpy, written from the OCP MX and ModelOpt NVFP4 specs) writes a
// safetensors file (CTest's fixture fp4_formats_fixture) of quantised matrices in the published
// dtypes — edge-case bytes (every E2M1 code, E8M0 0/1/254/255, every E4M3 scale byte) and matrices
// it quantised from fp32 sources — with the values it decodes them to. Here the file is read with
// the engine's safetensors reader, each matrix becomes a view through the loader's functions
// (Mxfp4View / Nvfp4View), and
//   * its decoded rows equal the Python decoder's values bit for bit (NaN where it has NaN);
//   * the C++ quantisers, given the same fp32 sources, write the same bytes as the Python ones.
// And the checkpoint tool (fixture fp4_tool_fixture: `fp4_formats.py tool-test`, a synthetic
// checkpoint with HF-stacked experts in F32 and BF16 and an official-named one, run through
// `quantize` to MXFP4 and NVFP4 with fp32 twins): every expert projection of the quantised
// directory loads by its published name (Fp4ExpertPrefix) through the loader's functions, its rows
// equal the twin's (the source's names and stacking, experts decoded by Python) bit for bit, and
// they are the source's gate / up / down rows to within the format's rounding.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>

#include "engine/safetensors.h"
#include "engine/weights.h"
#include "kernels/fp4.h"

namespace lockstep::kernels {
namespace {

class Fp4File : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string path = std::string(LOCKSTEP_PY_FIXTURES) + "/fp4_formats.safetensors";
    auto f = engine::SafetensorsFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status().message() << " (written by CTest's fp4_formats_fixture: "
                        << "/usr/bin/python3 tools/fixtures/fp4_formats.py test-file --out " << path << ")";
    file_ = f->release();
  }
  void SetUp() override { ASSERT_NE(file_, nullptr) << "the Python fixture file did not open"; }
  static void TearDownTestSuite() {
    delete file_;
    file_ = nullptr;
  }
  static StoredTensor Get(const std::string& name) {
    auto it = file_->tensors().find(name);
    EXPECT_NE(it, file_->tensors().end()) << name;
    if (it == file_->tensors().end()) return {};
    const engine::TensorView& t = it->second;
    return {t.name, std::string(engine::DTypeName(t.dtype)), t.shape, t.data, t.nbytes, t.file};
  }
  static std::vector<float> Floats(const std::string& name) {
    const StoredTensor t = Get(name);
    std::vector<float> v(t.nbytes / 4);
    if (t.data != nullptr) std::memcpy(v.data(), t.data, t.nbytes);
    return v;
  }
  static Result<WeightView> View(const std::string& prefix, WeightDType d, int64_t out, int64_t in) {
    const std::vector<std::string> n = Fp4TensorNames(d, prefix);
    if (d == WeightDType::kMxfp4) return Mxfp4View(Get(n[0]), Get(n[1]), out, in);
    return Nvfp4View(Get(n[0]), Get(n[1]), Get(n[2]), out, in);
  }
  // The view's rows equal `<prefix>.decoded` bit for bit; returns how many values were NaN.
  static int ExpectDecodedEqual(const std::string& prefix, WeightDType d) {
    const StoredTensor dec = Get(prefix + ".decoded");
    const int64_t out = dec.shape.at(0), in = dec.shape.at(1);
    auto v = View(prefix, d, out, in);
    EXPECT_TRUE(v.ok()) << v.status().message();
    if (!v.ok()) return 0;
    std::vector<float> mine(static_cast<size_t>(out * in));
    v->DecodeRows(0, out, mine.data());
    const std::vector<float> py = Floats(prefix + ".decoded");
    int nans = 0, mismatches = 0;
    for (size_t i = 0; i < mine.size(); ++i) {
      if (std::isnan(py[i])) {
        ++nans;
        if (!std::isnan(mine[i]) && ++mismatches < 5) ADD_FAILURE() << prefix << "[" << i << "]: " << mine[i] << ", Python NaN";
        continue;
      }
      if (std::bit_cast<uint32_t>(mine[i]) != std::bit_cast<uint32_t>(py[i]) && ++mismatches < 5) {
        ADD_FAILURE() << prefix << "[" << i / in << ", " << i % in << "]: C++ " << mine[i] << " (0x" << std::hex
                      << std::bit_cast<uint32_t>(mine[i]) << "), Python " << py[i] << " (0x"
                      << std::bit_cast<uint32_t>(py[i]) << std::dec << ")";
      }
    }
    EXPECT_EQ(mismatches, 0) << prefix;
    return nans;
  }
  static void ExpectSameBytes(const std::vector<uint8_t>& mine, const std::string& name) {
    const StoredTensor t = Get(name);
    ASSERT_EQ(mine.size(), t.nbytes) << name;
    const uint8_t* py = static_cast<const uint8_t*>(t.data);
    int diffs = 0;
    for (size_t i = 0; i < mine.size(); ++i) {
      if (mine[i] != py[i] && ++diffs < 5) {
        ADD_FAILURE() << name << " byte " << i << ": C++ 0x" << std::hex << int(mine[i]) << ", Python 0x" << int(py[i]);
      }
    }
    EXPECT_EQ(diffs, 0) << name;
  }
  static engine::SafetensorsFile* file_;
};
engine::SafetensorsFile* Fp4File::file_ = nullptr;

TEST_F(Fp4File, Mxfp4EdgeBytesDecodeAsPythonDecodesThem) {
  EXPECT_EQ(Get("mx.bytes.scale").dtype, "F8_E8M0");
  // Rows 3 and 4 hold 0xFF scales: a block of 32 NaNs each at least.
  EXPECT_GE(ExpectDecodedEqual("mx.bytes", WeightDType::kMxfp4), 2 * 32);
}

TEST_F(Fp4File, Nvfp4EdgeBytesDecodeAsPythonDecodesThem) {
  EXPECT_EQ(Get("nv.bytes.weight_scale").dtype, "F8_E4M3");
  EXPECT_GE(ExpectDecodedEqual("nv.bytes", WeightDType::kNvfp4), 2 * 16);  // scale bytes 0x7f, 0xff
}

TEST_F(Fp4File, QuantisedMatricesDecodeAsPythonDecodesThem) {
  EXPECT_GE(ExpectDecodedEqual("mx.quant", WeightDType::kMxfp4), 32);  // the NaN block
  EXPECT_EQ(ExpectDecodedEqual("nv.quant", WeightDType::kNvfp4), 0);
}

TEST_F(Fp4File, CppQuantisersWriteThePythonBytes) {
  const StoredTensor src = Get("mx.quant.source");
  const std::vector<float> mx = Floats("mx.quant.source");
  const Fp4Matrix q = QuantizeMxfp4(mx.data(), src.shape[0], src.shape[1]);
  ExpectSameBytes(q.packed, "mx.quant.weight");
  ExpectSameBytes(q.scales, "mx.quant.scale");

  const StoredTensor nsrc = Get("nv.quant.source");
  const std::vector<float> nv = Floats("nv.quant.source");
  const Fp4Matrix n = QuantizeNvfp4(nv.data(), nsrc.shape[0], nsrc.shape[1]);
  ExpectSameBytes(n.packed, "nv.quant.weight");
  ExpectSameBytes(n.scales, "nv.quant.weight_scale");
  EXPECT_EQ(std::bit_cast<uint32_t>(n.scale_2), std::bit_cast<uint32_t>(Floats("nv.quant.weight_scale_2").at(0)));
}

StoredTensor Stored(const engine::Checkpoint& ck, const std::string& name) {
  const engine::TensorView* t = ck.Find(name);
  EXPECT_NE(t, nullptr) << name;
  if (t == nullptr) return {name, "missing", {}, nullptr, 0, ""};
  return {t->name, std::string(engine::DTypeName(t->dtype)), t->shape, t->data, t->nbytes, t->file};
}

TEST(Fp4Tool, QuantisedCheckpointsLoadByTheirNamesAndEqualTheirTwins) {
  const std::string root = std::string(LOCKSTEP_PY_FIXTURES) + "/fp4_tool";
  auto src = engine::Checkpoint::Open(root + "/src");
  ASSERT_TRUE(src.ok()) << src.status().message();
  const int64_t E = 3, I = 32, D = 64;
  int projections = 0;
  for (WeightDType fmt : {WeightDType::kMxfp4, WeightDType::kNvfp4}) {
    const std::string name = fmt == WeightDType::kMxfp4 ? "mxfp4" : "nvfp4";
    auto q = engine::Checkpoint::Open(root + "/" + name);
    auto twin = engine::Checkpoint::Open(root + "/" + name + "_twin");
    ASSERT_TRUE(q.ok() && twin.ok()) << name;
    struct Proj { Fp4Naming naming; int64_t layer, expert; ExpertProj proj; std::string stacked; int64_t row0, rows, cols; };
    std::vector<Proj> projs;
    for (int64_t L : {0, 1}) {
      const std::string base = "model.layers." + std::to_string(L) + ".mlp.experts.";
      for (int64_t e = 0; e < E; ++e) {
        projs.push_back({Fp4Naming::kHf, L, e, ExpertProj::kGate, base + "gate_up_proj", e * 2 * I, I, D});
        projs.push_back({Fp4Naming::kHf, L, e, ExpertProj::kUp, base + "gate_up_proj", e * 2 * I + I, I, D});
        projs.push_back({Fp4Naming::kHf, L, e, ExpertProj::kDown, base + "down_proj", e * D, D, I});
      }
    }
    projs.push_back({Fp4Naming::kOfficial, 2, 0, ExpertProj::kDown, "layers.2.ffn.experts.0.w2.weight", 0, D, I});
    for (const Proj& p : projs) {
      const std::string prefix = Fp4ExpertPrefix(p.naming, p.layer, p.expert, p.proj);
      const std::vector<std::string> n = Fp4TensorNames(fmt, prefix);
      auto v = fmt == WeightDType::kMxfp4
                   ? Mxfp4View(Stored(**q, n[0]), Stored(**q, n[1]), p.rows, p.cols)
                   : Nvfp4View(Stored(**q, n[0]), Stored(**q, n[1]), Stored(**q, n[2]), p.rows, p.cols);
      ASSERT_TRUE(v.ok()) << v.status().message();
      std::vector<float> mine(static_cast<size_t>(p.rows * p.cols));
      v->DecodeRows(0, p.rows, mine.data());
      auto tw = engine::LoadMatrix(**twin, p.stacked);
      auto sm = engine::LoadMatrix(**src, p.stacked);
      ASSERT_TRUE(tw.ok() && sm.ok()) << p.stacked;
      const std::vector<float> want = tw->Rows(p.row0, p.rows).Dequantized();
      const std::vector<float> orig = sm->Rows(p.row0, p.rows).Dequantized();
      ASSERT_EQ(want.size(), mine.size()) << prefix;
      int64_t diffs = 0;
      for (size_t i = 0; i < mine.size(); ++i) diffs += std::bit_cast<uint32_t>(mine[i]) != std::bit_cast<uint32_t>(want[i]);
      EXPECT_EQ(diffs, 0) << name << " " << prefix << ": rows unlike the Python-decoded twin's";
      // Within a third of each row's largest magnitude of the source (a gate/up swap or a wrong
      // stacking offset lands far outside it).
      for (int64_t r = 0; r < p.rows; ++r) {
        float amax = 0;
        for (int64_t c = 0; c < p.cols; ++c) amax = std::max(amax, std::fabs(orig[r * p.cols + c]));
        for (int64_t c = 0; c < p.cols; ++c) {
          ASSERT_LE(std::fabs(mine[r * p.cols + c] - orig[r * p.cols + c]), amax / 3) << name << " " << prefix << " " << r << "," << c;
        }
      }
      ++projections;
    }
    EXPECT_EQ((*q)->Find("model.layers.0.mlp.experts.gate_up_proj"), nullptr) << "the stacked source stays out";
    EXPECT_NE((*q)->Find("model.norm.weight"), nullptr) << "other tensors are copied";
  }
  EXPECT_EQ(projections, 2 * (2 * E * 3 + 1));
}

}  // namespace
}  // namespace lockstep::kernels
