// tests/server/chat_template_test.cc — chat prompts as the deployment renders them
// (server/openai.h, server/chat_template.h).
//
// The expected texts and ids are transformers' own: tests/fixtures/chat_templates/*/expected.json,
// apply_chat_template(messages, tools=…, tokenize=False, add_generation_prompt=True) of every
// DeepSeek template found (SOURCES.md there) over conversations.json, made on the GPU machine by
// tools/fixtures/make_chat_template_fixtures.py. lockstep must give the same bytes: its Jinja
// renderer for a model's own template, its built-in formats where they stand in for one. Only
// DeepSeek-V3.2's built-in encoding (no Jinja template exists) is checked against strings
// derived by hand from DeepSeek's encoding_dsv32.py, as before.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "server/openai.h"
#include "tests/test_util.h"

namespace lockstep::server {
namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

const std::string B = "<｜begin▁of▁sentence｜>";
const std::string E = "<｜end▁of▁sentence｜>";

std::filesystem::path Fixtures() { return testing::FixtureDir() / "chat_templates"; }
std::filesystem::path TinyDir() { return testing::SourceDir() / "models" / "lockstep-tiny-v32"; }

// Key order matters (a template that prints JSON prints dict order): read as ordered_json.
ojson ReadOrdered(const std::filesystem::path& p) {
  std::ifstream in(p);
  return ojson::parse(in);
}
json Read(const std::filesystem::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}

// Every template folder: its tokenizer_config.json and transformers' expected.json.
struct Fixture {
  std::string name;
  json config;
  json expected;
};
std::vector<Fixture> AllFixtures() {
  std::vector<Fixture> out;
  for (const auto& e : std::filesystem::directory_iterator(Fixtures())) {
    if (!std::filesystem::exists(e.path() / "expected.json")) continue;
    const std::string name = e.path().filename().string();
    const auto config = name == "lockstep-tiny" ? TinyDir() / "tokenizer_config.json" : e.path() / "tokenizer_config.json";
    out.push_back({name, Read(config), Read(e.path() / "expected.json")});
  }
  std::sort(out.begin(), out.end(), [](const Fixture& a, const Fixture& b) { return a.name < b.name; });
  return out;
}

const ojson& Conversations() {
  static const ojson c = ReadOrdered(Fixtures() / "conversations.json");
  return c;
}

const json* Expected(const Fixture& f, const std::string& case_name) {
  for (const auto& c : f.expected["cases"]) {
    if (c["name"] == case_name) return &c;
  }
  return nullptr;
}

ChatTemplate Chosen(const json& config, const std::string& model_type = "deepseek_v3", const std::string& forced = "") {
  auto t = ChatTemplate::Choose(config, model_type, forced);
  EXPECT_TRUE(t.ok()) << t.status().message();
  return t.ok() ? *t : ChatTemplate{};
}

ojson Or(const ojson& c, const char* key) { return c.contains(key) ? c[key] : ojson(); }

// Every DeepSeek template found, the embedded model's and the probe: lockstep's rendering is
// transformers' byte for byte, and where transformers raised, lockstep refuses. Before the
// Jinja renderer, R1, V3.1 and V3-0324 (and the probe, and both R1-Distills) did not even
// start: their templates were refused unless --chat-template named a built-in format.
TEST(ChatTemplateTest, EveryTemplateRendersAsTransformers) {
  const auto fixtures = AllFixtures();
  ASSERT_GE(fixtures.size(), 10u);
  int rendered = 0, refused = 0;
  for (const Fixture& f : fixtures) {
    const ChatTemplate t = Chosen(f.config);
    ASSERT_EQ(t.style, ChatStyle::kJinja) << f.name;
    for (const ojson& c : Conversations()) {
      const std::string name = c["name"];
      const json* want = Expected(f, name);
      ASSERT_NE(want, nullptr) << f.name << " / " << name;
      auto got = t.Render(c["messages"], Or(c, "tools"), Or(c, "kwargs"));
      if (want->contains("error")) {
        ASSERT_FALSE(got.ok()) << f.name << " / " << name << ": transformers raised " << (*want)["error"];
        EXPECT_EQ(got.status().code(), Status::Code::kInvalidArgument) << got.status().message();
        ++refused;
        continue;
      }
      ASSERT_TRUE(got.ok()) << f.name << " / " << name << ": " << got.status().message();
      EXPECT_EQ(*got, (*want)["text"].get<std::string>()) << f.name << " / " << name;
      ++rendered;
    }
  }
  EXPECT_GE(rendered, 130);
  EXPECT_GE(refused, 4);  // V2-Chat's templates on a tool call's null content
}

// Text parts are joined into one string before the template sees them (the built-in formats
// did the same); the rendering is the string content's.
TEST(ChatTemplateTest, TextPartsRenderAsTheirJoinedText) {
  const ChatTemplate t = Chosen(Read(Fixtures() / "deepseek-v3" / "tokenizer_config.json"));
  const ojson parts = ojson::parse(R"([{"role": "user", "content": [{"type": "text", "text": "What is"},
                                                                    {"type": "text", "text": " 2+2?"}]}])");
  const ojson whole = ojson::parse(R"([{"role": "user", "content": "What is 2+2?"}])");
  auto a = t.Render(parts, nullptr, nullptr), b = t.Render(whole, nullptr, nullptr);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  // An image part is refused, not dropped.
  EXPECT_FALSE(t.Render(ojson::parse(R"([{"role": "user", "content": [{"type": "image_url"}]}])"), nullptr, nullptr).ok());
}

// The built-in formats, which --chat-template forces, are each their template's rendering for
// the conversations they accept (system/user/assistant text; V2 and the tiny format, like
// their templates, pass other roles), and refuse tool calls rather than approximate them.
TEST(ChatTemplateTest, BuiltInFormatsMatchTheirTemplates) {
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"deepseek-v2", "deepseek-v2-chat"}, {"deepseek-v3", "deepseek-v3"}, {"lockstep-tiny", "lockstep-tiny"}};
  const auto fixtures = AllFixtures();
  int compared = 0;
  for (const auto& [style, folder] : pairs) {
    const auto f = std::find_if(fixtures.begin(), fixtures.end(), [&](const Fixture& x) { return x.name == folder; });
    ASSERT_NE(f, fixtures.end()) << folder;
    const ChatTemplate t = Chosen(f->config, "deepseek_v3", style);
    ASSERT_NE(t.style, ChatStyle::kJinja);
    for (const ojson& c : Conversations()) {
      if (c.contains("tools") || c.contains("kwargs")) continue;  // the built-ins take neither (400)
      const json* want = Expected(*f, c["name"]);
      auto got = t.Render(c["messages"], nullptr, nullptr);
      if (!got.ok()) {
        // Refused: only what the format cannot render — tool calls, tool results, other roles.
        EXPECT_EQ(got.status().code(), Status::Code::kInvalidArgument);
        const std::string m = got.status().message();
        EXPECT_TRUE(m.find("tool") != std::string::npos || m.find("role") != std::string::npos) << m;
        continue;
      }
      ASSERT_TRUE(want->contains("text")) << style << " / " << c["name"] << " rendered where the template raised";
      EXPECT_EQ(*got, (*want)["text"].get<std::string>()) << style << " / " << c["name"];
      ++compared;
    }
  }
  EXPECT_GE(compared, 25);
}

TEST(ChatTemplateTest, V32WithoutTemplateUsesTheChatModeEncoding) {
  // DeepSeek-V3.2 ships no chat_template (encoding/encoding_dsv32.py instead).
  const ChatTemplate t = Chosen({{"bos_token", B}, {"eos_token", E}}, "deepseek_v32");
  EXPECT_EQ(t.style, ChatStyle::kV32);
  // encode_messages(..., thinking_mode="chat"): bos; system → content; user →
  // "<｜User｜>{content}<｜Assistant｜>" + "</think>" (chat mode, every user turn); assistant →
  // "{reasoning}{content}{tool_calls}<｜end▁of▁sentence｜>" with reasoning "" in chat mode.
  // Nothing is appended at the end: the last user turn already opened the reply.
  const json turns = json::parse(R"([{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                                     {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}])");
  auto s = t.Apply(turns);
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(*s, B + "S<｜User｜>U1<｜Assistant｜></think>A1" + E + "<｜User｜>U2<｜Assistant｜></think>");
}

TEST(ChatTemplateTest, NoTemplateMeansNoChat) {
  const ChatTemplate t = Chosen(json::object(), "deepseek_v2");
  EXPECT_EQ(t.style, ChatStyle::kNone);
  auto s = t.Apply(json::parse(R"([{"role": "user", "content": "U"}])"));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("no chat template"), std::string::npos);
}

TEST(ChatTemplateTest, StartUpErrorsSayWhatToDo) {
  // A template jinja2 cannot compile: jinja2's message, and the way out.
  auto bad = ChatTemplate::Choose({{"chat_template", "{% for m in messages %}{{ m.content }}"}}, "deepseek_v3", "");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("does not compile"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find("--chat-template"), std::string::npos) << bad.status().message();
  EXPECT_EQ(bad.status().message().find('\n'), std::string::npos) << bad.status().message();
  // No interpreter: what to install.
  JinjaOptions none;
  none.python = "/nonexistent/python3";
  auto missing = ChatTemplate::Choose({{"chat_template", "{{ bos_token }}"}}, "deepseek_v3", "", none);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("python3-jinja2"), std::string::npos) << missing.status().message();
  // --chat-template still forces a built-in format, names are checked.
  auto forced = ChatTemplate::Choose({{"chat_template", "whatever {{"}}, "deepseek_v3", "deepseek-v3");
  ASSERT_TRUE(forced.ok()) << forced.status().message();
  EXPECT_EQ(forced->style, ChatStyle::kV3);
  EXPECT_FALSE(ChatTemplate::Choose(json::object(), "deepseek_v3", "llama3").ok());
}

// A template that raises is a 400 with its message; one that runs away is killed after the
// timeout and the renderer starts afresh for the next request.
TEST(ChatTemplateTest, RendererFailuresAreContained) {
  JinjaOptions o;
  o.timeout_ms = 1500;
  o.memory_limit_mb = 1024;
  auto t = JinjaTemplate::Compile(
      "{% if messages[0].content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
      "{% endfor %}{% elif messages[0].content == 'big' %}{{ 'x' * 3000000000 }}"
      "{% elif messages[0].content == 'raise' %}{{ raise_exception('no such turn') }}{% endif %}{{ messages[0].content }}",
      json::object(), o);
  ASSERT_TRUE(t.ok()) << t.status().message();
  auto msg = [](const char* content) { return ojson::array({{{"role", "user"}, {"content", content}}}); };
  auto raised = (*t)->Render(msg("raise"), nullptr, true, nullptr);
  ASSERT_FALSE(raised.ok());
  EXPECT_EQ(raised.status().code(), Status::Code::kInvalidArgument);
  EXPECT_NE(raised.status().message().find("no such turn"), std::string::npos) << raised.status().message();
  auto big = (*t)->Render(msg("big"), nullptr, true, nullptr);
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.status().message().find("MemoryError"), std::string::npos) << big.status().message();
  auto loop = (*t)->Render(msg("loop"), nullptr, true, nullptr);
  ASSERT_FALSE(loop.ok());
  EXPECT_EQ(loop.status().code(), Status::Code::kIoError);
  EXPECT_NE(loop.status().message().find("1500 ms"), std::string::npos) << loop.status().message();
  auto after = (*t)->Render(msg("fine"), nullptr, true, nullptr);
  ASSERT_TRUE(after.ok()) << after.status().message();
  EXPECT_EQ(*after, "fine");
}

// The sandbox is jinja2's: a template cannot reach Python's internals.
TEST(ChatTemplateTest, TheSandboxHolds) {
  auto t = JinjaTemplate::Compile("{{ ''.__class__.__mro__[1].__subclasses__() }}", json::object());
  ASSERT_TRUE(t.ok()) << t.status().message();
  auto r = (*t)->Render(ojson::array(), nullptr, true, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("SecurityError"), std::string::npos) << r.status().message();
}

// Many threads render through one renderer; each gets its own conversation's text.
TEST(ChatTemplateTest, ConcurrentRendersAgree) {
  const auto fixtures = AllFixtures();
  const auto f = std::find_if(fixtures.begin(), fixtures.end(), [](const Fixture& x) { return x.name == "deepseek-v3.1"; });
  ASSERT_NE(f, fixtures.end());
  const ChatTemplate t = Chosen(f->config);
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      for (int k = 0; k < 20; ++k) {
        const ojson& c = Conversations()[(i + k) % Conversations().size()];
        auto got = t.Render(c["messages"], Or(c, "tools"), Or(c, "kwargs"));
        if (!got.ok() || *got != (*Expected(*f, c["name"]))["text"].get<std::string>()) ++mismatches;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

// ------------------------------------------------- through the request parser, with ids

class ChatRequestTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto t = engine::Tokenizer::Load(TinyDir() / "tokenizer.json");
    ASSERT_TRUE(t.ok()) << t.status().message();
    tok_ = new std::shared_ptr<const engine::Tokenizer>(*t);
  }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  static std::optional<ApiError> Parse(const ojson& body, bool chat, const ChatTemplate& t, GenerationRequest* r) {
    return ParseGenerationRequest(body.dump(), chat, "", **tok_, t, Limits{}, r);
  }
  static std::shared_ptr<const engine::Tokenizer>* tok_;
};
std::shared_ptr<const engine::Tokenizer>* ChatRequestTest::tok_ = nullptr;

// The embedded model, end to end: a chat's prompt ids are apply_chat_template(tokenize=True)'s
// (one BOS, the template's), a completion's are the tokenizer's with its BOS.
TEST_F(ChatRequestTest, PromptIdsAreTransformers) {
  const ChatTemplate t = Chosen(Read(TinyDir() / "tokenizer_config.json"), "deepseek_v32");
  const auto fixtures = AllFixtures();
  const auto tiny = std::find_if(fixtures.begin(), fixtures.end(), [](const Fixture& x) { return x.name == "lockstep-tiny"; });
  ASSERT_NE(tiny, fixtures.end());
  int checked = 0;
  for (const ojson& c : Conversations()) {
    if (c.contains("tools")) continue;
    ojson body = {{"messages", c["messages"]}};
    if (c.contains("kwargs")) body["chat_template_kwargs"] = c["kwargs"];
    GenerationRequest r;
    auto e = Parse(body, true, t, &r);
    const json* want = Expected(*tiny, c["name"]);
    ASSERT_TRUE(want->contains("ids")) << c["name"];
    ASSERT_FALSE(e) << c["name"] << ": " << e->message;
    EXPECT_EQ(r.prompt_text, (*want)["text"].get<std::string>()) << c["name"];
    EXPECT_EQ(r.prompt, (*want)["ids"].get<std::vector<int32_t>>()) << c["name"];
    ++checked;
  }
  EXPECT_GE(checked, 12);
  for (const json& text : tiny->expected["texts"]) {
    if (text["text"] == "") continue;  // an empty prompt is refused
    GenerationRequest r;
    ASSERT_FALSE(Parse({{"prompt", text["text"].get<std::string>()}}, false, t, &r));
    EXPECT_EQ(r.prompt, text["auto"].get<std::vector<int32_t>>()) << text["text"].dump();
  }
}

// `tools` reach the prompt only through a template that renders them; otherwise the request is
// a 400 naming `tools` (it used to be answered as plain text, the tools dropped unseen).
TEST_F(ChatRequestTest, ToolsAreRenderedOrRefused) {
  const ojson* with_tools = nullptr;
  for (const ojson& c : Conversations()) {
    if (c.contains("tools")) with_tools = &c;
  }
  ASSERT_NE(with_tools, nullptr);
  const ojson body = {{"messages", (*with_tools)["messages"]}, {"tools", (*with_tools)["tools"]}};
  // The embedded model's template never reads `tools`, nor do DeepSeek's.
  for (const char* folder : {"deepseek-v3", "deepseek-v3.1", "deepseek-r1"}) {
    const ChatTemplate t = Chosen(Read(Fixtures() / folder / "tokenizer_config.json"));
    EXPECT_FALSE(t.RendersTools()) << folder;
    GenerationRequest r;
    auto e = Parse(body, true, t, &r);
    ASSERT_TRUE(e) << folder << ": tools accepted by a template that does not render them";
    EXPECT_EQ(e->status, 400);
    EXPECT_EQ(e->param, "tools") << e->message;
  }
  const ChatTemplate tiny = Chosen(Read(TinyDir() / "tokenizer_config.json"), "deepseek_v32");
  GenerationRequest r;
  auto e = Parse(body, true, tiny, &r);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "tools");
  // A built-in format renders none either.
  auto forced = Parse(body, true, Chosen(json::object(), "deepseek_v3", "deepseek-v3"), &r);
  ASSERT_TRUE(forced);
  EXPECT_EQ(forced->param, "tools");
  // The probe's template renders them: the prompt is transformers' text for the same request.
  const auto fixtures = AllFixtures();
  const auto probe = std::find_if(fixtures.begin(), fixtures.end(), [](const Fixture& x) { return x.name == "tools-probe"; });
  ASSERT_NE(probe, fixtures.end());
  const ChatTemplate pt = Chosen(probe->config);
  EXPECT_TRUE(pt.RendersTools());
  GenerationRequest ok;
  auto none = Parse(body, true, pt, &ok);
  ASSERT_FALSE(none) << none->message;
  EXPECT_EQ(ok.prompt_text, (*Expected(*probe, (*with_tools)["name"]))["text"].get<std::string>());
  // No tool definitions at all (null, []) is no reason to refuse; a non-array is.
  for (const char* tools : {"null", "[]"}) {
    ojson b = {{"messages", (*with_tools)["messages"]}, {"tools", ojson::parse(tools)}};
    EXPECT_FALSE(Parse(b, true, tiny, &r)) << tools;
    EXPECT_FALSE(Parse(b, true, Chosen(json::object(), "deepseek_v3", "deepseek-v3"), &r)) << tools;
  }
  auto not_array = Parse({{"messages", (*with_tools)["messages"]}, {"tools", {{"type", "function"}}}}, true, tiny, &r);
  ASSERT_TRUE(not_array);
  EXPECT_EQ(not_array->param, "tools");
}

// chat_template_kwargs (vLLM's field) reach the template: V3.1's thinking mode.
TEST_F(ChatRequestTest, TemplateKwargsReachTheTemplate) {
  const auto fixtures = AllFixtures();
  const auto v31 = std::find_if(fixtures.begin(), fixtures.end(), [](const Fixture& x) { return x.name == "deepseek-v3.1"; });
  ASSERT_NE(v31, fixtures.end());
  const ChatTemplate t = Chosen(v31->config);
  for (const ojson& c : Conversations()) {
    if (c["name"] != "thinking_on") continue;
    GenerationRequest r;
    auto e = Parse({{"messages", c["messages"]}, {"chat_template_kwargs", c["kwargs"]}}, true, t, &r);
    ASSERT_FALSE(e) << e->message;
    EXPECT_EQ(r.prompt_text, (*Expected(*v31, "thinking_on"))["text"].get<std::string>());
    EXPECT_NE(r.prompt_text.find("<think>"), std::string::npos);
    // Names the server sets itself are not the client's to override.
    auto reserved = Parse({{"messages", c["messages"]}, {"chat_template_kwargs", {{"add_generation_prompt", false}}}},
                          true, t, &r);
    ASSERT_TRUE(reserved);
    EXPECT_EQ(reserved->param, "chat_template_kwargs");
  }
  // A built-in format takes none.
  GenerationRequest r;
  auto e = Parse({{"messages", ojson::parse(R"([{"role": "user", "content": "U"}])")},
                  {"chat_template_kwargs", {{"thinking", true}}}},
                 true, Chosen(json::object(), "deepseek_v3", "deepseek-v3"), &r);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "messages");
}

}  // namespace
}  // namespace lockstep::server
