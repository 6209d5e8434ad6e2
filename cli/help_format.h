// cli/help_format.h — how every sub-command's --help prints an option: its name, the kind of
// value it takes (INT, FLOAT, TEXT), and then the description with the default at its end,
// "[default: 64]" — CLI11's own layout packs the validator's text and the default into the
// value's name ("INT:≥ 0=64"), which reads as noise.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace lockstep::cli {

class HelpFormatter : public CLI::Formatter {
 public:
  HelpFormatter() { column_width(34); }

  std::string make_option_opts(const CLI::Option* opt) const override {
    std::string out;
    if (!opt->get_option_text().empty()) return " " + opt->get_option_text();
    if (opt->get_type_size() != 0) {
      std::string type = opt->get_type_name();
      // "INT:≥ 0", "TEXT:{fp32,bf16}", "FLOAT:FLOAT in [0 - 1]": the kind before the colon.
      if (const size_t c = type.find(':'); c != std::string::npos) type.resize(c);
      if (!type.empty()) out += " " + type;
      if (opt->get_expected_max() == CLI::detail::expected_max_vector_size) out += " ...";
      if (opt->get_required()) out += " REQUIRED";
    }
    return out;
  }

  std::string make_option_desc(const CLI::Option* opt) const override {
    std::string d = opt->get_description();
    const std::string def = opt->get_default_str();
    // Flags, empty strings and empty lists have no default worth showing.
    if (opt->get_type_size() != 0 && !def.empty() && def != "[]" && def != "{}") d += " [default: " + def + "]";
    return d;
  }
};

}  // namespace lockstep::cli
