// engine/tokenizer.cc — Hugging Face `tokenizer.json` byte-level BPE (see tokenizer.h).
//
// The ids must equal the ones Hugging Face `tokenizers` gives, since a replayed run is only
// comparable to a recorded one when both saw the same prompt ids. So every stage follows HF's
// observable behaviour, quirks included: the two-pass added-token split, Oniguruma regex
// semantics (translated to PCRE2), the empty-match rules of its find-iterator, the
// heap-ordered merge loop (which decides ties), and from_utf8_lossy on decode. The fixtures
// under tests/fixtures/tokenizers/ are HF's own output and pin all of this down.
//
// This file encodes and decodes; tokenizer_load.cc reads the files; tokenizer_impl.h holds
// what the two share.
#include "engine/tokenizer.h"

#include <cctype>
#include <tuple>

#include "engine/tokenizer_impl.h"

namespace lockstep::engine {

using namespace tokenizer_internal;  // NOLINT: the tokenizer's own helpers (tokenizer_impl.h)

namespace {

// HF caches words shorter than this many bytes, up to this many words.
constexpr size_t kCacheMaxWordBytes = 256;
constexpr size_t kCacheCapacity = 10000;

// ---------------------------------------------------------------------------------------
// UTF-8

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

}  // namespace

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
