// tests/fuzz/fuzz_tokenizer.cc — the tokenizer on arbitrary bytes, two ways per input:
//   1. as a tokenizer.json: FromJson must fail with a one-line message naming the origin,
//      or give a tokenizer that encodes and decodes without crashing;
//   2. as text, on the DeepSeek-V3-style fixture: ids in range, and decode(encode(s)) == s
//      for valid UTF-8 (byte-level BPE loses nothing; invalid bytes become U+FFFD).
// Seeds: the fixture tokenizer.json files (so mutants are mostly-valid tokenizers).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "engine/tokenizer.h"

namespace {

using lockstep::engine::Tokenizer;

bool ValidUtf8(std::string_view s) {
  // Decode(Encode(s)) replaces ill-formed subparts, so the round trip is exact only on
  // well-formed input; this is the plain structural check.
  size_t i = 0;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  while (i < s.size()) {
    const unsigned char c = p[i];
    size_t n;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 2, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 3, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 4, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    static const uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

const Tokenizer& Fixture() {
  static const std::shared_ptr<const Tokenizer> kTok = [] {
    auto r =
        Tokenizer::Load(std::string(LOCKSTEP_SOURCE_DIR) + "/tests/fixtures/tokenizers/deepseek_v3/tokenizer.json");
    if (!r.ok()) std::abort();
    return r.value();
  }();
  return *kTok;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);

  auto parsed = Tokenizer::FromJson(input, "fuzz.json");
  if (!parsed.ok()) {
    const std::string& m = parsed.status().message();
    if (m.rfind("fuzz.json: ", 0) != 0 || m.find('\n') != std::string::npos) std::abort();
  } else {
    const Tokenizer& t = *parsed.value();
    for (std::string_view text : {std::string_view("Hello, world! 12345 你好\n\t "), input.substr(0, 512)}) {
      const auto ids = t.Encode(text, /*add_special_tokens=*/true);
      (void)t.Decode(ids);
      (void)t.PreTokenize(text);
    }
  }

  const Tokenizer& tok = Fixture();
  const auto ids = tok.Encode(input);
  for (int32_t id : ids) {
    if (id < 0 || id >= tok.vocab_size()) std::abort();
  }
  if (ValidUtf8(input) && tok.Decode(ids) != input) std::abort();
  return 0;
}
