// bench/bench_record.cc — what recording costs: CPU decode tokens/s with no recorder and with
// capture none / summary / full, bytes written per generated token, and the compression
// ratio per kind of tensor (docs/performance.md, "Recording").
//
// Decode tokens/s counts the steps after the prefill step, until the last token (the
// writer's close is timed separately: it writes the last chunks). Each mode runs on a fresh
// engine with the same seeded prompts.
//
//   bench_record [--model DIR] [--prompt-len N] [--tokens N] [--batch B] [--kv-cache F]
//                [--flush-interval S] [--out DIR] [--modes off,hook,hook-summary,none,summary,full] [--repeat N]
//                [--backend cpu|cuda] [--random-weights 1] [--gpu-profile 1] [--compression-threads N] [--zstd-level N]
//
// Each mode runs --repeat times, interleaved with the others (off, summary, full, off, …), so
// that a slow stretch of a shared machine hits every mode alike. The table gives each mode's
// median and, in brackets, its range over the repeats; "vs off" compares medians.
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_args.h"
#include "bench/out_dir.h"
#include "engine/engine.h"
#include "recorder/recorder.h"
#include "traces/trace_reader.h"
#include "traces/trace_writer.h"

using namespace lockstep;
using Clock = std::chrono::steady_clock;

// CPU seconds of the calling thread, and of the whole process (engine + writer + workers):
// unlike wall time, not inflated when other programs share the cores.
double ThreadCpu() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}
double ProcessCpu() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

namespace {

struct Result_ {
  double decode_tps = 0, prefill_s = 0, close_s = 0, stall_s = 0;
  double tap_wait_s = 0;  // of stall_s: waiting for a lent tap buffer to come back
  traces::TraceWriter::ThreadTimes writer_times;  // after the close
  recorder::Recorder::EngineThreadTimes recorder_per_step;  // ns per decode step
  double decode_s = 0;
  double engine_cpu_us = 0, process_cpu_us = 0;  // per decode step
  int64_t tokens = 0, file_bytes = 0;
  std::map<std::string, std::pair<int64_t, int64_t>> kinds;  // kind → (raw, stored)
};

// Mode "hook": a tap hook that does nothing, to separate the engine's own cost of emitting
// taps from the recorder's.
struct NullHook : engine::TapHook {
  void OnTap(const engine::TapEvent&) override {}
};
// Mode "hook-summary": the same, asking for summaries only, of the taps and of the KV cache
// rows (what summary capture asks of the backend), to separate the backend's share of summary
// capture from the recorder's.
struct NullSummaryHook : NullHook {
  bool WantsTapValues() const override { return false; }
  bool WantsKvTaps() const override { return true; }
};

std::string Kind(const traces::TensorInfo& t) {
  if (t.group == "kv") return "kv cache";
  if (t.name.rfind("logits", 0) == 0) return "logits";
  return t.dtype == traces::DType::kI32 ? "taps i32" : "taps f32";
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir = LOCKSTEP_DEFAULT_MODEL_DIR, kv = "fp32", out_dir = "/tmp", modes = "off,hook,none,summary,full";
  int64_t prompt_len = 64, tokens = 128, batch = 1;
  double flush_interval = 1.0;
  int repeat = 3;
  std::string backend = "cpu";   // cuda: the GPU forward pass (taps copied back per step)
  bool random_weights = false;   // --random-weights 1: config only, weights made on the GPU
  bool gpu_profile = false;      // --gpu-profile 1: GPU time per phase of each run, on stderr
  int compression_threads = -1;  // the trace writer's compression workers (−1: record's default for the mode)
  int zstd_level = 0;            // 0: record's default for the mode
  int64_t chunk_kb = 0;  // 0: record's default for the mode
  std::string gemm = "bf16";     // the cuda backend's gemm variant
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h") {
      std::printf(
          "bench_record: what recording costs — decode tokens/s with no recorder and with each capture mode,\n"
          "bytes written per token, compression per kind of tensor (docs/performance.md, \"Recording\").\n\n"
          "  --model DIR              model folder (default: the embedded tiny model)\n"
          "  --random-weights 1       config only, weights drawn on the GPU (--backend cuda)\n"
          "  --backend cpu|cuda       where the forward pass runs (default cpu)\n"
          "  --batch B                requests decoded together (default 1)\n"
          "  --prompt-len N / --tokens N   per request (default 64 / 128)\n"
          "  --kv-cache fp32|bf16|fp8_e4m3 (default fp32)\n"
          "  --modes LIST             of off,hook,hook-summary,none,summary,full (default all but hook-summary);\n"
          "                           hook / hook-summary: a tap hook that keeps nothing, wanting values /\n"
          "                           summaries — the engine's share of full / summary capture\n"
          "  --repeat N               interleaved repeats per mode; medians and ranges (default 3)\n"
          "  --compression-threads N  the trace writer's zstd workers (default: record's — full capture half\n"
          "                           the cores, at most 8; otherwise 1)\n"
          "  --zstd-level N           the trace writer's Zstandard level (default: record's — 1 full, 3 otherwise)\n"
          "  --chunk-kb N             the trace writer's target chunk size (default: record's — 128 full, 64 otherwise)\n"
          "  --flush-interval S       seconds between flushes (default 1)\n"
          "  --out DIR                where the traces go (created; default /tmp)\n"
          "  --gpu-profile 1          GPU time per phase of each run, on stderr\n"
          "  --gemm NAME              the cuda backend's gemm variant (default bf16, cuBLAS; bf16_dot: our GEMVs)\n");
      return 0;
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "bench_record: %s needs a value (see --help)\n", argv[argc - 1]);
    return 2;
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    constexpr const char* kMe = "bench_record";
    bool ok = true;
    auto int_flag = [&](int64_t lo, int64_t hi, int* dst) {  // an int-valued flag in [lo, hi]
      int64_t n = 0;
      if (!bench::ParseInt(kMe, k, v, lo, hi, &n)) return false;
      *dst = static_cast<int>(n);
      return true;
    };
    if (k == "--model") model_dir = v;
    else if (k == "--prompt-len") ok = bench::ParseInt(kMe, k, v, 1, int64_t{1} << 24, &prompt_len);
    else if (k == "--tokens") ok = bench::ParseInt(kMe, k, v, 2, int64_t{1} << 24, &tokens);
    else if (k == "--batch") ok = bench::ParseInt(kMe, k, v, 1, 4096, &batch);
    else if (k == "--kv-cache") kv = v;
    else if (k == "--flush-interval") ok = bench::ParseNumber(kMe, k, v, 0.001, 3600.0, &flush_interval);
    else if (k == "--out") out_dir = v;
    else if (k == "--modes") modes = v;
    else if (k == "--repeat") ok = int_flag(1, 1000, &repeat);
    else if (k == "--backend") backend = v;
    else if (k == "--random-weights") random_weights = v == "1";
    else if (k == "--gpu-profile") gpu_profile = v == "1";
    else if (k == "--compression-threads") ok = int_flag(0, 256, &compression_threads);
    else if (k == "--zstd-level") ok = int_flag(1, 22, &zstd_level);
    else if (k == "--chunk-kb") ok = bench::ParseInt(kMe, k, v, 1, 1 << 20, &chunk_kb);
    else if (k == "--gemm") gemm = v;
    else {
      std::fprintf(stderr, "bench_record: unknown flag %s (see --help)\n", k.c_str());
      return 2;
    }
    if (!ok) return 2;
  }
  if (!bench::MakeOutDir("bench_record", out_dir)) return 2;
  auto model = random_weights ? engine::Model::RandomWeights(model_dir, 0) : engine::Model::Load(model_dir);
  if (!model.ok()) {
    std::fprintf(stderr, "bench_record: %s\n", model.status().message().c_str());
    return 1;
  }
  std::printf("backend %s%s, ", backend.c_str(), backend == "cuda" ? (" (gemm=" + gemm + ")").c_str() : "");
  std::printf("model %s, %lld requests × (%lld prompt + %lld generated) tokens, kv-cache %s, flush every %.2f s\n",
              model_dir.c_str(), static_cast<long long>(batch), static_cast<long long>(prompt_len),
              static_cast<long long>(tokens), kv.c_str(), flush_interval);
  {
    recorder::CapturePolicy full, summary;
    full.mode = recorder::CapturePolicy::Mode::kFull;
    summary.mode = recorder::CapturePolicy::Mode::kSummary;
    const unsigned cores = std::thread::hardware_concurrency();
    auto threads = [&](const recorder::CapturePolicy& p) {
      return compression_threads >= 0 ? compression_threads : recorder::RecorderOptions::CompressionThreads(p, cores);
    };
    auto level = [&](const recorder::CapturePolicy& p) {
      return zstd_level > 0 ? zstd_level : recorder::RecorderOptions::ZstdLevel(p);
    };
    auto chunk = [&](const recorder::CapturePolicy& p) {
      return static_cast<long long>(chunk_kb > 0 ? chunk_kb : recorder::RecorderOptions::TargetChunkBytes(p) >> 10);
    };
    std::printf("trace writer: full capture zstd level %d, %d compression workers, %lld KB chunks; summary level %d, "
                "%d, %lld KB\n\n",
                level(full), threads(full), chunk(full), level(summary), threads(summary), chunk(summary));
  }
  std::printf("| capture | decode tokens/s (wall) | vs off | engine-thread CPU µs/step | vs off | all threads CPU µs/step | close s | stall s | bytes/token | file MB |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  double off_tps = 0, off_cpu = 0;
  std::vector<std::pair<std::string, Result_>> results;
  std::vector<std::string> mode_list;
  {
    std::stringstream ms(modes);
    std::string m;
    while (std::getline(ms, m, ',')) mode_list.push_back(m);
  }
  std::map<std::string, std::vector<Result_>> runs;
  for (int rep = 0; rep < repeat; ++rep)
  for (const std::string& mode : mode_list) {
    engine::EngineOptions o;
    o.max_batch = batch;
    o.kv_format = *engine::ParseKvFormat(kv);
    o.backend = backend;
    if (backend == "cuda") o.kernels = {{"gemm", gemm}};
    o.device.profile = gpu_profile;
    o.kv_cache_tokens = std::max<int64_t>(o.kv_cache_tokens, batch * (prompt_len + tokens + 64));
    auto eng = engine::Engine::Create(*model, o);
    if (!eng.ok()) {
      std::fprintf(stderr, "bench_record: %s\n", eng.status().message().c_str());
      return 1;
    }
    std::mt19937 rng(1);
    const int64_t V = (*model)->config().vocab_size;
    for (int64_t b = 0; b < batch; ++b) {
      engine::Request r;
      r.name = std::to_string(b);
      for (int64_t i = 0; i < prompt_len; ++i) r.prompt.push_back(static_cast<int32_t>(3 + rng() % (V - 3)));
      r.max_new_tokens = tokens;
      auto id = (*eng)->AddRequest(r);
      if (!id.ok()) {
        std::fprintf(stderr, "bench_record: %s\n", id.status().message().c_str());
        return 1;
      }
    }
    const std::filesystem::path path = std::filesystem::path(out_dir) / ("bench_record_" + mode + ".h5");
    std::unique_ptr<traces::TraceWriter> writer;
    std::unique_ptr<recorder::Recorder> rec;
    NullHook null_hook;
    NullSummaryHook null_summary_hook;
    if (mode == "hook") (*eng)->SetTapHook(&null_hook);
    if (mode == "hook-summary") {
      (*eng)->SetTapHook(&null_summary_hook);
      // A forward callback, as the recorder's: the backend then stores the new cache rows for it
      // (here, as summaries for the hook).
      (*eng)->SetForwardCallback([](std::span<const engine::Segment>, const engine::PagedKvCache&) {});
    }
    if (mode != "off" && mode != "hook" && mode != "hook-summary") {
      traces::TraceWriterOptions wo;
      wo.batch_width = batch;
      {
        recorder::CapturePolicy pol;
        pol.mode = *recorder::CapturePolicy::ParseMode(mode);
        wo.alloc_block_bytes = recorder::RecorderOptions::AllocBlockBytes(pol);
        wo.compression_threads = compression_threads >= 0 ? compression_threads
                                                          : recorder::RecorderOptions::CompressionThreads(
                                                                pol, std::thread::hardware_concurrency());
        wo.zstd_level = zstd_level > 0 ? zstd_level : recorder::RecorderOptions::ZstdLevel(pol);
        wo.target_chunk_bytes = chunk_kb > 0 ? chunk_kb << 10 : recorder::RecorderOptions::TargetChunkBytes(pol);
      }
      auto w = traces::TraceWriter::Create(path, wo);
      if (!w.ok()) {
        std::fprintf(stderr, "bench_record: %s\n", w.status().message().c_str());
        return 1;
      }
      writer = std::move(*w);
      recorder::RecorderOptions ro;
      auto m = recorder::CapturePolicy::ParseMode(mode);
      if (!m.ok()) {
        std::fprintf(stderr, "bench_record: %s\n", m.status().message().c_str());
        return 2;
      }
      ro.policy.mode = *m;
      ro.flush_interval_s = flush_interval;
      rec = std::make_unique<recorder::Recorder>(eng->get(), writer.get(), ro);
      rec->Attach();
      for (int64_t b = 0; b < batch; ++b) {
        const Status st = rec->AddRequest(b, "");
        if (!st.ok()) {
          std::fprintf(stderr, "bench_record: %s\n", st.message().c_str());
          return 1;
        }
      }
    }
    Result_ res;
    const auto t0 = Clock::now();
    Clock::time_point t_first;
    double cpu_first = 0, pcpu_first = 0;
    recorder::Recorder::EngineThreadTimes rec_first;
    int64_t steps = 0;
    while (true) {
      auto more = (*eng)->Step();
      if (!more.ok() || !*more) break;
      if (rec && !rec->EndStep().ok()) {
        std::fprintf(stderr, "bench_record: %s\n", rec->status().message().c_str());
        return 1;
      }
      if (steps++ == 0) {
        t_first = Clock::now();
        cpu_first = ThreadCpu();
        pcpu_first = ProcessCpu();
        if (rec) rec_first = rec->engine_thread_times();
      }
    }
    const auto t_end = Clock::now();
    res.engine_cpu_us = 1e6 * (ThreadCpu() - cpu_first) / (steps - 1);
    res.process_cpu_us = 1e6 * (ProcessCpu() - pcpu_first) / (steps - 1);
    res.prefill_s = std::chrono::duration<double>(t_first - t0).count();
    res.tokens = batch * tokens;
    res.decode_s = std::chrono::duration<double>(t_end - t_first).count();
    res.decode_tps = (tokens - 1) * batch / res.decode_s;
    if (rec) {
      const auto& t = rec->engine_thread_times();
      const int64_t n = std::max<int64_t>(steps - 1, 1);
      res.recorder_per_step = {(t.taps_ns - rec_first.taps_ns) / n, (t.kv_ns - rec_first.kv_ns) / n,
                               (t.steps_ns - rec_first.steps_ns) / n};
    }
    if (writer) {
      if (const Status st = rec->Finish(); !st.ok()) {
        std::fprintf(stderr, "bench_record: %s\n", st.message().c_str());
        return 1;
      }
      rec.reset();
      // The engine's waits on the writer: a full queue, or (CUDA full capture) no lent tap
      // buffer back yet.
      res.tap_wait_s = (*eng)->backend().tap_wait_ns() / 1e9;
      res.stall_s = writer->stall_ns() / 1e9 + res.tap_wait_s;
      const auto c0 = Clock::now();
      Status s = writer->Close();
      res.close_s = std::chrono::duration<double>(Clock::now() - c0).count();
      if (!s.ok()) {
        std::fprintf(stderr, "bench_record: %s\n", s.message().c_str());
        return 1;
      }
      res.writer_times = writer->thread_times();
      res.file_bytes = static_cast<int64_t>(std::filesystem::file_size(path));
      auto r = traces::TraceReader::Open(path);
      if (r.ok()) {
        for (const auto& t : (*r)->tensors()) {
          auto& k = res.kinds[t.has_values ? Kind(t) : "summaries only"];
          k.first += t.raw_bytes;
          k.second += t.stored_bytes;
        }
      }
    }
    runs[mode].push_back(res);
  }
  // Median (the middle run, or the mean of the two middle ones) and range of a measure.
  struct Stat {
    double median = 0, lo = 0, hi = 0;
  };
  auto stat = [&](const std::string& mode, double Result_::*field) {
    std::vector<double> v;
    for (const Result_& r : runs[mode]) v.push_back(r.*field);
    std::sort(v.begin(), v.end());
    Stat st;
    if (v.empty()) return st;
    const size_t n = v.size();
    st.median = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
    st.lo = v.front();
    st.hi = v.back();
    return st;
  };
  for (const std::string& mode : mode_list) {
    const Result_& res = runs[mode].front();
    const Stat tps = stat(mode, &Result_::decode_tps), cpu = stat(mode, &Result_::engine_cpu_us),
               pcpu = stat(mode, &Result_::process_cpu_us);
    if (mode == "off") {
      off_tps = tps.median;
      off_cpu = cpu.median;
    }
    auto pct = [](double a, double b) { return b > 0 ? std::to_string(static_cast<int>(100 * a / b + 0.5)) + "%" : std::string(); };
    std::printf("| %s | %.0f [%.0f–%.0f] | %s | %.0f [%.0f–%.0f] | %s | %.0f | %.3f | %.3f | %s | %s |\n", mode.c_str(),
                tps.median, tps.lo, tps.hi, pct(tps.median, off_tps).c_str(), cpu.median, cpu.lo, cpu.hi,
                pct(cpu.median, off_cpu).c_str(), pcpu.median, res.close_s, res.stall_s,
                res.file_bytes ? std::to_string(res.file_bytes / res.tokens).c_str() : "—",
                res.file_bytes ? (std::to_string(res.file_bytes / 1000 / 1000.0).substr(0, 5)).c_str() : "—");
    results.push_back({mode, res});
  }
  // (The table's close and stall columns are the first run's.)
  for (const std::string& mode : mode_list) {
    if (mode == "off" || mode == "hook" || mode == "hook-summary") continue;
    std::printf("%s stalls per run, s (trace writer's queue + lent tap buffers):", mode.c_str());
    for (const Result_& r : runs[mode]) std::printf(" %.3f + %.3f", r.stall_s - r.tap_wait_s, r.tap_wait_s);
    std::printf("\n%s recorder on the engine thread per run, µs/step (taps / kv rows / sampler rows + step end):",
                mode.c_str());
    for (const Result_& r : runs[mode]) {
      const auto& u = r.recorder_per_step;
      std::printf(" %.0f / %.0f / %.0f", u.taps_ns / 1e3, u.kv_ns / 1e3, u.steps_ns / 1e3);
    }
    std::printf("\n%s trace writer's thread per run, s (appending [waiting for derived rows] / storing chunks [chunks] / "
                "flushing and closing; decode took):",
                mode.c_str());
    for (const Result_& r : runs[mode]) {
      const auto& w = r.writer_times;
      std::printf(" %.2f [%.2f] / %.2f [%lld] / %.2f; %.2f", w.append_ns / 1e9, w.derive_wait_ns / 1e9, w.write_ns / 1e9,
                  static_cast<long long>(w.chunks), w.flush_ns / 1e9, r.decode_s);
    }
    std::printf("\n");
  }
  std::printf("\n| capture | tensor kind | raw MB | stored MB | ratio |\n|---|---|---|---|---|\n");
  for (const auto& [mode, res] : results) {
    for (const auto& [kind, rs] : res.kinds) {
      std::printf("| %s | %s | %.2f | %.2f | %.2f |\n", mode.c_str(), kind.c_str(), rs.first / 1e6, rs.second / 1e6,
                  rs.second ? static_cast<double>(rs.first) / rs.second : 0.0);
    }
  }
  return 0;
}
