// base/natural_order.h — "natural" order for names with numbers in them: "layers.2.attn"
// before "layers.10.attn", as a person reads them. Runs of ASCII digits compare by value
// (leading zeros ignored; on equal value the shorter run first, so the order is total), every
// other byte compares as an unsigned byte. Used wherever tap names, tensor paths or layer
// labels are listed (inspect, diff, the HTML report). Header-only; pure.
#pragma once

#include <cstddef>
#include <string_view>

namespace lockstep {

// <0, 0 or >0 as `a` sorts before, with or after `b`.
inline int NaturalCompare(std::string_view a, std::string_view b) {
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (digit(a[i]) && digit(b[j])) {
      size_t i0 = i, j0 = j;
      while (i < a.size() && digit(a[i])) ++i;
      while (j < b.size() && digit(b[j])) ++j;
      size_t is = i0, js = j0;  // skip leading zeros
      while (is + 1 < i && a[is] == '0') ++is;
      while (js + 1 < j && b[js] == '0') ++js;
      const size_t la = i - is, lb = j - js;
      if (la != lb) return la < lb ? -1 : 1;  // more significant digits: larger
      const int c = a.substr(is, la).compare(b.substr(js, lb));
      if (c != 0) return c;
      if (i - i0 != j - j0) return (i - i0) < (j - j0) ? -1 : 1;  // "2" before "02"
      continue;
    }
    const unsigned char ca = static_cast<unsigned char>(a[i]), cb = static_cast<unsigned char>(b[j]);
    if (ca != cb) return ca < cb ? -1 : 1;
    ++i, ++j;
  }
  if (i < a.size()) return 1;
  if (j < b.size()) return -1;
  return 0;
}

// A strict weak order for std::sort / std::map: NaturalLess{}(a, b).
struct NaturalLess {
  using is_transparent = void;
  bool operator()(std::string_view a, std::string_view b) const { return NaturalCompare(a, b) < 0; }
};

}  // namespace lockstep
