// tests/safetensors_test.cc — a lying or truncated checkpoint gives a one-line error that
// names the file and the tensor, never a crash (ASan/UBSan builds run this too).
#include <gtest/gtest.h>

#include <fstream>

#include "engine/model.h"
#include "engine/safetensors.h"
#include "kernels/cpu/numerics.h"
#include "test_util.h"

namespace lockstep::engine {
namespace {

std::string Build(const std::string& header, const std::string& data, int64_t claimed_len = -1) {
  uint64_t n = claimed_len >= 0 ? static_cast<uint64_t>(claimed_len) : header.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

Status Parse(const std::string& bytes) {
  return SafetensorsFile::ParseHeader(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "x.safetensors")
      .status();
}

TEST(Safetensors, ParsesAValidHeader) {
  std::string data(16, '\0');
  auto bytes = Build(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"__metadata__":{"k":"v"}})", data);
  auto r = SafetensorsFile::ParseHeader(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "x");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->at("a").shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(r->at("a").nbytes, 16u);
}

struct BadCase {
  const char* what;
  std::string bytes;
  const char* expect;  // a substring of the message
};

TEST(Safetensors, RejectsEveryKindOfLie) {
  const std::string d16(16, '\0');
  const BadCase cases[] = {
      {"shorter than the length field", std::string("\x01\x02", 2), "truncated"},
      {"header longer than the file", Build("{}", "", 1000), "truncated"},
      {"absurd header length", Build("{}", "", int64_t{1} << 40), "exceeds"},
      {"not JSON", Build("{not json", d16), "not valid JSON"},
      {"not an object", Build("[1,2]", d16), "not a JSON object"},
      {"offsets past the end", Build(R"({"a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}})", d16), "end past"},
      {"shape disagrees with offsets", Build(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", d16),
       "needs 12 bytes"},
      {"begin after end", Build(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", d16), "begin > end"},
      {"unsupported dtype", Build(R"({"a":{"dtype":"C64","shape":[2],"data_offsets":[0,16]}})", d16),
       "unsupported dtype"},
      {"negative dim", Build(R"({"a":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})", d16), "negative"},
      {"petabyte shape", Build(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,4096],"data_offsets":[0,16]}})", d16),
       "overflows"},
      {"missing dtype", Build(R"({"a":{"shape":[4],"data_offsets":[0,16]}})", d16), "dtype"},
      {"offsets not integers", Build(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":["0",16]}})", d16),
       "data_offsets"},
  };
  for (const auto& c : cases) {
    Status s = Parse(c.bytes);
    EXPECT_FALSE(s.ok()) << c.what;
    EXPECT_NE(s.message().find(c.expect), std::string::npos) << c.what << ": " << s.message();
    EXPECT_NE(s.message().find("x.safetensors"), std::string::npos) << c.what << ": message must name the file";
    EXPECT_EQ(s.message().find('\n'), std::string::npos) << "one line";
  }
}

class ModelDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("lockstep_st_" + std::to_string(::getpid()) + "_" +
                                                     ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    src_ = testing::FixtureDir() / "models" / "v3_basic";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void Write(const std::string& name, const std::string& bytes) {
    std::ofstream(dir_ / name, std::ios::binary) << bytes;
  }
  std::string Read(const std::filesystem::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  std::filesystem::path dir_, src_;
};

TEST_F(ModelDirTest, MissingAndTruncatedFiles) {
  auto r = Model::Load(dir_);
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("config.json"), std::string::npos) << r.status().message();
  ASSERT_TRUE(std::filesystem::exists(src_ / "model.safetensors")) << "fixture v3_basic missing";
  Write("config.json", Read(src_ / "config.json"));
  r = Model::Load(dir_);
  EXPECT_NE(r.status().message().find("no model.safetensors"), std::string::npos) << r.status().message();
  const std::string full = Read(src_ / "model.safetensors");
  Write("model.safetensors", full.substr(0, full.size() / 2));
  r = Model::Load(dir_);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("model.safetensors"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("truncated"), std::string::npos) << r.status().message();
}

TEST_F(ModelDirTest, MissingAndMisshapenTensors) {
  // Rebuild the fixture's safetensors without one tensor, and with one tensor's shape changed.
  auto f = SafetensorsFile::Open(src_ / "model.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().message();
  auto rebuild = [&](const std::string& drop, const std::string& reshape, const std::string& extra = "") {
    std::string header = "{", data;
    bool first = true;
    if (!extra.empty()) {
      header += "\"" + extra + "\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}";
      data.assign(8, '\0');
      first = false;
    }
    for (const auto& [name, t] : (*f)->tensors()) {
      if (name == drop) continue;
      std::vector<int64_t> shape = t.shape;
      if (name == reshape) shape = {static_cast<int64_t>(t.numel())};
      std::string sh;
      for (auto d : shape) sh += (sh.empty() ? "" : ",") + std::to_string(d);
      header += std::string(first ? "" : ",") + "\"" + name + "\":{\"dtype\":\"" + std::string(DTypeName(t.dtype)) +
                "\",\"shape\":[" + sh + "],\"data_offsets\":[" + std::to_string(data.size()) + "," +
                std::to_string(data.size() + t.nbytes) + "]}";
      data.append(reinterpret_cast<const char*>(t.data), t.nbytes);
      first = false;
    }
    return Build(header + "}", data);
  };
  Write("config.json", Read(src_ / "config.json"));
  const std::string victim = "model.layers.1.self_attn.kv_b_proj.weight";
  Write("model.safetensors", rebuild(victim, ""));
  auto r = Model::Load(dir_);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(victim), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("missing"), std::string::npos) << r.status().message();
  Write("model.safetensors", rebuild("", victim));
  r = Model::Load(dir_);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(victim), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("config.json implies"), std::string::npos) << r.status().message();
  // An MTP layer (layers.{num_hidden_layers}) is skipped, and counted as such.
  Write("model.safetensors", rebuild("", "", "model.layers.3.eh_proj.weight"));
  r = Model::Load(dir_);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ((*r)->weights().mtp_tensors, 1);
  EXPECT_EQ((*r)->weights().skipped, std::vector<std::string>{"model.layers.3.eh_proj.weight"});
}

// F16 checkpoints load: the fp32 fixture rewritten as F16 (round to nearest, by hand) gives
// the logits of the fp32 model run on the F16-rounded weights — exactly.
uint16_t F32ToF16(float f) {
  // Hand-rolled round-to-nearest-even, subnormals included (no overflow in the fixture).
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  int32_t exp = static_cast<int32_t>((u >> 23) & 0xff) - 127 + 15;
  uint32_t man = u & 0x7fffffu;
  if (exp <= 0) {  // subnormal: units of 2^-24
    if (exp < -10) return static_cast<uint16_t>(sign);
    const uint32_t m = man | 0x800000u;
    const int shift = 14 - exp;
    uint32_t h = m >> shift;
    const uint32_t r = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (r > halfway || (r == halfway && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t half = (static_cast<uint32_t>(exp) << 10) | (man >> 13);
  const uint32_t rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(sign | half);
}

TEST_F(ModelDirTest, F16CheckpointsLoad) {
  auto f = SafetensorsFile::Open(src_ / "model.safetensors");
  ASSERT_TRUE(f.ok());
  std::string header = "{", data;
  for (const auto& [name, t] : (*f)->tensors()) {
    ASSERT_EQ(t.dtype, DType::kF32) << name;
    std::string sh;
    for (auto d : t.shape) sh += (sh.empty() ? "" : ",") + std::to_string(d);
    const size_t begin = data.size();
    for (int64_t i = 0; i < t.numel(); ++i) {
      float v;
      std::memcpy(&v, t.data + 4 * i, 4);
      const uint16_t h = F32ToF16(v);
      data.append(reinterpret_cast<const char*>(&h), 2);
    }
    header += std::string(header.size() > 1 ? "," : "") + "\"" + name + "\":{\"dtype\":\"F16\",\"shape\":[" + sh +
              "],\"data_offsets\":[" + std::to_string(begin) + "," + std::to_string(data.size()) + "]}";
  }
  Write("config.json", Read(src_ / "config.json"));
  Write("model.safetensors", Build(header + "}", data));
  auto m16 = Model::Load(dir_);
  ASSERT_TRUE(m16.ok()) << m16.status().message();
  EXPECT_EQ((*m16)->weights().dtype_counts.at("F16"), static_cast<int64_t>((*f)->tensors().size()));
  // Every loaded weight equals the F16 rounding of the fp32 original.
  auto m32 = Model::Load(src_);
  ASSERT_TRUE(m32.ok());
  const auto& a = (*m32)->weights().layers[0].kv_b_proj.data;
  const auto& b = (*m16)->weights().layers[0].kv_b_proj.data;
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(b[i], kernels::F16ToF32(F32ToF16(a[i]))) << i;
    ASSERT_NEAR(b[i], a[i], std::fabs(a[i]) * 1e-3 + 6e-8) << i;  // half an ulp; 2^-25 absolute below 2^-14
  }
}

TEST_F(ModelDirTest, ShardedCheckpointsAndLyingIndexes) {
  Write("config.json", Read(src_ / "config.json"));
  Write("model-00001-of-00001.safetensors", Read(src_ / "model.safetensors"));
  auto f = SafetensorsFile::Open(src_ / "model.safetensors");
  ASSERT_TRUE(f.ok());
  std::string wm;
  for (const auto& [name, t] : (*f)->tensors()) {
    wm += (wm.empty() ? "" : ",") + ("\"" + name + "\":\"model-00001-of-00001.safetensors\"");
  }
  Write("model.safetensors.index.json", "{\"weight_map\":{" + wm + "}}");
  auto r = Model::Load(dir_);
  ASSERT_TRUE(r.ok()) << r.status().message();
  Write("model.safetensors.index.json", "{\"weight_map\":{\"a\":\"../../etc/passwd\"}}");
  r = Model::Load(dir_);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("outside the model directory"), std::string::npos) << r.status().message();
  Write("model.safetensors.index.json", "{\"weight_map\":{\"a\":\"model-00002-of-00002.safetensors\"}}");
  r = Model::Load(dir_);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("missing"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace lockstep::engine
