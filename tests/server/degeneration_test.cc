// tests/server/degeneration_test.cc — the degeneration detector (diff/degeneration.h) that
// fires the server's degeneration captures and judges `lockstep degen`'s samples, on token
// sequences of the embedded model's tokenizer: real greedy output, loops built by hand from
// real lines, and natural English, HTML and JavaScript (tests/server/degeneration/).
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "diff/degeneration.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/tokenizer.h"
#include "tests/test_util.h"

namespace lockstep::diff {
namespace {

std::filesystem::path ModelDir() { return testing::SourceDir() / "models" / "lockstep-tiny-v32"; }

const engine::Tokenizer& Tok() {
  static const auto* tok = [] {
    auto t = engine::Tokenizer::Load(ModelDir() / "tokenizer.json");
    EXPECT_TRUE(t.ok()) << t.status().message();
    return t.ok() ? new std::shared_ptr<const engine::Tokenizer>(*t) : nullptr;
  }();
  if (!tok) std::abort();
  return **tok;
}

std::string ReadText(const std::string& name) {
  std::ifstream in(testing::SourceDir() / "tests" / "server" / "degeneration" / name, std::ios::binary);
  EXPECT_TRUE(in) << name;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The detector before issue 28: only the ≥ 2-repeat, ≥ half-the-tail rule.
DegenerationParams OldRule() {
  DegenerationParams p;
  p.repeats = 0;
  return p;
}

// The embedded model's greedy completion of the prompt, as `lockstep generate -t 0`
// and the server produce it (bos prepended, eos not suppressed).
std::vector<int32_t> GreedyCompletion(int64_t n) {
  auto model = engine::Model::Load(ModelDir());
  EXPECT_TRUE(model.ok()) << model.status().message();
  engine::EngineOptions o;
  auto eng = engine::Engine::Create(*model, o);
  EXPECT_TRUE(eng.ok()) << eng.status().message();
  engine::Request r;
  r.prompt = Tok().Encode("<!DOCTYPE html>\n<html>\n<head>\n<title>Counter</title>", /*add_special_tokens=*/true);
  r.max_new_tokens = n;
  r.sampling.temperature = 0;
  for (int64_t e : (*model)->config().eos_token_ids) r.stop_tokens.push_back(static_cast<int32_t>(e));
  EXPECT_TRUE((*eng)->AddRequest(r).ok());
  EXPECT_TRUE((*eng)->RunToCompletion().ok());
  return (*eng)->request(0).generated;
}

// Issue 28: 128 greedy tokens end in five identical `@import` lines (10 tokens each) after
// four different ones; a reader sees the loop, the old rule (50 periodic tokens < 64) did not.
TEST(DegenerationDetector, TheGreedyImportLoopIn128TokensFires) {
  const std::vector<int32_t> ids = GreedyCompletion(128);
  ASSERT_EQ(ids.size(), 128u) << "the model stopped early: " << Tok().Decode(ids);
  const std::string text = Tok().Decode(ids);
  const std::string line = "\t\t@import \"../../../dijit/themes/claro/claro.css\";\n";
  size_t count = 0;
  for (size_t at = text.find(line); at != std::string::npos; at = text.find(line, at + 1)) ++count;
  ASSERT_GE(count, 4u) << "the loop the issue saw is not in this output:\n" << text;

  const Degeneration d = DetectDegeneration(ids);
  EXPECT_TRUE(d.loop) << "period " << d.period << ", " << d.periodic_len << " periodic tokens:\n" << text;
  EXPECT_TRUE(d.degenerate);
  EXPECT_EQ(d.period, 10) << "one @import line is 10 tokens";
  EXPECT_GE(d.repeats, 4.0);
  EXPECT_FALSE(DetectDegeneration(ids, OldRule()).loop) << "the rule before issue 28 fires too: the test shows nothing";
}

// A line repeated 8 times at the end of 128 tokens, built from real text: the tokens of real
// HTML before it, then one real line's tokens 8 times. Every line length the old rule missed
// (8 repeats < 64 tokens: lines of ≤ 7 tokens) must fire now, and so must 4–7 repeats of
// longer lines once they cover a quarter of the completion.
TEST(DegenerationDetector, AHandBuiltRepeatedLineFiresInA128TokenCompletion) {
  const std::vector<int32_t> preamble = Tok().Encode(ReadText("underscore-index.html"));
  ASSERT_GE(preamble.size(), 128u);
  const std::vector<std::string> lines = {
      "\t\t<br/>\n",                                                // 4 tokens
      "\t<td></td>\n",                                               // 5
      "<li>item</li>\n",                                             // 6
      "\tvar x = 0;\n",                                              // 6
      "\t\tdojo.require(\"dijit.form.Button\");\n",                   // 8
      "\t\t@import \"../../../dijit/themes/claro/claro.css\";\n",       // 10: the line
      "<p>The quick brown fox jumps over the lazy dog.</p>\n",       // 21
  };
  int judged_old_missed = 0;
  for (const std::string& line : lines) {
    const std::vector<int32_t> unit = Tok().Encode(line);
    const int64_t k = static_cast<int64_t>(unit.size());
    ASSERT_GT(k, 0);
    for (int64_t r = 4; r <= 8; ++r) {
      if (r * k > 128 || r * k < 32) continue;  // a quarter of 128 tokens at least
      std::vector<int32_t> ids(preamble.begin(), preamble.begin() + (128 - r * k));
      for (int64_t i = 0; i < r; ++i) ids.insert(ids.end(), unit.begin(), unit.end());
      ASSERT_EQ(ids.size(), 128u);
      const Degeneration d = DetectDegeneration(ids);
      EXPECT_TRUE(d.loop) << r << " × " << k << "-token line " << ::testing::PrintToString(line);
      EXPECT_EQ(d.period, k) << ::testing::PrintToString(line);
      if (r == 8 && !DetectDegeneration(ids, OldRule()).loop) ++judged_old_missed;
    }
  }
  EXPECT_EQ(judged_old_missed, 4) << "8 repeats of a 4–7-token line: the cases the old rule missed";
}

// Scaled to the completion: a 64-token completion (the server's shortest judged) needs 16
// tokens of loop, a 256-token one 32 of its last 128. Three repeats are not enough.
TEST(DegenerationDetector, TheRepeatRuleScalesWithTheCompletion) {
  const std::vector<int32_t> text = Tok().Encode(ReadText("gpl-3.txt"));
  const std::vector<int32_t> unit = Tok().Encode("\t\tcolor: red;\n");  // k = 5 tokens
  const int64_t k = static_cast<int64_t>(unit.size());
  ASSERT_LE(4 * k, 32);
  ASSERT_GE(4 * k, 16);
  auto build = [&](int64_t len, int64_t r) {
    std::vector<int32_t> ids(text.begin() + 1000, text.begin() + 1000 + (len - r * k));
    for (int64_t i = 0; i < r; ++i) ids.insert(ids.end(), unit.begin(), unit.end());
    return ids;
  };
  EXPECT_TRUE(DetectDegeneration(build(64, 4)).loop) << "4 × " << k << " tokens of 64";
  EXPECT_FALSE(DetectDegeneration(build(64, 3)).loop) << "3 repeats are not a loop yet";
  const int64_t r256 = (32 + k - 1) / k;  // the fewest repeats that cover 32 of the last 128
  EXPECT_TRUE(DetectDegeneration(build(256, std::max<int64_t>(r256, 4))).loop);
  if (r256 > 4) {
    EXPECT_FALSE(DetectDegeneration(build(256, 4)).loop) << "4 × " << k << " < 32 tokens of 128";
  }
}

// Natural English, HTML and JavaScript, tokenized: cut as if a completion of 64, 128 or 256
// tokens ended at every position, nothing fires — no loop, no collapse.
TEST(DegenerationDetector, NaturalTextDoesNotFire) {
  for (const char* name : {"gpl-3.txt", "underscore-index.html", "underscore.js"}) {
    const std::vector<int32_t> ids = Tok().Encode(ReadText(name));
    ASSERT_GE(ids.size(), 5000u) << name;
    int64_t judged = 0, fired = 0;
    std::string first;
    for (size_t end = 64; end <= ids.size(); ++end) {
      for (size_t len : {64u, 128u, 256u}) {
        if (len > end) continue;
        const std::span<const int32_t> c(ids.data() + end - len, len);
        const Degeneration d = DetectDegeneration(c);
        ++judged;
        if (d.degenerate) {
          if (first.empty()) {
            first = "ending at token " + std::to_string(end) + " (" + std::to_string(len) + " tokens, period " +
                    std::to_string(d.period) + ", " + std::to_string(d.periodic_len) + " periodic, distinct " +
                    std::to_string(d.distinct) + "): " + Tok().Decode(c.subspan(len - 40));
          }
          ++fired;
        }
      }
    }
    EXPECT_EQ(fired, 0) << name << ": " << fired << " of " << judged << " cuts fire; first " << first;
    EXPECT_GT(judged, 3 * 4000) << name;
  }
}

// The rules before issue 28 still hold (tests/diff_test.cc has the older cases): a long loop
// fires with 2 repeats over half the tail, and the reported period is the loop's unit.
TEST(DegenerationDetector, LongPeriodsStillNeedHalfTheTail) {
  const std::vector<int32_t> text = Tok().Encode(ReadText("underscore.js"));
  // A 30-token unit of real JS, repeated: 2 repeats (60 tokens) are not half of 128; 3 are.
  const std::vector<int32_t> unit(text.begin() + 2000, text.begin() + 2030);
  auto build = [&](int64_t r) {
    std::vector<int32_t> ids(text.begin() + 3000, text.begin() + 3000 + (128 - 30 * r));
    for (int64_t i = 0; i < r; ++i) ids.insert(ids.end(), unit.begin(), unit.end());
    return ids;
  };
  EXPECT_FALSE(DetectDegeneration(build(2)).loop);
  const Degeneration d3 = DetectDegeneration(build(3));
  EXPECT_TRUE(d3.loop);
  EXPECT_EQ(d3.period, 30);
  EXPECT_GE(d3.periodic_len, 90);
}

}  // namespace
}  // namespace lockstep::diff
