// tests/server/chat_template_test.cc — the built-in DeepSeek chat formats (server/openai.h):
// which one a tokenizer_config.json selects, and what each renders.
//
// Expected strings are hand-derived: each is what transformers' apply_chat_template(messages,
// tokenize=False, add_generation_prompt=True) yields when the model's Jinja template is read
// step by step (the templates are quoted below where a test feeds them in), and for V3.2,
// which ships no Jinja template, what DeepSeek's encoding/encoding_dsv32.py encode_messages(
// messages, thinking_mode="chat") returns. transformers cannot run here; the derivations are
// in the comments.
#include <gtest/gtest.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "server/openai.h"
#include "tests/test_util.h"

namespace lockstep::server {
namespace {

using json = nlohmann::json;

const std::string B = "<｜begin▁of▁sentence｜>";
const std::string E = "<｜end▁of▁sentence｜>";

// deepseek-ai/DeepSeek-V2-Chat and DeepSeek-V2-Lite-Chat, tokenizer_config.json chat_template.
const char* kV2Template =
    R"({% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}{{ message['content'] + '\n\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %})";

// deepseek-ai/DeepSeek-V3, tokenizer_config.json chat_template.
const char* kV3Template =
    R"({% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls']%}{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- set ns.is_first = true -%}{%- else %}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %})";

json Msgs(std::initializer_list<std::pair<const char*, const char*>> m) {
  json a = json::array();
  for (const auto& [role, content] : m) a.push_back({{"role", role}, {"content", content}});
  return a;
}

// A system prompt, a turn, and a second question: every branch the formats differ in.
const json kTurns = Msgs({{"system", "S"}, {"user", "U1"}, {"assistant", "A1"}, {"user", "U2"}});

ChatTemplate Chosen(const json& config, const std::string& model_type = "deepseek_v3") {
  auto t = ChatTemplate::Choose(config, model_type, "");
  EXPECT_TRUE(t.ok()) << t.status().message();
  return t.ok() ? *t : ChatTemplate{};
}

std::string Render(const ChatTemplate& t, const json& messages) {
  auto s = t.Apply(messages);
  EXPECT_TRUE(s.ok()) << s.status().message();
  return s.ok() ? *s : "";
}

TEST(ChatTemplateTest, V2IsRecognisedAndRendered) {
  const ChatTemplate t = Chosen({{"chat_template", kV2Template}, {"bos_token", B}, {"eos_token", E}});
  EXPECT_EQ(t.style, ChatStyle::kV2);
  // {{ bos_token }}; system → content + '\n\n'; user → 'User: ' + content + '\n\n';
  // assistant → 'Assistant: ' + content + eos_token; add_generation_prompt → 'Assistant:'.
  EXPECT_EQ(Render(t, kTurns), B + "S\n\nUser: U1\n\nAssistant: A1" + E + "User: U2\n\nAssistant:");
  // Roles the template does not name render nothing.
  EXPECT_EQ(Render(t, Msgs({{"user", "U"}, {"tool", "T"}})), B + "User: U\n\nAssistant:");
}

TEST(ChatTemplateTest, V3IsRecognisedAndRendered) {
  // bos_token as transformers' AddedToken object, as DeepSeek-V3's file has it.
  const ChatTemplate t = Chosen({{"chat_template", kV3Template}, {"bos_token", {{"__type", "AddedToken"}, {"content", B}}}});
  EXPECT_EQ(t.style, ChatStyle::kV3);
  EXPECT_EQ(t.bos, B);
  // First loop: ns.system_prompt = "S". Then {{ bos_token }}{{ ns.system_prompt }}; user →
  // '<｜User｜>' + content; assistant with content, not after a tool → '<｜Assistant｜>' +
  // content + '<｜end▁of▁sentence｜>'; add_generation_prompt and not ns.is_tool → '<｜Assistant｜>'.
  EXPECT_EQ(Render(t, kTurns), B + "S<｜User｜>U1<｜Assistant｜>A1" + E + "<｜User｜>U2<｜Assistant｜>");
  // Every system message is hoisted behind bos, joined by '\n\n' (the is_first_sp branch).
  EXPECT_EQ(Render(t, Msgs({{"system", "S1"}, {"user", "U"}, {"system", "S2"}})), B + "S1\n\nS2<｜User｜>U<｜Assistant｜>");
  // No system message: ns.system_prompt stays ''.
  EXPECT_EQ(Render(t, Msgs({{"user", "U"}})), B + "<｜User｜>U<｜Assistant｜>");
}

TEST(ChatTemplateTest, V32WithoutTemplateUsesTheChatModeEncoding) {
  // DeepSeek-V3.2 ships no chat_template (encoding/encoding_dsv32.py instead).
  const ChatTemplate t = Chosen({{"bos_token", B}, {"eos_token", E}}, "deepseek_v32");
  EXPECT_EQ(t.style, ChatStyle::kV32);
  // encode_messages(..., thinking_mode="chat"): bos; system → content; user →
  // "<｜User｜>{content}<｜Assistant｜>" + "</think>" (chat mode, every user turn); assistant →
  // "{reasoning}{content}{tool_calls}<｜end▁of▁sentence｜>" with reasoning "" in chat mode.
  // Nothing is appended at the end: the last user turn already opened the reply.
  EXPECT_EQ(Render(t, kTurns),
            B + "S<｜User｜>U1<｜Assistant｜></think>A1" + E + "<｜User｜>U2<｜Assistant｜></think>");
}

TEST(ChatTemplateTest, TheEmbeddedModelsTemplateIsRecognised) {
  std::ifstream in(testing::SourceDir() / "models" / "lockstep-tiny-v32" / "tokenizer_config.json");
  const json config = json::parse(in);
  const ChatTemplate t = Chosen(config, "deepseek_v32");
  EXPECT_EQ(t.style, ChatStyle::kEmbedded);
  // {{ bos_token }}; user → <｜User｜>content; assistant → <｜Assistant｜>content<｜end▁of▁sentence｜>;
  // anything else → content, in place; add_generation_prompt → <｜Assistant｜>.
  EXPECT_EQ(Render(t, kTurns), B + "S<｜User｜>U1<｜Assistant｜>A1" + E + "<｜User｜>U2<｜Assistant｜>");
  EXPECT_EQ(Render(t, Msgs({{"user", "U"}, {"system", "S"}})), B + "<｜User｜>US<｜Assistant｜>");
  // Content given as text parts.
  json parts = json::array({{{"role", "user"}, {"content", json::array({{{"type", "text"}, {"text", "a"}}, {{"type", "text"}, {"text", "b"}}})}}});
  EXPECT_EQ(Render(t, parts), B + "<｜User｜>ab<｜Assistant｜>");
}

TEST(ChatTemplateTest, UnknownTemplatesAreRefusedAtStartUp) {
  // ChatML, and DeepSeek-R1's (V3's markers plus <think>), are not formats lockstep renders.
  for (const char* tmpl :
       {"{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'}}{% endfor %}",
        "{{ bos_token }}{{'<｜User｜>' + message['content']}}{{'<｜Assistant｜><think>\\n'}}"}) {
    auto t = ChatTemplate::Choose({{"chat_template", tmpl}}, "deepseek_v3", "");
    ASSERT_FALSE(t.ok()) << tmpl;
    EXPECT_NE(t.status().message().find("--chat-template"), std::string::npos) << t.status().message();
  }
  // R1's template differs from V3's only by the reasoning markers; it is not taken for V3.
  std::string r1 = kV3Template;
  r1.replace(r1.rfind("{{'<｜Assistant｜>'}}"), std::string("{{'<｜Assistant｜>'}}").size(), "{{'<｜Assistant｜><think>\\n'}}");
  EXPECT_FALSE(ChatTemplate::Choose({{"chat_template", r1}}, "deepseek_v3", "").ok());
  // --chat-template overrides, and names are checked.
  auto forced = ChatTemplate::Choose({{"chat_template", "whatever"}}, "deepseek_v3", "deepseek-v3");
  ASSERT_TRUE(forced.ok());
  EXPECT_EQ(forced->style, ChatStyle::kV3);
  EXPECT_FALSE(ChatTemplate::Choose(json::object(), "deepseek_v3", "llama3").ok());
}

TEST(ChatTemplateTest, NoTemplateMeansNoChat) {
  const ChatTemplate t = Chosen(json::object(), "deepseek_v2");
  EXPECT_EQ(t.style, ChatStyle::kNone);
  auto s = t.Apply(Msgs({{"user", "U"}}));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("no chat template"), std::string::npos);
}

TEST(ChatTemplateTest, ToolCallsAreRefusedNotApproximated) {
  ChatTemplate t;
  t.style = ChatStyle::kV3;
  json m = Msgs({{"user", "U"}});
  m.push_back({{"role", "assistant"}, {"content", nullptr}, {"tool_calls", json::array({{{"type", "function"}}})}});
  EXPECT_FALSE(t.Apply(m).ok());
  EXPECT_FALSE(t.Apply(Msgs({{"user", "U"}, {"tool", "T"}})).ok());
}

}  // namespace
}  // namespace lockstep::server
