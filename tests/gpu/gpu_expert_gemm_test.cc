// tests/gpu/gpu_expert_gemm_test.cc — the grouped expert GEMM (kernels/cuda/expert_gemm.cu,
// expert_gemm_stream.cu, expert_tc.cu) against cpu::MatMulNT on fresh seeded inputs: every
// launch shape bitwise the CPU's product of the same operands and within its fp64 bound, the
// SwiGLU epilogue, the device error flag for a bad expert id, a streaming GEMV started right
// after a long kernel, and the tensor-core shape's determinism, batch invariance and bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/numerics.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"
#include "tests/gpu/gpu_test_util.h"

namespace lockstep {
namespace {

using namespace gpu_testing;  // NOLINT

std::vector<float> Randn(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = g(rng);
  return v;
}

int32_t ReadFlag(const cu::DeviceBuffer& flag) { return Download<int32_t>(flag, 1)[0]; }

// --- ExpertGemm -------------------------------------------------------------------------------

struct GemmCase {
  int64_t rows, k, experts, out, in;
  bool w_bf16, x_per_slot, round_x;
  int64_t pad;  // extra elements per weight row (pad 1 breaks 16-byte alignment)
  bool w_fp8 = false;  // FP8 e4m3 weights with a scale per row and 128 columns (w_bf16 false)
};

std::string Name(const GemmCase& g) {
  return "rows=" + std::to_string(g.rows) + " k=" + std::to_string(g.k) + " E=" + std::to_string(g.experts) +
         " out=" + std::to_string(g.out) + " in=" + std::to_string(g.in) +
         (g.w_fp8 ? " fp8" : g.w_bf16 ? " bf16" : " fp32") +
         (g.x_per_slot ? " per-slot" : "") + (g.round_x ? " round-x" : "") + " pad=" + std::to_string(g.pad);
}

struct GemmData {
  GemmCase g;
  int64_t rs, es, xs, ys, xrows;
  std::vector<float> w;        // fp32 values (bf16-exact when w_bf16; FP8's dequantised values when w_fp8)
  std::vector<uint16_t> w16;   // bf16 bits when w_bf16
  std::vector<uint8_t> w8;     // e4m3 bytes when w_fp8
  std::vector<float> scales;   // w_fp8: [experts][out][srs] (row stride srs, expert stride ses)
  int64_t srs = 0, ses = 0;
  std::vector<float> x;
  std::vector<int32_t> ids;
};

GemmData MakeGemm(const GemmCase& g, uint64_t seed) {
  GemmData d;
  d.g = g;
  d.rs = g.in + g.pad;
  d.es = g.out * d.rs + 16;
  d.xrows = g.x_per_slot ? g.rows * g.k : g.rows;
  d.xs = g.in + 2;
  d.ys = g.out + 1;
  d.w = Randn(g.experts * d.es, seed, 0.05f);
  if (g.w_bf16) {
    d.w16.resize(d.w.size());
    for (size_t i = 0; i < d.w.size(); ++i) {
      d.w16[i] = kernels::F32ToBf16(d.w[i]);
      d.w[i] = kernels::Bf16ToF32(d.w16[i]);
    }
  }
  if (g.w_fp8) {
    // Each row's 128-column chunks quantised on their own amax (DeepSeek's amax / 448), scales
    // padded apart (srs > chunks, ses > out·srs) to exercise the strides; `w` becomes the exact
    // dequantisation, value × scale in fp32 — the CPU's definition (engine/weights.h).
    const int64_t chunks = (g.in + 127) / 128;
    d.srs = chunks + 1;
    d.ses = g.out * d.srs + 3;
    d.scales.assign(g.experts * d.ses, 0.0f);
    d.w8.assign(d.w.size(), 0);
    for (int64_t e = 0; e < g.experts; ++e) {
      for (int64_t o = 0; o < g.out; ++o) {
        for (int64_t j = 0; j < chunks; ++j) {
          const int64_t base = e * d.es + o * d.rs, c0 = 128 * j, c1 = std::min(g.in, c0 + 128);
          float amax = 0.0f;
          for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(d.w[base + c]));
          const float sc = amax > 0 ? amax / 448.0f : 1.0f;
          d.scales[e * d.ses + o * d.srs + j] = sc;
          for (int64_t c = c0; c < c1; ++c) {
            d.w8[base + c] = kernels::F32ToFp8E4m3(d.w[base + c] / sc);
            d.w[base + c] = kernels::Fp8E4m3ToF32(d.w8[base + c]) * sc;
          }
        }
      }
    }
  }
  d.x = Randn(d.xrows * d.xs, seed + 1, 1.0f);
  std::mt19937_64 rng(seed + 2);
  d.ids.resize(g.rows * g.k);
  for (int64_t r = 0; r < g.rows; ++r) {  // k distinct experts per row, ascending, like Route
    std::vector<int32_t> all(g.experts);
    for (int64_t e = 0; e < g.experts; ++e) all[e] = static_cast<int32_t>(e);
    std::shuffle(all.begin(), all.end(), rng);
    std::sort(all.begin(), all.begin() + g.k);
    std::copy(all.begin(), all.begin() + g.k, d.ids.begin() + r * g.k);
  }
  return d;
}

struct GemmRun {
  std::vector<float> y;
  int32_t flag = 0;
};

GemmRun GpuExpertGemm(const GemmData& d, const std::vector<int32_t>& ids, int64_t rows, const float* x_host,
                      cu::ExpertGemmParams::Launch launch = cu::ExpertGemmParams::Launch::kAuto,
                      int64_t swiglu_inter = 0, bool tensor_cores = false, int64_t ep_begin = 0,
                      int64_t ep_end = 0, float y_fill = 0.0f) {
  const GemmCase& g = d.g;
  cu::DeviceBuffer dw = g.w_fp8 ? Upload(d.w8) : g.w_bf16 ? Upload(d.w16) : Upload(d.w);
  cu::DeviceBuffer dscale = Upload(g.w_fp8 ? d.scales : std::vector<float>(1, 0.0f));
  const int64_t xrows = g.x_per_slot ? rows * g.k : rows;
  auto dx = Upload(std::vector<float>(x_host, x_host + xrows * d.xs));
  auto di = Upload(ids);
  auto dy = Upload(std::vector<float>(rows * g.k * d.ys, y_fill));
  auto flag = Zeros<int32_t>(1);
  // ep_end > 0: a rank's block [ep_begin, ep_end) of the experts (its weights only), the other
  // slots skipped (ExpertGemmParams::expert0 / skip_foreign).
  const bool ep = ep_end > 0;
  const size_t es_bytes = g.w_fp8 ? 1 : g.w_bf16 ? 2 : 4;
  cu::ExpertGemmParams p;
  p.rows = rows;
  p.k = g.k;
  p.experts = ep ? ep_end - ep_begin : g.experts;
  p.expert0 = static_cast<int32_t>(ep_begin);
  p.skip_foreign = ep;
  p.out = g.out;
  p.in = g.in;
  p.w = dw.as<const char>() + ep_begin * d.es * es_bytes;
  p.w_bf16 = g.w_bf16;
  p.w_fp8 = g.w_fp8;
  p.w_expert_stride = d.es;
  p.w_row_stride = d.rs;
  if (g.w_fp8) {
    p.w_scale = dscale.as<float>() + ep_begin * d.ses;
    p.w_scale_row_stride = d.srs;
    p.w_scale_expert_stride = d.ses;
  }
  p.x = dx.as<float>();
  p.x_stride = d.xs;
  p.x_per_slot = g.x_per_slot;
  p.round_x_bf16 = g.round_x;
  p.ids = di.as<int32_t>();
  p.y = dy.as<float>();
  p.y_stride = d.ys;
  p.error_flag = flag.as<int32_t>();
  p.launch = launch;
  p.swiglu_inter = swiglu_inter;
  p.tensor_cores = tensor_cores;
  GemmRun run;
  const Status s = cu::ExpertGemm(p);
  EXPECT_TRUE(s.ok()) << s.message();
  EXPECT_TRUE(cu::Synchronize().ok());
  run.y = Download<float>(dy, rows * g.k * d.ys);
  run.flag = ReadFlag(flag);
  return run;
}

// Each y element is cpu::Dot (16 FMA chains, pairwise fold) of the (rounded) x row and the
// weight row: bitwise cpu::MatMulNT. Independently, against an fp64 product, the standard
// bound for a sum of `in` products: |Δ| ≤ (in + 1)·u·Σ|w·x| (a chain of in/16 FMAs plus a
// 4-level fold is far shorter; the bound is the conservative textbook one).
TEST(CudaExpertGemm, BitwiseCpuMatMulAndWithinFp64Bound) {
  LS_REQUIRE_GPU();
  const GemmCase cases[] = {
      {1, 6, 64, 2816, 2048, true, false, true, 0},    // V2-Lite gate+up decode (per-slot grid)
      {3, 6, 64, 2816, 2048, true, false, true, 0},    // 18 slots: the per-expert grid
      {64, 6, 64, 300, 1408, true, true, true, 0},     // down projection, per-slot x
      {5, 2, 4, 70, 37, false, false, false, 1},       // odd `in`, unaligned rows: element loads
      {33, 3, 5, 129, 1040, false, true, false, 0},    // fp32 vector loads, in = 1024 + 16
      {9, 4, 8, 65, 2100, true, false, false, 3},      // bf16 unaligned, tail over two tiles
      {200, 8, 16, 64, 256, true, false, true, 0},     // many slots per expert: > 8 per chunk
      // Heads as experts (k = experts = 16: every row's ids are 0..15): the absorbed W_UK
      // (out 512, in 128) and W_UV (out 128, in 512) products, batched and decode.
      {64, 16, 16, 512, 128, true, true, true, 0},
      {64, 16, 16, 128, 512, true, true, false, 0},
      {1, 16, 16, 512, 128, true, true, true, 0},
      {1, 16, 16, 128, 512, true, true, true, 0},
      {40, 1, 1, 64, 2048, true, false, true, 0},      // the router: one "expert", one slot per row
      {7, 6, 64, 96, 1416, true, false, true, 0},      // aligned bf16, in % 16 = 8: the register path
  };
  uint64_t seed = 1000;
  for (const GemmCase& g : cases) {
    GemmData d = MakeGemm(g, seed += 10);
    GemmRun got = GpuExpertGemm(d, d.ids, g.rows, d.x.data());
    EXPECT_EQ(got.flag, 0) << Name(g);
    std::vector<float> want(got.y.size(), 0.0f), bound(got.y.size(), 0.0);
    std::vector<double> exact(got.y.size(), 0.0);
    std::vector<float> xr(g.in);
    for (int64_t r = 0; r < g.rows; ++r) {
      for (int64_t j = 0; j < g.k; ++j) {
        const int64_t slot = r * g.k + j, e = d.ids[slot];
        const float* xrow = &d.x[(g.x_per_slot ? slot : r) * d.xs];
        for (int64_t i = 0; i < g.in; ++i) {
          xr[i] = g.round_x ? kernels::Bf16ToF32(kernels::F32ToBf16(xrow[i])) : xrow[i];
        }
        kernels::cpu::MatMulNTStrided(xr.data(), g.in, 1, &d.w[e * d.es], d.rs, g.out, g.in, &want[slot * d.ys], 1);
        for (int64_t o = 0; o < g.out; ++o) {
          double s = 0, a = 0;
          const float* wr = &d.w[e * d.es + o * d.rs];
          for (int64_t i = 0; i < g.in; ++i) {
            s += static_cast<double>(wr[i]) * xr[i];
            a += std::fabs(static_cast<double>(wr[i]) * xr[i]);
          }
          exact[slot * d.ys + o] = s;
          bound[slot * d.ys + o] = static_cast<float>((g.in + 1) * kU32 * a);
        }
      }
    }
    EXPECT_TRUE(SameBitsOrBothNan(got.y, want, "expert gemm vs cpu::MatMulNT " + Name(g)));
    double worst = 0;
    for (size_t i = 0; i < got.y.size(); ++i) {
      if (bound[i] > 0) worst = std::max(worst, std::fabs(got.y[i] - exact[i]) / bound[i]);
    }
    EXPECT_LE(worst, 1.0) << Name(g);
    std::printf("  [expert gemm %s] bitwise cpu; worst |y − fp64| / ((in+1)·u·Σ|w·x|) = %.3g\n", Name(g).c_str(),
                worst);

    // Batch invariance: a row computed alone gives the bits it had in the batch.
    for (int64_t r : {int64_t{0}, g.rows - 1}) {
      const std::vector<int32_t> one(d.ids.begin() + r * g.k, d.ids.begin() + (r + 1) * g.k);
      const float* x_one = &d.x[(g.x_per_slot ? r * g.k : r) * d.xs];
      GemmRun alone = GpuExpertGemm(d, one, 1, x_one);
      EXPECT_TRUE(BitwiseEqual(alone.y,
                               std::vector<float>(got.y.begin() + r * g.k * d.ys, got.y.begin() + (r + 1) * g.k * d.ys),
                               "expert gemm row " + std::to_string(r) + " alone vs batch " + Name(g)));
    }
  }
}

// cpu::MatMulNT of every slot: the bits every launch shape must give.
std::vector<float> CpuExpertGemm(const GemmData& d) {
  const GemmCase& g = d.g;
  std::vector<float> want(g.rows * g.k * d.ys, 0.0f), xr(g.in);
  for (int64_t slot = 0; slot < g.rows * g.k; ++slot) {
    const float* xrow = &d.x[(g.x_per_slot ? slot : slot / g.k) * d.xs];
    for (int64_t i = 0; i < g.in; ++i) xr[i] = g.round_x ? kernels::Bf16ToF32(kernels::F32ToBf16(xrow[i])) : xrow[i];
    kernels::cpu::MatMulNTStrided(xr.data(), g.in, 1, &d.w[d.ids[slot] * d.es], d.rs, g.out, g.in,
                                  &want[slot * d.ys], 1);
  }
  return want;
}

// The launch shape is speed only: every shape ExpertGemm can take — forced — gives
// cpu::MatMulNT's bits, for dense layers (one "expert": gemm=*_dot) at decode and prefill row
// counts and for MoE. The cp.async shapes refuse operands they cannot stream.
TEST(CudaExpertGemm, EveryLaunchShapeGivesTheSameBits) {
  LS_REQUIRE_GPU();
  using L = cu::ExpertGemmParams::Launch;
  const GemmCase cases[] = {
      {1, 1, 1, 3072, 2048, true, false, true, 0},   // V2-Lite q_proj at batch 1
      {5, 1, 1, 576, 2048, true, false, true, 0},    // kv_a_proj, a few rows
      {70, 1, 1, 200, 1408, true, false, true, 0},   // more rows than a chunk, tail tile
      {4, 6, 64, 352, 512, true, false, true, 0},    // MoE decode
      {50, 6, 8, 96, 1024, true, true, false, 0},    // MoE crowded, per-slot x
      {3, 1, 1, 40, 72, false, false, false, 1},     // fp32, unaligned: register shapes only
      {1, 1, 1, 200, 4352, true, false, true, 0},    // streaming: 17 blocks > the ring, two x tiles
      {2, 3, 5, 40, 1408, true, true, true, 0},      // streaming: per-slot x, half a last block
      {1, 6, 8, 2048, 1408, true, true, true, 0},    // routed down at one token: 768 CTAs, a 3-deep ring refilled
      {1, 1, 1, 42, 10944, true, false, true, 0},    // a warp with 2 rows; 22 blocks over 3 x tiles (layer 0's down)
      // FP8 weights (gemm=fp8_dot): every shape but the streaming one (bf16 only), which refuses them.
      {1, 1, 1, 3072, 2048, false, false, false, 0, true},   // q_proj at batch 1
      {5, 1, 1, 576, 2048, false, false, false, 0, true},    // kv_a_proj, a few rows
      {4, 6, 64, 352, 512, false, false, false, 0, true},    // MoE decode
      {50, 6, 8, 96, 1024, false, true, false, 0, true},     // MoE crowded, per-slot x
      {1, 1, 1, 42, 10944, false, false, false, 0, true},    // 22 blocks over 3 x tiles, 86 scale chunks
      {2, 3, 5, 40, 1408, false, true, false, 0, true},      // half a last block, 11 chunks
      {1, 6, 8, 2048, 1408, false, true, false, 0, true},    // routed down at one token
      {3, 1, 1, 40, 200, false, false, false, 1, true},      // unaligned rows, a partial chunk: register only
  };
  const L all[] = {L::kAuto,        L::kRegBySlot,  L::kRegChunk,   L::kFastBySlot4,
                   L::kFastChunk4,  L::kFastBySlot1, L::kFastChunk1, L::kStreamBySlot, L::kBulkBySlot};
  uint64_t seed = 5000;
  for (const GemmCase& g : cases) {
    GemmData d = MakeGemm(g, seed += 10);
    const std::vector<float> want = CpuExpertGemm(d);
    const bool aligned = g.pad == 0 && g.in % 16 == 0;
    for (L launch : all) {
      const bool fast = launch >= L::kFastBySlot4;
      const bool fast_ok = aligned && (g.w_bf16 || (g.w_fp8 && launch != L::kStreamBySlot));
      const std::string what = Name(g) + " launch " + std::to_string(static_cast<int>(launch));
      if (fast && !fast_ok) {
        // Refused with a named field, before any launch.
        cu::ExpertGemmParams p;
        p.rows = g.rows, p.k = g.k, p.experts = g.experts, p.out = g.out, p.in = g.in;
        p.w = reinterpret_cast<const void*>(uintptr_t{16});  // never dereferenced: the check comes first
        p.w_bf16 = g.w_bf16, p.w_expert_stride = d.es, p.w_row_stride = d.rs;
        p.w_fp8 = g.w_fp8, p.w_scale = reinterpret_cast<const float*>(uintptr_t{16});
        p.w_scale_row_stride = d.srs, p.w_scale_expert_stride = d.ses;
        p.x = reinterpret_cast<const float*>(uintptr_t{16}), p.x_stride = d.xs;
        p.ids = reinterpret_cast<const int32_t*>(uintptr_t{16});
        p.y = reinterpret_cast<float*>(uintptr_t{16}), p.y_stride = d.ys;
        p.launch = launch;
        const Status st = cu::ExpertGemm(p);
        EXPECT_FALSE(st.ok()) << what;
        EXPECT_NE(st.message().find("launch"), std::string::npos) << st.message();
        continue;
      }
      GemmRun got = GpuExpertGemm(d, d.ids, g.rows, d.x.data(), launch);
      EXPECT_EQ(got.flag, 0) << what;
      EXPECT_TRUE(SameBitsOrBothNan(got.y, want, "expert gemm vs cpu::MatMulNT, " + what));
    }
  }
}

// Expert parallelism: a launch over one rank's block of experts [b, e) with the ids' global
// numbering (expert0 = b, skip_foreign) computes that block's slots with the bits of the launch
// over every expert and leaves every other slot's row as it was — no NaN, no error flag — in
// every launch shape. (The tensor-core shape reads the same ids; this data's x rows are not
// 16-byte aligned, so it is not among the shapes checked here.)
TEST(CudaExpertGemm, ExpertParallelBlockComputesItsSlotsOnly) {
  LS_REQUIRE_GPU();
  using L = cu::ExpertGemmParams::Launch;
  const GemmCase cases[] = {
      {4, 6, 64, 352, 512, true, false, true, 0},         // MoE decode
      {50, 6, 8, 96, 1024, true, true, true, 0},          // crowded, per-slot x
      {1, 6, 8, 2048, 1408, true, true, true, 0},         // routed down at one token
      {4, 6, 64, 352, 512, false, false, false, 0, true},  // FP8
      {3, 2, 4, 40, 72, false, false, false, 1},          // fp32, unaligned: register shapes only
  };
  const L all[] = {L::kAuto,       L::kRegBySlot,   L::kRegChunk,   L::kFastBySlot4, L::kFastChunk4,
                   L::kFastBySlot1, L::kFastChunk1, L::kStreamBySlot, L::kBulkBySlot};
  constexpr float kUntouched = -1234.5f;
  uint64_t seed = 7000;
  for (const GemmCase& g : cases) {
    GemmData d = MakeGemm(g, seed += 10);
    const std::vector<float> want = CpuExpertGemm(d);
    const bool aligned = g.pad == 0 && g.in % 16 == 0;
    const int64_t b = g.experts / 4, e = g.experts / 2;  // a middle block: ids below and above it
    for (int tc = 0; tc < 1; ++tc) {
      for (L launch : all) {
        const bool fast = launch >= L::kFastBySlot4;
        if (fast && !(aligned && (g.w_bf16 || (g.w_fp8 && launch != L::kStreamBySlot)))) continue;
        if (tc == 1 && (launch != L::kAuto || !g.w_bf16 || !g.round_x)) continue;
        const std::string what = Name(g) + " block [" + std::to_string(b) + ", " + std::to_string(e) + ") launch " +
                                 std::to_string(static_cast<int>(launch)) + (tc ? " tensor cores" : "");
        GemmRun got = GpuExpertGemm(d, d.ids, g.rows, d.x.data(), launch, 0, tc == 1, b, e, kUntouched);
        EXPECT_EQ(got.flag, 0) << what;
        std::vector<float> ref = tc ? GpuExpertGemm(d, d.ids, g.rows, d.x.data(), launch, 0, true).y : want;
        size_t own = 0, bad = 0;
        for (int64_t sl = 0; sl < g.rows * g.k; ++sl) {
          const bool mine = d.ids[sl] >= b && d.ids[sl] < e;
          own += mine;
          for (int64_t o = 0; o < g.out; ++o) {
            const float v = got.y[sl * d.ys + o];
            const float w = mine ? ref[sl * d.ys + o] : kUntouched;
            bad += std::memcmp(&v, &w, 4) != 0;
          }
        }
        EXPECT_GT(own, 0u) << what << ": no slot routed to the block (the case tests nothing)";
        EXPECT_EQ(bad, 0u) << what << ": values not the whole launch's (own slots) or not left as they were (others)";
      }
    }
  }
}

// With fixed ids the streaming GEMV requests its weights before the kernel launched just before
// it has finished (kernels/cuda/launch.cuh); its x must still be that kernel's output. Here that
// kernel is a long Scale (× 2, exact) over 256 MB whose last row is x: a GEMV that read x before
// its wait would see x / 2 (or a mix) and miss cpu::MatMulNT's bits.
TEST(CudaExpertGemm, StreamingGemvReadsXOnlyAfterTheKernelBefore) {
  LS_REQUIRE_GPU();
  std::printf("  overlapped launch: %s\n", cu::OverlappedLaunch() ? "on" : "off (device before sm_90)");
  auto stream = cu::CudaStream::Create();
  ASSERT_TRUE(stream.ok()) << stream.status().message();
  const cu::Stream s = (*stream)->get();
  const GemmCase g{1, 1, 1, 2048, 2048, true, false, true, 0};
  const GemmData d = MakeGemm(g, 9100);
  const std::vector<float> want = CpuExpertGemm(d);
  const int64_t n = d.xs, filler = (int64_t{64} << 20) / n;  // rows before x's
  std::vector<float> halves((filler + 1) * n, 1.0f);
  for (int64_t i = 0; i < n; ++i) halves[filler * n + i] = d.x[i] * 0.5f;
  cu::DeviceBuffer big = Upload(halves);
  cu::DeviceBuffer dw = Upload(d.w16);
  cu::DeviceBuffer ids = Zeros<int32_t>(1);
  cu::DeviceBuffer dy = Zeros<float>(d.ys);
  cu::ExpertGemmParams p;
  p.rows = 1, p.k = 1, p.experts = 1, p.out = g.out, p.in = g.in;
  p.w = dw.data(), p.w_bf16 = true, p.w_expert_stride = d.es, p.w_row_stride = d.rs;
  p.x = big.as<float>() + filler * n, p.x_stride = n, p.round_x_bf16 = true;
  p.ids = ids.as<int32_t>(), p.ids_fixed = true;
  p.y = dy.as<float>(), p.y_stride = d.ys;
  using L = cu::ExpertGemmParams::Launch;
  for (L launch : {L::kStreamBySlot, L::kBulkBySlot, L::kAuto}) {
    p.launch = launch;
    for (int rep = 0; rep < 4; ++rep) {
      ASSERT_TRUE(cu::CopyAsync(big.data(), halves.data(), halves.size() * sizeof(float), s).ok());
      ASSERT_TRUE(cu::MemsetAsync(dy.data(), 0xff, d.ys * sizeof(float), s).ok());  // NaNs until written
      ASSERT_TRUE(cu::Scale(big.as<float>(), n, filler + 1, n, 2.0f, s).ok());
      ASSERT_TRUE(cu::ExpertGemm(p, s).ok());
      ASSERT_TRUE((*stream)->Synchronize().ok());
      const std::vector<float> y = Download<float>(dy, d.ys);
      EXPECT_TRUE(SameBitsOrBothNan(std::vector<float>(y.begin(), y.begin() + g.out),
                                    std::vector<float>(want.begin(), want.begin() + g.out),
                                    "launch " + std::to_string(static_cast<int>(launch)) + " rep " +
                                        std::to_string(rep)));
    }
  }
}

// The SwiGLU epilogue (swiglu_inter = I; the product's 2·I rows are [gate | up]): each slot's
// I activations are the SwiGlu kernel's over the product's gate and up rows, bit for bit (the
// product is cpu::MatMulNT's bits: the tests above; SwiGlu is within an exp ulp of the CPU's:
// CudaSwiGlu), and nothing past them is written — V2-Lite's shared experts at batch 1 and 8
// (I = 2816), a token's routed experts (I = 1408, six slots by id), FP8 weights, and I not a
// multiple of 8 (the last CTA's gate and up halves both partial); a bad id gives NaN
// activations and the flag. Refused by name where the bulk shape does not run;
// ExpertGemmSwiGluFits says so beforehand.
TEST(CudaExpertGemm, SwiGluEpilogueIsTheProductThenSwiGlu) {
  LS_REQUIRE_GPU();
  using L = cu::ExpertGemmParams::Launch;
  const GemmCase cases[] = {
      {1, 1, 1, 5632, 2048, true, false, true, 0},           // shared gate_up, batch 1
      {8, 1, 1, 5632, 2048, true, false, true, 0},           // batch 8
      {1, 6, 64, 2816, 2048, true, false, true, 0},          // routed gate_up of a token
      {2, 2, 4, 26, 64, true, false, true, 0},               // I = 13
      {1, 1, 1, 5632, 2048, false, false, false, 0, true},   // FP8
      {3, 2, 4, 42, 256, false, false, false, 0, true},      // FP8, I = 21
  };
  uint64_t seed = 7100;
  for (const GemmCase& g : cases) {
    const int64_t I = g.out / 2, slots = g.rows * g.k;
    GemmData d = MakeGemm(g, seed += 10);
    const GemmRun prod = GpuExpertGemm(d, d.ids, g.rows, d.x.data(), L::kBulkBySlot);
    ASSERT_TRUE(SameBitsOrBothNan(prod.y, CpuExpertGemm(d), "the product, " + Name(g)));
    cu::DeviceBuffer dprod = Upload(prod.y), dwant = Zeros<float>(slots * d.ys);
    cu::SwiGluParams sp;
    sp.g = dprod.as<float>(), sp.g_stride = d.ys;
    sp.u = dprod.as<float>() + I, sp.u_stride = d.ys;
    sp.out = dwant.as<float>(), sp.out_stride = d.ys;
    sp.rows = slots, sp.n = I;
    LS_ASSERT_OK(cu::SwiGlu(sp));
    LS_ASSERT_OK(cu::Synchronize());
    const std::vector<float> want = Download<float>(dwant, slots * d.ys);
    GemmRun got = GpuExpertGemm(d, d.ids, g.rows, d.x.data(), L::kBulkBySlot, I);
    EXPECT_EQ(got.flag, 0) << Name(g);
    EXPECT_TRUE(SameBitsOrBothNan(got.y, want, "swiglu epilogue vs the product then SwiGlu, " + Name(g)));

    // A bad id: that slot's activations NaN, the flag set, the other slots unchanged.
    if (g.k > 1) {
      std::vector<int32_t> ids = d.ids;
      ids[1] = static_cast<int32_t>(g.experts);
      GemmRun bad = GpuExpertGemm(d, ids, g.rows, d.x.data(), L::kBulkBySlot, I);
      EXPECT_EQ(bad.flag, cu::kErrExpert) << Name(g);
      for (int64_t slot = 0; slot < slots; ++slot) {
        for (int64_t c = 0; c < d.ys; ++c) {
          const float v = bad.y[slot * d.ys + c];
          if (c >= I) {
            ASSERT_EQ(v, 0.0f) << Name(g) << " slot " << slot << " col " << c << ": past the activations";
          } else if (slot == 1) {
            ASSERT_TRUE(std::isnan(v)) << Name(g) << " col " << c;
          } else {
            ASSERT_EQ(std::bit_cast<uint32_t>(v), std::bit_cast<uint32_t>(want[slot * d.ys + c]))
                << Name(g) << " slot " << slot << " col " << c;
          }
        }
      }
    }
  }

  // Where it applies: the auto shape at decode's few rows (the engine's shared experts) fits;
  // a crowded product and a forced non-bulk shape do not, and ExpertGemm refuses them by name.
  const GemmData d = MakeGemm({1, 1, 1, 5632, 2048, true, false, true, 0}, 7300);
  cu::DeviceBuffer dw = Upload(d.w16), dx = Upload(std::vector<float>(64 * 2048, 0.5f)), ids = Zeros<int32_t>(64),
                   dy = Zeros<float>(64 * d.ys);
  cu::ExpertGemmParams p;
  p.rows = 1, p.k = 1, p.experts = 1, p.out = 5632, p.in = 2048;
  p.w = dw.data(), p.w_bf16 = true, p.w_expert_stride = d.es, p.w_row_stride = d.rs;
  p.x = dx.as<float>(), p.x_stride = 2048, p.round_x_bf16 = true;
  p.ids = ids.as<int32_t>(), p.ids_fixed = true;
  p.y = dy.as<float>(), p.y_stride = d.ys;
  p.swiglu_inter = 2816;
  EXPECT_TRUE(cu::ExpertGemmSwiGluFits(p)) << "decode's shared gate_up at one row";
  p.launch = L::kStreamBySlot;
  EXPECT_FALSE(cu::ExpertGemmSwiGluFits(p));
  Status st = cu::ExpertGemm(p);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("swiglu_inter"), std::string::npos) << st.message();
  p.launch = L::kAuto;
  p.rows = 64;  // crowded: the chunked cp.async shape
  EXPECT_FALSE(cu::ExpertGemmSwiGluFits(p));
  st = cu::ExpertGemm(p);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("swiglu_inter"), std::string::npos) << st.message();
  p.rows = 1;
  p.swiglu_inter = 2815;  // out ≠ 2·I
  EXPECT_FALSE(cu::ExpertGemmSwiGluFits(p));
  st = cu::ExpertGemm(p);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("swiglu_inter"), std::string::npos) << st.message();
}

TEST(CudaExpertGemm, BadExpertIdGivesNanRowAndFlag) {
  LS_REQUIRE_GPU();
  // 6 slots (the per-slot grid) and 40 slots (the per-expert grid), each on the cp.async path
  // (in = 64) and the register path (in = 60).
  for (int64_t rows : {3, 20, -3, -20}) {
    const GemmCase g{rows < 0 ? -rows : rows, 2, 4, 100, rows < 0 ? 60 : 64, true, false, false, 0};
    GemmData d = MakeGemm(g, 77 + rows);
    std::vector<int32_t> ids = d.ids;
    ids[1] = 4;   // row 0 slot 1: out of range
    ids[4] = -1;  // row 2 slot 0
    GemmRun got = GpuExpertGemm(d, ids, g.rows, d.x.data());
    EXPECT_EQ(got.flag, cu::kErrExpert) << Name(g);
    for (int64_t slot = 0; slot < g.rows * g.k; ++slot) {
      const bool bad = slot == 1 || slot == 4;
      for (int64_t o = 0; o < g.out; ++o) {
        ASSERT_EQ(std::isnan(got.y[slot * d.ys + o]), bad) << Name(g) << " slot " << slot << " col " << o;
      }
    }
  }
}

// The tensor-core shape (gemm=bf16's routed experts): not cpu::Dot's order, so checked against
// the fp64 product of the same bf16 operands — within 2·(in + 1)·u·Σ|w·x| (the MMA's internal
// fp32 additions need not round to nearest: twice the textbook bound) — and for what the
// variant promises: the same bits run to run and for a row alone as in its batch. Shapes: V2-
// Lite's gate_up and down at 1 and 64 tokens, experts with more than 32 slots (several
// passes), a partial row tile and a partial K chunk.
TEST(CudaExpertGemm, TensorCoresAreDeterministicBatchInvariantAndWithinBound) {
  LS_REQUIRE_GPU();
  const GemmCase cases[] = {
      // (8 experts, not V2-Lite's 64: the shapes that matter are out and in, and the host's
      // random weights for 64 took seconds; 64 rows then put ~48 slots on each expert.)
      {1, 6, 8, 2816, 2048, true, false, true, 0},    // decode gate_up
      {64, 6, 8, 2816, 2048, true, false, true, 0},   // batch 64 gate_up: passes of 32 slots
      {64, 6, 8, 2048, 1408, true, true, true, 0},    // batch 64 down, per-slot x, in = 5.5 chunks
      {50, 2, 4, 200, 320, true, false, true, 8},     // partial row tile and K chunk, padded rows
      {7, 1, 1, 64, 32, true, true, true, 0},         // one 32-column block
  };
  uint64_t seed = 4000;
  for (const GemmCase& g : cases) {
    GemmData d = MakeGemm(g, seed += 10);
    d.xs = g.in + 4;  // 16-byte x rows
    d.x = Randn(d.xrows * d.xs, seed + 1, 1.0f);
    if (g.experts == 4) {  // expert 0 in every row: 50 slots, two passes of ≤ 32
      for (int64_t r = 0; r < g.rows; ++r) {
        d.ids[r * g.k] = 0;
        d.ids[r * g.k + 1] = 1 + static_cast<int32_t>(r % 3);
      }
    }
    cu::ExpertGemmParams probe;
    probe.w_bf16 = true;
    probe.round_x_bf16 = true;
    probe.x = reinterpret_cast<const float*>(uintptr_t{256});
    probe.w = reinterpret_cast<const void*>(uintptr_t{256});
    probe.in = g.in;
    probe.w_row_stride = d.rs;
    probe.w_expert_stride = d.es;
    probe.x_stride = d.xs;
    ASSERT_TRUE(cu::ExpertGemmTcFits(probe)) << Name(g);
    const auto kAuto = cu::ExpertGemmParams::Launch::kAuto;
    GemmRun got = GpuExpertGemm(d, d.ids, g.rows, d.x.data(), kAuto, 0, true);
    EXPECT_EQ(got.flag, 0) << Name(g);
    double worst = 0;
    int64_t bad = 0;
    std::vector<float> xr(g.in);
    // (The fp64 reference over every 7th output row and the last: the batch-64 cases' full
    // products take the host minutes; the bitwise checks below cover every element.)
    for (int64_t slot = 0; slot < g.rows * g.k; ++slot) {
      const int64_t e = d.ids[slot];
      const float* xrow = &d.x[(g.x_per_slot ? slot : slot / g.k) * d.xs];
      for (int64_t i = 0; i < g.in; ++i) xr[i] = kernels::Bf16ToF32(kernels::F32ToBf16(xrow[i]));
      for (int64_t o = 0; o < g.out; o = o == g.out - 1 ? g.out : std::min(o + 7, g.out - 1)) {
        double s = 0, a = 0;
        const float* wr = &d.w[e * d.es + o * d.rs];
        for (int64_t i = 0; i < g.in; ++i) {
          s += static_cast<double>(wr[i]) * xr[i];
          a += std::fabs(static_cast<double>(wr[i]) * xr[i]);
        }
        const double y = got.y[slot * d.ys + o], bound = 2.0 * (g.in + 1) * kU32 * a;
        if (!(std::fabs(y - s) <= bound)) {  // NaN fails
          if (bad++ < 3) ADD_FAILURE() << Name(g) << " slot " << slot << " row " << o << ": " << y << " vs " << s;
        } else if (bound > 0) {
          worst = std::max(worst, std::fabs(y - s) / bound);
        }
      }
    }
    EXPECT_EQ(bad, 0) << Name(g);
    GemmRun again = GpuExpertGemm(d, d.ids, g.rows, d.x.data(), kAuto, 0, true);
    EXPECT_TRUE(BitwiseEqual(again.y, got.y, "tensor cores run to run " + Name(g)));
    for (int64_t r : {int64_t{0}, g.rows - 1}) {
      const std::vector<int32_t> one(d.ids.begin() + r * g.k, d.ids.begin() + (r + 1) * g.k);
      const float* x_one = &d.x[(g.x_per_slot ? r * g.k : r) * d.xs];
      GemmRun alone = GpuExpertGemm(d, one, 1, x_one, kAuto, 0, true);
      EXPECT_TRUE(BitwiseEqual(alone.y,
                               std::vector<float>(got.y.begin() + r * g.k * d.ys, got.y.begin() + (r + 1) * g.k * d.ys),
                               "tensor cores: row " + std::to_string(r) + " alone vs batch " + Name(g)));
    }
    std::printf("  [expert gemm tensor cores %s] worst |y − fp64| / (2·(in+1)·u·Σ|w·x|) = %.3g\n", Name(g).c_str(),
                worst);
  }
  // A bad id: its row NaN and the flag, as the other shapes.
  const GemmCase g{20, 2, 4, 100, 64, true, false, true, 0};
  GemmData d = MakeGemm(g, 91);
  d.xs = g.in + 4;
  d.x = Randn(d.xrows * d.xs, 92, 1.0f);
  std::vector<int32_t> ids = d.ids;
  ids[1] = 4;
  ids[4] = -1;
  GemmRun got = GpuExpertGemm(d, ids, g.rows, d.x.data(), cu::ExpertGemmParams::Launch::kAuto, 0, true);
  EXPECT_EQ(got.flag, cu::kErrExpert);
  for (int64_t slot = 0; slot < g.rows * g.k; ++slot) {
    for (int64_t o = 0; o < g.out; ++o) {
      ASSERT_EQ(std::isnan(got.y[slot * d.ys + o]), slot == 1 || slot == 4) << "slot " << slot << " col " << o;
    }
  }
  // A shape the MMA blocks do not tile: refused, naming the field (nothing is launched).
  cu::ExpertGemmParams p;
  p.rows = 1;
  p.k = 1;
  p.experts = 1;
  p.out = 64;
  p.in = 48;  // not a multiple of 32
  p.w = reinterpret_cast<const void*>(uintptr_t{256});
  p.w_bf16 = true;
  p.w_row_stride = 48;
  p.w_expert_stride = 64 * 48;
  p.x = reinterpret_cast<const float*>(uintptr_t{256});
  p.x_stride = 48;
  p.round_x_bf16 = true;
  p.ids = reinterpret_cast<const int32_t*>(uintptr_t{256});
  p.y = reinterpret_cast<float*>(uintptr_t{256});
  p.y_stride = 64;
  p.tensor_cores = true;
  EXPECT_FALSE(cu::ExpertGemmTcFits(p));
  const Status st = cu::ExpertGemm(p);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("tensor_cores"), std::string::npos) << st.message();
}
}  // namespace
}  // namespace lockstep
