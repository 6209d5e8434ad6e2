// kernels/fp4.cc — see fp4.h.
#include "kernels/fp4.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/numerics.h"

namespace lockstep::kernels {

const float* E2m1Table() {
  static const std::array<float, 16> table = [] {
    std::array<float, 16> t{};
    for (int c = 0; c < 16; ++c) {
      const int e = (c >> 1) & 3, m = c & 1;
      // e = 0: subnormal, m × 0.5; else (1 + m/2) × 2^(e − 1).
      const float mag = e == 0 ? 0.5f * static_cast<float>(m) : std::ldexp(1.0f + 0.5f * m, e - 1);
      t[c] = (c & 8) ? -mag : mag;
    }
    return t;
  }();
  return table.data();
}

const float* E8m0Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int e = 0; e < 255; ++e) t[e] = std::ldexp(1.0f, e - 127);  // 2^−127 is an fp32 subnormal
    t[255] = std::numeric_limits<float>::quiet_NaN();
    return t;
  }();
  return table.data();
}

uint8_t F32ToE2m1(float x) {
  if (std::isnan(x)) return 0;
  const uint8_t sign = x < 0.0f ? 8 : 0;  // −0 encodes as +0 (ModelOpt's rule: sign = x < 0)
  const float a = std::fabs(x);
  // Midpoints of the grid 0, 0.5, 1, 1.5, 2, 3, 4, 6; a tie goes to the even code (≤ where the
  // lower neighbour is even, < where the upper one is).
  uint8_t c;
  if (a <= 0.25f) c = 0;
  else if (a < 0.75f) c = 1;
  else if (a <= 1.25f) c = 2;
  else if (a < 1.75f) c = 3;
  else if (a <= 2.5f) c = 4;
  else if (a < 3.5f) c = 5;
  else if (a <= 5.0f) c = 6;
  else c = 7;
  return sign | c;
}

namespace {

// The smallest k with amax ≤ 6·2^k, for finite amax > 0 (exact: compared, not logged).
int Mxfp4Exponent(float amax) {
  int e;
  std::frexp(static_cast<double>(amax) / 6.0, &e);  // amax/6 in [2^(e−1), 2^e)
  int k = e;
  while (k > -200 && 6.0 * std::ldexp(1.0, k - 1) >= static_cast<double>(amax)) --k;
  while (6.0 * std::ldexp(1.0, k) < static_cast<double>(amax)) ++k;
  return k;
}

void PackPair(uint8_t* row, int64_t c, uint8_t code) {
  uint8_t& b = row[c / 2];
  b = (c & 1) ? static_cast<uint8_t>((b & 0x0f) | (code << 4)) : static_cast<uint8_t>((b & 0xf0) | code);
}

}  // namespace

WeightView Fp4Matrix::view() const {
  WeightView v;
  v.dtype = dtype;
  v.rows = rows;
  v.cols = cols;
  v.values = packed.data();
  v.scales = scales.data();
  v.block_rows = 1;
  v.block_cols = dtype == WeightDType::kMxfp4 ? 32 : 16;
  v.scale_2 = scale_2;
  return v;
}

Fp4Matrix QuantizeMxfp4(const float* m, int64_t rows, int64_t cols) {
  constexpr int64_t kBlock = 32;
  Fp4Matrix q;
  q.dtype = WeightDType::kMxfp4;
  q.rows = rows;
  q.cols = cols;
  q.packed.assign(static_cast<size_t>(rows * cols / 2), 0);
  q.scales.assign(static_cast<size_t>(rows * (cols / kBlock)), 0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = m + r * cols;
    uint8_t* row = q.packed.data() + r * cols / 2;
    for (int64_t b = 0; b < cols / kBlock; ++b) {
      const float* xb = x + b * kBlock;
      float amax = 0.0f;
      bool finite = true;
      for (int64_t i = 0; i < kBlock; ++i) {
        finite = finite && std::isfinite(xb[i]);
        amax = std::max(amax, std::fabs(xb[i]));
      }
      uint8_t& sbyte = q.scales[static_cast<size_t>(r * (cols / kBlock) + b)];
      if (!finite) {
        sbyte = 0xff;  // NaN scale: the block decodes to NaN; codes stay 0
        continue;
      }
      const int k = amax == 0.0f ? 0 : std::clamp(Mxfp4Exponent(amax), -127, 127);
      sbyte = static_cast<uint8_t>(k + 127);
      const float s = E8m0Table()[sbyte];
      for (int64_t i = 0; i < kBlock; ++i) PackPair(row, b * kBlock + i, F32ToE2m1(xb[i] / s));
    }
  }
  return q;
}

Fp4Matrix QuantizeNvfp4(const float* m, int64_t rows, int64_t cols) {
  constexpr int64_t kBlock = 16;
  Fp4Matrix q;
  q.dtype = WeightDType::kNvfp4;
  q.rows = rows;
  q.cols = cols;
  q.packed.assign(static_cast<size_t>(rows * cols / 2), 0);
  q.scales.assign(static_cast<size_t>(rows * (cols / kBlock)), 0);
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < rows * cols; ++i) {
    finite = finite && std::isfinite(m[i]);
    amax = std::max(amax, std::fabs(m[i]));
  }
  if (!finite) {
    q.scale_2 = std::numeric_limits<float>::quiet_NaN();
    std::fill(q.scales.begin(), q.scales.end(), uint8_t{0x7f});  // E4M3 NaN
    return q;
  }
  q.scale_2 = amax > 0.0f ? amax / (6.0f * kFp8E4m3Max) : 1.0f;
  const float six_s2 = 6.0f * q.scale_2;
  const float* e4m3 = Fp8E4m3Table();
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = m + r * cols;
    uint8_t* row = q.packed.data() + r * cols / 2;
    for (int64_t b = 0; b < cols / kBlock; ++b) {
      const float* xb = x + b * kBlock;
      float bmax = 0.0f;
      for (int64_t i = 0; i < kBlock; ++i) bmax = std::max(bmax, std::fabs(xb[i]));
      const float sb = bmax > 0.0f ? bmax / six_s2 : 1.0f;
      const uint8_t sbyte = F32ToFp8E4m3(sb);
      q.scales[static_cast<size_t>(r * (cols / kBlock) + b)] = sbyte;
      const float divisor = e4m3[sbyte] * q.scale_2;
      if (divisor == 0.0f) continue;  // the block is below E4M3's range: codes 0 (decodes to 0)
      for (int64_t i = 0; i < kBlock; ++i) PackPair(row, b * kBlock + i, F32ToE2m1(xb[i] / divisor));
    }
  }
  return q;
}

std::string Fp4ExpertPrefix(Fp4Naming naming, int64_t layer, int64_t expert, ExpertProj proj) {
  const std::string L = std::to_string(layer), E = std::to_string(expert);
  if (naming == Fp4Naming::kOfficial) {
    const char* w = proj == ExpertProj::kGate ? "w1" : proj == ExpertProj::kUp ? "w3" : "w2";
    return "layers." + L + ".ffn.experts." + E + "." + w;
  }
  const char* w = proj == ExpertProj::kGate ? "gate_proj" : proj == ExpertProj::kUp ? "up_proj" : "down_proj";
  return "model.layers." + L + ".mlp.experts." + E + "." + w;
}

std::vector<std::string> Fp4TensorNames(WeightDType format, std::string_view prefix) {
  const std::string p(prefix);
  if (format == WeightDType::kMxfp4) return {p + ".weight", p + ".scale"};
  return {p + ".weight", p + ".weight_scale", p + ".weight_scale_2"};
}

namespace {

std::string ShapeString(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

Status Bad(const StoredTensor& t, const std::string& what) {
  return Status::InvalidArgument((t.file.empty() ? "" : t.file + ": ") + "tensor '" + t.name + "': " + what);
}

// dtype ∈ allowed, shape == want, nbytes == product × element bytes.
Status Check(const StoredTensor& t, std::initializer_list<std::string_view> allowed, const std::vector<int64_t>& want,
             const char* role) {
  if (std::find(allowed.begin(), allowed.end(), t.dtype) == allowed.end()) {
    std::string list;
    for (std::string_view a : allowed) list += (list.empty() ? "" : " or ") + std::string(a);
    return Bad(t, "dtype " + t.dtype + ", expected " + list + " (" + role + ")");
  }
  if (t.shape != want) return Bad(t, "shape " + ShapeString(t.shape) + ", expected " + ShapeString(want) + " (" + role + ")");
  size_t n = t.dtype == "F32" ? 4 : 1;
  for (int64_t d : want) n *= static_cast<size_t>(d);
  if (t.nbytes != n || t.data == nullptr) {
    return Bad(t, std::to_string(t.nbytes) + " bytes, expected " + std::to_string(n) + " (" + role + ")");
  }
  return Status::Ok();
}

Status CheckDims(const StoredTensor& weight, int64_t out, int64_t in, int64_t block, const char* format) {
  if (out <= 0 || in <= 0 || in % block != 0) {
    return Bad(weight, std::string(format) + " needs an input dimension (" + std::to_string(in) +
                           ") that is a positive multiple of " + std::to_string(block));
  }
  return Status::Ok();
}

}  // namespace

Result<WeightView> Mxfp4View(const StoredTensor& weight, const StoredTensor& scale, int64_t out, int64_t in) {
  LS_RETURN_IF_ERROR(CheckDims(weight, out, in, 32, "MXFP4"));
  LS_RETURN_IF_ERROR(Check(weight, {"I8", "U8"}, {out, in / 2}, "MXFP4 E2M1 pairs"));
  LS_RETURN_IF_ERROR(Check(scale, {"F8_E8M0", "U8"}, {out, in / 32}, "MXFP4 block scales"));
  WeightView v;
  v.dtype = WeightDType::kMxfp4;
  v.rows = out;
  v.cols = in;
  v.values = weight.data;
  v.scales = scale.data;
  v.block_rows = 1;
  v.block_cols = 32;
  return v;
}

Result<WeightView> Nvfp4View(const StoredTensor& weight, const StoredTensor& weight_scale,
                             const StoredTensor& weight_scale_2, int64_t out, int64_t in) {
  LS_RETURN_IF_ERROR(CheckDims(weight, out, in, 16, "NVFP4"));
  LS_RETURN_IF_ERROR(Check(weight, {"U8", "I8"}, {out, in / 2}, "NVFP4 E2M1 pairs"));
  LS_RETURN_IF_ERROR(Check(weight_scale, {"F8_E4M3"}, {out, in / 16}, "NVFP4 block scales"));
  const std::vector<int64_t> scalar = weight_scale_2.shape.empty() ? std::vector<int64_t>{} : std::vector<int64_t>{1};
  LS_RETURN_IF_ERROR(Check(weight_scale_2, {"F32"}, scalar, "NVFP4 per-tensor scale"));
  WeightView v;
  v.dtype = WeightDType::kNvfp4;
  v.rows = out;
  v.cols = in;
  v.values = weight.data;
  v.scales = weight_scale.data;
  v.block_rows = 1;
  v.block_cols = 16;
  std::memcpy(&v.scale_2, weight_scale_2.data, 4);
  return v;
}

}  // namespace lockstep::kernels
