// tests/gpu/gpu_engine_taps_test.cc — the CUDA backend's taps end to end: taps of graphed
// steps are those of plain launches; summaries made on the GPU are the host's summaries of the
// values, for activations and for the KV cache's rows; full capture's values and KV rows come
// from the tap slab (lent, with their summaries); and the taps have the CPU backend's names and
// shapes, values close, with the cache bytes mirrored to the host equal to what the step
// stored. Skips (not passes) without a GPU.
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <tuple>

#include "engine/engine.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"
#include "tests/gpu/gpu_engine_util.h"
#include "tests/test_util.h"
#include "traces/row_summary.h"

namespace lockstep {
namespace {

using engine::Engine;
using engine::EngineOptions;
using engine::Model;
using gpu_testing::Cuda;
using gpu_testing::TapRecorder;
using gpu_testing::Tiny;

// Taps of steps replayed from a CUDA graph are the taps of the same steps launched plainly.
TEST(GpuEngine, TapsFromGraphsAreTheSame) {
  LS_REQUIRE_GPU();
  auto run = [&](TapRecorder* rec, bool graphs) {
    EngineOptions o = Cuda(engine::KvFormat::kFp8E4m3, "bf16");
    o.max_batch = 2;
    o.device.cuda_graphs = graphs;
    auto eng = Engine::Create(Tiny(), o);
    ASSERT_TRUE(eng.ok()) << eng.status().message();
    (*eng)->SetTapHook(rec);
    for (int i = 0; i < 2; ++i) {
      engine::Request r;
      for (int j = 0; j < 20 + 9 * i; ++j) r.prompt.push_back(static_cast<int32_t>((13 * j + 5 * i) % 5000 + 10));
      r.max_new_tokens = 10;
      ASSERT_TRUE((*eng)->AddRequest(r).ok());
    }
    const Status st = (*eng)->RunToCompletion();
    ASSERT_TRUE(st.ok()) << st.message();
  };
  TapRecorder plain, graphed;
  run(&plain, false);
  run(&graphed, true);
  ASSERT_EQ(plain.taps.size(), graphed.taps.size());
  for (const auto& [name, t] : plain.taps) {
    auto it = graphed.taps.find(name);
    ASSERT_NE(it, graphed.taps.end()) << name;
    EXPECT_EQ(t.bytes, it->second.bytes) << name;
  }
}

// Two sampled requests of different prompt lengths (30 and 41 tokens, 8 new tokens each),
// run to completion: prefill steps, then graphed decode steps of both.
void RunTwoSampledRequests(Engine& eng) {
  for (int i = 0; i < 2; ++i) {
    engine::Request r;
    for (int j = 0; j < 30 + 11 * i; ++j) r.prompt.push_back(static_cast<int32_t>((7 * j + 3 * i) % 5000 + 10));
    r.max_new_tokens = 8;
    r.sampling.temperature = 0.8;
    r.sampling.seed = 5 + i;
    ASSERT_TRUE(eng.AddRequest(r).ok());
  }
  const Status st = eng.RunToCompletion();
  ASSERT_TRUE(st.ok()) << st.message();
}

traces::DType TraceDType(engine::TapDType t) {
  switch (t) {
    case engine::TapDType::kI32: return traces::DType::kI32;
    case engine::TapDType::kBf16: return traces::DType::kBf16;
    case engine::TapDType::kFp8E4m3: return traces::DType::kFp8E4m3;
    case engine::TapDType::kF32: break;
  }
  return traces::DType::kF32;
}

// The cache layouts the KV tests cover: fp32 and bf16 latents with fp32 index keys, the FP8
// latent with FP8 index keys (indexer=fp8_paged). Options: two requests at once, gemm=bf16.
struct KvCase {
  engine::KvFormat format;
  const char* indexer;
  EngineOptions Options() const {
    EngineOptions o = Cuda(format, "bf16");
    o.max_batch = 2;
    if (*indexer) o.kernels["indexer"] = indexer;
    return o;
  }
};
const KvCase kKvCases[] = {{engine::KvFormat::kFp32, ""}, {engine::KvFormat::kBf16, ""},
                           {engine::KvFormat::kFp8E4m3, "fp8_paged"}};

// Every part of every stored row the segments wrote, as the host cache holds it:
// fn("kv/layers.L.<stream><suffix>@<position>#<request>", part, bytes).
void ForEachKvPartRow(std::span<const engine::Segment> segs, const engine::PagedKvCache& cache, int64_t layers,
                      const std::function<void(const std::string&, const engine::KvPart&, const uint8_t*)>& fn) {
  for (const auto& g : segs) {
    for (int64_t l = 0; l < layers; ++l) {
      for (size_t si = 0; si < cache.streams(l).size(); ++si) {
        for (const engine::KvPart& part : cache.parts(l, si)) {
          for (size_t j = 0; j < g.tokens.size(); ++j) {
            const int64_t pos = g.start_pos + static_cast<int64_t>(j);
            fn("kv/layers." + std::to_string(l) + "." + cache.streams(l)[si].name + part.suffix + "@" +
                   std::to_string(pos) + "#" + std::to_string(g.request_id),
               part, cache.TokenBytes(l, si, *g.cache, pos) + part.offset);
          }
        }
      }
    }
  }
}

// A hook that wants only summaries gets them computed on the GPU (no values): for prefill
// steps (a summary launch per group of taps) and decode steps (the tap slab, one launch per
// step, graphs on) alike, each row's summary is traces::Summarize of the values a values hook
// sees for the same run, field for field.
class SummaryHook : public engine::TapHook {
 public:
  std::map<std::string, std::vector<engine::TapRowSummary>> taps;
  int64_t with_values = 0;
  bool WantsTapValues() const override { return false; }
  void OnTap(const engine::TapEvent& e) override {
    if (e.name == "logits") return;  // the host's logits always come as values
    if (e.data != nullptr || e.summaries == nullptr) ++with_values;
    if (e.summaries == nullptr) return;
    auto& v = taps[std::string(e.name) + "@" + std::to_string(e.position) + "#" + std::to_string(e.request_id)];
    v.assign(e.summaries, e.summaries + e.rows);
  }
};

TEST(GpuEngine, SummaryTapsAreTheHostSummariesOfTheValues) {
  LS_REQUIRE_GPU();
  auto run = [&](engine::TapHook* hook) {
    EngineOptions o = Cuda(engine::KvFormat::kFp8E4m3, "bf16");
    o.max_batch = 2;
    auto eng = Engine::Create(Tiny(), o);
    ASSERT_TRUE(eng.ok()) << eng.status().message();
    (*eng)->SetTapHook(hook);
    RunTwoSampledRequests(**eng);
  };
  TapRecorder values;
  SummaryHook sums;
  run(&values);
  run(&sums);
  EXPECT_EQ(sums.with_values, 0) << "events that carried values instead of summaries";
  int64_t rows = 0, logits = 0;
  for (const auto& [name, t] : values.taps) {
    if (name.starts_with("logits@")) {
      ++logits;
      continue;
    }
    auto it = sums.taps.find(name);
    ASSERT_NE(it, sums.taps.end()) << name;
    ASSERT_EQ(static_cast<int64_t>(it->second.size()), t.rows) << name;
    for (int64_t r = 0; r < t.rows; ++r) {
      traces::SummaryRow want;
      traces::Summarize(TraceDType(t.dtype),
                        t.bytes.data() + r * t.cols * 4, t.cols, &want);
      const engine::TapRowSummary& got = it->second[r];
      ASSERT_EQ(got.hash, want.hash) << name << " row " << r;
      ASSERT_EQ(got.nan_count, want.nan_count) << name;
      ASSERT_EQ(got.inf_count, want.inf_count) << name;
      ASSERT_EQ(0, std::memcmp(&got.rms, &want.rms, 4)) << name << " rms";
      ASSERT_EQ(0, std::memcmp(&got.absmax, &want.absmax, 4)) << name << " absmax";
      ASSERT_EQ(0, std::memcmp(&got.min, &want.min, 4)) << name << " min";
      ASSERT_EQ(0, std::memcmp(&got.max, &want.max, 4)) << name << " max";
      ++rows;
    }
  }
  EXPECT_EQ(values.taps.size(), sums.taps.size() + logits);
  EXPECT_GT(rows, 1000);
  std::printf("  %lld tap rows: GPU summaries = host summaries of the values\n", static_cast<long long>(rows));
}

// A summary hook that also wants the KV cache rows as summaries (the recorder's summary
// capture) gets them from the GPU as kv/ events — one per part of each layer's streams
// (PagedKvCache::parts), after the step's taps — and each row's summary is traces::Summarize
// of the bytes the cache mirror holds for that row in a run that copies them back: for the
// fp32, bf16 and FP8 latent layouts and fp32 and FP8 index keys, prefill steps (summary
// batches) and decode steps (the tap slab, graphs on) alike. The forward callback still comes
// every step; the KV events' dtypes are the parts'.
class KvSummaryHook : public SummaryHook {
 public:
  std::map<std::string, engine::TapRowSummary> kv;  // name@position#request → the row's summary
  std::map<std::string, engine::TapDType> kv_dtype;
  std::string order_error;
  bool WantsKvTaps() const override { return true; }
  void OnTapSummaries(std::span<const engine::TapEvent> events) override {
    bool seen_kv = false;
    for (const engine::TapEvent& e : events) {
      const bool is_kv = e.name.starts_with("kv/");
      if (seen_kv && !is_kv && order_error.empty()) order_error = "tap '" + std::string(e.name) + "' after a kv/ event";
      seen_kv |= is_kv;
      if (!is_kv) {
        OnTap(e);
        continue;
      }
      if (e.data != nullptr || e.summaries == nullptr) ++with_values;
      if (e.summaries == nullptr) continue;
      for (int64_t r = 0; r < e.rows; ++r) {
        kv[std::string(e.name) + "@" + std::to_string(e.position + r) + "#" + std::to_string(e.request_id)] =
            e.summaries[r];
      }
      kv_dtype[std::string(e.name)] = e.dtype;
    }
  }
};

TEST(GpuEngine, KvSummariesAreTheHostSummariesOfTheCacheRows) {
  LS_REQUIRE_GPU();
  for (const KvCase& c : kKvCases) {
    SCOPED_TRACE(std::string("kv ") + std::string(engine::KvFormatName(c.format)) + " indexer " + c.indexer);
    std::map<std::string, engine::TapRowSummary> want;  // from the mirrored bytes
    std::map<std::string, engine::TapDType> want_dtype;
    int64_t forwards = 0;
    auto run = [&](engine::TapHook* hook, bool mirror_rows) {
      auto eng = Engine::Create(Tiny(), c.Options());
      ASSERT_TRUE(eng.ok()) << eng.status().message();
      (*eng)->SetTapHook(hook);
      (*eng)->SetForwardCallback([&](std::span<const engine::Segment> segs, const engine::PagedKvCache& cache) {
        ++forwards;
        if (!mirror_rows) return;
        ForEachKvPartRow(segs, cache, Tiny()->config().num_hidden_layers,
                         [&](const std::string& key, const engine::KvPart& part, const uint8_t* b) {
                           traces::SummaryRow s;
                           traces::Summarize(TraceDType(part.type), b, part.cols, &s);
                           want[key] = {s.hash, s.nan_count, s.inf_count, s.rms, s.absmax, s.min, s.max};
                           want_dtype[key.substr(0, key.find('@'))] = part.type;
                         });
      });
      RunTwoSampledRequests(**eng);
    };
    SummaryHook plain;
    KvSummaryHook sums;
    run(&plain, true);
    const int64_t plain_forwards = forwards;
    forwards = 0;
    run(&sums, false);
    EXPECT_EQ(forwards, plain_forwards) << "the forward callback comes every step";
    EXPECT_EQ(sums.with_values, 0);
    EXPECT_EQ(sums.order_error, "");
    EXPECT_EQ(sums.taps.size(), plain.taps.size()) << "the taps are unchanged";
    ASSERT_EQ(sums.kv.size(), want.size());
    EXPECT_EQ(sums.kv_dtype, want_dtype);
    for (const auto& [key, exp] : want) {
      auto it = sums.kv.find(key);
      ASSERT_NE(it, sums.kv.end()) << key;
      const engine::TapRowSummary& got = it->second;
      ASSERT_EQ(got.hash, exp.hash) << key;
      ASSERT_EQ(got.nan_count, exp.nan_count) << key;
      ASSERT_EQ(got.inf_count, exp.inf_count) << key;
      ASSERT_EQ(0, std::memcmp(&got.rms, &exp.rms, 4)) << key << " rms " << got.rms << " vs " << exp.rms;
      ASSERT_EQ(0, std::memcmp(&got.absmax, &exp.absmax, 4)) << key << " absmax";
      ASSERT_EQ(0, std::memcmp(&got.min, &exp.min, 4)) << key << " min";
      ASSERT_EQ(0, std::memcmp(&got.max, &exp.max, 4)) << key << " max";
    }
    EXPECT_GT(want.size(), 100u);
    std::printf("  %s: %zu KV part rows: GPU summaries = host summaries of the stored bytes\n",
                std::string(engine::KvFormatName(c.format)).c_str(), want.size());
  }
}

// Full capture with the KV rows as taps (the recorder's, TapHook::WantsKvTaps with values):
// in decode steps the rows come as kv/ events from the tap slab — the bytes the cache stored,
// each part's rows contiguous, with their GPU summaries equal to traces::Summarize of those
// bytes — and the host cache does not get them; in prefill steps no kv/ events come and the
// forward callback reads them from the host cache as before. Together they are every row a
// run without kv/ events mirrors, byte for byte, for the fp32, bf16 and FP8 layouts.
class KvValuesHook : public engine::TapHook {
 public:
  std::map<std::string, std::vector<uint8_t>> rows;  // name@position#request → bytes
  int64_t events = 0, summarised = 0;
  bool came = false;  // kv/ events in the current step
  std::string bad;
  bool WantsKvTaps() const override { return true; }
  void OnTap(const engine::TapEvent& e) override {
    if (!e.name.starts_with("kv/")) return;
    came = true;
    ++events;
    const int64_t esize = engine::TapDTypeSize(e.dtype);
    const auto* p = static_cast<const uint8_t*>(e.data);
    if (p == nullptr || e.summaries == nullptr) {
      if (bad.empty()) bad = std::string(e.name) + ": no values or no summaries";
      return;
    }
    for (int64_t r = 0; r < e.rows; ++r) {
      const uint8_t* row = p + r * e.cols * esize;
      rows[std::string(e.name) + "@" + std::to_string(e.position + r) + "#" + std::to_string(e.request_id)].assign(
          row, row + e.cols * esize);
      traces::SummaryRow want;
      traces::Summarize(TraceDType(e.dtype), row, e.cols, &want);
      const engine::TapRowSummary& got = e.summaries[r];
      if (bad.empty() && (got.hash != want.hash || got.nan_count != want.nan_count || got.inf_count != want.inf_count ||
                          std::memcmp(&got.rms, &want.rms, 4) != 0 || std::memcmp(&got.min, &want.min, 4) != 0 ||
                          std::memcmp(&got.max, &want.max, 4) != 0 || std::memcmp(&got.absmax, &want.absmax, 4) != 0)) {
        bad = std::string(e.name) + " at position " + std::to_string(e.position + r) + ": summary";
      }
      ++summarised;
    }
  }
};

TEST(GpuEngine, FullCaptureTakesTheKvRowsFromTheSlab) {
  LS_REQUIRE_GPU();
  for (const KvCase& c : kKvCases) {
    SCOPED_TRACE(std::string("kv ") + std::string(engine::KvFormatName(c.format)) + " indexer " + c.indexer);
    auto run = [&](engine::TapHook* hook, KvValuesHook* kv, std::map<std::string, std::vector<uint8_t>>* cached) {
      auto eng = Engine::Create(Tiny(), c.Options());
      ASSERT_TRUE(eng.ok()) << eng.status().message();
      (*eng)->SetTapHook(hook);
      (*eng)->SetForwardCallback([&](std::span<const engine::Segment> segs, const engine::PagedKvCache& cache) {
        const bool came = kv != nullptr && kv->came;
        if (kv != nullptr) kv->came = false;
        if (came) return;  // the host cache does not hold this step's rows
        ForEachKvPartRow(segs, cache, Tiny()->config().num_hidden_layers,
                         [&](const std::string& key, const engine::KvPart& part, const uint8_t* b) {
                           (*cached)[key].assign(b, b + part.cols * engine::TapDTypeSize(part.type));
                         });
      });
      RunTwoSampledRequests(**eng);
    };
    TapRecorder plain;
    std::map<std::string, std::vector<uint8_t>> want, host_rows;
    run(&plain, nullptr, &want);
    KvValuesHook kv;
    run(&kv, &kv, &host_rows);
    EXPECT_EQ(kv.bad, "");
    EXPECT_GT(kv.events, 0) << "decode steps sent no kv/ events";
    EXPECT_GT(host_rows.size(), 0u) << "prefill steps' rows reach the host cache";
    std::map<std::string, std::vector<uint8_t>> got = host_rows;
    for (const auto& [k, v] : kv.rows) {
      EXPECT_TRUE(got.emplace(k, v).second) << k << " came both ways";
    }
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [k, v] : want) {
      auto it = got.find(k);
      ASSERT_NE(it, got.end()) << k;
      ASSERT_EQ(it->second, v) << k;
    }
    std::printf("  %s: %lld KV part rows from the slab (summaries = host's), %zu through the host cache\n",
                std::string(engine::KvFormatName(c.format)).c_str(), static_cast<long long>(kv.summarised),
                host_rows.size());
  }
}

// Full capture (a hook that wants values): decode steps come from the tap slab in a pinned
// buffer lent to the hook (TapEvent::owner) with each row's summary made on the GPU beside the
// values. Checked: every decode step's events carry an owner and summaries, each summary is
// traces::Summarize of the row's values, the values are those of a run without graphs
// (TapRecorder's), no step waited for a buffer the hook had let go, and a buffer the hook
// keeps stays unchanged while later steps run (the backend takes others).
class LentHook : public engine::TapHook {
 public:
  struct Kept {
    std::shared_ptr<const void> owner;
    const uint8_t* data = nullptr;
    std::vector<uint8_t> copy;
  };
  std::map<std::string, std::vector<uint8_t>> values;
  std::vector<Kept> kept;
  int64_t rows_summarised = 0, lent_events = 0, events = 0;
  std::string bad;
  void OnTap(const engine::TapEvent& e) override {
    if (e.name == "logits") return;
    ++events;
    const auto* p = static_cast<const uint8_t*>(e.data);
    const size_t bytes = static_cast<size_t>(e.rows * e.cols) * 4;
    values[std::string(e.name) + "@" + std::to_string(e.position) + "#" + std::to_string(e.request_id)].assign(p, p + bytes);
    if (e.owner) ++lent_events;
    if (e.owner && kept.size() < 40) kept.push_back({e.owner, p, std::vector<uint8_t>(p, p + bytes)});
    if (e.summaries == nullptr) return;
    for (int64_t r = 0; r < e.rows; ++r) {
      traces::SummaryRow want;
      traces::Summarize(TraceDType(e.dtype),
                        p + r * e.cols * 4, e.cols, &want);
      const engine::TapRowSummary& got = e.summaries[r];
      if (bad.empty() && (got.hash != want.hash || got.nan_count != want.nan_count || got.inf_count != want.inf_count ||
                          std::memcmp(&got.rms, &want.rms, 4) != 0 || std::memcmp(&got.absmax, &want.absmax, 4) != 0 ||
                          std::memcmp(&got.min, &want.min, 4) != 0 || std::memcmp(&got.max, &want.max, 4) != 0)) {
        bad = std::string(e.name) + " at position " + std::to_string(e.position + r);
      }
      ++rows_summarised;
    }
  }
};

TEST(GpuEngine, FullCaptureLendsTheValuesWithTheirSummaries) {
  LS_REQUIRE_GPU();
  auto run = [&](engine::TapHook* hook, bool graphs) {
    EngineOptions o = Cuda(engine::KvFormat::kFp8E4m3, "bf16");
    o.max_batch = 2;
    o.device.cuda_graphs = graphs;
    auto eng = Engine::Create(Tiny(), o);
    ASSERT_TRUE(eng.ok()) << eng.status().message();
    (*eng)->SetTapHook(hook);
    for (int i = 0; i < 2; ++i) {
      engine::Request r;
      for (int j = 0; j < 25 + 7 * i; ++j) r.prompt.push_back(static_cast<int32_t>((11 * j + 3 * i) % 5000 + 10));
      r.max_new_tokens = 14;  // more decode steps than the backend lends buffers (8)
      ASSERT_TRUE((*eng)->AddRequest(r).ok());
    }
    const Status st = (*eng)->RunToCompletion();
    ASSERT_TRUE(st.ok()) << st.message();
    EXPECT_EQ((*eng)->backend().tap_wait_ns(), 0) << "a step waited for a lent buffer the hook had let go";
  };
  TapRecorder plain;
  LentHook lent;
  run(&plain, false);
  run(&lent, true);
  EXPECT_TRUE(lent.bad.empty()) << "GPU summary differs from the host's for " << lent.bad;
  EXPECT_GT(lent.lent_events, 0);
  EXPECT_GT(lent.rows_summarised, 500);
  size_t logits = 0;
  for (const auto& [name, t] : plain.taps) logits += name.starts_with("logits@");
  ASSERT_EQ(plain.taps.size() - logits, lent.values.size());
  for (const auto& [name, t] : plain.taps) {
    if (name.starts_with("logits@")) continue;
    auto it = lent.values.find(name);
    ASSERT_NE(it, lent.values.end()) << name;
    EXPECT_EQ(t.bytes, it->second) << name;
  }
  ASSERT_FALSE(lent.kept.empty());
  for (const LentHook::Kept& k : lent.kept) {
    ASSERT_EQ(0, std::memcmp(k.data, k.copy.data(), k.copy.size())) << "a lent buffer changed while the hook held it";
  }
  std::printf("  %lld of %lld events lent, %lld rows with GPU summaries = host summaries\n",
              static_cast<long long>(lent.lent_events), static_cast<long long>(lent.events),
              static_cast<long long>(lent.rows_summarised));
}

TEST(GpuEngine, TapsMatchTheCpuBackendAndTheCacheMirror) {
  LS_REQUIRE_GPU();
  // index_keys: every sparse layer's indexer keys of every new row, as the host mirror holds them.
  auto run = [&](const EngineOptions& o, TapRecorder* rec, std::vector<std::vector<uint8_t>>* cache_rows,
                 std::vector<float>* index_keys) {
    auto eng = Engine::Create(Tiny(), o);
    EXPECT_TRUE(eng.ok()) << eng.status().message();
    (*eng)->SetTapHook(rec);
    (*eng)->SetForwardCallback([&](std::span<const engine::Segment> segs, const engine::PagedKvCache& cache) {
      for (const auto& g : segs) {
        for (size_t j = 0; j < g.tokens.size(); ++j) {
          const int64_t pos = g.start_pos + static_cast<int64_t>(j);
          const uint8_t* b = cache.TokenBytes(0, 0, *g.cache, pos);
          cache_rows->emplace_back(b, b + cache.latent_bytes_per_token());
          for (int64_t l = 0; l < Tiny()->config().num_hidden_layers; ++l) {
            for (size_t st = 0; st < cache.streams(l).size(); ++st) {
              if (cache.streams(l)[st].kind != engine::StreamKind::kIndexerKey) continue;
              const auto* k = reinterpret_cast<const float*>(cache.TokenBytes(l, st, *g.cache, pos));
              index_keys->insert(index_keys->end(), k, k + cache.streams(l)[st].bytes_per_token / 4);
            }
          }
        }
      }
    });
    engine::Request r;
    for (int j = 0; j < 40; ++j) r.prompt.push_back(static_cast<int32_t>(17 * j % 5000 + 10));
    r.max_new_tokens = 6;
    EXPECT_TRUE((*eng)->AddRequest(r).ok());
    const Status st = (*eng)->RunToCompletion();
    EXPECT_TRUE(st.ok()) << st.message();
  };
  EngineOptions cpu;
  cpu.page_size = 16;
  cpu.kv_cache_tokens = 4096;
  TapRecorder g, c;
  std::vector<std::vector<uint8_t>> g_rows, c_rows;
  std::vector<float> g_keys, c_keys;
  run(Cuda(), &g, &g_rows, &g_keys);
  run(cpu, &c, &c_rows, &c_keys);
  ASSERT_EQ(g.taps.size(), c.taps.size());
  int compared = 0;
  for (const auto& [name, ct] : c.taps) {
    auto it = g.taps.find(name);
    ASSERT_NE(it, g.taps.end()) << "tap missing on the GPU: " << name;
    const auto& gt = it->second;
    ASSERT_EQ(gt.rows, ct.rows) << name;
    ASSERT_EQ(gt.cols, ct.cols) << name;
    ASSERT_EQ(gt.dtype, ct.dtype) << name;
    if (ct.dtype == engine::TapDType::kI32) {
      // Expert ids and indexer selections: equal unless a near-tie flipped; allow none here.
      EXPECT_EQ(gt.bytes, ct.bytes) << name;
    } else {
      const auto* a = reinterpret_cast<const float*>(gt.bytes.data());
      const auto* b = reinterpret_cast<const float*>(ct.bytes.data());
      double num = 0, den = 0;
      for (int64_t i = 0; i < gt.rows * gt.cols; ++i) {
        ASSERT_FALSE(std::isnan(a[i]) && !std::isnan(b[i])) << name << " NaN at " << i;
        num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
        den += double(b[i]) * b[i];
      }
      EXPECT_LE(std::sqrt(num / std::max(den, 1e-30)), 1e-4) << name;
    }
    ++compared;
  }
  EXPECT_GT(compared, 50);
  // The cache rows mirrored to the host are what the GPU stored: for the fp32 cache, the
  // latent tap then the k_rope tap, bit for bit.
  ASSERT_EQ(g_rows.size(), c_rows.size());
  const auto& lat = g.taps.at("layers.0.attn.latent@0#0");
  const auto& kr = g.taps.at("layers.0.attn.k_rope@0#0");
  for (int64_t r = 0; r < lat.rows; ++r) {
    std::vector<uint8_t> want(lat.bytes.begin() + r * lat.cols * 4, lat.bytes.begin() + (r + 1) * lat.cols * 4);
    want.insert(want.end(), kr.bytes.begin() + r * kr.cols * 4, kr.bytes.begin() + (r + 1) * kr.cols * 4);
    ASSERT_EQ(g_rows[r], want) << "mirrored cache row " << r;
  }
  // The indexer keys mirrored to the host are the GPU's keys: the CPU's within the taps' bound.
  ASSERT_FALSE(c_keys.empty()) << "the tiny model has sparse layers";
  ASSERT_EQ(g_keys.size(), c_keys.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < c_keys.size(); ++i) {
    ASSERT_FALSE(std::isnan(g_keys[i])) << "mirrored indexer key value " << i;
    num += (double(g_keys[i]) - c_keys[i]) * (double(g_keys[i]) - c_keys[i]);
    den += double(c_keys[i]) * c_keys[i];
  }
  EXPECT_LE(std::sqrt(num / std::max(den, 1e-30)), 1e-4) << "mirrored indexer keys";
}

}  // namespace
}  // namespace lockstep
