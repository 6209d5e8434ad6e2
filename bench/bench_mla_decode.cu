// bench/bench_mla_decode.cu — the CUDA MLA decode (kernels/cuda/ops.h) at 4k, 16k and 64k
// context: time per call, achieved cache bandwidth beside a device-to-device copy measured
// in the same process (the memory ceiling), and the fp32 FMA rate (the compute ceiling of
// this reference-precision kernel: 2·(kv_lora + rope) + 2·kv_lora flops per key and head).
//
//   bench_mla_decode [--heads 128] [--reps 10] [--context 4096,16384,65536] [--overlapped-launch 1]
//                    [--heads-per-cta 0|1|8|16]   (the split CTA's shape; 0: the kernel's choice)
//                    [--key-staging 0|1|2]        (MlaDecodeParams::key_staging; 0: the kernel's choice)
// (--heads 16 --context 256: a V2-Lite decode step's attention at a short prompt)
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

double CopyBandwidth(int reps) {
  auto bw = cu::MeasureCopyBandwidth(reps);
  CHECK_OK(bw.status());
  return *bw;
}

int g_heads_per_cta = 0;  // --heads-per-cta
int g_key_staging = 0;  // --key-staging

struct Result {
  double ms, gbps, tflops;
};

Result Bench(cu::LatentFormat fmt, int64_t batch, int64_t ctx, int64_t heads, int64_t topk, int reps) {
  const int64_t C = 512, R = 64, page_size = 64;
  const int64_t tokens = batch * ctx, pages = tokens / page_size;
  const int64_t bpt = cu::LatentBytesPerToken(fmt, C, R);
  auto pool = cu::DeviceBuffer::Allocate(tokens * bpt);
  CHECK_OK(pool.status());
  // Fill the cache through the real write path, 64k tokens at a time.
  {
    const int64_t chunk = 65536;
    auto lat = cu::DeviceBuffer::Allocate(chunk * C * 4), rope = cu::DeviceBuffer::Allocate(chunk * R * 4),
         slots = cu::DeviceBuffer::Allocate(chunk * 4);
    for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
      const int64_t n = std::min(chunk, tokens - t0);
      Fill(lat->as<float>(), n * C, static_cast<uint32_t>(t0 + 1));
      Fill(rope->as<float>(), n * R, static_cast<uint32_t>(t0 + 7));
      Iota(slots->as<int32_t>(), n, static_cast<int32_t>(t0));
      cu::LatentWriteParams w;
      w.latent = lat->as<float>();
      w.latent_stride = C;
      w.rope = rope->as<float>();
      w.rope_stride = R;
      w.slots = slots->as<int32_t>();
      w.cache = pool->as<uint8_t>();
      w.num_slots = tokens;
      w.rows = n;
      w.kv_lora = C;
      w.rope_dim = R;
      w.format = fmt;
      CHECK_OK(cu::WriteLatent(w));
    }
    CHECK_OK(cu::Synchronize());
  }
  auto q = cu::DeviceBuffer::Allocate(batch * heads * (C + R) * 4);
  Fill(q->as<float>(), batch * heads * (C + R), 99);
  const int64_t max_pages = ctx / page_size;
  auto table = cu::DeviceBuffer::Allocate(pages * 4), lens = cu::DeviceBuffer::Allocate(batch * 4);
  Iota(table->as<int32_t>(), pages);
  std::vector<int32_t> hl(batch, static_cast<int32_t>(ctx));
  CHECK_OK(lens->CopyFromHost(hl.data(), hl.size() * 4));
  // Sparse: topk evenly spaced slots of each request.
  std::vector<int32_t> hidx;
  for (int64_t b = 0; b < batch && topk > 0; ++b) {
    for (int64_t i = 0; i < topk; ++i) hidx.push_back(static_cast<int32_t>(b * ctx + i * (ctx / topk)));
  }
  auto idx = cu::DeviceBuffer::Allocate(std::max<size_t>(4, hidx.size() * 4));
  if (!hidx.empty()) CHECK_OK(idx->CopyFromHost(hidx.data(), hidx.size() * 4));
  auto out = cu::DeviceBuffer::Allocate(batch * heads * C * 4), lse = cu::DeviceBuffer::Allocate(batch * heads * 4);

  cu::MlaDecodeParams p;
  p.batch = batch;
  p.heads = heads;
  p.kv_lora = C;
  p.rope_dim = R;
  p.format = fmt;
  p.softmax_scale = 0.0722f;
  p.heads_per_cta = g_heads_per_cta;
  p.key_staging = g_key_staging;
  p.q_latent = q->as<float>();
  p.q_latent_batch_stride = heads * (C + R);
  p.q_latent_head_stride = C + R;
  p.q_rope = q->as<float>() + C;
  p.q_rope_batch_stride = heads * (C + R);
  p.q_rope_head_stride = C + R;
  p.cache = pool->as<uint8_t>();
  p.num_pages = pages;
  p.page_size = page_size;
  if (topk > 0) {
    p.indices = idx->as<int32_t>();
    p.indices_stride = topk;
    p.topk = topk;
  } else {
    p.page_table = table->as<int32_t>();
    p.page_table_stride = max_pages;
    p.seq_lens = lens->as<int32_t>();
    p.max_seq_len = ctx;
  }
  p.o_latent = out->as<float>();
  p.o_batch_stride = heads * C;
  p.o_head_stride = C;
  p.lse = lse->as<float>();
  auto ws = cu::DeviceBuffer::Allocate(cu::MlaDecodeWorkspaceBytes(p));
  CHECK_OK(ws.status());
  p.workspace = ws->data();
  p.workspace_bytes = ws->size();
  auto run = [&] { CHECK_OK(topk > 0 ? cu::MlaSparseDecode(p) : cu::MlaDecode(p)); };
  const double ms = MsPerCall(run, reps, /*warmups=*/2);
  const double t = ms * 1e-3;
  const int64_t keys = topk > 0 ? topk : ctx;
  const double bytes = static_cast<double>(batch) * keys * bpt;
  const double flops = static_cast<double>(batch) * keys * heads * (2.0 * (C + R) + 2.0 * C);
  return {ms, bytes / t / 1e9, flops / t / 1e12};
}

}  // namespace

int main(int argc, char** argv) {
  int64_t heads = 128;
  int reps = 10;
  std::vector<int64_t> contexts = {4096, 16384, 65536};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      std::printf(
          "bench_mla_decode: CUDA MLA decode (fp8, bf16 caches; dense and sparse top-2048) per call, its cache\n"
          "bandwidth against a device copy measured in the same process, and its fp32 FMA rate.\n\n"
          "  --heads N              query heads (default 128; 16: V2-Lite)\n"
          "  --reps N               calls timed per figure (default 10)\n"
          "  --context N[,N...]     keys per request (default 4096,16384,65536)\n"
          "  --overlapped-launch 0|1  programmatic dependent launch (default: the device's support)\n"
          "  --heads-per-cta 0|1|8|16 the split CTA's shape (0: the kernel's choice)\n"
          "  --key-staging 0|1|2    MlaDecodeParams::key_staging (0: the kernel's choice; 1 row by row;\n"
          "                         2 staged wherever the format allows)\n");
      return 0;
    }
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--heads")) heads = std::atoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--overlapped-launch")) cu::SetOverlappedLaunch(std::atoi(argv[i + 1]) != 0);
    if (!std::strcmp(argv[i], "--heads-per-cta")) g_heads_per_cta = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--key-staging")) g_key_staging = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--context")) {
      contexts.clear();
      for (const char* c = argv[i + 1]; *c != '\0';) {
        char* end = nullptr;
        contexts.push_back(std::strtoll(c, &end, 10));
        if (end == c || contexts.back() <= 0) {
          std::fprintf(stderr, "bench_mla_decode: --context: expected positive integers separated by commas\n");
          return 2;
        }
        c = *end == ',' ? end + 1 : end;
      }
    }
  }
  if (cu::DeviceCount() == 0) {
    std::printf("bench_mla_decode: %s\n", cu::DeviceDescription().c_str());
    return 0;
  }
  std::printf("device: %s\n", cu::DeviceDescription().c_str());
  const double copy = CopyBandwidth(reps);
  std::printf("device-to-device copy: %.0f GB/s (read + write)\n", copy / 1e9);
  std::printf("%-9s %5s %7s %6s %10s %10s %8s %9s\n", "format", "batch", "context", "topk", "ms/call", "cache GB/s",
              "of copy", "fp32 TF/s");
  for (cu::LatentFormat fmt : {cu::LatentFormat::kFp8E4m3, cu::LatentFormat::kBf16}) {
    for (int64_t batch : {int64_t{1}, int64_t{8}}) {
      for (int64_t ctx : contexts) {
        for (int64_t topk : {int64_t{0}, int64_t{2048}}) {
          if (topk > 0 && (fmt != cu::LatentFormat::kFp8E4m3 || ctx != contexts.back() || ctx <= topk)) continue;
          const Result r = Bench(fmt, batch, ctx, heads, topk, reps);
          std::printf("%-9s %5lld %7lld %6lld %10.3f %10.0f %7.1f%% %9.1f\n",
                      fmt == cu::LatentFormat::kFp8E4m3 ? "fp8_e4m3" : "bf16", static_cast<long long>(batch),
                      static_cast<long long>(ctx), static_cast<long long>(topk), r.ms, r.gbps, 100.0 * r.gbps * 1e9 / copy,
                      r.tflops);
        }
      }
    }
  }
  return 0;
}
