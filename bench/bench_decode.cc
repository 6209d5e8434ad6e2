// bench/bench_decode.cc — CPU decode speed of the reference engine, against the memory
// bandwidth this machine delivers in the same run.
//
// Decode on a CPU is bound by reading the weights: every generated token reads all active
// parameters once, as the checkpoint stores them (the GEMM dequantises rows as it reads them:
// 2 bytes a parameter for bf16). So the figure of merit is achieved weight bandwidth (the
// active weights' stored bytes × steps/s) over the copy bandwidth measured here (memcpy of a
// buffer far larger than the caches, read + write bytes counted).
//
//   bench_decode [--model DIR] [--prompt-len N] [--tokens N] [--batch B] [--kv-cache fp32|bf16|fp8_e4m3]
//                [--touch-weights] [--help]
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_args.h"
#include "engine/engine.h"
#include "engine/memory.h"

using namespace lockstep;

static double CopyBandwidthGBs() {
  const size_t n = size_t{512} << 20;  // 512 MiB each way
  std::vector<char> a(n, 1), b(n, 0);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), n);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * n / s / 1e9);
    a[rep] = b[n - 1 - rep];
  }
  return best;
}

int main(int argc, char** argv) {
  std::string model_dir = LOCKSTEP_DEFAULT_MODEL_DIR, kv = "fp32";
  int64_t prompt_len = 64, tokens = 128, batch = 1;
  bool touch_weights = false;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--touch-weights") {
      touch_weights = true;
      continue;
    }
    if (k == "--help" || k == "-h") {
      std::printf(
          "bench_decode: decode tokens/s of the CPU reference engine, and the weight bandwidth that makes,\n"
          "against a memcpy measured in the same run (docs/performance.md). One JSON line on stdout.\n\n"
          "  --model DIR        a model folder (default: the embedded model)\n"
          "  --prompt-len N     random prompt tokens per request (default 64)\n"
          "  --tokens N         tokens generated per request; the steps after the prefill are timed (default 128)\n"
          "  --batch B          requests decoded together (default 1)\n"
          "  --kv-cache F       fp32 | bf16 | fp8_e4m3 (default fp32)\n"
          "  --touch-weights    read every weight once before timing: the prefill step then does not take the\n"
          "                     page faults of the mapped checkpoint's first read\n"
          "OMP_NUM_THREADS sets the threads (the figures in docs/performance.md use 1).\n");
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_decode: %s needs a value (--help lists the flags)\n", k.c_str());
      return 2;
    }
    const std::string v = argv[++i];
    bool ok = true;
    if (k == "--model") model_dir = v;
    else if (k == "--prompt-len") ok = bench::ParseInt("bench_decode", k, v, 1, int64_t{1} << 24, &prompt_len);
    else if (k == "--tokens") ok = bench::ParseInt("bench_decode", k, v, 2, int64_t{1} << 24, &tokens);
    else if (k == "--batch") ok = bench::ParseInt("bench_decode", k, v, 1, 4096, &batch);
    else if (k == "--kv-cache") kv = v;
    else {
      std::fprintf(stderr, "bench_decode: unknown flag %s (--help lists them)\n", k.c_str());
      return 2;
    }
    if (!ok) return 2;
  }
  auto format = engine::ParseKvFormat(kv);
  if (!format.ok()) {
    std::fprintf(stderr, "bench_decode: %s\n", format.status().message().c_str());
    return 2;
  }
  auto model = engine::Model::Load(model_dir);
  if (!model.ok()) {
    std::fprintf(stderr, "bench_decode: %s\n", model.status().message().c_str());
    return 1;
  }
  if (touch_weights) {
    volatile float sink = 0;
    engine::ForEachMatrix((*model)->config(), (*model)->weights(), [&](const engine::Matrix& m) {
      if (!m.empty()) sink = sink + m.Dequantized()[0];
    });
  }
  engine::EngineOptions o;
  o.max_batch = batch;
  o.kv_format = *format;
  auto eng = engine::Engine::Create(*model, o);
  if (!eng.ok()) {
    std::fprintf(stderr, "bench_decode: %s\n", eng.status().message().c_str());
    return 1;
  }
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "bench_decode: %s\n", s.message().c_str());
    return 1;
  };
  std::mt19937 rng(1);
  const int64_t V = (*model)->config().vocab_size;
  for (int64_t b = 0; b < batch; ++b) {
    engine::Request r;
    for (int64_t i = 0; i < prompt_len; ++i) r.prompt.push_back(static_cast<int32_t>(rng() % V));
    r.max_new_tokens = tokens;
    if (auto id = (*eng)->AddRequest(r); !id.ok()) return fail(id.status());
  }
  // Step 0 is the prefill; time the decode steps after it.
  auto t0 = std::chrono::steady_clock::now();
  if (auto first = (*eng)->Step(); !first.ok()) return fail(first.status());
  auto t1 = std::chrono::steady_clock::now();
  int64_t steps = 0;
  while (true) {
    auto more = (*eng)->Step();
    if (!more.ok()) return fail(more.status());
    if (!*more) break;
    ++steps;
  }
  auto t2 = std::chrono::steady_clock::now();
  const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  const double decode_s = std::chrono::duration<double>(t2 - t1).count();
  const double tok_s = static_cast<double>(steps * batch) / decode_s;
  const double step_s = static_cast<double>(steps) / decode_s;
  const double weight_gb = engine::ActiveWeightBytes((*model)->config(), (*model)->weights()) / 1e9;
  const double achieved = weight_gb * step_s;  // weights are read once per step, shared by the batch
  const double copy = CopyBandwidthGBs();
  std::printf(
      "{\"model\": \"%s\", \"kv_cache\": \"%s\", \"batch\": %lld, \"prompt_len\": %lld, \"decode_steps\": %lld, "
      "\"prefill_tokens_per_s\": %.1f, \"decode_tokens_per_s\": %.1f, \"active_weight_bytes\": %.0f, "
      "\"achieved_weight_gb_s\": %.2f, \"copy_gb_s\": %.2f, \"fraction_of_copy_bw\": %.3f, \"touched_weights\": %s}\n",
      model_dir.c_str(), kv.c_str(), static_cast<long long>(batch), static_cast<long long>(prompt_len),
      static_cast<long long>(steps), prompt_len * batch / prefill_s, tok_s, weight_gb * 1e9, achieved, copy,
      achieved / copy, touch_weights ? "true" : "false");
  return 0;
}
