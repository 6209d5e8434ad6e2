// engine/tokenizer_impl.h — the tokenizer's insides (Tokenizer::Impl and the helpers it is
// built from), shared by tokenizer_load.cc (reading tokenizer.json) and tokenizer.cc
// (encoding and decoding). Private to engine/.
#pragma once

#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/status.h"
#include "engine/tokenizer.h"

namespace lockstep::engine {
namespace tokenizer_internal {

using Json = nlohmann::json;

// Ids past this are refused: a real vocabulary is far smaller, and a corrupt file must not
// make us allocate gigabytes for the id → token table.
constexpr int64_t kMaxId = int64_t{1} << 24;

// ---------------------------------------------------------------------------------------
// UTF-8

inline void AppendUtf8(std::string* out, char32_t cp) {
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

// Decodes the (valid) UTF-8 char at s[i].
inline char32_t DecodeUtf8(std::string_view s, size_t i, size_t* len) {
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

inline size_t Utf8CharLen(unsigned char lead) { return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4; }

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

inline const ByteAlphabet& Alphabet() {
  static const ByteAlphabet kAlphabet;
  return kAlphabet;
}

// ---------------------------------------------------------------------------------------
// Regex: PCRE2 standing in for the Oniguruma that HF uses.

// Oniguruma's pattern as PCRE2 (tokenizer_load.cc says how the two differ).
Result<std::string> TranslateOnigPattern(std::string_view p);

class Regex {
 public:
  // `literal`: match `pattern` as plain text (HF's Split with a String pattern).
  static Result<std::unique_ptr<Regex>> Compile(std::string_view pattern, bool literal);

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

// ---------------------------------------------------------------------------------------
// JSON access that names the field at fault.

inline std::string TypeName(const Json& j) { return j.type_name(); }

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

}  // namespace tokenizer_internal

struct Tokenizer::Impl {
  // tokenizer_internal's types, by the names the member functions use.
  using Json = tokenizer_internal::Json;
  using Parser = tokenizer_internal::Parser;
  using Regex = tokenizer_internal::Regex;
  using StringHash = tokenizer_internal::StringHash;
  using StringIdMap = tokenizer_internal::StringIdMap;

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

}  // namespace lockstep::engine
