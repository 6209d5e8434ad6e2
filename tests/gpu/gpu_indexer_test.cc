// tests/gpu/gpu_indexer_test.cc — CUDA V3.2 indexer scores and top-k against the CPU
// engine's loop (engine/model.cc: cpu::Dot per head, × key scale, ReLU, Σ_h w_h· in head
// order; std::partial_sort by score desc, position asc; then ascending positions).
// Scores must be bitwise equal (same fp32 operations in the same order), so the selected
// sets must be identical — ties included, which the test makes plentiful on purpose.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "engine/kv_cache.h"
#include "kernels/cpu/numerics.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu/gpu_test_util.h"

namespace lockstep {
namespace {

using namespace gpu_testing;  // NOLINT
namespace cpu = kernels::cpu;

struct IndexerCase {
  int64_t heads, dim, topk, page_size;
  std::vector<int64_t> lens;
  bool ties;  // many exactly-zero and duplicated scores
  bool fp8 = false;  // keys stored as the cache's FP8 rows (indexer=fp8_paged)
};

struct IndexerData {
  int64_t B = 0, num_pages = 0, max_pages = 0, max_len = 0;
  std::vector<float> q, w, keys;   // q [B, H, d]; w [B, H]; keys [num_pages, page_size, d]
  std::vector<int32_t> table;      // [B, max_pages]
  std::vector<int32_t> lens;
  std::vector<uint8_t> keys8, q8;  // fp8: FP8 rows of every slot's key and every (b, h) query
};

IndexerData MakeData(const IndexerCase& c, uint64_t seed) {
  IndexerData d;
  d.B = static_cast<int64_t>(c.lens.size());
  d.max_len = *std::max_element(c.lens.begin(), c.lens.end());
  d.max_pages = (d.max_len + c.page_size - 1) / c.page_size;
  d.num_pages = d.B * d.max_pages + 3;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  d.q.resize(d.B * c.heads * c.dim);
  for (auto& v : d.q) v = g(rng);
  d.w.resize(d.B * c.heads);
  const float wscale = 1.0f / std::sqrt(static_cast<float>(c.heads));
  // weights_proj(x) · H^-0.5: either sign; positive in the tie cases, so that every key with a
  // non-zero vector scores > 0 and the zero keys (score exactly 0) decide the top-k boundary.
  for (auto& v : d.w) v = (c.ties ? std::fabs(g(rng)) : g(rng)) * wscale;
  d.keys.assign(d.num_pages * c.page_size * c.dim, NAN);  // unused slots are NaN
  std::vector<int32_t> pages(d.num_pages);
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng);
  d.table.assign(d.B * d.max_pages, 0x7fffffff);
  d.lens.resize(d.B);
  int next = 0;
  for (int64_t b = 0; b < d.B; ++b) {
    d.lens[b] = static_cast<int32_t>(c.lens[b]);
    for (int64_t i = 0; i < (c.lens[b] + c.page_size - 1) / c.page_size; ++i) d.table[b * d.max_pages + i] = pages[next++];
    for (int64_t t = 0; t < c.lens[b]; ++t) {
      float* k = &d.keys[(static_cast<int64_t>(d.table[b * d.max_pages + t / c.page_size]) * c.page_size +
                          t % c.page_size) * c.dim];
      for (int64_t i = 0; i < c.dim; ++i) k[i] = g(rng);
      if (c.ties) {
        if (t % 3 != 2) std::fill(k, k + c.dim, 0.0f);  // two thirds: every dot 0, score exactly 0
        if (t % 7 == 1 && t >= 7) {                      // a copy of an earlier key: equal score
          const float* src = &d.keys[(static_cast<int64_t>(d.table[b * d.max_pages + (t - 7) / c.page_size]) *
                                          c.page_size + (t - 7) % c.page_size) * c.dim];
          std::copy(src, src + c.dim, k);
        }
      }
    }
  }
  if (c.fp8) {
    // Every used slot's key and every query as the engine's FP8 rows (unused slots: NaN bytes).
    const int64_t rb = engine::Fp8RowBytes(c.dim);
    d.keys8.assign(d.num_pages * c.page_size * rb, 0x7f);
    for (int64_t slot = 0; slot < d.num_pages * c.page_size; ++slot) {
      if (!std::isnan(d.keys[slot * c.dim])) engine::QuantizeFp8Row(&d.keys[slot * c.dim], c.dim, &d.keys8[slot * rb]);
    }
    d.q8.resize(d.B * c.heads * rb);
    for (int64_t i = 0; i < d.B * c.heads; ++i) engine::QuantizeFp8Row(&d.q[i * c.dim], c.dim, &d.q8[i * rb]);
  }
  return d;
}

// engine/model.cc's indexer for request b.
void CpuIndexer(const IndexerCase& c, const IndexerData& d, int64_t b, float kscale, std::vector<float>* scores,
                std::vector<int32_t>* selected) {
  const int64_t T = d.lens[b];
  std::vector<std::pair<float, int32_t>> sc_t(T);
  scores->resize(T);
  for (int64_t t = 0; t < T; ++t) {
    const float* kt = &d.keys[(static_cast<int64_t>(d.table[b * d.max_pages + t / c.page_size]) * c.page_size +
                               t % c.page_size) * c.dim];
    float s = 0;
    const int64_t rb = engine::Fp8RowBytes(c.dim), slot = (kt - d.keys.data()) / c.dim;
    for (int64_t hd = 0; hd < c.heads; ++hd) {
      // fp8: engine/model.cc's fp8_paged product, the rows' exact dot rounded once.
      const float dot = c.fp8 ? static_cast<float>(engine::Fp8RowDot(&d.q8[(b * c.heads + hd) * rb],
                                                                     &d.keys8[slot * rb], c.dim))
                              : cpu::Dot(&d.q[(b * c.heads + hd) * c.dim], kt, c.dim);
      const float dd = dot * kscale;
      s += d.w[b * c.heads + hd] * std::max(dd, 0.0f);
    }
    sc_t[t] = {s, static_cast<int32_t>(t)};
    (*scores)[t] = s;
  }
  const int64_t k = std::min(c.topk, T);
  std::partial_sort(sc_t.begin(), sc_t.begin() + k, sc_t.end(), [](const auto& x, const auto& y) {
    return x.first > y.first || (x.first == y.first && x.second < y.second);
  });
  selected->clear();
  for (int64_t i = 0; i < k; ++i) selected->push_back(sc_t[i].second);
  std::sort(selected->begin(), selected->end());
}

struct GpuIndexer {
  std::vector<float> scores;       // [B, max_len]
  std::vector<int32_t> positions;  // [B, topk]
  std::vector<int32_t> slots;      // [B, topk]
  int32_t flag = 0;
};

GpuIndexer RunGpu(const IndexerCase& c, const IndexerData& d, float kscale) {
  auto dq = Upload(d.q), dw = Upload(d.w), dk = Upload(d.keys), dt = Upload(d.table), dl = Upload(d.lens);
  const std::vector<uint8_t> none(1, 0);
  auto dk8 = Upload(c.fp8 ? d.keys8 : none), dq8 = Upload(c.fp8 ? d.q8 : none);
  auto dscores = Zeros<float>(d.B * d.max_len), dpos = Zeros<int32_t>(d.B * c.topk),
       dslots = Zeros<int32_t>(d.B * c.topk), flag = Zeros<int32_t>(1);
  cu::IndexerScoreParams s;
  s.batch = d.B;
  s.heads = c.heads;
  s.head_dim = c.dim;
  s.q = dq.as<float>();
  s.q_batch_stride = c.heads * c.dim;
  s.q_head_stride = c.dim;
  s.weights = dw.as<float>();
  s.weights_stride = c.heads;
  s.key_scale = kscale;
  if (c.fp8) {
    s.q_fp8 = dq8.as<uint8_t>();
    s.keys_fp8 = dk8.as<uint8_t>();
  } else {
    s.keys = dk.as<float>();
  }
  s.num_pages = d.num_pages;
  s.page_size = c.page_size;
  s.page_table = dt.as<int32_t>();
  s.page_table_stride = d.max_pages;
  s.seq_lens = dl.as<int32_t>();
  s.max_seq_len = d.max_len;
  s.scores = dscores.as<float>();
  s.scores_stride = d.max_len;
  s.error_flag = flag.as<int32_t>();
  GpuIndexer r;
  Status st = cu::IndexerScores(s);
  EXPECT_TRUE(st.ok()) << st.message();
  cu::TopKParams k;
  k.batch = d.B;
  k.topk = c.topk;
  k.scores = dscores.as<float>();
  k.scores_stride = d.max_len;
  k.seq_lens = dl.as<int32_t>();
  k.max_seq_len = d.max_len;
  k.positions = dpos.as<int32_t>();
  k.slots = dslots.as<int32_t>();
  k.page_table = dt.as<int32_t>();
  k.page_table_stride = d.max_pages;
  k.page_size = c.page_size;
  k.num_pages = d.num_pages;
  k.error_flag = flag.as<int32_t>();
  st = cu::TopK(k);
  EXPECT_TRUE(st.ok()) << st.message();
  st = cu::Synchronize();
  EXPECT_TRUE(st.ok()) << st.message();
  r.scores = Download<float>(dscores, d.B * d.max_len);
  r.positions = Download<int32_t>(dpos, d.B * c.topk);
  r.slots = Download<int32_t>(dslots, d.B * c.topk);
  r.flag = Download<int32_t>(flag, 1)[0];
  return r;
}

bool SameBitsOrBothNan(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 4) == 0;
}

void CheckCase(const IndexerCase& c, uint64_t seed) {
  SCOPED_TRACE("heads " + std::to_string(c.heads) + " dim " + std::to_string(c.dim) + " topk " +
               std::to_string(c.topk) + (c.ties ? " (ties)" : "") + (c.fp8 ? " fp8 keys" : ""));
  const IndexerData d = MakeData(c, seed);
  const float kscale = 1.0f / std::sqrt(static_cast<float>(c.dim));
  const GpuIndexer g = RunGpu(c, d, kscale);
  EXPECT_EQ(g.flag, 0);
  for (int64_t b = 0; b < d.B; ++b) {
    std::vector<float> want;
    std::vector<int32_t> sel;
    CpuIndexer(c, d, b, kscale, &want, &sel);
    int64_t bad = 0;
    for (int64_t t = 0; t < d.max_len; ++t) {
      const float got = g.scores[b * d.max_len + t];
      const bool ok = t < d.lens[b] ? SameBitsOrBothNan(got, want[t]) : got == -INFINITY;
      if (!ok && bad++ < 3) {
        ADD_FAILURE() << "request " << b << " position " << t << ": GPU score " << got << ", CPU "
                      << (t < d.lens[b] ? want[t] : -INFINITY);
      }
    }
    EXPECT_EQ(bad, 0) << "request " << b << ": scores must be bitwise the CPU's";
    std::vector<int32_t> got_pos(g.positions.begin() + b * c.topk, g.positions.begin() + (b + 1) * c.topk);
    std::vector<int32_t> want_pos = sel;
    want_pos.resize(c.topk, -1);
    EXPECT_EQ(got_pos, want_pos) << "request " << b << ": top-k sets differ";
    for (int64_t i = 0; i < c.topk; ++i) {
      const int32_t p = want_pos[i];
      const int32_t want_slot =
          p < 0 ? -1 : static_cast<int32_t>(d.table[b * d.max_pages + p / c.page_size] * c.page_size + p % c.page_size);
      if (g.slots[b * c.topk + i] != want_slot) {
        ADD_FAILURE() << "request " << b << " entry " << i << ": slot " << g.slots[b * c.topk + i] << ", want "
                      << want_slot;
        break;
      }
    }
  }
}

TEST(CudaIndexer, ScoresBitwiseAndTopKIdenticalToCpu) {
  LS_REQUIRE_GPU();
  CheckCase({64, 128, 2048, 64, {5000, 2048, 100, 2049}, false}, 1);  // DeepSeek-V3.2 shapes
  CheckCase({64, 128, 2048, 64, {5000, 3000}, true}, 2);              // ties: zeros and duplicates
  CheckCase({8, 32, 16, 16, {1, 16, 17, 70}, false}, 3);              // the tiny test model
  CheckCase({8, 32, 16, 16, {70, 40}, true}, 4);
  CheckCase({5, 20, 7, 3, {50, 7, 6}, true}, 5);                      // odd shapes: head tail, dim tail
}

// indexer=fp8_paged: queries and keys as FP8 rows, each product the rows' exact dot rounded
// once (engine::Fp8RowDot) — whatever the kernel's tiling, the CPU's scores bit for bit and the
// same sets, ties included. Tiles of 64 keys past a request's end exit at once (-inf).
TEST(CudaIndexer, Fp8RowsScoreAsTheirExactDot) {
  LS_REQUIRE_GPU();
  CheckCase({64, 128, 2048, 64, {5000, 2048, 100, 2049}, false, true}, 11);  // V3.2: 132-byte rows
  CheckCase({64, 128, 2048, 64, {3000, 2500}, true, true}, 12);
  CheckCase({8, 32, 16, 16, {1, 16, 17, 70}, false, true}, 13);              // 36-byte rows
  CheckCase({4, 256, 40, 5, {90, 33}, false, true}, 14);                     // two tiles a key
  CheckCase({5, 32, 7, 3, {50, 7, 6}, true, true}, 15);                      // odd heads, pages of 3
  CheckCase({100, 64, 30, 16, {200, 64, 65}, false, true}, 16);              // two passes over heads
}

TEST(CudaIndexer, DeterministicAndBatchInvariant) {
  LS_REQUIRE_GPU();
  const IndexerCase c{64, 128, 2048, 64, {4000, 100, 2500}, true};
  const IndexerData d = MakeData(c, 11);
  const float kscale = 1.0f / std::sqrt(128.0f);
  const GpuIndexer a = RunGpu(c, d, kscale), b = RunGpu(c, d, kscale);
  EXPECT_TRUE(BitwiseEqual(a.scores, b.scores, "indexer scores, run twice"));
  EXPECT_EQ(a.positions, b.positions);
  // Request 2 alone (its own table row; a smaller grid).
  IndexerCase c1 = c;
  c1.lens = {2500};
  IndexerData d1 = d;
  d1.B = 1;
  d1.max_len = 2500;
  d1.max_pages = (2500 + 63) / 64;
  d1.q.assign(d.q.begin() + 2 * 64 * 128, d.q.end());
  d1.w.assign(d.w.begin() + 2 * 64, d.w.end());
  d1.table.assign(d.table.begin() + 2 * d.max_pages, d.table.begin() + 2 * d.max_pages + d1.max_pages);
  d1.lens = {2500};
  const GpuIndexer s = RunGpu(c1, d1, kscale);
  EXPECT_TRUE(BitwiseEqual(s.scores, std::vector<float>(a.scores.begin() + 2 * d.max_len,
                                                        a.scores.begin() + 2 * d.max_len + 2500),
                           "request 2 alone vs in a batch of 3"));
  EXPECT_EQ(s.positions, std::vector<int32_t>(a.positions.begin() + 2 * 2048, a.positions.end()));
}

TEST(CudaIndexer, ValidationNamesTheField) {
  cu::TopKParams p;
  float f = 0;
  int32_t i = 0;
  p.batch = 1;
  p.topk = 0;
  p.scores = &f;
  p.seq_lens = p.positions = &i;
  Status s = cu::TopK(p);
  EXPECT_EQ(s.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(s.message().find("topk"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace lockstep
