// tests/gpu/gpu_mla_decode_test.cc — CUDA MLA absorbed decode (dense and sparse) against
// the CPU engine's absorbed attention on a real engine::PagedKvCache, in the three cache
// formats; NaN positions; bitwise determinism and batch invariance; device error flags.
//
// The CPU twin is engine/model.cc's absorbed branch verbatim (cpu::Dot scores, cpu::Softmax,
// cpu::Axpy in key order) over cache.ReadLatent. Values are judged against an fp64 softmax
// and weighted sum built from the same fp32 scores (the GPU computes those scores bit for
// bit as the CPU does), with the tolerance derived in MlaTolerance below.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "engine/config.h"
#include "engine/kv_cache.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu/gpu_test_util.h"

namespace lockstep {
namespace {

using namespace gpu_testing;  // NOLINT
namespace cpu = kernels::cpu;

engine::ModelConfig Shapes(int64_t kv_lora, int64_t rope) {
  auto c = engine::ModelConfig::FromJson(R"({"model_type":"deepseek_v3","num_hidden_layers":1,"kv_lora_rank":)" +
                                             std::to_string(kv_lora) + R"(,"qk_rope_head_dim":)" +
                                             std::to_string(rope) + "}",
                                         "config.json");
  EXPECT_TRUE(c.ok()) << c.status().message();
  return *c;
}

// A paged cache holding `lens[b]` tokens for each request, and its device pool.
struct World {
  int64_t C = 0, R = 0, page_size = 0, num_pages = 0, bpt = 0;
  engine::KvFormat format = engine::KvFormat::kFp8E4m3;
  std::unique_ptr<engine::PagedKvCache> cache;
  std::vector<engine::SeqCache> seqs;
  std::vector<uint8_t> pool;  // [num_pages · page_size, bpt]; never-written slots hold NaN bytes
};

// Latent rows ~ N(0,1) (RMSNorm output), rope ~ N(0,1), written token by token through the
// engine's WriteLatent. `skip_pages` requests are reserved first so page ids differ between
// worlds built with different values.
World MakeWorld(int64_t C, int64_t R, engine::KvFormat format, const std::vector<int64_t>& lens, uint64_t seed,
                int64_t page_size = 64, int64_t skip_pages = 0) {
  World w;
  w.C = C;
  w.R = R;
  w.format = format;
  w.page_size = page_size;
  int64_t pages = skip_pages;
  for (int64_t n : lens) pages += (n + page_size - 1) / page_size;
  w.num_pages = pages + 1;
  const engine::ModelConfig cfg = Shapes(C, R);
  w.cache = std::make_unique<engine::PagedKvCache>(cfg, format, page_size, w.num_pages);
  w.bpt = w.cache->latent_bytes_per_token();
  engine::SeqCache skip;
  if (skip_pages > 0) {
    EXPECT_TRUE(w.cache->Reserve(&skip, skip_pages * page_size).ok());
  }
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> lat(C), rope(R);
  w.seqs.resize(lens.size());
  for (size_t b = 0; b < lens.size(); ++b) {
    EXPECT_TRUE(w.cache->Reserve(&w.seqs[b], lens[b]).ok());
    w.seqs[b].length = lens[b];
  }
  // Tokens are generated request by request, position by position: a request's content
  // depends on (seed, its index, position) only, so worlds can share requests.
  for (size_t b = 0; b < lens.size(); ++b) {
    std::mt19937_64 r(seed * 1000003 + b);
    for (int64_t t = 0; t < lens[b]; ++t) {
      for (auto& v : lat) v = g(r);
      for (auto& v : rope) v = g(r);
      w.cache->WriteLatent(0, w.seqs[b], t, lat.data(), rope.data());
    }
  }
  w.pool.assign(w.num_pages * page_size * w.bpt, 0xFF);  // 0xFF: NaN in fp8, bf16 and fp32 alike
  for (size_t b = 0; b < lens.size(); ++b) {
    for (int64_t t = 0; t < lens[b]; ++t) {
      const int64_t slot = w.seqs[b].pages[t / page_size] * page_size + t % page_size;
      std::memcpy(&w.pool[slot * w.bpt], w.cache->TokenBytes(0, 0, w.seqs[b], t), w.bpt);
    }
  }
  return w;
}

int32_t SlotOf(const World& w, size_t b, int64_t pos) {
  return static_cast<int32_t>(w.seqs[b].pages[pos / w.page_size] * w.page_size + pos % w.page_size);
}

struct Queries {
  int64_t heads = 0;
  std::vector<float> q_lat;   // [B, H, C]
  std::vector<float> q_rope;  // [B, H, R]
};

// Absorbed queries with a spread of sharpness: head h has std 0.5·(1 + h mod 4), so softmaxes
// range from flat to peaked (score std ≈ 0.6 to 2.4 at DeepSeek's scale 192^-0.5).
Queries MakeQueries(int64_t B, int64_t H, int64_t C, int64_t R, uint64_t seed) {
  Queries q;
  q.heads = H;
  q.q_lat.resize(B * H * C);
  q.q_rope.resize(B * H * R);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const float s = 0.5f * static_cast<float>(1 + h % 4);
      for (int64_t i = 0; i < C; ++i) q.q_lat[(b * H + h) * C + i] = g(rng) * s;
      for (int64_t i = 0; i < R; ++i) q.q_rope[(b * H + h) * R + i] = g(rng) * s;
    }
  }
  return q;
}

// The CPU side: engine/model.cc's absorbed attention for every (request, head), and the fp64
// reference from the same scores.
struct Reference {
  std::vector<float> o32;     // [B, H, C] the engine's fp32 result
  std::vector<double> o64;    // [B, H, C] fp64 softmax-weighted sum of the same scores
  std::vector<double> mass;   // [B, H, C] Σ_t p_t |c_t[i]| (the scale of the error bound)
  std::vector<double> lse64;  // [B, H]
};

// keys[b]: the positions request b attends to, in order (−1 = no key).
Reference CpuReference(const World& w, const Queries& q, const std::vector<std::vector<int32_t>>& keys, float scale) {
  const int64_t B = static_cast<int64_t>(keys.size()), H = q.heads, C = w.C, R = w.R;
  Reference ref;
  ref.o32.assign(B * H * C, 0.0f);
  ref.o64.assign(B * H * C, 0.0);
  ref.mass.assign(B * H * C, 0.0);
  ref.lse64.assign(B * H, -INFINITY);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int32_t> pos;
    for (int32_t k : keys[b]) {
      if (k >= 0) pos.push_back(k);
    }
    const int64_t n = static_cast<int64_t>(pos.size());
    std::vector<float> lat(n * C), kr(n * R);
    for (int64_t j = 0; j < n; ++j) w.cache->ReadLatent(0, w.seqs[b], pos[j], &lat[j * C], &kr[j * R]);
#pragma omp parallel for schedule(dynamic)
    for (int64_t h = 0; h < H; ++h) {
      const float* ql = &q.q_lat[(b * H + h) * C];
      const float* qr = &q.q_rope[(b * H + h) * R];
      std::vector<float> sc(n);
      for (int64_t j = 0; j < n; ++j) sc[j] = (cpu::Dot(ql, &lat[j * C], C) + cpu::Dot(qr, &kr[j * R], R)) * scale;
      // fp64 reference from these scores.
      double m = -INFINITY;
      for (float s : sc) m = std::fmax(m, static_cast<double>(s));
      std::vector<double> p(n);
      double z = 0;
      for (int64_t j = 0; j < n; ++j) z += (p[j] = std::exp(static_cast<double>(sc[j]) - m));
      if (n > 0) ref.lse64[b * H + h] = m + std::log(z);
      double* o64 = &ref.o64[(b * H + h) * C];
      double* mass = &ref.mass[(b * H + h) * C];
      for (int64_t j = 0; j < n; ++j) {
        const double pj = p[j] / z;
        for (int64_t i = 0; i < C; ++i) {
          o64[i] += pj * lat[j * C + i];
          mass[i] += pj * std::fabs(lat[j * C + i]);
        }
      }
      // The engine's fp32 path (engine/model.cc's absorbed attention): cpu::MlaAttend over the
      // key list as the kernels hold it (n = its length, −1 entries masked) — their bits.
      const int64_t n_list = static_cast<int64_t>(keys[b].size());
      std::vector<float> sc_list(n_list, -INFINITY);
      std::vector<const float*> rows(n_list, nullptr);
      for (int64_t j = 0, at = 0; j < n_list; ++j) {
        if (keys[b][j] < 0) continue;
        sc_list[j] = sc[at];
        rows[j] = &lat[at * C];
        ++at;
      }
      cpu::MlaAttend(sc_list.data(), rows.data(), n_list, C, &ref.o32[(b * H + h) * C]);
    }
  }
  return ref;
}

// Error bound of the GPU result against the fp64 reference, relative to mass = Σ p_t|c_t|:
// along any path the GPU forms at most `depth` fp32 roundings of sums/products — split_keys
// FMAs into o (and into l), one rescale per 32-key tile, S split combinations, the final
// division — each ≤ u; and `exps` exp evaluations (ExpF ≤ 1 ulp; 4u each is loose: the key's own, the
// tile rescales, the split factor). Numerator and denominator each carry it: ×2. Another
// u·mass for the reference's rounding to fp32 when compared.
struct MlaTolerance {
  double rel;  // × mass
  double lse;  // absolute, plus 4u·|lse|
};
MlaTolerance Tolerance(int64_t n_keys) {
  const int64_t split = cu::MlaSplitKeys(std::max<int64_t>(n_keys, 1));
  const int64_t splits = (n_keys + split - 1) / split;
  const double depth = static_cast<double>(split + split / 32 + splits + 4);
  const double exps = static_cast<double>(split / 32 + 2);
  const double rel = 2.0 * (depth + 4.0 * exps) * kU32 + kU32;
  return {rel, rel};
}

struct GpuResult {
  std::vector<float> o, lse;
  std::vector<float> y_unfused, y_fused;  // with an Absorption: W_UV on o, and on the merged splits
  int32_t flag = 0;
  Status status;
};

// Runs dense (indices empty) or sparse decode of all requests of `w`.
// W_UV for the absorption after the decode (ExpertGemmParams::x_partials' test): [H, dv, C]
// bf16, or FP8 e4m3 with a scale per row and 128 columns.
struct Absorption {
  int64_t dv = 0;
  bool fp8 = false, round_x_bf16 = false;
  std::vector<uint16_t> w16;
  std::vector<uint8_t> w8;
  std::vector<float> scale;
};
Absorption MakeAbsorption(int64_t H, int64_t dv, int64_t C, bool fp8, bool round_x_bf16, uint64_t seed) {
  Absorption a;
  a.dv = dv;
  a.fp8 = fp8;
  a.round_x_bf16 = round_x_bf16;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 0.05f);
  if (fp8) {
    a.w8.resize(H * dv * C);
    for (auto& v : a.w8) v = static_cast<uint8_t>(rng() % 0x7F) | static_cast<uint8_t>(rng() % 2 ? 0x80 : 0);  // no NaN
    a.scale.resize(H * dv * ((C + 127) / 128));
    for (auto& v : a.scale) v = 0.001f * static_cast<float>(1 + rng() % 16);
  } else {
    a.w16.resize(H * dv * C);
    for (auto& v : a.w16) {
      const float f = g(rng);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      v = static_cast<uint16_t>(u >> 16);
    }
  }
  return a;
}

GpuResult RunGpu(const World& w, const Queries& q, const std::vector<int64_t>& seq_lens, int64_t max_seq_len,
                 const std::vector<std::vector<int32_t>>* sparse_slots, float scale,
                 const std::vector<int32_t>* page_table_override = nullptr, int32_t heads_per_cta = 0,
                 int32_t key_staging = 0, const Absorption* uv = nullptr) {
  const int64_t B = static_cast<int64_t>(seq_lens.size()), H = q.heads, C = w.C, R = w.R;
  const int64_t max_pages = std::max<int64_t>(1, (max_seq_len + w.page_size - 1) / w.page_size);
  std::vector<int32_t> table(B * max_pages, 0x7fffffff);  // unused entries: out of range if ever read
  for (int64_t b = 0; b < B; ++b) {
    for (size_t i = 0; i < w.seqs[b].pages.size() && static_cast<int64_t>(i) < max_pages; ++i) {
      table[b * max_pages + i] = w.seqs[b].pages[i];
    }
  }
  if (page_table_override != nullptr) table = *page_table_override;
  std::vector<int32_t> lens(B);
  for (int64_t b = 0; b < B; ++b) lens[b] = static_cast<int32_t>(seq_lens[b]);
  int64_t topk = 0;
  std::vector<int32_t> idx;
  if (sparse_slots != nullptr) {
    for (const auto& s : *sparse_slots) topk = std::max<int64_t>(topk, static_cast<int64_t>(s.size()));
    idx.assign(B * topk, -1);
    for (int64_t b = 0; b < B; ++b) std::copy((*sparse_slots)[b].begin(), (*sparse_slots)[b].end(), &idx[b * topk]);
  }
  auto dql = Upload(q.q_lat), dqr = Upload(q.q_rope), dpool = Upload(w.pool), dtable = Upload(table),
       dlens = Upload(lens), didx = Upload(idx);
  auto dout = Zeros<float>(B * H * C), dlse = Zeros<float>(B * H), flag = Zeros<int32_t>(1);
  cu::MlaDecodeParams p;
  p.batch = B;
  p.heads = H;
  p.kv_lora = C;
  p.rope_dim = R;
  p.format = static_cast<cu::LatentFormat>(w.format);
  p.softmax_scale = scale;
  p.q_latent = dql.as<float>();
  p.q_latent_batch_stride = H * C;
  p.q_latent_head_stride = C;
  p.q_rope = dqr.as<float>();
  p.q_rope_batch_stride = H * R;
  p.q_rope_head_stride = R;
  p.cache = dpool.as<uint8_t>();
  p.num_pages = w.num_pages;
  p.page_size = w.page_size;
  if (sparse_slots != nullptr) {
    p.indices = didx.as<int32_t>();
    p.indices_stride = topk;
    p.topk = topk;
  } else {
    p.page_table = dtable.as<int32_t>();
    p.page_table_stride = max_pages;
    p.seq_lens = dlens.as<int32_t>();
    p.max_seq_len = max_seq_len;
  }
  p.o_latent = dout.as<float>();
  p.o_batch_stride = H * C;
  p.o_head_stride = C;
  p.lse = dlse.as<float>();
  p.error_flag = flag.as<int32_t>();
  p.heads_per_cta = heads_per_cta;
  p.key_staging = key_staging;
  GpuResult r;
  auto ws = cu::DeviceBuffer::Allocate(cu::MlaDecodeWorkspaceBytes(p));
  if (!ws.ok()) {
    r.status = ws.status();
    return r;
  }
  p.workspace = ws->data();
  p.workspace_bytes = ws->size();
  r.status = sparse_slots != nullptr ? cu::MlaSparseDecode(p) : cu::MlaDecode(p);
  if (r.status.ok()) r.status = cu::Synchronize();
  r.o = Download<float>(dout, B * H * C);
  r.lse = Download<float>(dlse, B * H);
  r.flag = Download<int32_t>(flag, 1)[0];
  if (uv != nullptr && r.status.ok()) {
    // W_UV on o_latent as the engine absorbs it, then on the splits merged where they are read.
    std::vector<int32_t> heads(B * H);
    for (int64_t i = 0; i < B * H; ++i) heads[i] = static_cast<int32_t>(i % H);
    auto dids = Upload(heads), dw16 = Upload(uv->w16), dw8 = Upload(uv->w8), dscale = Upload(uv->scale);
    auto dy0 = Zeros<float>(B * H * uv->dv), dy1 = Zeros<float>(B * H * uv->dv);
    cu::ExpertGemmParams g;
    g.rows = B;
    g.k = H;
    g.experts = H;
    g.out = uv->dv;
    g.in = C;
    g.w = uv->fp8 ? dw8.data() : dw16.data();
    g.w_bf16 = !uv->fp8;
    g.w_fp8 = uv->fp8;
    g.w_row_stride = C;
    g.w_expert_stride = uv->dv * C;
    g.w_scale = uv->fp8 ? dscale.as<float>() : nullptr;
    g.w_scale_row_stride = (C + 127) / 128;
    g.w_scale_expert_stride = uv->dv * g.w_scale_row_stride;
    g.x = dout.as<float>();
    g.x_stride = C;
    g.x_per_slot = true;
    g.round_x_bf16 = uv->round_x_bf16;
    g.ids = dids.as<int32_t>();
    g.ids_fixed = true;
    g.y = dy0.as<float>();
    g.y_stride = uv->dv;
    r.status = cu::ExpertGemm(g);
    if (r.status.ok()) {
      r.status = sparse_slots != nullptr ? cu::MlaSparseDecodeSplits(p, &g.x_partials) : cu::MlaDecodeSplits(p, &g.x_partials);
    }
    if (r.status.ok()) {
      g.x = nullptr;
      g.y = dy1.as<float>();
      r.status = cu::ExpertGemm(g);
    }
    if (r.status.ok()) r.status = cu::Synchronize();
    r.y_unfused = Download<float>(dy0, B * H * uv->dv);
    r.y_fused = Download<float>(dy1, B * H * uv->dv);
  }
  return r;
}

// NaN positions against the engine's fp32 result, values against the fp64 reference.
void Check(const GpuResult& got, const Reference& ref, const std::vector<int64_t>& n_keys, int64_t H, int64_t C,
           const std::string& what) {
  ASSERT_TRUE(got.status.ok()) << got.status.message();
  EXPECT_EQ(got.flag, 0) << what << ": error flag";
  const int64_t B = static_cast<int64_t>(n_keys.size());
  std::vector<float> want(ref.o64.size());
  for (size_t i = 0; i < want.size(); ++i) want[i] = std::isnan(ref.o32[i]) ? NAN : static_cast<float>(ref.o64[i]);
  auto where = [&](size_t i) {
    return "(b " + std::to_string(i / (H * C)) + ", h " + std::to_string(i / C % H) + ", c " + std::to_string(i % C) +
           ")";
  };
  EXPECT_TRUE(AllClose(
      got.o, want,
      [&](size_t i) { return Tolerance(n_keys[i / (H * C)]).rel * ref.mass[i] + 1e-37; }, what + " o_latent", where));
  std::vector<float> want_lse(B * H);
  for (int64_t i = 0; i < B * H; ++i) {
    const bool nan_row = std::isnan(ref.o32[i * C]);
    want_lse[i] = nan_row ? NAN : static_cast<float>(ref.lse64[i]);
  }
  EXPECT_TRUE(AllClose(
      got.lse, want_lse,
      [&](size_t i) { return Tolerance(n_keys[i / H]).lse + 4 * kU32 * std::fabs(ref.lse64[i]); }, what + " lse",
      [&](size_t i) { return "(b " + std::to_string(i / H) + ", h " + std::to_string(i % H) + ")"; }));
  // The CPU engine's own result (cpu::MlaAttend, the kernels' splits, tiles and exp), bit for bit.
  size_t differ = 0, first = 0;
  for (size_t i = 0; i < ref.o32.size(); ++i) {
    const bool same = std::bit_cast<uint32_t>(got.o[i]) == std::bit_cast<uint32_t>(ref.o32[i]) ||
                      (std::isnan(got.o[i]) && std::isnan(ref.o32[i]));
    if (!same && differ++ == 0) first = i;
  }
  EXPECT_EQ(differ, 0u) << what << ": o_latent is not cpu::MlaAttend's bits; first at " << where(first) << ": GPU "
                        << got.o[first] << ", CPU " << ref.o32[first];
  // Context for the report: how far is the CPU engine itself from the fp64 reference?
  double cpu_worst = 0, gpu_worst = 0;
  for (size_t i = 0; i < ref.o64.size(); ++i) {
    if (std::isnan(ref.o32[i]) || ref.mass[i] == 0) continue;
    cpu_worst = std::max(cpu_worst, std::fabs(ref.o32[i] - ref.o64[i]) / ref.mass[i]);
    gpu_worst = std::max(gpu_worst, std::fabs(got.o[i] - ref.o64[i]) / ref.mass[i]);
  }
  std::printf("  [%s] max |err|/mass: GPU %.3g, CPU engine %.3g (u = %.3g)\n", what.c_str(), gpu_worst, cpu_worst,
              kU32);
}

constexpr float kV3Scale = 0.07216878f;  // (128 + 64)^-0.5

std::vector<std::vector<int32_t>> DenseKeys(const std::vector<int64_t>& lens) {
  std::vector<std::vector<int32_t>> k(lens.size());
  for (size_t b = 0; b < lens.size(); ++b) {
    k[b].resize(lens[b]);
    std::iota(k[b].begin(), k[b].end(), 0);
  }
  return k;
}

TEST(CudaMlaDecode, DenseMatchesCpuEngineInEveryFormat) {
  LS_REQUIRE_GPU();
  struct Case {
    engine::KvFormat format;
    int64_t heads, C, R, page_size;
    std::vector<int64_t> lens;
  };
  const std::vector<Case> cases = {
      {engine::KvFormat::kFp8E4m3, 128, 512, 64, 64, {1, 33, 257, 1500, 2600}},  // DeepSeek V3, 656 B/token
      {engine::KvFormat::kBf16, 20, 512, 64, 64, {700, 5, 2049}},                  // a partial 16-head group
      {engine::KvFormat::kFp32, 20, 512, 64, 16, {300, 64, 1}},
      {engine::KvFormat::kFp32, 2, 32, 8, 16, {70, 1, 17}},   // the tiny test models
      {engine::KvFormat::kFp8E4m3, 4, 32, 8, 16, {70, 2}},
  };
  uint64_t seed = 1;
  for (const Case& c : cases) {
    const std::string what = std::string(engine::KvFormatName(c.format)) + " H=" + std::to_string(c.heads) +
                             " C=" + std::to_string(c.C);
    World w = MakeWorld(c.C, c.R, c.format, c.lens, seed++, c.page_size);
    Queries q = MakeQueries(static_cast<int64_t>(c.lens.size()), c.heads, c.C, c.R, seed++);
    const Reference ref = CpuReference(w, q, DenseKeys(c.lens), kV3Scale);
    const int64_t max_len = *std::max_element(c.lens.begin(), c.lens.end());
    GpuResult got = RunGpu(w, q, c.lens, max_len + 5, nullptr, kV3Scale);
    Check(got, ref, c.lens, c.heads, c.C, what);
  }
}

TEST(CudaMlaDecode, LongContextUsesWiderSplits) {
  LS_REQUIRE_GPU();
  const std::vector<int64_t> lens = {20000, 16385};  // > 64·256 keys: splits of 320 and 288
  ASSERT_EQ(cu::MlaSplitKeys(20000), 320);
  World w = MakeWorld(512, 64, engine::KvFormat::kFp8E4m3, lens, 77, 64);
  Queries q = MakeQueries(2, 16, 512, 64, 78);
  const Reference ref = CpuReference(w, q, DenseKeys(lens), kV3Scale);
  GpuResult got = RunGpu(w, q, lens, 20000, nullptr, kV3Scale);
  Check(got, ref, lens, 16, 512, "fp8 long context");
}

TEST(CudaMlaDecode, SparseTopKSlotsMatchCpuEngine) {
  LS_REQUIRE_GPU();
  const int64_t H = 32, C = 512, R = 64, topk = 2048;
  const std::vector<int64_t> lens = {6000, 2500, 900};
  World w = MakeWorld(C, R, engine::KvFormat::kFp8E4m3, lens, 5, 64);
  Queries q = MakeQueries(4, H, C, R, 6);
  // Request 0: 2048 distinct random positions (unsorted); 1: 2000 positions and −1 padding
  // in between; 2: fewer keys than top-k (−1 tail); 3: no key at all (all −1).
  std::mt19937_64 rng(9);
  std::vector<std::vector<int32_t>> positions(4), slots(4);
  for (int b = 0; b < 3; ++b) {
    std::vector<int32_t> all(lens[b]);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    const int64_t n = std::min<int64_t>(b == 1 ? 2000 : topk, lens[b]);
    positions[b].assign(all.begin(), all.begin() + n);
    if (b == 1) {
      for (int i = 0; i < 48; ++i) positions[b].insert(positions[b].begin() + 40 * i, -1);
    }
    positions[b].resize(topk, -1);
  }
  positions[3].assign(topk, -1);
  World w4 = std::move(w);
  w4.seqs.push_back(engine::SeqCache{});  // request 3 owns nothing
  for (int b = 0; b < 4; ++b) {
    for (int32_t pos : positions[b]) slots[b].push_back(pos < 0 ? -1 : SlotOf(w4, b, pos));
  }
  const Reference ref = CpuReference(w4, q, positions, kV3Scale);
  GpuResult got = RunGpu(w4, q, {topk, topk, topk, topk}, 0, &slots, kV3Scale);
  Check(got, ref, {topk, topk, topk, topk}, H, C, "sparse fp8");
  // The empty request: zeros and lse −∞.
  for (int64_t i = 3 * H * C; i < 4 * H * C; ++i) ASSERT_EQ(got.o[i], 0.0f) << i;
  for (int64_t h = 0; h < H; ++h) EXPECT_EQ(got.lse[3 * H + h], -INFINITY);
}

TEST(CudaMlaDecode, NanPositionsMatchCpuEngine) {
  LS_REQUIRE_GPU();
  for (engine::KvFormat f : {engine::KvFormat::kFp32, engine::KvFormat::kBf16, engine::KvFormat::kFp8E4m3}) {
    const std::vector<int64_t> lens = {300, 300, 40};
    World w = MakeWorld(512, 64, f, lens, 21, 64);
    // Request 0: one latent value NaN at token 17; request 1: a rope value +Inf at token 250.
    auto poke = [&](size_t b, int64_t pos, int64_t elem, bool rope, float value) {
      std::vector<float> lat(512), kr(64);
      w.cache->ReadLatent(0, w.seqs[b], pos, lat.data(), kr.data());
      (rope ? kr[elem] : lat[elem]) = value;
      w.cache->WriteLatent(0, w.seqs[b], pos, lat.data(), kr.data());
      std::memcpy(&w.pool[SlotOf(w, b, pos) * w.bpt], w.cache->TokenBytes(0, 0, w.seqs[b], pos), w.bpt);
    };
    poke(0, 17, 100, false, NAN);
    poke(1, 250, 3, true, INFINITY);
    Queries q = MakeQueries(3, 16, 512, 64, 22);
    const Reference ref = CpuReference(w, q, DenseKeys(lens), kV3Scale);
    GpuResult got = RunGpu(w, q, lens, 300, nullptr, kV3Scale);
    size_t nans = 0;
    for (float v : ref.o32) nans += std::isnan(v);
    EXPECT_GT(nans, 0u) << "the case must produce NaNs to be a test";
    Check(got, ref, lens, 16, 512, std::string("special values ") + std::string(engine::KvFormatName(f)));
  }
}

TEST(CudaMlaDecode, BitwiseDeterministicAndBatchInvariant) {
  LS_REQUIRE_GPU();
  const int64_t H = 128, C = 512, R = 64;
  const std::vector<int64_t> lens = {1, 100, 257, 1024, 3000, 5, 4097, 700};
  for (engine::KvFormat f : {engine::KvFormat::kFp8E4m3, engine::KvFormat::kBf16}) {
    World w = MakeWorld(C, R, f, lens, 31, 64);
    Queries q = MakeQueries(8, H, C, R, 32);
    GpuResult a = RunGpu(w, q, lens, 4097, nullptr, kV3Scale);
    GpuResult b = RunGpu(w, q, lens, 4097, nullptr, kV3Scale);
    ASSERT_TRUE(a.status.ok()) << a.status.message();
    EXPECT_TRUE(BitwiseEqual(a.o, b.o, "o_latent, run twice"));
    EXPECT_TRUE(BitwiseEqual(a.lse, b.lse, "lse, run twice"));
    for (int64_t i : {0, 3, 4, 6}) {
      // Request i alone: batch 1, other physical pages, a different grid (max_seq_len).
      World solo = MakeWorld(C, R, f, {lens[i]}, 0, 64, /*skip_pages=*/7 + i);
      // Same content: rebuild request i's tokens from `w` byte for byte.
      for (int64_t t = 0; t < lens[i]; ++t) {
        std::memcpy(&solo.pool[SlotOf(solo, 0, t) * solo.bpt], &w.pool[SlotOf(w, i, t) * w.bpt], w.bpt);
      }
      Queries qi;
      qi.heads = H;
      qi.q_lat.assign(q.q_lat.begin() + i * H * C, q.q_lat.begin() + (i + 1) * H * C);
      qi.q_rope.assign(q.q_rope.begin() + i * H * R, q.q_rope.begin() + (i + 1) * H * R);
      GpuResult s = RunGpu(solo, qi, {lens[i]}, lens[i] + 999, nullptr, kV3Scale);
      ASSERT_TRUE(s.status.ok()) << s.status.message();
      const std::string what = std::string(engine::KvFormatName(f)) + " request " + std::to_string(i) +
                               " alone vs in a batch of 8";
      EXPECT_TRUE(BitwiseEqual(s.o, std::vector<float>(a.o.begin() + i * H * C, a.o.begin() + (i + 1) * H * C),
                               what + " (o_latent)"));
      EXPECT_TRUE(BitwiseEqual(s.lse, std::vector<float>(a.lse.begin() + i * H, a.lse.begin() + (i + 1) * H),
                               what + " (lse)"));
    }
  }
}

// The split CTA's shape is speed only: one head a CTA (batch-1 decode), 8 or 16, keys staged in
// shared memory or read row by row, give the same bits, dense and sparse, in every cache
// format, at V2-Lite's 16 heads and V3's 128, with partial tiles, masked keys and one-key
// requests.
TEST(CudaMlaDecode, EveryHeadsPerCtaGivesTheSameBits) {
  LS_REQUIRE_GPU();
  for (int64_t H : {16, 128}) {
    for (engine::KvFormat f : {engine::KvFormat::kFp8E4m3, engine::KvFormat::kBf16, engine::KvFormat::kFp32}) {
      const std::vector<int64_t> lens = {256, 1, 70, 3000};
      World w = MakeWorld(512, 64, f, lens, 41, 64);
      Queries q = MakeQueries(4, H, 512, 64, 42);
      std::vector<std::vector<int32_t>> slots(4);
      for (int64_t b = 0; b < 4; ++b) {
        for (int64_t t = 0; t < std::min<int64_t>(lens[b], 100); ++t) slots[b].push_back(SlotOf(w, b, t));
        slots[b].resize(100, -1);  // masked tail
      }
      const std::string what = "H " + std::to_string(H) + " " + std::string(engine::KvFormatName(f));
      // Shapes 1, 8, 16 with keys staged where the format allows (bf16, fp8), then 1 and 16 read
      // row by row, then 8 as the default reads them (row by row: only one head a CTA stages).
      // Dense twice: a grid for 3001 keys, and one for 2048, where the one-head kernel reads a
      // split's page-table entries before its key count (a split is then 32 keys whatever the
      // count; the table's entries past max_seq_len are out of range, so a read of one flags).
      constexpr int kShapes = 6;
      const std::vector<int64_t> short_lens = {256, 1, 70, 2000};
      GpuResult dense[kShapes], dense_short[kShapes], sparse[kShapes];
      const int32_t shapes[kShapes] = {1, 8, 16, 1, 16, 8};
      const int32_t staging[kShapes] = {2, 2, 2, 1, 1, 0};
      for (int i = 0; i < kShapes; ++i) {
        dense[i] = RunGpu(w, q, lens, 3001, nullptr, kV3Scale, nullptr, shapes[i], staging[i]);
        dense_short[i] = RunGpu(w, q, short_lens, 2048, nullptr, kV3Scale, nullptr, shapes[i], staging[i]);
        sparse[i] = RunGpu(w, q, {100, 100, 100, 100}, 0, &slots, kV3Scale, nullptr, shapes[i], staging[i]);
        ASSERT_TRUE(dense[i].status.ok()) << dense[i].status.message();
        ASSERT_TRUE(dense_short[i].status.ok()) << dense_short[i].status.message();
        EXPECT_EQ(dense_short[i].flag, 0) << what << " shape " << i;
        ASSERT_TRUE(sparse[i].status.ok()) << sparse[i].status.message();
      }
      for (int i = 1; i < kShapes; ++i) {
        const std::string s = what + ", " + std::to_string(shapes[i]) + " heads a CTA" +
                              " (key_staging " + std::to_string(staging[i]) + ") vs 1 (staged)";
        EXPECT_TRUE(BitwiseEqual(dense[i].o, dense[0].o, s + " (dense o_latent)"));
        EXPECT_TRUE(BitwiseEqual(dense[i].lse, dense[0].lse, s + " (dense lse)"));
        EXPECT_TRUE(BitwiseEqual(dense_short[i].o, dense_short[0].o, s + " (dense ≤ 2048 keys o_latent)"));
        EXPECT_TRUE(BitwiseEqual(dense_short[i].lse, dense_short[0].lse, s + " (dense ≤ 2048 keys lse)"));
        EXPECT_TRUE(BitwiseEqual(sparse[i].o, sparse[0].o, s + " (sparse o_latent)"));
        EXPECT_TRUE(BitwiseEqual(sparse[i].lse, sparse[0].lse, s + " (sparse lse)"));
      }
    }
  }
}

// The combine merged inside W_UV's absorption (MlaDecodeSplits + ExpertGemmParams::x_partials,
// the engine's batch-1 path) against MlaDecode's combine kernel and the absorption of its
// o_latent: the same bits, for splits of one tile up to the widest (63 splits at 3000 keys),
// an empty request, sparse top-k with masked slots, bf16 and FP8 weights, x rounded or not.
TEST(CudaMlaDecode, CombineInsideTheAbsorptionGivesTheSameBits) {
  LS_REQUIRE_GPU();
  const std::vector<int64_t> lens = {256, 1, 70, 3000, 0};
  World w = MakeWorld(512, 64, engine::KvFormat::kFp8E4m3, lens, 51, 64);
  Queries q = MakeQueries(5, 16, 512, 64, 52);
  std::vector<std::vector<int32_t>> slots(5);
  for (int64_t b = 0; b < 5; ++b) {
    for (int64_t t = 0; t < std::min<int64_t>(lens[b], 100); ++t) slots[b].push_back(SlotOf(w, b, t));
    slots[b].resize(100, -1);
  }
  for (bool fp8 : {false, true}) {
    for (bool round : {false, true}) {
      const Absorption uv = MakeAbsorption(16, 128, 512, fp8, round, 53);
      const std::string what = std::string(fp8 ? "FP8" : "bf16") + " W_UV, x " + (round ? "rounded" : "fp32");
      for (int32_t hpc : {0, 1}) {  // the engine's pick (one head a CTA at batch ≤ 2) and forced
        GpuResult dense = RunGpu(w, q, lens, 3001, nullptr, kV3Scale, nullptr, hpc, 0, &uv);
        GpuResult sparse = RunGpu(w, q, {100, 100, 100, 100, 100}, 0, &slots, kV3Scale, nullptr, hpc, 0, &uv);
        ASSERT_TRUE(dense.status.ok()) << dense.status.message();
        ASSERT_TRUE(sparse.status.ok()) << sparse.status.message();
        EXPECT_EQ(dense.flag, 0) << what;
        EXPECT_TRUE(BitwiseEqual(dense.y_fused, dense.y_unfused, what + " (dense)"));
        EXPECT_TRUE(BitwiseEqual(sparse.y_fused, sparse.y_unfused, what + " (sparse)"));
        // Not vacuous: the outputs are finite and not all zero (the empty request's rows are 0).
        size_t finite_nonzero = 0;
        for (float v : dense.y_fused) finite_nonzero += std::isfinite(v) && v != 0.0f;
        EXPECT_GT(finite_nonzero, dense.y_fused.size() / 2) << what;
      }
    }
  }
  // What the fused path refuses, by name: fp32 weights (no bulk shape), another launch shape.
  auto buf = cu::DeviceBuffer::Allocate(1 << 20);
  ASSERT_TRUE(buf.ok());
  float* f = buf->as<float>();
  cu::ExpertGemmParams g;
  g.rows = 1;
  g.k = 16;
  g.experts = 16;
  g.out = 128;
  g.in = 512;
  g.w = f;
  g.w_row_stride = 512;
  g.w_expert_stride = 128 * 512;
  g.ids = reinterpret_cast<const int32_t*>(f);
  g.y = f;
  g.y_stride = 128;
  g.x_partials = {f, f, f, 1, 16, 512, 4, nullptr, 0, 0, 100};
  Status st = cu::ExpertGemm(g);
  EXPECT_NE(st.message().find("x_partials (needs bf16 or FP8 weights"), std::string::npos) << st.message();
  g.w_bf16 = true;
  g.launch = cu::ExpertGemmParams::Launch::kFastBySlot4;
  st = cu::ExpertGemm(g);
  EXPECT_NE(st.message().find("launch (x_partials: the bulk shape)"), std::string::npos) << st.message();
  g.launch = cu::ExpertGemmParams::Launch::kAuto;
  g.x_partials.kv_lora = 256;
  st = cu::ExpertGemm(g);
  EXPECT_NE(st.message().find("x_partials.kv_lora"), std::string::npos) << st.message();
  g.x_partials.kv_lora = 512;
  g.x_partials.splits = 3;  // 100 keys make 4 splits: the merge would read past the workspace
  st = cu::ExpertGemm(g);
  EXPECT_NE(st.message().find("x_partials.splits"), std::string::npos) << st.message();
}

TEST(CudaMlaDecode, SparseOrderOfEqualSetsIsBatchInvariant) {
  LS_REQUIRE_GPU();
  // The same slot list in a batch of 3 and alone gives identical bits.
  const int64_t H = 16, C = 512, R = 64;
  World w = MakeWorld(C, R, engine::KvFormat::kFp8E4m3, {3000, 3000, 3000}, 41, 64);
  Queries q = MakeQueries(3, H, C, R, 42);
  std::vector<std::vector<int32_t>> slots(3);
  std::mt19937_64 rng(43);
  for (int b = 0; b < 3; ++b) {
    for (int i = 0; i < 2048; ++i) slots[b].push_back(SlotOf(w, b, static_cast<int64_t>(rng() % 3000)));
  }
  GpuResult all = RunGpu(w, q, {2048, 2048, 2048}, 0, &slots, kV3Scale);
  ASSERT_TRUE(all.status.ok()) << all.status.message();
  Queries q1;
  q1.heads = H;
  q1.q_lat.assign(q.q_lat.begin() + H * C, q.q_lat.begin() + 2 * H * C);
  q1.q_rope.assign(q.q_rope.begin() + H * R, q.q_rope.begin() + 2 * H * R);
  std::vector<std::vector<int32_t>> s1 = {slots[1]};
  GpuResult one = RunGpu(w, q1, {2048}, 0, &s1, kV3Scale);
  ASSERT_TRUE(one.status.ok()) << one.status.message();
  EXPECT_TRUE(BitwiseEqual(one.o, std::vector<float>(all.o.begin() + H * C, all.o.begin() + 2 * H * C),
                           "sparse request 1 alone vs in a batch of 3"));
}

TEST(CudaMlaDecode, DeviceContractViolationsAreFlagged) {
  LS_REQUIRE_GPU();
  World w = MakeWorld(32, 8, engine::KvFormat::kFp32, {40, 40}, 51, 16);
  Queries q = MakeQueries(2, 2, 32, 8, 52);
  // A sequence length beyond max_seq_len.
  GpuResult r1 = RunGpu(w, q, {40, 41}, 40, nullptr, kV3Scale);
  ASSERT_TRUE(r1.status.ok()) << r1.status.message();
  EXPECT_EQ(r1.flag & cu::kErrSeqLen, cu::kErrSeqLen);
  // A page id outside the pool.
  std::vector<int32_t> table = {w.seqs[0].pages[0], w.seqs[0].pages[1], static_cast<int32_t>(w.num_pages),
                                w.seqs[1].pages[0], w.seqs[1].pages[1], w.seqs[1].pages[2]};
  GpuResult r2 = RunGpu(w, q, {40, 40}, 48, nullptr, kV3Scale, &table);
  ASSERT_TRUE(r2.status.ok()) << r2.status.message();
  EXPECT_EQ(r2.flag, cu::kErrPageId);
  // A sparse slot outside the pool.
  std::vector<std::vector<int32_t>> slots = {{0, 1, static_cast<int32_t>(w.num_pages * w.page_size)}, {2, -1, 3}};
  GpuResult r3 = RunGpu(w, q, {3, 3}, 0, &slots, kV3Scale);
  ASSERT_TRUE(r3.status.ok()) << r3.status.message();
  EXPECT_EQ(r3.flag, cu::kErrSlot);
}

TEST(CudaMlaDecode, ValidationNamesTheField) {  // no GPU needed
  cu::MlaDecodeParams p;
  float f = 0;
  int32_t i = 0;
  uint8_t b = 0;
  p.batch = 1;
  p.heads = 1;
  p.kv_lora = 600;
  p.rope_dim = 64;
  p.softmax_scale = 0.1f;
  p.q_latent = p.q_rope = &f;
  p.cache = &b;
  p.page_table = p.seq_lens = &i;
  Status s = cu::MlaDecode(p);
  EXPECT_EQ(s.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(s.message().find("kv_lora"), std::string::npos) << s.message();
  p.kv_lora = 512;
  p.q_latent_head_stride = 512;
  p.q_latent_batch_stride = 512;
  p.q_rope_head_stride = p.q_rope_batch_stride = 64;
  p.num_pages = p.page_size = 1;
  p.page_table_stride = 1;
  p.max_seq_len = 1;
  p.o_latent = &f;
  p.o_head_stride = p.o_batch_stride = 512;
  s = cu::MlaDecode(p);
  EXPECT_NE(s.message().find("workspace_bytes"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace lockstep
