// engine/tokenizer.cc — Hugging Face `tokenizer.json` byte-level BPE (see tokenizer.h).
//
// The ids must equal the ones Hugging Face `tokenizers` gives, since a replayed run is only
// comparable to a recorded one when both saw the same prompt ids. So every stage follows HF's
// observable behaviour, quirks included: the two-pass added-token split, Oniguruma regex
// semantics (translated to PCRE2), the empty-match rules of its find-iterator, the
// heap-ordered merge loop (which decides ties), and from_utf8_lossy on decode. The fixtures
// under tests/fixtures/tokenizers/ are HF's own output and pin all of this down.
#include "engine/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>
#include <unordered_map>
#include <utility>

namespace lockstep::engine {
namespace {

using Json = nlohmann::json;

// Ids past this are refused: a real vocabulary is far smaller, and a corrupt file must not
// make us allocate gigabytes for the id → token table.
constexpr int64_t kMaxId = int64_t{1} << 24;
// Nesting of Sequence pre-tokenizers / normalizers / processors / decoders we follow.
constexpr int kMaxDepth = 16;
// HF caches words shorter than this many bytes, up to this many words.
constexpr size_t kCacheMaxWordBytes = 256;
constexpr size_t kCacheCapacity = 10000;

// ---------------------------------------------------------------------------------------
// UTF-8

void AppendUtf8(std::string* out, char32_t cp) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Length of the well-formed UTF-8 sequence at s[i], or, negated, the length of the maximal
// ill-formed subpart there (Unicode's "substitution of maximal subparts", which is what
// Rust's from_utf8_lossy does: one U+FFFD per such subpart).
int ScanUtf8(std::string_view s, size_t i) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  const unsigned char c = p[i];
  if (c < 0x80) return 1;
  int need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return -1;
  }
  int k = 1;
  for (; k <= need; ++k) {
    if (i + k >= n) return -k;
    const unsigned char b = p[i + k];
    const unsigned char bl = (k == 1) ? lo : 0x80, bh = (k == 1) ? hi : 0xBF;
    if (b < bl || b > bh) return -k;
  }
  return need + 1;
}

// `s` with every ill-formed subpart replaced by U+FFFD; `s` itself (no copy) when valid.
std::string_view ToValidUtf8(std::string_view s, std::string* storage) {
  size_t i = 0;
  while (i < s.size()) {
    const int len = ScanUtf8(s, i);
    if (len < 0) break;
    i += len;
  }
  if (i == s.size()) return s;
  storage->assign(s.substr(0, i));
  while (i < s.size()) {
    const int len = ScanUtf8(s, i);
    if (len > 0) {
      storage->append(s.substr(i, len));
      i += len;
    } else {
      storage->append("\xEF\xBF\xBD");
      i += -len;
    }
  }
  return *storage;
}

// Decodes the (valid) UTF-8 char at s[i].
char32_t DecodeUtf8(std::string_view s, size_t i, size_t* len) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + i;
  if (p[0] < 0x80) {
    *len = 1;
    return p[0];
  }
  if (p[0] < 0xE0) {
    *len = 2;
    return ((p[0] & 0x1F) << 6) | (p[1] & 0x3F);
  }
  if (p[0] < 0xF0) {
    *len = 3;
    return ((p[0] & 0x0F) << 12) | ((p[1] & 0x3F) << 6) | (p[2] & 0x3F);
  }
  *len = 4;
  return ((p[0] & 0x07) << 18) | ((p[1] & 0x3F) << 12) | ((p[2] & 0x3F) << 6) | (p[3] & 0x3F);
}

size_t Utf8CharLen(unsigned char lead) { return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4; }

// Start of the last char of non-empty valid UTF-8 `s`.
size_t LastCharStart(std::string_view s) {
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

// Rust's char::is_whitespace / regex `\s`: the Unicode White_Space property.
bool IsWhiteSpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// ---------------------------------------------------------------------------------------
// The GPT-2 byte-level alphabet: each byte gets a printable char so that BPE vocabularies
// never hold raw control bytes or spaces.

struct ByteAlphabet {
  std::array<char32_t, 256> byte_to_cp{};
  std::array<std::string, 256> byte_to_utf8;
  std::array<int16_t, 324> cp_to_byte{};  // -1 where the char is not in the alphabet

  ByteAlphabet() {
    cp_to_byte.fill(-1);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      byte_to_cp[b] = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
      AppendUtf8(&byte_to_utf8[b], byte_to_cp[b]);
      cp_to_byte[byte_to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteAlphabet& Alphabet() {
  static const ByteAlphabet kAlphabet;
  return kAlphabet;
}

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

class Regex {
 public:
  // `literal`: match `pattern` as plain text (HF's Split with a String pattern).
  static Result<std::unique_ptr<Regex>> Compile(std::string_view pattern, bool literal) {
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

  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // All matches in `subject`, as Oniguruma's find-iterator (which HF uses) yields them: an
  // empty match right where the previous match ended is skipped by one char, any other
  // empty match counts (so `x*` cuts "abc" between every char).
  void FindAll(std::string_view subject, pcre2_match_data* md, std::vector<std::pair<size_t, size_t>>* matches) const {
    matches->clear();
    size_t pos = 0;
    bool have_last = false;
    size_t last_end = 0;
    const auto* subj = reinterpret_cast<PCRE2_SPTR>(subject.data());
    while (pos <= subject.size()) {
      const int rc = pcre2_match(code_, subj, subject.size(), pos, PCRE2_NO_UTF_CHECK, md, nullptr);
      if (rc < 0) break;  // no match, or a resource limit: what is left stays unmatched
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      size_t s = ov[0], e = ov[1];
      if (s > e) s = e;  // \K can put the start past the end
      if (s == e && have_last && last_end == e) {
        if (pos >= subject.size()) break;
        pos += Utf8CharLen(static_cast<unsigned char>(subject[pos]));
        continue;
      }
      matches->emplace_back(s, e);
      pos = e;
      last_end = e;
      have_last = true;
    }
  }

 private:
  explicit Regex(pcre2_code* code) : code_(code) {}
  pcre2_code* code_;
};

// Owns a pcre2_match_data for one Encode call (the compiled patterns are shared).
class MatchData {
 public:
  MatchData() : md_(pcre2_match_data_create(1, nullptr)) {}
  ~MatchData() { pcre2_match_data_free(md_); }
  MatchData(const MatchData&) = delete;
  MatchData& operator=(const MatchData&) = delete;
  pcre2_match_data* get() const { return md_; }

 private:
  pcre2_match_data* md_;
};

// Rust regex's Unicode `\w` (used by HF for single_word added tokens).
bool IsRustWordChar(char32_t c) {
  if (c < 0x80) return std::isalnum(static_cast<int>(c)) || c == '_';
  static const std::unique_ptr<Regex> kWord = [] {
    auto r = Regex::Compile("[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}]", /*literal=*/false);
    return r.ok() ? std::move(r).value() : nullptr;
  }();
  if (kWord == nullptr) return false;
  std::string s;
  AppendUtf8(&s, c);
  MatchData md;
  std::vector<std::pair<size_t, size_t>> m;
  kWord->FindAll(s, md.get(), &m);
  return !m.empty() && m[0].first == 0 && m[0].second == s.size();
}

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

std::string TypeName(const Json& j) { return j.type_name(); }

class Parser {
 public:
  explicit Parser(std::string origin) : origin_(std::move(origin)) {}

  Status Bad(const std::string& field, const std::string& what) const {
    return Status::Corruption(origin_ + ": " + field + ": " + what);
  }
  Status Unsupported(const std::string& field, const std::string& what) const {
    return Status::Unsupported(origin_ + ": " + field + ": " + what);
  }

  // The member, or nullptr when absent or null.
  static const Json* Get(const Json& obj, const char* key) {
    if (!obj.is_object()) return nullptr;
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return nullptr;
    return &*it;
  }

  Result<std::string> String(const Json& obj, const std::string& path, const char* key) const {
    const Json* v = Get(obj, key);
    if (v == nullptr) return Bad(path + "." + key, "missing");
    if (!v->is_string()) return Bad(path + "." + key, "expected a string, got " + TypeName(*v));
    return v->get<std::string>();
  }

  Result<bool> Bool(const Json& obj, const std::string& path, const char* key, bool fallback) const {
    const Json* v = Get(obj, key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) return Bad(path + "." + key, "expected true or false, got " + TypeName(*v));
    return v->get<bool>();
  }

  Result<int32_t> Id(const Json& v, const std::string& field) const {
    if (!v.is_number_integer()) return Bad(field, "expected an integer id, got " + TypeName(v));
    const int64_t id =
        v.is_number_unsigned() ? static_cast<int64_t>(std::min<uint64_t>(v.get<uint64_t>(), kMaxId)) : v.get<int64_t>();
    if (id < 0 || id >= kMaxId)
      return Bad(field, "id " + v.dump() + " out of range [0, " + std::to_string(kMaxId) + ")");
    return static_cast<int32_t>(id);
  }

  const std::string& origin() const { return origin_; }

 private:
  std::string origin_;
};

// Heterogeneous lookup, so that hot paths look string_views up without building strings.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using StringIdMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

}  // namespace

// ---------------------------------------------------------------------------------------

struct Tokenizer::Impl {
  // --- added tokens
  struct AddedToken {
    int32_t id;
    std::string content;
    bool single_word, lstrip, rstrip, normalized, special;
  };
  // A byte trie over added-token contents; leftmost-longest matching (as HF's Aho-Corasick).
  struct Trie {
    std::vector<int32_t> terminal;                // per node: index into added_, or -1
    std::unordered_map<uint64_t, int32_t> edges;  // (node << 8 | byte) → child
    std::array<bool, 256> first_byte{};
    bool empty = true;

    Trie() { terminal.push_back(-1); }
    void Insert(std::string_view s, int32_t token_index) {
      if (s.empty()) return;
      empty = false;
      first_byte[static_cast<unsigned char>(s[0])] = true;
      int32_t node = 0;
      for (unsigned char b : s) {
        const uint64_t key = (static_cast<uint64_t>(node) << 8) | b;
        auto it = edges.find(key);
        if (it == edges.end()) {
          const int32_t child = static_cast<int32_t>(terminal.size());
          terminal.push_back(-1);
          edges.emplace(key, child);
          node = child;
        } else {
          node = it->second;
        }
      }
      terminal[node] = token_index;
    }
    // Longest token starting at s[i]: its length, and its index in *token.
    size_t LongestAt(std::string_view s, size_t i, int32_t* token) const {
      size_t best = 0;
      int32_t node = 0;
      for (size_t j = i; j < s.size(); ++j) {
        auto it = edges.find((static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(s[j]));
        if (it == edges.end()) break;
        node = it->second;
        if (terminal[node] >= 0) {
          best = j + 1 - i;
          *token = terminal[node];
        }
      }
      return best;
    }
  };

  // --- pre-tokenizer
  enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
  struct PreStep {
    bool byte_level = false;
    // Split
    std::unique_ptr<Regex> regex;
    Behavior behavior = Behavior::kIsolated;
    bool invert = false;
    // ByteLevel
    bool add_prefix_space = true;
    bool use_regex = true;
  };

  // --- post-processor: for add_special_tokens, each step wraps the ids (A) in its template.
  struct TemplateItem {
    bool is_sequence = false;
    std::vector<int32_t> ids;
  };

  // --- model
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };

  StringIdMap vocab;                     // model vocab
  std::vector<std::string> id_to_token;  // added tokens override the model's
  std::vector<uint8_t> has_token;
  std::vector<uint8_t> is_special;
  std::unordered_map<uint64_t, Merge> merges;  // (left id << 32 | right id) → merge
  std::vector<int32_t> char_id;                // single-char vocab ids by code point (< 0x800)
  std::optional<std::string> unk_token, continuing_subword_prefix, end_of_word_suffix;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
  int32_t vocab_size = 0;

  std::vector<AddedToken> added;
  StringIdMap added_by_content;
  Trie raw_trie, normalized_trie;

  std::vector<PreStep> pre_steps;
  std::unique_ptr<Regex> gpt2_regex;  // for ByteLevel use_regex
  std::vector<std::vector<TemplateItem>> post_steps;

  enum class DecoderKind { kNone, kByteLevel };
  DecoderKind decoder = DecoderKind::kNone;
  std::vector<std::string> decoded;  // per id: the bytes the decoder turns the token into

  mutable std::mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache;

  // ------------------------------------------------------------------ loading
  Status ParseModel(const Parser& ps, const Json& model);
  Status ParseAddedTokens(const Parser& ps, const Json& root);
  Status ParseNormalizer(const Parser& ps, const Json& n, const std::string& path, int depth);
  Status ParsePreTokenizer(const Parser& ps, const Json& p, const std::string& path, int depth);
  Status ParsePostProcessor(const Parser& ps, const Json& p, const std::string& path, int depth);
  Status ParseDecoder(const Parser& ps, const Json& d, const std::string& path, int depth);
  Status ApplyConfig(const Parser& cs, const Json& config);
  void Finish();

  // ------------------------------------------------------------------ encoding
  struct Segment {
    size_t begin, end;
    int32_t id;  // -1: plain text
  };
  void FindAddedTokens(std::string_view text, size_t base, const Trie& trie, std::vector<Segment>* out) const;
  void PreTokenizeInto(std::string_view text, pcre2_match_data* md, std::vector<std::string>* pieces) const;
  void BpeInto(std::string_view word, std::vector<int32_t>* out) const;
  void MergeWord(std::string_view word, std::vector<int32_t>* out) const;
  int32_t LookupSymbol(std::string_view s) const;
};

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

// ------------------------------------------------------------------------------ encoding

// HF's AddedVocabulary::find_matches on `text` (which sits at `base` in the whole input).
void Tokenizer::Impl::FindAddedTokens(std::string_view text, size_t base, const Trie& trie,
                                      std::vector<Segment>* out) const {
  if (trie.empty || text.empty()) {
    if (!text.empty()) out->push_back({base, base + text.size(), -1});
    return;
  }
  size_t start_offset = 0;
  size_t i = 0;
  while (i < text.size()) {
    if (!trie.first_byte[static_cast<unsigned char>(text[i])]) {
      ++i;
      continue;
    }
    int32_t index = -1;
    const size_t len = trie.LongestAt(text, i, &index);
    if (len == 0) {
      ++i;
      continue;
    }
    const AddedToken& tok = added[index];
    size_t start = i, stop = i + len;
    i = stop;  // the next search starts after this match, whatever happens to it
    if (tok.single_word) {
      bool start_ok = true, stop_ok = true;
      if (start > 0) {
        size_t l = 0;
        start_ok = !IsRustWordChar(DecodeUtf8(text, LastCharStart(text.substr(0, start)), &l));
      }
      if (stop < text.size()) {
        size_t l = 0;
        stop_ok = !IsRustWordChar(DecodeUtf8(text, stop, &l));
      }
      if (!start_ok || !stop_ok) continue;
    }
    if (tok.lstrip) {
      size_t s = start;
      while (s > 0) {
        const size_t c = LastCharStart(text.substr(0, s));
        size_t l = 0;
        if (!IsWhiteSpace(DecodeUtf8(text, c, &l))) break;
        s = c;
      }
      start = std::max(s, start_offset);
    }
    if (tok.rstrip) {
      while (stop < text.size()) {
        size_t l = 0;
        if (!IsWhiteSpace(DecodeUtf8(text, stop, &l))) break;
        stop += l;
      }
    }
    if (start_offset < start) out->push_back({base + start_offset, base + start, -1});
    out->push_back({base + start, base + stop, tok.id});
    start_offset = stop;
  }
  if (start_offset < text.size()) out->push_back({base + start_offset, base + text.size(), -1});
}

// HF's NormalizedString::split, then the ByteLevel step, over every piece.
void Tokenizer::Impl::PreTokenizeInto(std::string_view text, pcre2_match_data* md,
                                      std::vector<std::string>* pieces) const {
  pieces->clear();
  if (text.empty()) return;
  pieces->emplace_back(text);
  std::vector<std::string> next;
  std::vector<std::pair<size_t, size_t>> matches;
  // (begin, end, is_match) over a piece, covering all of it.
  std::vector<std::tuple<size_t, size_t, bool>> parts;
  const ByteAlphabet& alpha = Alphabet();
  for (const PreStep& step : pre_steps) {
    next.clear();
    for (std::string& piece : *pieces) {
      if (step.byte_level) {
        std::string s = std::move(piece);
        if (step.add_prefix_space && s[0] != ' ') s.insert(s.begin(), ' ');
        auto emit = [&](std::string_view sub) {
          if (sub.empty()) return;
          std::string mapped;
          mapped.reserve(sub.size() * 2);
          for (unsigned char b : sub) mapped += alpha.byte_to_utf8[b];
          next.push_back(std::move(mapped));
        };
        if (step.use_regex) {
          gpt2_regex->FindAll(s, md, &matches);
          size_t prev = 0;
          for (const auto& [b, e] : matches) {
            emit(std::string_view(s).substr(prev, b - prev));
            emit(std::string_view(s).substr(b, e - b));
            prev = e;
          }
          emit(std::string_view(s).substr(prev));
        } else {
          emit(s);
        }
        continue;
      }
      step.regex->FindAll(piece, md, &matches);
      parts.clear();
      size_t prev = 0;
      for (const auto& [b, e] : matches) {
        if (prev != b) parts.emplace_back(prev, b, step.invert);
        parts.emplace_back(b, e, !step.invert);
        prev = e;
      }
      if (prev != piece.size()) parts.emplace_back(prev, piece.size(), step.invert);
      // Fold the parts into splits as HF does (kept: (begin, end)).
      std::vector<std::pair<size_t, size_t>> splits;
      switch (step.behavior) {
        case Behavior::kIsolated:
          for (const auto& [b, e, m] : parts) splits.emplace_back(b, e);
          break;
        case Behavior::kRemoved:
          for (const auto& [b, e, m] : parts) {
            if (!m) splits.emplace_back(b, e);
          }
          break;
        case Behavior::kContiguous: {
          bool previous = false;
          for (const auto& [b, e, m] : parts) {
            if (m == previous && !splits.empty()) {
              splits.back().second = e;
            } else {
              splits.emplace_back(b, e);
            }
            previous = m;
          }
          break;
        }
        case Behavior::kMergedWithPrevious: {
          bool previous = false;
          for (const auto& [b, e, m] : parts) {
            if (m && !previous && !splits.empty()) {
              splits.back().second = e;
            } else {
              splits.emplace_back(b, e);
            }
            previous = m;
          }
          break;
        }
        case Behavior::kMergedWithNext: {
          bool previous = false;
          for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
            const auto& [b, e, m] = *it;
            if (m && !previous && !splits.empty()) {
              splits.back().first = b;
            } else {
              splits.emplace_back(b, e);
            }
            previous = m;
          }
          std::reverse(splits.begin(), splits.end());
          break;
        }
      }
      for (const auto& [b, e] : splits) {
        if (e > b) next.emplace_back(piece, b, e - b);
      }
    }
    pieces->swap(next);
  }
}

int32_t Tokenizer::Impl::LookupSymbol(std::string_view s) const {
  if (!s.empty() && static_cast<unsigned char>(s[0]) < 0xE0) {
    size_t len = 0;
    const char32_t cp = DecodeUtf8(s, 0, &len);
    if (len == s.size() && cp < char_id.size()) return char_id[cp];
  }
  auto it = vocab.find(s);
  return it == vocab.end() ? -1 : it->second;
}

// HF's BPE::merge_word + Word::merge_all: the same heap order decides which of two
// overlapping pairs of equal rank merges first, and stale entries are dropped the same way.
void Tokenizer::Impl::MergeWord(std::string_view w, std::vector<int32_t>* out) const {
  struct Symbol {
    int32_t c, prev, next, len;
  };
  std::vector<Symbol> sym;
  sym.reserve(w.size());
  auto add = [&](int32_t c, int32_t len) {
    const int32_t n = static_cast<int32_t>(sym.size());
    if (n > 0) sym.back().next = n;
    sym.push_back(Symbol{c, n - 1, -1, len});
  };
  const bool plain = !continuing_subword_prefix && !end_of_word_suffix;
  int32_t unk_id = -1, unk_len = 0;  // an unknown run not yet added (unk_id >= 0)
  std::string buf;
  for (size_t i = 0; i < w.size();) {
    const size_t len = Utf8CharLen(static_cast<unsigned char>(w[i]));
    const bool first = i == 0, last = i + len >= w.size();
    std::string_view s = w.substr(i, len);
    if (!plain) {
      buf.clear();
      if (!first && continuing_subword_prefix) buf += *continuing_subword_prefix;
      buf += s;
      if (last && end_of_word_suffix) buf += *end_of_word_suffix;
      s = buf;
    }
    i += len;
    const int32_t id = LookupSymbol(s);
    if (id >= 0) {
      if (unk_id >= 0) {
        add(unk_id, unk_len);
        unk_id = -1;
      }
      add(id, static_cast<int32_t>(len));
      continue;
    }
    if (byte_fallback) {
      std::vector<int32_t> ids;
      for (unsigned char b : s) {
        char name[8];
        std::snprintf(name, sizeof(name), "<0x%02X>", b);
        auto it = vocab.find(std::string_view(name));
        if (it == vocab.end()) break;
        ids.push_back(it->second);
      }
      if (ids.size() == s.size()) {
        for (int32_t b : ids) add(b, 1);
        continue;
      }
    }
    if (unk_token) {
      if (unk_id >= 0 && fuse_unk) {
        unk_len += static_cast<int32_t>(len);
      } else {
        if (unk_id >= 0) add(unk_id, unk_len);
        unk_id = vocab.find(*unk_token)->second;
        unk_len = static_cast<int32_t>(len);
      }
    }
    // Without unk_token HF drops the char; byte-level vocabularies never get here.
  }
  if (unk_id >= 0) add(unk_id, unk_len);

  struct Entry {
    int32_t rank, pos, new_id;
  };
  // std heap functions keep the largest on top: "larger" here is lower rank, then lower pos.
  auto after = [](const Entry& a, const Entry& b) { return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos; };
  std::vector<Entry> heap;
  heap.reserve(sym.size());
  auto find = [&](int32_t a, int32_t b) -> const Merge* {
    auto it = merges.find((static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b));
    return it == merges.end() ? nullptr : &it->second;
  };
  for (size_t i = 0; i + 1 < sym.size(); ++i) {
    if (const Merge* m = find(sym[i].c, sym[i + 1].c))
      heap.push_back(Entry{m->rank, static_cast<int32_t>(i), m->new_id});
  }
  std::make_heap(heap.begin(), heap.end(), after);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), after);
    const Entry top = heap.back();
    heap.pop_back();
    Symbol& cur = sym[top.pos];
    if (cur.len == 0 || cur.next == -1) continue;
    const int32_t next_pos = cur.next;
    const Symbol right = sym[next_pos];
    const Merge* still = find(cur.c, right.c);
    if (still == nullptr || still->new_id != top.new_id) continue;  // stale entry
    cur.c = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    sym[next_pos].len = 0;
    if (right.next >= 0) sym[right.next].prev = top.pos;
    if (cur.prev >= 0) {
      if (const Merge* m = find(sym[cur.prev].c, cur.c)) {
        heap.push_back(Entry{m->rank, cur.prev, m->new_id});
        std::push_heap(heap.begin(), heap.end(), after);
      }
    }
    if (cur.next >= 0) {
      if (const Merge* m = find(cur.c, sym[cur.next].c)) {
        heap.push_back(Entry{m->rank, top.pos, m->new_id});
        std::push_heap(heap.begin(), heap.end(), after);
      }
    }
  }
  for (const Symbol& s : sym) {
    if (s.len != 0) out->push_back(s.c);
  }
}

void Tokenizer::Impl::BpeInto(std::string_view word, std::vector<int32_t>* out) const {
  if (word.empty()) return;
  if (ignore_merges) {
    auto it = vocab.find(word);
    if (it != vocab.end()) {
      out->push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() < kCacheMaxWordBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu);
    auto it = cache.find(word);
    if (it != cache.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t before = out->size();
  MergeWord(word, out);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu);
    if (cache.size() < kCacheCapacity) {
      cache.emplace(std::string(word), std::vector<int32_t>(out->begin() + before, out->end()));
    }
  }
}

// ------------------------------------------------------------------------------ Tokenizer

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

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

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  const Impl& im = *impl_;
  std::string storage;
  const std::string_view s = ToValidUtf8(text, &storage);

  // 1. Tokens that must match the raw text, then 2. the normalized ones in what is left.
  std::vector<Impl::Segment> first, segments;
  im.FindAddedTokens(s, 0, im.raw_trie, &first);
  for (const Impl::Segment& seg : first) {
    if (seg.id >= 0) {
      segments.push_back(seg);
    } else {
      im.FindAddedTokens(s.substr(seg.begin, seg.end - seg.begin), seg.begin, im.normalized_trie, &segments);
    }
  }

  std::vector<int32_t> ids;
  ids.reserve(s.size() / 3 + 4);
  MatchData md;
  std::vector<std::string> pieces;
  for (const Impl::Segment& seg : segments) {
    if (seg.id >= 0) {
      ids.push_back(seg.id);
      continue;
    }
    im.PreTokenizeInto(s.substr(seg.begin, seg.end - seg.begin), md.get(), &pieces);
    for (const std::string& piece : pieces) im.BpeInto(piece, &ids);
  }

  if (add_special_tokens) {
    for (const auto& step : im.post_steps) {
      std::vector<int32_t> wrapped;
      wrapped.reserve(ids.size() + 4);
      for (const Impl::TemplateItem& item : step) {
        if (item.is_sequence) {
          wrapped.insert(wrapped.end(), ids.begin(), ids.end());
        } else {
          wrapped.insert(wrapped.end(), item.ids.begin(), item.ids.end());
        }
      }
      ids.swap(wrapped);
    }
  }
  return ids;
}

std::vector<std::string> Tokenizer::PreTokenize(std::string_view text) const {
  std::string storage;
  MatchData md;
  std::vector<std::string> pieces;
  impl_->PreTokenizeInto(ToValidUtf8(text, &storage), md.get(), &pieces);
  return pieces;
}

std::string Tokenizer::Decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& im = *impl_;
  std::string out;
  bool first = true;
  for (int32_t id : ids) {
    if (id < 0 || id >= im.vocab_size || !im.has_token[id]) continue;  // HF skips unknown ids
    if (skip_special_tokens && im.is_special[id]) continue;
    if (im.decoder == Impl::DecoderKind::kNone && !first) out += ' ';  // HF joins with spaces
    out += im.decoded[id];
    first = false;
  }
  std::string storage;
  const std::string_view valid = ToValidUtf8(out, &storage);
  if (valid.data() == out.data()) return out;
  return std::string(valid);
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  auto a = impl_->added_by_content.find(token);
  if (a != impl_->added_by_content.end()) return a->second;
  auto it = impl_->vocab.find(token);
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> Tokenizer::IdToToken(int32_t id) const {
  if (id < 0 || id >= impl_->vocab_size || !impl_->has_token[id]) return std::nullopt;
  return impl_->id_to_token[id];
}

bool Tokenizer::IsSpecial(int32_t id) const { return id >= 0 && id < impl_->vocab_size && impl_->is_special[id]; }

}  // namespace lockstep::engine
