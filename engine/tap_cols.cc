// engine/tap_cols.cc — evaluates a tap table width ("H", "nh·(dn+dr); V4 nh·d", "(2+hc)·hc").
#include "engine/tap_cols.h"

#include <cctype>
#include <string>

namespace lockstep::engine {
namespace {

// Recursive descent over  expr = term ('+' term)* ; term = factor ('·' factor)* ;
// factor = symbol | digits | '(' expr ')'. Any error makes the whole result −1.
class Eval {
 public:
  Eval(std::string_view s, const ModelConfig& c, int64_t tp) : s_(s), c_(c), tp_(tp) {}

  int64_t Run() {
    const int64_t v = Expr();
    Space();
    return ok_ && i_ == s_.size() ? v : -1;
  }

 private:
  void Space() {
    while (i_ < s_.size() && s_[i_] == ' ') ++i_;
  }
  bool Eat(std::string_view tok) {
    Space();
    if (s_.substr(i_, tok.size()) != tok) return false;
    i_ += tok.size();
    return true;
  }
  int64_t Expr() {
    int64_t v = Term();
    while (ok_ && Eat("+")) v += Term();
    return v;
  }
  int64_t Term() {
    int64_t v = Factor();
    while (ok_ && Eat("\xC2\xB7")) v *= Factor();  // U+00B7 MIDDLE DOT
    return v;
  }
  int64_t Factor() {
    if (Eat("(")) {
      const int64_t v = Expr();
      if (!Eat(")")) ok_ = false;
      return v;
    }
    Space();
    const size_t b = i_;
    if (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) {
      int64_t v = 0;
      while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_])) && v < (int64_t{1} << 40)) {
        v = v * 10 + (s_[i_++] - '0');
      }
      return v;
    }
    while (i_ < s_.size() && std::isalpha(static_cast<unsigned char>(s_[i_]))) ++i_;
    const int64_t v = Symbol(s_.substr(b, i_ - b));
    if (v < 0) ok_ = false;
    return v;
  }
  // The doc's symbols (engine/tap.h); −1 for one this family has not.
  int64_t Symbol(std::string_view n) const {
    const bool v4 = c_.is_v4();
    if (n == "H") return c_.hidden_size;
    if (n == "tp") return tp_ > 1 ? tp_ : -1;
    if (n == "nh") return c_.num_attention_heads;
    if (n == "k") return c_.num_experts_per_tok;
    if (n == "K") return c_.index_topk > 0 ? c_.index_topk : -1;
    if (n == "V") return c_.vocab_size;
    if (n == "di") return c_.index_head_dim > 0 ? c_.index_head_dim : -1;
    if (n == "dr") return v4 ? c_.v4.rope_dim : c_.qk_rope_head_dim;
    if (!v4) {
      if (n == "dn") return c_.qk_nope_head_dim;
      if (n == "dv") return c_.v_head_dim;
      if (n == "C") return c_.kv_lora_rank;
    } else {
      if (n == "d") return c_.v4.head_dim;
      if (n == "hc") return c_.v4.hc_mult;
    }
    return -1;
  }

  std::string_view s_;
  const ModelConfig& c_;
  int64_t tp_;
  size_t i_ = 0;
  bool ok_ = true;
};

}  // namespace

int64_t TapCols(const TapPoint& t, const ModelConfig& c, int64_t tp) {
  // "generic; V4 special": the V4 alternative for a V4 model, the first otherwise.
  std::string_view e = t.cols;
  constexpr std::string_view kV4 = "; V4 ";
  const size_t alt = e.find(kV4);
  if (alt != std::string_view::npos) e = c.is_v4() ? e.substr(alt + kV4.size()) : e.substr(0, alt);
  return Eval(e, c, tp).Run();
}

}  // namespace lockstep::engine
