// engine/v4_blocks.cc — see v4_blocks.h.
#include "engine/v4_blocks.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/ffn_blocks.h"
#include "kernels/cpu/ops.h"
#include "kernels/hidden_fault.h"

namespace lockstep::engine::v4 {

namespace cpu = kernels::cpu;

namespace {
float Sigmoid(float x) { return 1.0f / (1.0f + cpu::ExpF(-x)); }

double YarnDim(double rot, double dim, double base, double max_pos) {
  return dim * std::log(max_pos / (rot * 2.0 * M_PI)) / (2.0 * std::log(base));
}
}  // namespace

RopeTable::RopeTable(const V4Rope& r, int64_t rd) : attention_factor_(static_cast<float>(r.attention_factor)) {
  inv_freq_.resize(rd / 2);
  for (int64_t i = 0; i < rd / 2; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(rd);
    inv_freq_[i] = 1.0f / static_cast<float>(std::pow(r.theta, static_cast<double>(e)));
  }
  if (!r.yarn) return;
  // transformers' _compute_yarn_parameters: blend interpolated and extrapolated frequencies by
  // a linear ramp between the correction dims of beta_fast and beta_slow.
  double low = YarnDim(r.beta_fast, rd, r.theta, r.original_max_position_embeddings);
  double high = YarnDim(r.beta_slow, rd, r.theta, r.original_max_position_embeddings);
  if (r.truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(rd - 1));
  if (low == high) high += 0.001;
  for (int64_t i = 0; i < rd / 2; ++i) {
    const float extra = inv_freq_[i];
    const float inter = extra / static_cast<float>(r.factor);
    const float ramp = std::clamp(static_cast<float>((static_cast<double>(i) - low) / (high - low)), 0.0f, 1.0f);
    const float extra_factor = 1.0f - ramp;
    inv_freq_[i] = inter * (1.0f - extra_factor) + extra * extra_factor;
  }
}

void RopeTable::At(int64_t pos, float* cos, float* sin) const {
  for (size_t i = 0; i < inv_freq_.size(); ++i) {
    const float a = inv_freq_[i] * static_cast<float>(pos);
    cos[i] = std::cos(a) * attention_factor_;
    sin[i] = std::sin(a) * attention_factor_;
  }
}

void RopeTrailing(float* x, int64_t width, int64_t rd, const float* cos, const float* sin, bool inverse) {
  float* r = x + (width - rd);
  for (int64_t i = 0; i < rd / 2; ++i) {
    const float a = r[2 * i], b = r[2 * i + 1];
    const float s = inverse ? -sin[i] : sin[i];
    r[2 * i] = a * cos[i] - b * s;
    r[2 * i + 1] = b * cos[i] + a * s;
  }
}

void RmsScale(const float* x, int64_t n, double eps, float* y) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv;
}

void HcPre(const V4HcWeights& w, const V4Config& v, double rms_eps, const float* X, int64_t D, HcMix* mix,
           float* x_in) {
  const int64_t hc = v.hc_mult, n = hc * D;
  const float eps = static_cast<float>(v.hc_eps);
  // f̂ = RMS-normalised flatten(X)                            [hc·D]
  std::vector<float> f(n), m((2 + hc) * hc);
  RmsScale(X, n, rms_eps, f.data());
  // mix = f̂ · fnᵀ                                             [(2 + hc)·hc]
  cpu::MatMulNT(f.data(), 1, w.fn.data, kernels::WeightRounding::kAsStored, m.data());
  const float* base = w.base.ptr();
  const float* scale = w.scale.ptr();
  mix->pre.resize(hc);
  mix->post.resize(hc);
  mix->comb.resize(hc * hc);
  for (int64_t j = 0; j < hc; ++j) {
    mix->pre[j] = Sigmoid(m[j] * scale[0] + base[j]) + eps;
    mix->post[j] = 2.0f * Sigmoid(m[hc + j] * scale[1] + base[hc + j]);
  }
  // C = softmax over k of (comb·scale + base) + eps, then Sinkhorn: columns, then (rows, columns)…
  float* C = mix->comb.data();
  for (int64_t j = 0; j < hc; ++j) {
    for (int64_t k = 0; k < hc; ++k) C[j * hc + k] = m[2 * hc + j * hc + k] * scale[2] + base[2 * hc + j * hc + k];
    cpu::Softmax(&C[j * hc], hc);
    for (int64_t k = 0; k < hc; ++k) C[j * hc + k] += eps;
  }
  auto columns = [&] {
    for (int64_t k = 0; k < hc; ++k) {
      float s = 0;
      for (int64_t j = 0; j < hc; ++j) s += C[j * hc + k];
      for (int64_t j = 0; j < hc; ++j) C[j * hc + k] /= s + eps;
    }
  };
  auto rows = [&] {
    for (int64_t j = 0; j < hc; ++j) {
      float s = 0;
      for (int64_t k = 0; k < hc; ++k) s += C[j * hc + k];
      for (int64_t k = 0; k < hc; ++k) C[j * hc + k] /= s + eps;
    }
  };
  columns();
  // Hidden fault zoo (kernels/hidden_fault.h): one round fewer.
  const int64_t iters = v.hc_sinkhorn_iters -
                        (kernels::HiddenFaultOrNone() == kernels::HiddenFault::kV4SinkhornOneRoundShort ? 1 : 0);
  for (int64_t it = 1; it < iters; ++it) {
    rows();
    columns();
  }
  // x_in = Σ_j pre[j]·X[j]                                    [D]
  for (int64_t i = 0; i < D; ++i) {
    float s = 0;
    for (int64_t j = 0; j < hc; ++j) s += mix->pre[j] * X[j * D + i];
    x_in[i] = s;
  }
}

void HcPost(const HcMix& mix, const float* X, const float* y, int64_t hc, int64_t D, float* X_out) {
  for (int64_t k = 0; k < hc; ++k) {
    for (int64_t i = 0; i < D; ++i) {
      float s = 0;
      for (int64_t j = 0; j < hc; ++j) s += mix.comb[j * hc + k] * X[j * D + i];
      X_out[k * D + i] = mix.post[k] * y[i] + s;
    }
  }
}

void HcHead(const V4HcWeights& w, const V4Config& v, double rms_eps, const float* X, int64_t D, float* h,
            float* pre_out) {
  const int64_t hc = v.hc_mult;
  std::vector<float> f(hc * D), m(hc), pre(hc);
  RmsScale(X, hc * D, rms_eps, f.data());
  cpu::MatMulNT(f.data(), 1, w.fn.data, kernels::WeightRounding::kAsStored, m.data());
  for (int64_t k = 0; k < hc; ++k) pre[k] = Sigmoid(m[k] * w.scale.ptr()[0] + w.base.ptr()[k]) + static_cast<float>(v.hc_eps);
  for (int64_t i = 0; i < D; ++i) {
    float s = 0;
    for (int64_t k = 0; k < hc; ++k) s += pre[k] * X[k * D + i];
    h[i] = s;
  }
  if (pre_out != nullptr) std::copy(pre.begin(), pre.end(), pre_out);
}

void PoolEntry(const float* kv, const float* gate, int64_t slots, int64_t width, const float* norm_w, double eps,
               int64_t rd, const float* cos, const float* sin, float* e) {
  std::vector<float> a(slots), pooled(width);
  for (int64_t c = 0; c < width; ++c) {
    for (int64_t j = 0; j < slots; ++j) a[j] = gate[j * width + c];
    cpu::Softmax(a.data(), slots);  // an empty slot's −inf gives weight 0
    float s = 0;
    for (int64_t j = 0; j < slots; ++j) {
      if (a[j] != 0.0f) s += a[j] * kv[j * width + c];
    }
    pooled[c] = s;
  }
  cpu::RmsNorm(pooled.data(), norm_w, 1, width, eps, e);
  RopeTrailing(e, width, rd, cos, sin);
}

float AttendWithSink(const float* q, const float* const* keys, int64_t n, int64_t d, float scale, float sink,
                    float* out, bool fault_sink_one_side) {
  std::vector<float> l(n);
  float mx = sink;
  for (int64_t t = 0; t < n; ++t) {
    l[t] = cpu::Dot(q, keys[t], d) * scale;
    mx = std::max(mx, l[t]);
  }
  // Fault zoo (softmax=fault_sink_one_side): the sink in the max, not in the denominator.
  double den = fault_sink_one_side ? 0.0 : std::exp(static_cast<double>(sink) - mx);
  for (int64_t t = 0; t < n; ++t) {
    l[t] = cpu::ExpF(l[t] - mx);
    den += l[t];
  }
  std::fill(out, out + d, 0.0f);
  const float inv = static_cast<float>(1.0 / den);
  for (int64_t t = 0; t < n; ++t) cpu::Axpy(l[t] * inv, keys[t], d, out);
  return static_cast<float>(std::exp(static_cast<double>(sink) - mx) / den);
}

float SqrtSoftplus(float x) {
  const float sp = x > 20.0f ? x : static_cast<float>(std::log1p(std::exp(static_cast<double>(x))));
  return std::sqrt(sp);
}

void ClampedSwiGlu(const MlpWeights& m, double limit, const float* x, int64_t rows, const Gemm& gemm, float* y) {
  SwiGluMlp(gemm, m, x, rows, y, static_cast<float>(limit));
}

}  // namespace lockstep::engine::v4
