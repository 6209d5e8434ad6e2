// tests/traces/capture_driver.cc — records a seeded multi-request run of a fixture model
// and, independently of the recorder, writes what the engine produced: the XXH3-64 of every
// tap row straight from the TapEvent and of every KV-cache token's bytes straight from
// PagedKvCache::TokenBytes (--expect FILE.json). check_trace.py then reads the trace with
// h5py and compares. With --print-flushes it prints "flushed N" after each durable flush
// (the SIGKILL test reads those lines to know what must survive).
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine/model.h"
#include "recorder/recorder.h"
#include "traces/row_summary.h"
#include "traces/trace_writer.h"

namespace {

using namespace lockstep;
using json = nlohmann::json;

std::string Hash(const void* p, size_t n) { return std::to_string(traces::ContentHash(p, n)); }

// Sees every tap before the recorder does.
class Witness : public engine::TapHook {
 public:
  Witness(recorder::Recorder* rec) : rec_(rec) {}
  void OnTap(const engine::TapEvent& e) override {
    const size_t rb = e.cols * 4;
    auto& rows = taps[std::string(e.name)];
    for (int64_t i = 0; i < e.rows; ++i) {
      rows.push_back({e.request_id, e.position + i, Hash(static_cast<const uint8_t*>(e.data) + i * rb, rb)});
    }
    rec_->OnTap(e);
  }
  json taps = json::object();

 private:
  recorder::Recorder* rec_;
};

int Fail(const std::string& m) {
  std::fprintf(stderr, "capture_driver: %s\n", m.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir, kv = "fp32", capture = "full", out, expect, indexer;
  int64_t max_tokens = 12, requests = 3, chunk_bytes = 8 << 10;
  double flush_interval = 0;
  bool print_flushes = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--model") model_dir = next();
    else if (a == "--kv") kv = next();
    else if (a == "--indexer") indexer = next();
    else if (a == "--capture") capture = next();
    else if (a == "--out") out = next();
    else if (a == "--expect") expect = next();
    else if (a == "--max-tokens") max_tokens = std::stoll(next());
    else if (a == "--requests") requests = std::stoll(next());
    else if (a == "--flush-interval") flush_interval = std::stod(next());
    else if (a == "--print-flushes") print_flushes = true;
    else if (a == "--chunk-bytes") chunk_bytes = std::stoll(next());
    else return Fail("unknown argument " + a);
  }
  if (model_dir.empty() || out.empty()) {
    return Fail("usage: --model DIR --out X.h5 [--kv F] [--indexer VARIANT] [--expect X.json]");
  }
  auto model = engine::Model::Load(model_dir);
  if (!model.ok()) return Fail(model.status().message());
  engine::EngineOptions eo;
  auto fmt = engine::ParseKvFormat(kv);
  if (!fmt.ok()) return Fail(fmt.status().message());
  eo.kv_format = *fmt;
  if (!indexer.empty()) eo.kernels["indexer"] = indexer;
  eo.page_size = 16;
  eo.max_batch = 2;  // three requests: the third joins when the first finishes
  auto eng = engine::Engine::Create(*model, eo);
  if (!eng.ok()) return Fail(eng.status().message());

  traces::TraceWriterOptions wo;
  wo.batch_width = eo.max_batch;
  // Small chunks: many full chunks and tails in a short run (--chunk-bytes 64: 8 rows per
  // chunk in every table, so chunk indexes grow deep enough to split their B-tree nodes).
  wo.target_chunk_bytes = chunk_bytes;
  wo.alloc_block_bytes = 256 << 10;
  if (print_flushes) {
    wo.on_flushed = [](int64_t steps) {
      std::printf("flushed %lld\n", static_cast<long long>(steps));
      std::fflush(stdout);
    };
  }
  auto writer = traces::TraceWriter::Create(out, wo);
  if (!writer.ok()) return Fail(writer.status().message());
  if (print_flushes) {
    std::printf("created\n");
    std::fflush(stdout);
  }
  recorder::RecorderOptions ro;
  auto mode = recorder::CapturePolicy::ParseMode(capture);
  if (!mode.ok()) return Fail(mode.status().message());
  ro.policy.mode = *mode;
  ro.flush_interval_s = flush_interval;
  recorder::Recorder rec(eng->get(), writer->get(), ro);
  rec.Attach();
  Witness witness(&rec);
  json kv_expect = json::object();
  (*eng)->SetTapHook(&witness);
  (*eng)->SetForwardCallback([&](std::span<const engine::Segment> segs, const engine::PagedKvCache& cache) {
    const engine::ModelConfig& c = (*eng)->model().config();
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      for (size_t s = 0; s < cache.streams(l).size(); ++s) {
        const auto& st = cache.streams(l)[s];
        auto& rows = kv_expect["layers." + std::to_string(l) + "." + st.name];
        for (const auto& g : segs) {
          for (size_t i = 0; i < g.tokens.size(); ++i) {
            const int64_t pos = g.start_pos + static_cast<int64_t>(i);
            rows.push_back({g.request_id, pos, Hash(cache.TokenBytes(l, s, *g.cache, pos), st.bytes_per_token)});
          }
        }
      }
    }
    rec.OnForward(segs, cache);
  });

  std::mt19937 rng(1234);
  const int64_t V = (*model)->config().vocab_size;
  for (int64_t r = 0; r < requests; ++r) {
    engine::Request q;
    q.name = "req" + std::to_string(r);
    const int64_t len = 5 + static_cast<int64_t>(rng() % 16);
    for (int64_t i = 0; i < len; ++i) q.prompt.push_back(static_cast<int32_t>(3 + rng() % (V - 3)));
    q.max_new_tokens = max_tokens - r;  // requests finish at different steps
    q.sampling.temperature = 0.8;
    q.sampling.top_k = 20;
    q.sampling.seed = 100 + r;
    auto id = (*eng)->AddRequest(q);
    if (!id.ok()) return Fail(id.status().message());
    if (auto s = rec.AddRequest(*id, ""); !s.ok()) return Fail(s.message());
  }
  while (true) {
    auto more = (*eng)->Step();
    if (!more.ok()) return Fail(more.status().message());
    if (!*more) break;
    if (auto s = rec.EndStep(); !s.ok()) return Fail(s.message());
  }
  if (auto s = rec.Finish(); !s.ok()) return Fail(s.message());
  if (auto s = (*writer)->Close(); !s.ok()) return Fail(s.message());

  if (!expect.empty()) {
    json j;
    j["kv_format"] = kv;
    j["fp8_index_keys"] = indexer == "fp8_paged";
    j["index_head_dim"] = (*model)->config().index_head_dim;
    j["capture"] = capture;
    j["taps"] = witness.taps;
    j["kv"] = kv_expect;
    j["kv_lora_rank"] = (*model)->config().kv_lora_rank;
    j["qk_rope_head_dim"] = (*model)->config().qk_rope_head_dim;
    json reqs = json::array();
    for (int64_t i = 0; i < (*eng)->num_requests(); ++i) {
      const auto& r = (*eng)->request(i);
      reqs.push_back({{"prompt", r.request.prompt}, {"generated", r.generated}, {"finish_reason", r.finish_reason}});
    }
    j["requests"] = reqs;
    std::ofstream(expect) << j.dump() << "\n";
  }
  return 0;
}
