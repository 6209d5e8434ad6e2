// base/json_text.h — JSON text that cannot throw on what it carries.
//
// nlohmann::json::dump throws (type_error 316) on a string that is not valid UTF-8 — and strings
// here come from models (a token's bytes, a text cut mid-character) and from strangers' traces.
// JsonText writes every ill-formed byte as U+FFFD instead, so a report is always written.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace lockstep {

template <typename Json>
std::string JsonText(const Json& j, int indent = -1) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

// The last `max_bytes` bytes of `s`, or fewer: never starting inside a UTF-8 character.
inline std::string Utf8Tail(const std::string& s, size_t max_bytes) {
  size_t start = s.size() > max_bytes ? s.size() - max_bytes : 0;
  while (start < s.size() && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) ++start;
  return s.substr(start);
}

}  // namespace lockstep
