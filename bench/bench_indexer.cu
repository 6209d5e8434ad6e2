// bench/bench_indexer.cu — the V3.2 lightning indexer on the GPU (kernels/cuda/ops.h:
// IndexerScores, then TopK) at DeepSeek-V3.2's shapes — 64 heads of 128, top-2048, pages of
// 64 — the reference variant (fp32 keys, 512 bytes a token, one thread a key in cpu::Dot's
// order) against indexer=fp8_paged (FP8 rows of 132 bytes, exact fp64 dot products in register
// tiles): time per call, the FP8 keys' bytes per second beside a device-to-device copy
// measured in the same process, and the fp64 FMA rate of the FP8 scoring.
//
//   bench_indexer [--reps 20] [--context 4096,16384,65536] [--batch 1,8]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/cuda_bench.h"
#include "bench/cuda_fill.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"

namespace cu = lockstep::kernels::cuda;

namespace {

constexpr int64_t kHeads = 64, kDim = 128, kTopK = 2048, kPage = 64;

std::vector<int64_t> ParseList(const char* flag, const char* s) {
  std::vector<int64_t> out;
  for (const char* c = s; *c != '\0';) {
    char* end = nullptr;
    out.push_back(std::strtoll(c, &end, 10));
    if (end == c || out.back() <= 0) {
      std::fprintf(stderr, "bench_indexer: %s: expected positive integers separated by commas\n", flag);
      std::exit(2);
    }
    c = *end == ',' ? end + 1 : end;
  }
  return out;
}

// Milliseconds per call for `batch` requests of `ctx` keys each: IndexerScores + TopK, and
// IndexerScores alone.
struct Times {
  double both, scores;
};
Times Bench(bool fp8, int64_t batch, int64_t ctx, int reps) {
  const int64_t tokens = batch * ctx, pages = tokens / kPage;
  const int64_t row_bytes = fp8 ? kDim + 4 : kDim * 4;
  auto keys = cu::DeviceBuffer::Allocate(tokens * row_bytes);
  CHECK_OK(keys.status());
  if (fp8) {  // through the real quantise-on-write path (WriteLatent's layout without rope)
    const int64_t chunk = 65536;
    auto k = cu::DeviceBuffer::Allocate(chunk * kDim * 4), slots = cu::DeviceBuffer::Allocate(chunk * 4);
    for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
      const int64_t n = std::min(chunk, tokens - t0);
      Fill(k->as<float>(), n * kDim, static_cast<uint32_t>(t0 + 3));
      std::vector<int32_t> hs(n);
      for (int64_t i = 0; i < n; ++i) hs[i] = static_cast<int32_t>(t0 + i);
      CHECK_OK(slots->CopyFromHost(hs.data(), hs.size() * 4));
      cu::LatentWriteParams w;
      w.latent = k->as<float>();
      w.latent_stride = kDim;
      w.rope = k->as<float>();
      w.slots = slots->as<int32_t>();
      w.cache = keys->as<uint8_t>();
      w.num_slots = tokens;
      w.rows = n;
      w.kv_lora = kDim;
      w.format = cu::LatentFormat::kFp8E4m3;
      CHECK_OK(cu::WriteLatent(w));
      CHECK_OK(cu::Synchronize());
    }
  } else {
    Fill(keys->as<float>(), tokens * kDim, 3);
  }
  auto q = cu::DeviceBuffer::Allocate(batch * kHeads * kDim * 4), w = cu::DeviceBuffer::Allocate(batch * kHeads * 4);
  auto q8 = cu::DeviceBuffer::Allocate(batch * kHeads * (kDim + 4));
  Fill(q->as<float>(), batch * kHeads * kDim, 5);
  if (fp8) {  // the queries as FP8 rows, as the engine makes them (WriteLatent, row r to slot r)
    cu::LatentWriteParams qw;
    qw.latent = q->as<float>();
    qw.latent_stride = kDim;
    qw.rope = q->as<float>();
    qw.cache = q8->as<uint8_t>();
    qw.num_slots = batch * kHeads;
    qw.rows = batch * kHeads;
    qw.kv_lora = kDim;
    qw.format = cu::LatentFormat::kFp8E4m3;
    CHECK_OK(cu::WriteLatent(qw));
  }
  Fill(w->as<float>(), batch * kHeads, 7);
  auto table = cu::DeviceBuffer::Allocate(pages * 4), lens = cu::DeviceBuffer::Allocate(batch * 4);
  Iota(table->as<int32_t>(), pages);
  std::vector<int32_t> hl(batch, static_cast<int32_t>(ctx));
  CHECK_OK(lens->CopyFromHost(hl.data(), hl.size() * 4));
  auto scores = cu::DeviceBuffer::Allocate(batch * ctx * 4), pos = cu::DeviceBuffer::Allocate(batch * kTopK * 4);

  cu::IndexerScoreParams s;
  s.batch = batch;
  s.heads = kHeads;
  s.head_dim = kDim;
  s.q = q->as<float>();
  s.q_batch_stride = kHeads * kDim;
  s.q_head_stride = kDim;
  s.weights = w->as<float>();
  s.weights_stride = kHeads;
  s.key_scale = 0.0883883f;
  if (fp8) {
    s.q_fp8 = q8->as<uint8_t>();
    s.keys_fp8 = keys->as<uint8_t>();
  } else {
    s.keys = keys->as<float>();
  }
  s.num_pages = pages;
  s.page_size = kPage;
  s.page_table = table->as<int32_t>();
  s.page_table_stride = ctx / kPage;
  s.seq_lens = lens->as<int32_t>();
  s.max_seq_len = ctx;
  s.scores = scores->as<float>();
  s.scores_stride = ctx;
  cu::TopKParams t;
  t.batch = batch;
  t.topk = kTopK;
  t.scores = scores->as<float>();
  t.scores_stride = ctx;
  t.seq_lens = lens->as<int32_t>();
  t.max_seq_len = ctx;
  t.positions = pos->as<int32_t>();
  auto time = [&](bool topk) {
    return MsPerCall(
        [&] {
          CHECK_OK(cu::IndexerScores(s));
          if (topk) CHECK_OK(cu::TopK(t));
        },
        reps);
  };
  return {time(true), time(false)};
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20;
  std::vector<int64_t> contexts = {4096, 16384, 65536}, batches = {1, 8};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf(
          "bench_indexer: the V3.2 indexer (IndexerScores + TopK, 64 heads × 128, top-2048, pages of 64)\n"
          "with fp32 keys (indexer=reference, 512 B a token) and FP8 rows (indexer=fp8_paged, 132 B)\n\n"
          "  --reps N          calls timed per figure (default 20)\n"
          "  --context LIST    keys per request, comma-separated (default 4096,16384,65536)\n"
          "  --batch LIST      requests per call (default 1,8)\n");
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_indexer: %s needs a value (--help lists the flags)\n", a.c_str());
      return 2;
    }
    const char* v = argv[++i];
    if (a == "--reps") {
      reps = std::atoi(v);
      if (reps <= 0) {
        std::fprintf(stderr, "bench_indexer: --reps: expected a positive integer\n");
        return 2;
      }
    } else if (a == "--context") {
      contexts = ParseList("--context", v);
      for (int64_t c : contexts) {
        if (c % kPage != 0) {
          std::fprintf(stderr, "bench_indexer: --context: %lld is not a multiple of the page size %lld\n",
                       static_cast<long long>(c), static_cast<long long>(kPage));
          return 2;
        }
      }
    } else if (a == "--batch") {
      batches = ParseList("--batch", v);
    } else {
      std::fprintf(stderr, "bench_indexer: unknown flag %s (--help lists the flags)\n", a.c_str());
      return 2;
    }
  }
  if (cu::DeviceCount() == 0) {
    std::printf("bench_indexer: %s\n", cu::DeviceDescription().c_str());
    return 0;
  }
  std::printf("device: %s\n", cu::DeviceDescription().c_str());
  auto copy = cu::MeasureCopyBandwidth(5);
  CHECK_OK(copy.status());
  std::printf("device-to-device copy: %.0f GB/s (read + write)\n", *copy / 1e9);
  std::printf("%5s %7s | %-24s | %-24s | %7s %9s %8s %9s\n", "", "", "  scores+top-k ms/call", "  scores alone ms/call",
              "scores", "fp8 keys", "", "fp8 dot");
  std::printf("%5s %7s | %11s %12s | %11s %12s | %7s %9s %8s %9s\n", "batch", "context", "reference", "fp8_paged",
              "reference", "fp8_paged", "speedup", "GB/s", "of copy", "fp64 TF/s");
  for (int64_t batch : batches) {
    for (int64_t ctx : contexts) {
      const Times f32 = Bench(false, batch, ctx, reps), f8 = Bench(true, batch, ctx, reps);
      const double gbs = static_cast<double>(batch) * ctx * (kDim + 4) / (f8.scores * 1e-3) / 1e9;
      const double tf = 2.0 * batch * ctx * kHeads * kDim / (f8.scores * 1e-3) / 1e12;
      std::printf("%5lld %7lld | %11.3f %12.3f | %11.3f %12.3f | %6.2fx %9.0f %7.1f%% %9.1f\n",
                  static_cast<long long>(batch), static_cast<long long>(ctx), f32.both, f8.both, f32.scores, f8.scores,
                  f32.scores / f8.scores, gbs, 100.0 * gbs * 1e9 / *copy, tf);
    }
  }
  return 0;
}
