// cli/table.h — terminal tables whose columns are as wide as their data. Widths count what a
// terminal shows: one column per UTF-8 code point, two for East Asian wide and fullwidth
// characters (DeepSeek's special tokens are written with fullwidth bars: "<｜User｜>"), none
// for combining marks. Header-only; used by inspect, kernels, degen, bisect and the diff text.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace lockstep::cli {

// Terminal columns of one code point (a simplified wcwidth: wide CJK ranges, fullwidth forms
// and emoji count 2; combining marks and zero-width characters 0; everything else 1).
inline int CodePointWidth(uint32_t c) {
  if (c == 0x200B || c == 0x200C || c == 0x200D || c == 0xFEFF) return 0;
  if ((c >= 0x0300 && c <= 0x036F) || (c >= 0x1AB0 && c <= 0x1AFF) || (c >= 0x1DC0 && c <= 0x1DFF) ||
      (c >= 0x20D0 && c <= 0x20FF) || (c >= 0xFE20 && c <= 0xFE2F)) {
    return 0;
  }
  if ((c >= 0x1100 && c <= 0x115F) || (c >= 0x2E80 && c <= 0x303E) || (c >= 0x3041 && c <= 0x33FF) ||
      (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0xA000 && c <= 0xA4CF) ||
      (c >= 0xAC00 && c <= 0xD7A3) || (c >= 0xF900 && c <= 0xFAFF) || (c >= 0xFE30 && c <= 0xFE4F) ||
      (c >= 0xFF00 && c <= 0xFF60) || (c >= 0xFFE0 && c <= 0xFFE6) || (c >= 0x1F300 && c <= 0x1F64F) ||
      (c >= 0x1F900 && c <= 0x1F9FF) || (c >= 0x20000 && c <= 0x3FFFD)) {
    return 2;
  }
  return 1;
}

// Terminal columns of a UTF-8 string; a byte that is not part of a valid sequence counts 1.
inline int DisplayWidth(std::string_view s) {
  int w = 0;
  for (size_t i = 0; i < s.size();) {
    const unsigned char b = static_cast<unsigned char>(s[i]);
    int len = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 0;
    if (len == 0 || i + len > s.size()) {
      ++w, ++i;
      continue;
    }
    uint32_t c = len == 1 ? b : b & (0x7F >> len);
    bool ok = true;
    for (int k = 1; k < len; ++k) {
      const unsigned char n = static_cast<unsigned char>(s[i + k]);
      if ((n & 0xC0) != 0x80) ok = false;
      c = (c << 6) | (n & 0x3F);
    }
    if (!ok) {
      ++w, ++i;
      continue;
    }
    w += CodePointWidth(c);
    i += len;
  }
  return w;
}

// Rows of cells printed with every column as wide as its widest cell (header included).
// Columns marked right-aligned suit numbers. The last column is not padded.
class Table {
 public:
  explicit Table(std::vector<std::string> header, std::vector<bool> right_aligned = {})
      : header_(std::move(header)), right_(std::move(right_aligned)) {
    right_.resize(header_.size(), false);
  }
  void Add(std::vector<std::string> row) {
    row.resize(header_.size());
    rows_.push_back(std::move(row));
  }
  bool empty() const { return rows_.empty(); }
  // `indent` spaces before every line; columns separated by two spaces; the header line only
  // when `header` (its cells still count for the widths).
  std::string Render(int indent = 0, bool header = true) const {
    std::vector<int> width(header_.size(), 0);
    auto widen = [&](const std::vector<std::string>& r) {
      for (size_t c = 0; c < r.size(); ++c) width[c] = std::max(width[c], DisplayWidth(r[c]));
    };
    widen(header_);
    for (const auto& r : rows_) widen(r);
    std::string out;
    auto line = [&](const std::vector<std::string>& r) {
      out.append(indent, ' ');
      for (size_t c = 0; c < r.size(); ++c) {
        const int pad = width[c] - DisplayWidth(r[c]);
        const bool last = c + 1 == r.size();
        if (right_[c]) out.append(pad, ' ');
        out += r[c];
        if (!right_[c] && !last) out.append(pad, ' ');
        if (!last) out += "  ";
      }
      while (!out.empty() && out.back() == ' ') out.pop_back();
      out += '\n';
    };
    if (header) line(header_);
    for (const auto& r : rows_) line(r);
    return out;
  }
  void Print(int indent = 0, bool header = true, FILE* f = stdout) const {
    std::fputs(Render(indent, header).c_str(), f);
  }

 private:
  std::vector<std::string> header_;
  std::vector<bool> right_;
  std::vector<std::vector<std::string>> rows_;
};

// printf into a std::string (for table cells).
template <typename... A>
std::string Format(const char* fmt, A... a) {
  char buf[256];
  std::snprintf(buf, sizeof buf, fmt, a...);
  return buf;
}

}  // namespace lockstep::cli
