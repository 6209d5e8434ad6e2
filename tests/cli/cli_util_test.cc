// tests/cli/cli_util_test.cc — the small pieces every command's output leans on: natural order
// of names (layers.2 before layers.10), terminal widths of UTF-8 text and the tables sized by
// them, human-readable durations and sizes. Expected values are worked out by hand.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "base/json_text.h"
#include "base/natural_order.h"
#include "cli/progress.h"
#include "cli/table.h"

namespace lockstep {
namespace {

TEST(NaturalOrder, NumbersCompareByValue) {
  std::vector<std::string> v = {"layers.10.attn.out", "layers.2.attn.out", "layers.1.resid_out", "embed",
                                "layers.2.attn.norm", "logits", "layers.100.x", "layers.02.attn.out"};
  std::sort(v.begin(), v.end(), NaturalLess{});
  const std::vector<std::string> want = {"embed",              "layers.1.resid_out", "layers.2.attn.norm",
                                         "layers.2.attn.out",  "layers.02.attn.out", "layers.10.attn.out",
                                         "layers.100.x",       "logits"};
  EXPECT_EQ(v, want);
}

TEST(NaturalOrder, IsAStrictWeakOrder) {
  EXPECT_EQ(NaturalCompare("a2", "a2"), 0);
  EXPECT_LT(NaturalCompare("a2", "a02"), 0);  // equal value: the shorter run first (a total order)
  EXPECT_GT(NaturalCompare("a02", "a2"), 0);
  EXPECT_LT(NaturalCompare("a9", "a10"), 0);
  EXPECT_LT(NaturalCompare("a", "a0"), 0);
  EXPECT_LT(NaturalCompare("x.99999999999999999999", "x.100000000000000000000"), 0);  // past 64 bits
  EXPECT_FALSE(NaturalLess{}("b", "b"));
}

TEST(DisplayWidth, CountsWhatATerminalShows) {
  EXPECT_EQ(cli::DisplayWidth("layers.0"), 8);
  EXPECT_EQ(cli::DisplayWidth("µs"), 2);                  // 2-byte sequence, one column
  EXPECT_EQ(cli::DisplayWidth("≥ 0"), 3);                 // 3-byte sequence
  EXPECT_EQ(cli::DisplayWidth("<｜User｜>"), 10);         // two fullwidth bars: 2 columns each
  EXPECT_EQ(cli::DisplayWidth("中文"), 4);
  EXPECT_EQ(cli::DisplayWidth("e\xCC\x81"), 1);           // e + combining acute
  EXPECT_EQ(cli::DisplayWidth("\xFF\xFE"), 2);            // invalid bytes: one column each
  EXPECT_EQ(cli::DisplayWidth("\xE4\xB8"), 2);            // truncated sequence
}

TEST(Table, ColumnsAreAsWideAsTheirWidestCell) {
  cli::Table t({"name", "MB"}, {false, true});
  t.Add({"kv/layers.0.latent", "0.002"});
  t.Add({"<｜User｜>", "12.5"});
  const std::string out = t.Render();
  // "name" is padded to the widest name (18 columns), numbers right-aligned under "MB".
  EXPECT_EQ(out,
            "name                   MB\n"
            "kv/layers.0.latent  0.002\n"
            "<｜User｜>           12.5\n");
  EXPECT_EQ(t.Render(2, /*header=*/false),
            "  kv/layers.0.latent  0.002\n"
            "  <｜User｜>           12.5\n");
}

TEST(Human, DurationsAndBytes) {
  EXPECT_EQ(cli::HumanDuration(0.2), "1 s");
  EXPECT_EQ(cli::HumanDuration(59.5), "60 s");
  EXPECT_EQ(cli::HumanDuration(125), "2 min 05 s");
  EXPECT_EQ(cli::HumanDuration(3725), "1 h 02 min");
  EXPECT_EQ(cli::HumanDuration(-1), "?");
  EXPECT_EQ(cli::HumanBytes(812), "812 B");
  EXPECT_EQ(cli::HumanBytes(3.4e6), "3.4 MB");
  EXPECT_EQ(cli::HumanBytes(1.234e9), "1.23 GB");
}

// Model text is bytes: a token may end mid-character, a tail cut by bytes may start inside one.
// Reports must still be written (nlohmann's dump throws on ill-formed UTF-8; lockstep degen
// --json aborted on a sample's 200-byte tail).
TEST(JsonText, IllFormedUtf8BecomesReplacementCharacters) {
  const std::string cut = std::string("\x81\xbf") + "ok \xe2\x82";  // two stray continuation bytes, a cut €
  const nlohmann::json j = {{"text", cut}};
  EXPECT_THROW((void)j.dump(), nlohmann::json::type_error);
  EXPECT_EQ(JsonText(j), "{\"text\":\"\xef\xbf\xbd\xef\xbf\xbdok \xef\xbf\xbd\"}");
  EXPECT_EQ(JsonText(nlohmann::json{{"a", 1}}, 2), "{\n  \"a\": 1\n}");
}

TEST(JsonText, Utf8TailNeverStartsInsideACharacter) {
  const std::string s = "ab\xe2\x82\xac" "cd";  // "ab€cd": € is 3 bytes
  EXPECT_EQ(Utf8Tail(s, 4), "cd");          // the last 4 bytes start inside €: skip to its end
  EXPECT_EQ(Utf8Tail(s, 5), "\xe2\x82\xac" "cd");
  EXPECT_EQ(Utf8Tail(s, 100), s);
  EXPECT_EQ(Utf8Tail("", 3), "");
}

}  // namespace
}  // namespace lockstep
