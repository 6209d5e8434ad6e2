// verify/golden.h — golden twins: each op of the DeepSeek forward pass written once more, from
// the math, in fp64, together with an error budget for the production op.
//
// Nothing here calls kernels/cpu or kernels/cuda: a bug in a production kernel cannot hide in
// its own reference. Every function takes fp32 inputs exactly as a trace recorded them and
// returns a Vec — the exact (fp64) value of the op and, per element, a bound on how far an
// implementation that meets the op's declared precision may land from it (first-order error
// analysis: an fp32 sum of n terms errs by at most γ_n·Σ|terms|, γ_n = n·u/(1 − n·u) with
// u = 2⁻²⁴; an input the op rounds to bf16/FP8 first adds its relative rounding times the same
// sums). Bounds propagate through chains of ops (q_a → norm → q_b → RoPE) by the same rules, so
// a chain whose intermediates a trace does not hold is checked end to end.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace lockstep::verify::golden {

// Unit roundoffs.
inline constexpr double kFp32U = 0x1p-24;  // fp32 round-to-nearest
inline constexpr double kBf16U = 0x1p-8;   // bf16 (8 significant bits)
inline constexpr double kFp8U = 0x1p-4;    // FP8 e4m3 (4 significant bits)
// γ_n for fp32 accumulation of n terms.
double Gamma(int64_t n, double u = kFp32U);

// The precision an op declares: its accumulation's unit roundoff and the relative rounding of
// each input it quantises before multiplying (0 when it reads its inputs as they are).
struct Precision {
  double acc = kFp32U;
  double in_x = 0;  // activations
  double in_w = 0;  // weights
};

// Values and their absolute error budgets, element by element.
struct Vec {
  std::vector<double> v, e;
  int64_t size() const { return static_cast<int64_t>(v.size()); }
};
Vec Exact(const float* x, int64_t n);  // recorded values: e = 0

// A weight matrix [rows, cols], row-major, as the checkpoint's values (fp32, dequantised).
struct WeightRef {
  const float* w = nullptr;
  int64_t rows = 0, cols = 0;
};

// y = W x (rows [r0, r0 + n) of W when n ≥ 0).
Vec Linear(WeightRef w, const Vec& x, const Precision& p, int64_t r0 = 0, int64_t n = -1);
// RMSNorm: x / sqrt(mean(x²) + eps) · w.
Vec RmsNorm(const Vec& x, const float* w, double eps);
// LayerNorm: (x − mean) / sqrt(var + eps) · w + b.
Vec LayerNorm(const Vec& x, const float* w, const float* b, double eps);
// SwiGLU: silu(g) · u.
Vec SwiGlu(const Vec& g, const Vec& u);
// a + b (fp32 add).
Vec Add(const Vec& a, const Vec& b);

// RoPE layouts (as the config names them): pairs (2i, 2i+1) in place; pairs rotated and written
// out as [evens…, odds…]; or (i, i + d/2) in place.
enum class RopeLayout { kPairsAdjacent, kPairsToHalves, kHalves };
// RoPE frequencies from the config, in fp64: θ^(−2i/d), with YaRN's ramp between the
// interpolated and extrapolated frequencies when `yarn`.
struct RopeSpec {
  double theta = 10000;
  bool yarn = false;
  double factor = 1, beta_fast = 32, beta_slow = 1, original_max_pos = 0, attention_factor = 1;
  bool truncate = true;
};
std::vector<double> RopeInvFreq(const RopeSpec& s, int64_t dim);
// The constants the config implies, from its fields (DeepSeek-V2/V3's modelling code, not the
// engine's): YaRN's magnitude 0.1·m·ln(s) + 1 for a factor s > 1, else 1; MLA's softmax scale
// (qk_nope + qk_rope)^−½, × YarnMscale(factor, mscale_all_dim)² under YaRN when mscale_all_dim
// is set; YaRN's factor on cos and sin: the file's `attention_factor` when given, else
// YarnMscale(factor, mscale) / YarnMscale(factor, mscale_all_dim) when both are set, else
// YarnMscale(factor, 1) — 1 without YaRN.
double YarnMscale(double factor, double mscale);
double MlaSoftmaxScale(int64_t qk_nope, int64_t qk_rope, bool yarn, double factor, double mscale_all_dim);
double RopeAttentionFactor(bool yarn, double factor, double mscale, double mscale_all_dim, double file_factor);
// Rotates dims [off, off + dim) of x at position `pos`. The budget covers an fp32 angle
// (inv_freq·pos rounded) and fp32 sin/cos, times the attention factor.
void Rope(Vec* x, int64_t off, int64_t dim, int64_t pos, std::span<const double> inv_freq, double attention_factor,
          RopeLayout layout);

// Softmax of scores with budgets es → probabilities with budgets.
Vec Softmax(const Vec& s);

// One token's MoE routing from the router logits (with their budgets).
enum class Gate { kSoftmaxGreedy, kSoftmaxGroupLimited, kSigmoidNoauxTc };
struct RouteSpec {
  Gate gate = Gate::kSigmoidNoauxTc;
  int64_t experts = 0, top_k = 0, groups = 1, top_groups = 1;
  bool normalise = true;
  double scaling = 1;
};
struct Route {
  std::vector<int32_t> ids;   // ascending
  std::vector<double> weights, weight_budget;  // of ids
  std::vector<double> choice, choice_budget;   // per expert: the selection score (+ bias)
  std::vector<bool> allowed;                   // per expert: in a kept group
};
Route RouteToken(const RouteSpec& s, const Vec& logits, const float* bias);
// Weights of a given id set (the recorded choice), with budgets.
void RouteWeights(const RouteSpec& s, const Vec& logits, std::span<const int32_t> ids, std::vector<double>* w,
                  std::vector<double>* budget);

// ---- The KV cache's encodings, independently ----------------------------------------------
uint16_t Bf16Bits(float x);             // round to nearest even (NaN stays NaN)
float Bf16Value(uint16_t b);
uint8_t E4m3Bits(double x);             // round to nearest even, saturating at ±448
double E4m3Value(uint8_t b);
// A tile's FP8 scale: the least power of two ≥ amax / 448 (1 for an all-zero tile).
float Fp8Scale(const float* x, int64_t n);

// ---- The sampler ---------------------------------------------------------------------------
// Philox4x32-10 as in Salmon et al. (SC'11) → a 53-bit uniform in [0, 1): counter (step, 0,
// stream, 0), key = seed.
double PhiloxUniform(uint64_t seed, uint64_t counter, uint32_t stream);
struct Draw {
  int32_t token = -1;
  double uniform = -1;
  int64_t candidates = 0;
};
// docs/sampling.md from the logits: greedy argmax (lowest id on ties, NaN never); else
// candidates by logit descending (id ascending), weights exp((l − l_max)/T) in fp64, top-p's
// shortest prefix reaching top_p of the total, min-p against the top weight, then the inverse
// CDF at u × the kept mass.
Draw Sample(std::span<const float> logits, double temperature, int64_t top_k, double top_p, double min_p,
            uint64_t seed, uint64_t counter);

// The same draw when only the row's K largest logits were recorded (`--logits topk`: ids,
// values, and the row's logsumexp at temperature 1). The unrecorded V − K logits are each ≤ the
// K-th, so every sum over them lies in [0, (n − K) × w_K]: the total, top-p's cut, min-p's cut
// and the inverse CDF are carried as intervals, and a draw is decided when the interval falls
// inside one token's CDF step (or past all K: the token is one of the others). `lse` (NaN when
// absent; rounded to float as traces record it) narrows the unrecorded mass at any temperature.
// LseRelMargin: how far e^(lse − lmax) may be off, relative: the float's rounding and some.
double LseRelMargin(double lse);
struct TopKDraw {
  enum Outcome { kToken, kOutsideTopK, kUndecided } outcome = kUndecided;
  int32_t token = -1;   // kToken: the token
  double uniform = -1;  // the Philox draw (−1 greedy)
  std::string why;      // kUndecided: which step the unrecorded tail leaves open
};
// `lse_t` (NaN when absent): the row's logsumexp at `temperature` (logits.logsumexp_t), which
// fixes the unrecorded mass at that temperature to within its float rounding — every draw is
// then decided unless top-k keeps more than the recorded K or a cut lands within that rounding.
TopKDraw SampleFromTopK(std::span<const int32_t> ids, std::span<const float> values, int64_t vocab, double lse,
                        double temperature, int64_t top_k, double top_p, double min_p, uint64_t seed, uint64_t counter,
                        double lse_t = std::numeric_limits<double>::quiet_NaN());

}  // namespace lockstep::verify::golden
