// engine/tokenizer_load.cc — reading a Hugging Face tokenizer.json (and tokenizer_config.json)
// into Tokenizer::Impl (tokenizer_impl.h): the model, added tokens, normalizer, pre-tokenizer,
// post-processor and decoder, each a one-line error naming the field at fault; and Oniguruma's
// patterns translated to PCRE2. Encoding is tokenizer.cc.
#include "engine/tokenizer.h"

#include <cctype>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <tuple>

#include "engine/tokenizer_impl.h"

namespace lockstep::engine {

using namespace tokenizer_internal;  // NOLINT: the tokenizer's own helpers (tokenizer_impl.h)

namespace {

// Nesting of Sequence pre-tokenizers / normalizers / processors / decoders we follow.
constexpr int kMaxDepth = 16;

constexpr char kGpt2Pattern[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

// ---------------------------------------------------------------------------------------
// JSON access that names the field at fault.

std::string Quote(std::string_view s) {
  std::string out = "'";
  for (char c : s.substr(0, 60)) {
    if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned char>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  if (s.size() > 60) out += "...";
  return out + "'";
}

}  // namespace

namespace tokenizer_internal {

// ---------------------------------------------------------------------------------------
// Regex: PCRE2 standing in for the Oniguruma that HF uses.

// Oniguruma (Ruby syntax, UTF-8) differs from PCRE2 (UTF+UCP) where these rewrites say, as
// measured against HF in tests/fixtures/tokenizers/probes.json: `\s` is White_Space (with
// U+0085, without U+180E); `\w` is letters, marks, numbers, connector punctuation and other
// alphabetics (½ and ⓐ are word chars there); `\h` is a hex digit; `\uXXXX` is a code
// point. `^`/`$` are line anchors (done with PCRE2_MULTILINE). Nested classes and `&&` have
// no PCRE2 spelling and are refused. `\b` keeps PCRE2's notion of a word char.
Result<std::string> TranslateOnigPattern(std::string_view p) {
  // Unicode White_Space, spelled out: PCRE2's own \s also takes U+180E, Oniguruma's does not.
  static constexpr char kSpace[] =
      "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}"
      "\\x{205F}\\x{3000}";
  static constexpr char kWord[] = "\\p{L}\\p{M}\\p{N}\\p{Pc}\\p{Alphabetic}";
  static constexpr char kHex[] = "0-9A-Fa-f";
  std::string out;
  out.reserve(p.size() + 16);
  bool in_class = false;
  size_t class_start = 0;  // index in `p` just past "[" or "[^"
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      auto cls = [&](const char* body, bool negate) {
        if (in_class) {
          out += body;
        } else {
          out += negate ? "[^" : "[";
          out += body;
          out += "]";
        }
      };
      switch (e) {
        case 's':
          cls(kSpace, false);
          ++i;
          continue;
        case 'S':
          // Inside a class a negated set has no spelling; PCRE2's own \S is near enough there
          // (it differs on U+0085 and U+180E only).
          out += in_class ? "\\S" : std::string("[^") + kSpace + "]";
          ++i;
          continue;
        case 'w':
          cls(kWord, false);
          ++i;
          continue;
        case 'W':
          out += in_class ? "\\W" : std::string("[^") + kWord + "]";  // as \S
          ++i;
          continue;
        case 'h':
          cls(kHex, false);
          ++i;
          continue;
        case 'H':
          if (in_class) return Status::Unsupported("\\H inside a character class");
          cls(kHex, true);
          ++i;
          continue;
        case 'u':
          if (i + 6 <= p.size()) {
            const std::string_view hex = p.substr(i + 2, 4);
            if (std::all_of(hex.begin(), hex.end(),
                            [](char h) { return std::isxdigit(static_cast<unsigned char>(h)); })) {
              out += "\\x{";
              out += hex;
              out += "}";
              i += 5;
              continue;
            }
          }
          return Status::Unsupported("\\u not followed by four hex digits");
        default: {
          // Copy the escape whole, a multi-byte char included.
          const size_t len = Utf8CharLen(static_cast<unsigned char>(e));
          out += c;
          out += p.substr(i + 1, len);
          i += len;
          continue;
        }
      }
    }
    if (in_class) {
      if (c == ']' && i != class_start) {
        in_class = false;
      } else if (c == '[') {
        if (i + 1 < p.size() && (p[i + 1] == ':' || p[i + 1] == '=' || p[i + 1] == '.')) {
          const size_t close = p.find(std::string{p[i + 1], ']'}, i + 2);
          if (close == std::string_view::npos) return Status::Unsupported("unterminated POSIX class");
          out += p.substr(i, close + 2 - i);
          i = close + 1;
          continue;
        }
        return Status::Unsupported("nested character class (Oniguruma set operations)");
      } else if (c == '&' && i + 1 < p.size() && p[i + 1] == '&') {
        return Status::Unsupported("'&&' class intersection");
      }
      out += c;
      continue;
    }
    if (c == '[') {
      in_class = true;
      out += c;
      class_start = i + 1;
      if (i + 1 < p.size() && p[i + 1] == '^') {
        out += '^';
        ++i;
        class_start = i + 1;
      }
      continue;
    }
    out += c;
  }
  return out;
}

Result<std::unique_ptr<Regex>> Regex::Compile(std::string_view pattern, bool literal) {
  std::string translated;
  if (literal) {
    translated = pattern;
  } else {
    LS_ASSIGN_OR_RETURN(translated, TranslateOnigPattern(pattern));
  }
  pcre2_compile_context* ctx = pcre2_compile_context_create(nullptr);
  pcre2_set_newline(ctx, PCRE2_NEWLINE_LF);
  const uint32_t options = literal ? PCRE2_UTF | PCRE2_LITERAL : PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE;
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(), options,
                                   &error, &offset, ctx);
  pcre2_compile_context_free(ctx);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return Status::InvalidArgument("cannot compile: " + std::string(reinterpret_cast<char*>(message)) +
                                   " at offset " + std::to_string(offset));
  }
  // JIT is several times faster; the interpreter is the fallback where JIT is unavailable.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return std::unique_ptr<Regex>(new Regex(code));
}

}  // namespace tokenizer_internal

// ------------------------------------------------------------------------------ model

Status Tokenizer::Impl::ParseModel(const Parser& ps, const Json& model) {
  if (!model.is_object()) return ps.Bad("model", "expected an object, got " + TypeName(model));
  if (const Json* type = Parser::Get(model, "type")) {
    if (!type->is_string()) return ps.Bad("model.type", "expected a string");
    if (type->get<std::string>() != "BPE") {
      return ps.Unsupported("model.type",
                            "model type " + Quote(type->get<std::string>()) + " is not supported (only BPE)");
    }
  } else if (Parser::Get(model, "merges") == nullptr) {
    return ps.Unsupported("model.type", "missing, and the model has no merges: only BPE is supported");
  }
  if (const Json* d = Parser::Get(model, "dropout")) {
    if (!d->is_number()) return ps.Bad("model.dropout", "expected a number");
    if (d->get<double>() != 0.0) return ps.Unsupported("model.dropout", "BPE dropout makes encoding random; refused");
  }
  auto opt_string = [&](const char* key, std::optional<std::string>* out) -> Status {
    if (const Json* v = Parser::Get(model, key)) {
      if (!v->is_string()) return ps.Bad(std::string("model.") + key, "expected a string, got " + TypeName(*v));
      *out = v->get<std::string>();
    }
    return Status::Ok();
  };
  LS_RETURN_IF_ERROR(opt_string("unk_token", &unk_token));
  LS_RETURN_IF_ERROR(opt_string("continuing_subword_prefix", &continuing_subword_prefix));
  LS_RETURN_IF_ERROR(opt_string("end_of_word_suffix", &end_of_word_suffix));
  LS_ASSIGN_OR_RETURN(fuse_unk, ps.Bool(model, "model", "fuse_unk", false));
  LS_ASSIGN_OR_RETURN(byte_fallback, ps.Bool(model, "model", "byte_fallback", false));
  LS_ASSIGN_OR_RETURN(ignore_merges, ps.Bool(model, "model", "ignore_merges", false));

  const Json* v = Parser::Get(model, "vocab");
  if (v == nullptr) return ps.Bad("model.vocab", "missing");
  if (!v->is_object()) return ps.Bad("model.vocab", "expected an object, got " + TypeName(*v));
  vocab.reserve(v->size());
  for (auto it = v->begin(); it != v->end(); ++it) {
    LS_ASSIGN_OR_RETURN(int32_t id, ps.Id(it.value(), "model.vocab[" + Quote(it.key()) + "]"));
    vocab[it.key()] = id;
    vocab_size = std::max(vocab_size, id + 1);
  }

  const Json* m = Parser::Get(model, "merges");
  if (m == nullptr) return ps.Bad("model.merges", "missing");
  if (!m->is_array()) return ps.Bad("model.merges", "expected an array, got " + TypeName(*m));
  merges.reserve(m->size());
  const size_t prefix_len = continuing_subword_prefix ? continuing_subword_prefix->size() : 0;
  int32_t rank = 0;
  for (size_t i = 0; i < m->size(); ++i) {
    const Json& e = (*m)[i];
    const std::string field = "model.merges[" + std::to_string(i) + "]";
    std::string a, b;
    if (e.is_string()) {
      const std::string& line = e.get_ref<const std::string&>();
      if (line.rfind("#version", 0) == 0) continue;  // HF skips these header lines
      const size_t sp = line.find(' ');
      if (sp == std::string::npos || line.find(' ', sp + 1) != std::string::npos) {
        return ps.Bad(field, "expected \"left right\" with exactly one space, got " + Quote(line));
      }
      a = line.substr(0, sp);
      b = line.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    } else {
      return ps.Bad(field, "expected \"left right\" or [left, right], got " + e.dump().substr(0, 60));
    }
    auto ia = vocab.find(a);
    if (ia == vocab.end()) return ps.Bad(field, "unknown token " + Quote(a));
    auto ib = vocab.find(b);
    if (ib == vocab.end()) return ps.Bad(field, "unknown token " + Quote(b));
    std::string joined = a + b.substr(std::min(prefix_len, b.size()));
    auto ij = vocab.find(joined);
    if (ij == vocab.end()) return ps.Bad(field, "merged token " + Quote(joined) + " is not in model.vocab");
    const uint64_t key =
        (static_cast<uint64_t>(static_cast<uint32_t>(ia->second)) << 32) | static_cast<uint32_t>(ib->second);
    merges[key] = Merge{rank, ij->second};  // a repeated pair keeps its last rank, as in HF
    ++rank;
  }
  if (unk_token && vocab.find(*unk_token) == vocab.end()) {
    return ps.Bad("model.unk_token", Quote(*unk_token) + " is not in model.vocab");
  }
  return Status::Ok();
}

Status Tokenizer::Impl::ParseAddedTokens(const Parser& ps, const Json& root) {
  const Json* list = Parser::Get(root, "added_tokens");
  if (list == nullptr) return Status::Ok();
  if (!list->is_array()) return ps.Bad("added_tokens", "expected an array, got " + TypeName(*list));
  // HF does not take the listed ids as given: it re-adds the tokens in order, and each gets
  // the id its content already has (an earlier added token, else the model vocab), else the
  // next id past the model's vocab. Files HF wrote come out as listed; edited ones come out
  // as HF would encode them. A later definition of a content replaces the earlier one.
  int64_t next_id = static_cast<int64_t>(vocab.size());
  std::map<int32_t, AddedToken> by_id;
  for (size_t i = 0; i < list->size(); ++i) {
    const Json& t = (*list)[i];
    const std::string path = "added_tokens[" + std::to_string(i) + "]";
    if (!t.is_object()) return ps.Bad(path, "expected an object, got " + TypeName(t));
    AddedToken a;
    const Json* id = Parser::Get(t, "id");
    if (id == nullptr) return ps.Bad(path + ".id", "missing");
    LS_ASSIGN_OR_RETURN(a.id, ps.Id(*id, path + ".id"));
    LS_ASSIGN_OR_RETURN(a.content, ps.String(t, path, "content"));
    LS_ASSIGN_OR_RETURN(a.special, ps.Bool(t, path, "special", false));
    LS_ASSIGN_OR_RETURN(a.single_word, ps.Bool(t, path, "single_word", false));
    LS_ASSIGN_OR_RETURN(a.lstrip, ps.Bool(t, path, "lstrip", false));
    LS_ASSIGN_OR_RETURN(a.rstrip, ps.Bool(t, path, "rstrip", false));
    LS_ASSIGN_OR_RETURN(a.normalized, ps.Bool(t, path, "normalized", !a.special));
    if (a.content.empty()) continue;  // HF ignores these
    if (auto it = added_by_content.find(a.content); it != added_by_content.end()) {
      a.id = it->second;
    } else if (auto v = vocab.find(a.content); v != vocab.end()) {
      a.id = v->second;
    } else {
      if (next_id >= kMaxId) return ps.Bad(path, "too many added tokens");
      a.id = static_cast<int32_t>(next_id++);
    }
    added_by_content[a.content] = a.id;
    vocab_size = std::max(vocab_size, a.id + 1);
    by_id[a.id] = std::move(a);
  }
  for (auto& [id, a] : by_id) {
    const int32_t index = static_cast<int32_t>(added.size());
    (a.normalized ? normalized_trie : raw_trie).Insert(a.content, index);
    added.push_back(std::move(a));
  }
  return Status::Ok();
}

Status Tokenizer::Impl::ParseNormalizer(const Parser& ps, const Json& n, const std::string& path, int depth) {
  if (n.is_null()) return Status::Ok();
  if (depth > kMaxDepth) return ps.Unsupported(path, "nested too deeply");
  if (!n.is_object()) return ps.Bad(path, "expected an object, got " + TypeName(n));
  LS_ASSIGN_OR_RETURN(std::string type, ps.String(n, path, "type"));
  if (type == "Sequence") {
    const Json* list = Parser::Get(n, "normalizers");
    if (list == nullptr) return ps.Bad(path + ".normalizers", "missing");
    if (!list->is_array()) return ps.Bad(path + ".normalizers", "expected an array");
    for (size_t i = 0; i < list->size(); ++i) {
      LS_RETURN_IF_ERROR(ParseNormalizer(ps, (*list)[i], path + ".normalizers[" + std::to_string(i) + "]", depth + 1));
    }
    return Status::Ok();
  }
  return ps.Unsupported(path + ".type",
                        "normalizer " + Quote(type) + " is not supported (byte-level BPE tokenizers have none)");
}

Status Tokenizer::Impl::ParsePreTokenizer(const Parser& ps, const Json& p, const std::string& path, int depth) {
  if (p.is_null()) return Status::Ok();
  if (depth > kMaxDepth) return ps.Unsupported(path, "nested too deeply");
  if (!p.is_object()) return ps.Bad(path, "expected an object, got " + TypeName(p));
  LS_ASSIGN_OR_RETURN(std::string type, ps.String(p, path, "type"));
  if (type == "Sequence") {
    const Json* list = Parser::Get(p, "pretokenizers");
    if (list == nullptr) return ps.Bad(path + ".pretokenizers", "missing");
    if (!list->is_array()) return ps.Bad(path + ".pretokenizers", "expected an array");
    for (size_t i = 0; i < list->size(); ++i) {
      LS_RETURN_IF_ERROR(
          ParsePreTokenizer(ps, (*list)[i], path + ".pretokenizers[" + std::to_string(i) + "]", depth + 1));
    }
    return Status::Ok();
  }
  PreStep step;
  if (type == "ByteLevel") {
    step.byte_level = true;
    LS_ASSIGN_OR_RETURN(step.add_prefix_space, ps.Bool(p, path, "add_prefix_space", true));
    LS_ASSIGN_OR_RETURN(step.use_regex, ps.Bool(p, path, "use_regex", true));
    if (step.use_regex && gpt2_regex == nullptr) {
      auto r = Regex::Compile(kGpt2Pattern, false);
      if (!r.ok()) return Status::Internal(ps.origin() + ": GPT-2 pattern: " + r.status().message());
      gpt2_regex = std::move(r).value();
    }
  } else if (type == "Split") {
    const Json* pattern = Parser::Get(p, "pattern");
    if (pattern == nullptr) return ps.Bad(path + ".pattern", "missing");
    if (!pattern->is_object() || pattern->size() != 1) {
      return ps.Bad(path + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
    }
    const std::string kind = pattern->begin().key();
    const Json& text = pattern->begin().value();
    if ((kind != "Regex" && kind != "String") || !text.is_string()) {
      return ps.Bad(path + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
    }
    auto r = Regex::Compile(text.get_ref<const std::string&>(), kind == "String");
    if (!r.ok()) {
      const std::string field = path + ".pattern." + kind;
      if (r.status().code() == Status::Code::kUnsupported) return ps.Unsupported(field, r.status().message());
      return ps.Bad(field, r.status().message());
    }
    step.regex = std::move(r).value();
    LS_ASSIGN_OR_RETURN(std::string behavior, ps.String(p, path, "behavior"));
    static const std::pair<const char*, Behavior> kBehaviors[] = {{"Removed", Behavior::kRemoved},
                                                                  {"Isolated", Behavior::kIsolated},
                                                                  {"MergedWithPrevious", Behavior::kMergedWithPrevious},
                                                                  {"MergedWithNext", Behavior::kMergedWithNext},
                                                                  {"Contiguous", Behavior::kContiguous}};
    bool found = false;
    for (const auto& [name, value] : kBehaviors) {
      if (behavior == name) {
        step.behavior = value;
        found = true;
      }
    }
    if (!found) return ps.Unsupported(path + ".behavior", "split behavior " + Quote(behavior) + " is not supported");
    LS_ASSIGN_OR_RETURN(step.invert, ps.Bool(p, path, "invert", false));
  } else {
    return ps.Unsupported(path + ".type",
                          "pre-tokenizer " + Quote(type) + " is not supported (only Split, ByteLevel, Sequence)");
  }
  pre_steps.push_back(std::move(step));
  return Status::Ok();
}

Status Tokenizer::Impl::ParsePostProcessor(const Parser& ps, const Json& p, const std::string& path, int depth) {
  if (p.is_null()) return Status::Ok();
  if (depth > kMaxDepth) return ps.Unsupported(path, "nested too deeply");
  if (!p.is_object()) return ps.Bad(path, "expected an object, got " + TypeName(p));
  LS_ASSIGN_OR_RETURN(std::string type, ps.String(p, path, "type"));
  if (type == "Sequence") {
    const Json* list = Parser::Get(p, "processors");
    if (list == nullptr) return ps.Bad(path + ".processors", "missing");
    if (!list->is_array()) return ps.Bad(path + ".processors", "expected an array");
    for (size_t i = 0; i < list->size(); ++i) {
      LS_RETURN_IF_ERROR(
          ParsePostProcessor(ps, (*list)[i], path + ".processors[" + std::to_string(i) + "]", depth + 1));
    }
    return Status::Ok();
  }
  if (type == "ByteLevel") return Status::Ok();  // only trims offsets, which we don't keep
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    // "cls": ["<s>", 0], "sep": ["</s>", 2]; a single sequence becomes cls A sep.
    auto token = [&](const char* key) -> Result<int32_t> {
      const Json* v = Parser::Get(p, key);
      const std::string field = path + "." + key;
      if (v == nullptr) return ps.Bad(field, "missing");
      if (!v->is_array() || v->size() != 2 || !(*v)[0].is_string()) return ps.Bad(field, "expected [token, id]");
      return ps.Id((*v)[1], field + "[1]");
    };
    LS_ASSIGN_OR_RETURN(int32_t cls, token("cls"));
    LS_ASSIGN_OR_RETURN(int32_t sep, token("sep"));
    post_steps.push_back({TemplateItem{false, {cls}}, TemplateItem{true, {}}, TemplateItem{false, {sep}}});
    return Status::Ok();
  }
  if (type == "TemplateProcessing") {
    const Json* single = Parser::Get(p, "single");
    if (single == nullptr) return ps.Bad(path + ".single", "missing");
    if (!single->is_array()) return ps.Bad(path + ".single", "expected an array");
    const Json* specials = Parser::Get(p, "special_tokens");
    std::vector<TemplateItem> items;
    for (size_t i = 0; i < single->size(); ++i) {
      const Json& piece = (*single)[i];
      const std::string field = path + ".single[" + std::to_string(i) + "]";
      if (const Json* seq = Parser::Get(piece, "Sequence")) {
        LS_ASSIGN_OR_RETURN(std::string which, ps.String(*seq, field + ".Sequence", "id"));
        if (which != "A") return ps.Bad(field + ".Sequence.id", "a single-sequence template can only hold A");
        items.push_back(TemplateItem{true, {}});
      } else if (const Json* sp = Parser::Get(piece, "SpecialToken")) {
        LS_ASSIGN_OR_RETURN(std::string name, ps.String(*sp, field + ".SpecialToken", "id"));
        const Json* entry = specials != nullptr ? Parser::Get(*specials, name.c_str()) : nullptr;
        if (entry == nullptr) {
          return ps.Bad(path + ".special_tokens", "no entry for " + Quote(name) + " used by " + field);
        }
        const std::string efield = path + ".special_tokens[" + Quote(name) + "].ids";
        const Json* ids = Parser::Get(*entry, "ids");
        if (ids == nullptr || !ids->is_array()) return ps.Bad(efield, "expected an array of ids");
        TemplateItem item;
        for (size_t k = 0; k < ids->size(); ++k) {
          LS_ASSIGN_OR_RETURN(int32_t id, ps.Id((*ids)[k], efield + "[" + std::to_string(k) + "]"));
          item.ids.push_back(id);
        }
        items.push_back(std::move(item));
      } else {
        return ps.Bad(field, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
      }
    }
    post_steps.push_back(std::move(items));
    return Status::Ok();
  }
  return ps.Unsupported(path + ".type", "post-processor " + Quote(type) + " is not supported");
}

// tokenizer_config.json's add_bos_token / add_eos_token. transformers' LlamaTokenizerFast (the
// class DeepSeek's files name; add_bos_token defaults to true there, add_eos_token to false)
// and transformers 5's TokenizersBackend, given either flag, replace tokenizer.json's
// post-processor with TemplateProcessing "[bos] $A [eos]" (update_post_processor). DeepSeek-V3's
// tokenizer.json has a ByteLevel post-processor and no BOS of its own: without this step a
// prompt starts without the <｜begin▁of▁sentence｜> that vLLM and sglang put first.
Status Tokenizer::Impl::ApplyConfig(const Parser& cs, const Json& config) {
  if (!config.is_object()) return cs.Bad("(top level)", "expected an object, got " + TypeName(config));
  std::string cls;
  if (const Json* c = Parser::Get(config, "tokenizer_class"); c != nullptr && c->is_string()) cls = c->get<std::string>();
  const bool llama = cls == "LlamaTokenizerFast" || cls == "LlamaTokenizer";
  const Json* bos_flag = Parser::Get(config, "add_bos_token");
  const Json* eos_flag = Parser::Get(config, "add_eos_token");
  if (!llama && bos_flag == nullptr && eos_flag == nullptr) return Status::Ok();  // tokenizer.json decides
  LS_ASSIGN_OR_RETURN(const bool add_bos, cs.Bool(config, "(top level)", "add_bos_token", llama));
  LS_ASSIGN_OR_RETURN(const bool add_eos, cs.Bool(config, "(top level)", "add_eos_token", false));
  // bos_token / eos_token: a string, or an AddedToken object {"content": …}.
  auto token_id = [&](const char* key, const char* flag) -> Result<int32_t> {
    const Json* v = Parser::Get(config, key);
    std::string content;
    if (v != nullptr && v->is_string()) {
      content = v->get<std::string>();
    } else if (v != nullptr && v->is_object() && Parser::Get(*v, "content") && (*v)["content"].is_string()) {
      content = (*v)["content"].get<std::string>();
    } else {
      return cs.Bad(key, std::string(flag) + " is true but " + key + " is " +
                             (v == nullptr ? "missing" : "neither a string nor {\"content\": …}"));
    }
    if (auto a = added_by_content.find(content); a != added_by_content.end()) return a->second;
    if (auto it = vocab.find(content); it != vocab.end()) return it->second;
    return cs.Bad(key, Quote(content) + " is not a token of tokenizer.json");
  };
  std::vector<TemplateItem> single;
  if (add_bos) {
    LS_ASSIGN_OR_RETURN(int32_t id, token_id("bos_token", "add_bos_token"));
    single.push_back(TemplateItem{false, {id}});
  }
  single.push_back(TemplateItem{true, {}});
  if (add_eos) {
    LS_ASSIGN_OR_RETURN(int32_t id, token_id("eos_token", "add_eos_token"));
    single.push_back(TemplateItem{false, {id}});
  }
  post_steps.clear();
  post_steps.push_back(std::move(single));
  return Status::Ok();
}

Status Tokenizer::Impl::ParseDecoder(const Parser& ps, const Json& d, const std::string& path, int depth) {
  if (d.is_null()) return Status::Ok();
  if (depth > kMaxDepth) return ps.Unsupported(path, "nested too deeply");
  if (!d.is_object()) return ps.Bad(path, "expected an object, got " + TypeName(d));
  LS_ASSIGN_OR_RETURN(std::string type, ps.String(d, path, "type"));
  if (type == "ByteLevel") {
    decoder = DecoderKind::kByteLevel;
    return Status::Ok();
  }
  if (type == "Sequence") {
    const Json* list = Parser::Get(d, "decoders");
    if (list == nullptr) return ps.Bad(path + ".decoders", "missing");
    if (!list->is_array() || list->size() != 1) {
      return ps.Unsupported(path + ".decoders", "only a Sequence of one ByteLevel decoder is supported");
    }
    return ParseDecoder(ps, (*list)[0], path + ".decoders[0]", depth + 1);
  }
  return ps.Unsupported(path + ".type", "decoder " + Quote(type) + " is not supported (only ByteLevel)");
}

void Tokenizer::Impl::Finish() {
  id_to_token.assign(vocab_size, std::string());
  has_token.assign(vocab_size, 0);
  is_special.assign(vocab_size, 0);
  for (const auto& [token, id] : vocab) {
    // Two tokens with one id: keep the smaller string, so the choice does not depend on
    // hash order.
    if (!has_token[id] || token < id_to_token[id]) id_to_token[id] = token;
    has_token[id] = 1;
  }
  for (const AddedToken& a : added) {
    id_to_token[a.id] = a.content;
    has_token[a.id] = 1;
    is_special[a.id] = a.special;
  }
  char_id.assign(0x800, -1);
  for (const auto& [token, id] : vocab) {
    if (token.empty() || static_cast<unsigned char>(token[0]) >= 0xE0) continue;
    size_t len = 0;
    const char32_t cp = DecodeUtf8(token, 0, &len);
    if (len == token.size() && cp < char_id.size()) char_id[cp] = id;
  }
  // The ByteLevel decoder turns a token back into bytes only when every char of it is in the
  // byte alphabet; other tokens (most added tokens) stand for their own UTF-8.
  decoded.assign(vocab_size, std::string());
  const ByteAlphabet& alpha = Alphabet();
  for (int32_t id = 0; id < vocab_size; ++id) {
    if (!has_token[id]) continue;
    const std::string& t = id_to_token[id];
    if (decoder != DecoderKind::kByteLevel) {
      decoded[id] = t;
      continue;
    }
    std::string bytes;
    bool all_mapped = true;
    for (size_t i = 0; i < t.size();) {
      size_t len = 0;
      const char32_t cp = DecodeUtf8(t, i, &len);
      if (cp >= alpha.cp_to_byte.size() || alpha.cp_to_byte[cp] < 0) {
        all_mapped = false;
        break;
      }
      bytes.push_back(static_cast<char>(alpha.cp_to_byte[cp]));
      i += len;
    }
    decoded[id] = all_mapped ? std::move(bytes) : t;
  }
}

Result<std::shared_ptr<const Tokenizer>> Tokenizer::Load(const std::filesystem::path& path) {
  std::error_code dir_ec;
  if (std::filesystem::is_directory(path, dir_ec)) return Status::IoError(path.string() + ": is a directory");
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) return Status::NotFound(path.string() + ": no such file");
    return Status::IoError(path.string() + ": cannot open for reading");
  }
  std::ostringstream buf;
  buf << in.rdbuf();
  if (in.bad()) return Status::IoError(path.string() + ": read failed");
  // transformers reads tokenizer_config.json beside tokenizer.json; so do we (only the flags
  // that change the ids, see ApplyConfig).
  const std::filesystem::path config_path = path.parent_path() / "tokenizer_config.json";
  std::ifstream cin(config_path, std::ios::binary);
  if (!cin) return FromJson(buf.str(), path.string());
  std::ostringstream config;
  config << cin.rdbuf();
  if (cin.bad()) return Status::IoError(config_path.string() + ": read failed");
  return FromJson(buf.str(), path.string(), config.str(), config_path.string());
}

Result<std::shared_ptr<const Tokenizer>> Tokenizer::FromJson(std::string_view json, std::string origin) {
  return FromJson(json, std::move(origin), std::string_view(), std::string());
}

Result<std::shared_ptr<const Tokenizer>> Tokenizer::FromJson(std::string_view json, std::string origin,
                                                              std::string_view config_json, std::string config_origin) {
  Parser ps(std::move(origin));
  Json root;
  try {
    root = Json::parse(json.begin(), json.end());
  } catch (const Json::parse_error& e) {
    std::string what = e.what();
    // "[json.exception.parse_error.101] parse error at line 1, column 2: ..." → the tail.
    const size_t colon = what.find(": ");
    if (colon != std::string::npos) what = what.substr(colon + 2);
    return Status::Corruption(ps.origin() + ": (JSON) malformed at byte " + std::to_string(e.byte) + ": " + what);
  } catch (const std::exception& e) {
    return Status::Corruption(ps.origin() + ": (JSON) malformed: " + e.what());
  }
  if (!root.is_object()) return ps.Bad("(top level)", "expected an object, got " + TypeName(root));

  auto impl = std::make_unique<Impl>();
  try {
    const Json* model = Parser::Get(root, "model");
    if (model == nullptr) return ps.Bad("model", "missing");
    LS_RETURN_IF_ERROR(impl->ParseModel(ps, *model));
    LS_RETURN_IF_ERROR(impl->ParseAddedTokens(ps, root));
    if (const Json* n = Parser::Get(root, "normalizer"))
      LS_RETURN_IF_ERROR(impl->ParseNormalizer(ps, *n, "normalizer", 0));
    if (const Json* p = Parser::Get(root, "pre_tokenizer")) {
      LS_RETURN_IF_ERROR(impl->ParsePreTokenizer(ps, *p, "pre_tokenizer", 0));
    }
    if (const Json* p = Parser::Get(root, "post_processor")) {
      LS_RETURN_IF_ERROR(impl->ParsePostProcessor(ps, *p, "post_processor", 0));
    }
    if (const Json* d = Parser::Get(root, "decoder")) LS_RETURN_IF_ERROR(impl->ParseDecoder(ps, *d, "decoder", 0));
  } catch (const std::exception& e) {
    // nlohmann throws on type mismatches we did not foresee; keep them one-line errors.
    return Status::Corruption(ps.origin() + ": unexpected JSON shape: " + e.what());
  }
  if (!config_json.empty()) {
    const Parser cs(std::move(config_origin));
    const Json config = Json::parse(config_json.begin(), config_json.end(), nullptr, /*allow_exceptions=*/false);
    if (config.is_discarded()) return Status::Corruption(cs.origin() + ": (JSON) malformed");
    try {
      LS_RETURN_IF_ERROR(impl->ApplyConfig(cs, config));
    } catch (const std::exception& e) {
      return Status::Corruption(cs.origin() + ": unexpected JSON shape: " + e.what());
    }
  }
  impl->Finish();
  return std::shared_ptr<const Tokenizer>(new Tokenizer(std::move(impl)));
}

}  // namespace lockstep::engine
