// tests/server/openai_request_test.cc — ParseGenerationRequest (server/openai.h) on bodies whose
// fields have the wrong type: each is a 400 that names the field, not an exception (which the
// HTTP layer turned into a 500 without the error envelope before; found by
// fuzz/fuzz_openai_request.cc), and nulls where a field is optional read as absent.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "server/openai.h"
#include "tests/test_util.h"

namespace lockstep::server {
namespace {

using json = nlohmann::json;

class RequestTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto t = engine::Tokenizer::Load(testing::SourceDir() / "models" / "lockstep-tiny-v32" / "tokenizer.json");
    ASSERT_TRUE(t.ok()) << t.status().message();
    tok_ = new std::shared_ptr<const engine::Tokenizer>(*t);
  }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  // Parses `body` for /v1/completions (chat false) or /v1/chat/completions.
  static std::optional<ApiError> Parse(const std::string& body, bool chat, GenerationRequest* r) {
    return ParseGenerationRequest(body, chat, "", **tok_, ChatTemplate{}, Limits{}, r);
  }
  static std::shared_ptr<const engine::Tokenizer>* tok_;
};
std::shared_ptr<const engine::Tokenizer>* RequestTest::tok_ = nullptr;

TEST_F(RequestTest, AFieldOfTheWrongTypeIsA400NamingIt) {
  struct Case {
    bool chat;
    const char* body;
    const char* param;
  };
  const Case cases[] = {
      {false, R"({"model": 7, "prompt": "x"})", "model"},
      {false, R"({"prompt": "x", "stream": true, "stream_options": {"include_usage": "yes"}})", "stream_options"},
      {false, R"({"prompt": "x", "stream_options": 5})", "stream_options"},
      {false, R"({"prompt": "x", "ignore_eos": "no"})", "ignore_eos"},
      {false, R"({"prompt": "x", "stream": 1})", "stream"},
      {true, R"({"messages": [{"role": "user", "content": [{"type": 1, "text": 2}]}]})", "messages"},
      {true, R"({"messages": [{"role": "user", "content": [{"type": "text", "text": 2}]}]})", "messages"},
      {true, R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})",
       "messages"},
      {true, R"({"messages": [{"role": "user", "content": 5}]})", "messages"},
      {true, R"({"messages": [{"role": 3, "content": "hi"}]})", "messages"},
  };
  for (const Case& c : cases) {
    GenerationRequest r;
    std::optional<ApiError> e;
    ASSERT_NO_THROW(e = Parse(c.body, c.chat, &r)) << c.body;
    ASSERT_TRUE(e.has_value()) << c.body << " was accepted";
    EXPECT_EQ(e->status, 400) << c.body;
    EXPECT_EQ(e->param, c.param) << c.body << ": " << e->message;
    EXPECT_FALSE(e->message.empty()) << c.body;
    const json envelope = json::parse(e->Body());
    EXPECT_EQ(envelope["error"]["param"], c.param) << e->Body();
  }
}

TEST_F(RequestTest, NullOptionalFieldsReadAsAbsent) {
  GenerationRequest r;
  auto e = Parse(R"({"model": null, "prompt": "x", "stream": null, "stream_options": null, "ignore_eos": null})", false,
                 &r);
  ASSERT_FALSE(e.has_value()) << e->message;
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.include_usage);
  EXPECT_FALSE(r.ignore_eos);
  EXPECT_EQ(r.model, "");
  GenerationRequest c;
  e = Parse(R"({"messages": [{"role": "user", "content": "hi"}], "logprobs": null, "stream_options": {"include_usage": null}})",
            true, &c);
  ASSERT_FALSE(e.has_value()) << e->message;
  EXPECT_EQ(c.top_logprobs, -1);
  EXPECT_FALSE(c.include_usage);
}

// Text parts are joined, in order, as the string content would be.
TEST_F(RequestTest, TextPartsAreTheSameAsTheString) {
  GenerationRequest parts, whole;
  ASSERT_FALSE(Parse(R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "A counter"},
                                                                     {"type": "text", "text": " page"}]}]})",
                     true, &parts));
  ASSERT_FALSE(Parse(R"({"messages": [{"role": "user", "content": "A counter page"}]})", true, &whole));
  EXPECT_EQ(parts.prompt_text, whole.prompt_text);
  EXPECT_EQ(parts.prompt, whole.prompt);
  EXPECT_NE(whole.prompt_text.find("A counter page"), std::string::npos) << whole.prompt_text;
}

// tokenizer_config.json's chat_template list with a non-string name: no template chosen, no throw.
TEST(ChooseTemplate, AListEntryWithoutAStringNameIsSkipped) {
  const json config = {{"chat_template", json::array({{{"name", 1}, {"template", "{{ x }}"}}})}};
  Result<ChatTemplate> t = Status::Internal("unset");
  ASSERT_NO_THROW(t = ChatTemplate::Choose(config, "deepseek_v3", ""));
  ASSERT_TRUE(t.ok()) << t.status().message();
  EXPECT_EQ(t->style, ChatStyle::kNone);
}

}  // namespace
}  // namespace lockstep::server
