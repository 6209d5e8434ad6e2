// bench/bench_recorder_host.cc — what recording costs the engine's thread per decode step, with
// no model and no GPU: the recorder is fed the tap events of a DeepSeek-V2-Lite-shaped decode
// step (27 layers, hidden 2048, 16 heads, vocabulary 102400; the CUDA backend's tap set) made
// of random values, and each step is closed as the engine's loop closes it (EndStep). The
// host side of `bench_record --backend cuda`, measured apart from the GPU.
//
//   bench_recorder_host [--steps 64] [--batch 1] [--modes summary-gpu,summary,full] [--compression-threads 4] [--zstd-level 3]
//                       [--vocab 102400] [--no-logits] [--gpu-ms 5] [--out /tmp] [--model DIR]
//
// --gpu-ms: the engine thread sleeps this long after each step (the GPU's part of a step), so
// the writer's threads run beside it as they do in a real run.
//
// Prints, per mode, the engine thread's wall µs per step and how it splits between the taps
// of the layers and the logits row (the two are timed apart). summary-gpu is summary capture
// as the CUDA backend feeds it: each tap event carries its rows' summaries, not the values, a
// step's events come in one TapHook::OnStepTaps call (an event a tensor, every request's
// row), and the logits come with an owner (engine/tap.h), from a pool of up to four buffers
// as the backend's pinned ones, so the writer reads them in place. full-gpu is full capture
// as the CUDA backend feeds it: each step's values lie in one buffer lent from a LendingPool (the
// backend's pinned tap buffers, filled there by the GPU's copy), each event with its rows'
// summaries, so the writer compresses the rows where they are; the time steps wait for a
// buffer to come back is counted (wait ms).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/out_dir.h"
#include "engine/engine.h"
#include "engine/lending_pool.h"
#include "engine/model.h"
#include "recorder/recorder.h"
#include "traces/trace_writer.h"

using namespace lockstep;  // NOLINT
using Clock = std::chrono::steady_clock;

namespace {

struct TapSpec {
  std::string name;
  int64_t cols;
  engine::TapDType dtype;
};

std::vector<TapSpec> V2LiteTaps(int64_t layers, int64_t hidden) {
  std::vector<TapSpec> t = {{"embed", hidden, engine::TapDType::kF32}};
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    for (auto [n, c] : {std::pair<const char*, int64_t>{"attn.norm", hidden}, {"attn.q", 16 * 192}, {"attn.latent", 512},
                        {"attn.k_rope", 64}, {"attn.heads", 16 * 128}, {"attn.out", hidden}, {"resid_mid", hidden},
                        {"ffn.norm", hidden}, {"ffn.out", hidden}, {"resid_out", hidden}}) {
      t.push_back({p + n, c, engine::TapDType::kF32});
    }
    if (l > 0) {
      t.push_back({p + "ffn.router.topk_ids", 6, engine::TapDType::kI32});
      t.push_back({p + "ffn.router.topk_weights", 6, engine::TapDType::kF32});
    }
  }
  t.push_back({"final_norm", hidden, engine::TapDType::kF32});
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t steps = 64, batch = 1, vocab = 102400;
  double gpu_ms = 5.0;
  int threads = 4;
  int zstd_level = traces::kDefaultZstdLevel;  // --zstd-level (negative: zstd's fast levels)
  bool logits = true;
  std::string modes = "summary-gpu,summary,full", out_dir = "/tmp", model_dir = LOCKSTEP_DEFAULT_MODEL_DIR;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::printf(
          "bench_recorder_host: what recording costs the engine's thread per decode step, without a GPU: a\n"
          "DeepSeek-V2-Lite-shaped step's tap events (and logits row) fed to the recorder (docs/performance.md).\n\n"
          "  --steps N                decode steps (default 64; the first 4 are not timed)\n"
          "  --batch B                requests per step (default 1)\n"
          "  --modes LIST             of summary-gpu (summaries and lent logits, as from --backend cuda),\n"
          "                           summary, full (values, as from --backend cpu), full-gpu (values lent\n"
          "                           with their summaries, as from --backend cuda); default summary-gpu,summary,full\n"
          "  --compression-threads N  the trace writer's zstd workers (default 4)\n"
          "  --zstd-level L           (default %d)\n"
          "  --vocab V / --no-logits  the logits row (default 102400)\n"
          "  --gpu-ms MS              sleep after each step, standing in for the GPU (default 5)\n"
          "  --out DIR                where the traces go (created; default /tmp)\n"
          "  --model DIR              the model the recorder's engine is made from (default: the tiny model)\n",
          traces::kDefaultZstdLevel);
      return 0;
    }
    if (k == "--no-logits") {
      logits = false;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_recorder_host: %s needs a value\n", k.c_str());
      return 2;
    }
    const std::string v = argv[++i];
    if (k == "--steps") steps = std::stoll(v);
    else if (k == "--batch") batch = std::stoll(v);
    else if (k == "--modes") modes = v;
    else if (k == "--compression-threads") threads = std::stoi(v);
    else if (k == "--zstd-level") zstd_level = std::stoi(v);
    else if (k == "--vocab") vocab = std::stoll(v);
    else if (k == "--out") out_dir = v;
    else if (k == "--gpu-ms") gpu_ms = std::stod(v);
    else if (k == "--model") model_dir = v;
    else {
      std::fprintf(stderr, "bench_recorder_host: unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  if (!bench::MakeOutDir("bench_recorder_host", out_dir)) return 2;
  // The recorder needs an engine to attach to (--model: the tiny model by default); its CPU
  // engine never runs here.
  auto model = engine::Model::Load(model_dir);
  if (!model.ok()) {
    std::fprintf(stderr, "bench_recorder_host: %s\n", model.status().message().c_str());
    return 1;
  }
  auto eng = engine::Engine::Create(*model, engine::EngineOptions{});
  if (!eng.ok()) {
    std::fprintf(stderr, "bench_recorder_host: %s\n", eng.status().message().c_str());
    return 1;
  }
  const std::vector<TapSpec> taps = V2LiteTaps(27, 2048);
  std::vector<float> values(static_cast<size_t>(batch) * std::max<int64_t>(vocab, 4096));
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (float& v : values) v = nd(rng);
  int64_t bytes_per_step = 0;
  for (const TapSpec& t : taps) bytes_per_step += batch * t.cols * 4;
  std::printf("%zu taps, %.2f MB of tap values per step (batch %lld), logits %s; %d compression threads\n\n",
              taps.size(), bytes_per_step / 1e6, static_cast<long long>(batch),
              logits ? std::to_string(vocab).c_str() : "off", threads);
  std::printf("| capture | engine thread µs/step | taps µs | logits µs | close s | wait ms |\n|---|---|---|---|---|---|\n");
  std::stringstream ms(modes);
  std::string mode;
  while (std::getline(ms, mode, ',')) {
    const bool gpu_summaries = mode == "summary-gpu", lend = mode == "full-gpu";
    auto m = recorder::CapturePolicy::ParseMode(gpu_summaries ? "summary" : lend ? "full" : mode);
    if (!m.ok()) {
      std::fprintf(stderr, "bench_recorder_host: %s\n", m.status().message().c_str());
      return 2;
    }
    const std::filesystem::path path = std::filesystem::path(out_dir) / ("bench_recorder_host_" + mode + ".h5");
    traces::TraceWriterOptions wo;
    wo.batch_width = batch;
    wo.compression_threads = threads;
    wo.zstd_level = zstd_level;
    recorder::RecorderOptions ro;
    ro.policy.mode = *m;
    wo.alloc_block_bytes = recorder::RecorderOptions::AllocBlockBytes(ro.policy);
    wo.target_chunk_bytes = recorder::RecorderOptions::TargetChunkBytes(ro.policy);  // (record's)
    auto w = traces::TraceWriter::Create(path, wo);
    if (!w.ok()) {
      std::fprintf(stderr, "bench_recorder_host: %s\n", w.status().message().c_str());
      return 1;
    }
    double taps_s = 0, logits_s = 0, total_s = 0;
    std::vector<engine::TapRowSummary> sums(static_cast<size_t>(batch));  // what a device summary would be
    std::vector<engine::TapEvent> events;  // summary-gpu, full-gpu: the step's taps
    std::vector<engine::TapSegment> segments;
    // summary-gpu: the backend's logits buffers (CudaTapCapture::LogitsBuffer's rule).
    std::vector<std::shared_ptr<std::vector<float>>> logits_pool;
    int64_t logits_copied = 0;  // steps whose logits had no free shared buffer
    // full-gpu: the backend's lent tap buffers (CudaTapCapture::Flush's rule), each filled once
    // with the random values as the GPU's copy would fill it.
    // (Random values, nothing repeated within a chunk: as hard for zstd as random-weight
    // activations, which compress about 1.1 : 1. full reads the same bytes from step_values.)
    const size_t lend_bytes = static_cast<size_t>(bytes_per_step);
    auto fill = [&](uint8_t* p, size_t n) {
      for (size_t at = 0; at < n; at += values.size() * 4) std::memcpy(p + at, values.data(), std::min(n - at, values.size() * 4));
    };
    std::vector<uint8_t> step_values(lend_bytes);
    fill(step_values.data(), lend_bytes);
    engine::LendingPool lend_pool(
        [&](size_t n) -> Result<std::shared_ptr<void>> {
          auto b = std::make_shared<std::vector<uint8_t>>(n);
          fill(b->data(), n);
          return std::shared_ptr<void>(b, b->data());
        },
        engine::TapLendBuffers(lend_bytes));
    {
      recorder::Recorder rec(eng->get(), w->get(), ro);
      for (int64_t s = 0; s < steps; ++s) {
        const auto t0 = Clock::now();
        events.clear();
        engine::LendingPool::Lease lease;
        if (lend) {
          auto l = lend_pool.Take(lend_bytes, std::chrono::seconds(5));
          if (!l.ok() || l->data == nullptr) {
            std::fprintf(stderr, "bench_recorder_host: no tap buffer came back in 5 s\n");
            return 1;
          }
          lease = std::move(*l);
        }
        size_t lent_at = 0;
        // summary-gpu and full-gpu: the step's events as the CUDA backend hands them over
        // (TapHook::OnStepTaps), one a tensor covering every request's row.
        segments.clear();
        for (int64_t b = 0; b < batch; ++b) segments.push_back({b, 64 + s, 1});
        for (int64_t b = 0; b < batch; ++b) sums[b].hash = static_cast<uint64_t>(s * 1000 + b);
        for (const TapSpec& t : taps) {
          if (gpu_summaries || lend) {
            engine::TapEvent e;
            e.name = t.name;
            e.rows = batch;
            e.cols = t.cols;
            e.dtype = t.dtype;
            e.summaries = sums.data();
            if (lend) {  // the requests' rows of a tap back to back, as in the backend's slab
              e.data = static_cast<const char*>(lease.data) + lent_at;
              e.owner = lease.owner;
            }
            events.push_back(e);
          } else {
            for (int64_t b = 0; b < batch; ++b) {  // the same bytes as full-gpu's, copied by the recorder
              engine::TapEvent e;
              e.name = t.name;
              e.request_id = b;
              e.position = 64 + s;
              e.rows = 1;
              e.cols = t.cols;
              e.dtype = t.dtype;
              e.data = step_values.data() + lent_at + b * t.cols * 4;
              rec.OnTap(e);
            }
          }
          lent_at += static_cast<size_t>(batch * t.cols * 4);
        }
        if (gpu_summaries || lend) rec.OnStepTaps(events, segments);
        events.clear();
        lease = {};  // the recorder's copies of the owner keep the buffer
        const auto t1 = Clock::now();
        if (logits) {
          std::shared_ptr<std::vector<float>> buf;
          if (gpu_summaries || lend) {
            for (auto& p : logits_pool) {
              if (p.use_count() == 1) buf = p;
            }
            if (!buf && logits_pool.size() < 4) {
              logits_pool.push_back(std::make_shared<std::vector<float>>(values.begin(), values.begin() + batch * vocab));
              buf = logits_pool.back();
            }
            if (!buf) ++logits_copied;
          }
          for (int64_t b = 0; b < batch; ++b) {
            engine::TapEvent e;
            e.name = "logits";
            e.request_id = b;
            e.position = 64 + s;
            e.rows = 1;
            e.cols = vocab;
            e.data = buf ? buf->data() + b * vocab : values.data() + b * vocab;
            e.owner = buf;
            rec.OnTap(e);
          }
        }
        const auto t2 = Clock::now();
        const Status st = rec.EndStep();
        if (!st.ok()) {
          std::fprintf(stderr, "bench_recorder_host: %s\n", st.message().c_str());
          return 1;
        }
        const auto t3 = Clock::now();
        std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(gpu_ms));
        if (s >= 4) {  // warm-up: first allocations
          taps_s += std::chrono::duration<double>(t1 - t0).count();
          logits_s += std::chrono::duration<double>(t2 - t1).count();
          total_s += std::chrono::duration<double>(t3 - t0).count();
        }
      }
      if (const Status st = rec.Finish(); !st.ok()) {
        std::fprintf(stderr, "bench_recorder_host: %s\n", st.message().c_str());
        return 1;
      }
    }
    const auto c0 = Clock::now();
    const Status st = (*w)->Close();
    const double close_s = std::chrono::duration<double>(Clock::now() - c0).count();
    if (!st.ok()) {
      std::fprintf(stderr, "bench_recorder_host: %s\n", st.message().c_str());
      return 1;
    }
    const double n = static_cast<double>(std::max<int64_t>(steps - 4, 1));
    std::printf("| %s | %.0f | %.0f | %.0f | %.2f | %.0f |\n", mode.c_str(), 1e6 * total_s / n, 1e6 * taps_s / n,
                1e6 * logits_s / n, close_s, lend_pool.waited_ns() / 1e6);
    if (logits_copied > 0) {
      std::printf("  (%s: %lld steps found all four logits buffers held by the writer: copied)\n", mode.c_str(),
                  static_cast<long long>(logits_copied));
    }
    std::filesystem::remove(path);
  }
  return 0;
}
