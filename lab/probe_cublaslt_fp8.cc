// lab/probe_cublaslt_fp8.cc — does this cuBLASLt run DeepSeek's FP8 recipe (e4m3 weights with
// a scale per 128 × 128 block, e4m3 activations with a scale per token and 128 values) on this
// GPU, and which scale-tensor layouts does it read? The header names the scale modes
// (CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, _VEC128_32F) but not their layouts; this probe
// tries the natural candidates against an fp64 reference of the same FP8 operands and prints,
// per candidate, the status and the error. A probe for the W8A8 variant's design (issue 6), not
// a benchmark of lockstep code.
//
//   probe_cublaslt_fp8 [--m 256] [--n 64] [--k 512]
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/cuda_bench.h"
#include "kernels/cpu/numerics.h"

namespace {

// Row-major [rows, cols] quantised per (rb × cb) block: scale = amax / 448 (DeepSeek's rule).
void Quantize(const std::vector<float>& x, int rows, int cols, int rb, int cb, std::vector<uint8_t>* q,
              std::vector<float>* scales) {
  const int br = (rows + rb - 1) / rb, bc = (cols + cb - 1) / cb;
  q->assign(static_cast<size_t>(rows) * cols, 0);
  scales->assign(static_cast<size_t>(br) * bc, 1.0f);
  for (int i = 0; i < br; ++i) {
    for (int j = 0; j < bc; ++j) {
      float amax = 0;
      for (int r = i * rb; r < std::min(rows, (i + 1) * rb); ++r) {
        for (int c = j * cb; c < std::min(cols, (j + 1) * cb); ++c) amax = std::max(amax, std::fabs(x[r * cols + c]));
      }
      const float s = amax > 0 ? amax / 448.0f : 1.0f;
      (*scales)[i * bc + j] = s;
      for (int r = i * rb; r < std::min(rows, (i + 1) * rb); ++r) {
        for (int c = j * cb; c < std::min(cols, (j + 1) * cb); ++c) {
          (*q)[r * cols + c] = lockstep::kernels::F32ToFp8E4m3(x[r * cols + c] / s);
        }
      }
    }
  }
}

template <typename T>
T* ToDevice(const std::vector<T>& v) {
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(v.size(), 1) * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// A scale grid [outer, inner] (inner fastest) rewritten as [inner, outer].
std::vector<float> Transpose(const std::vector<float>& s, int outer, int inner) {
  std::vector<float> t(s.size());
  for (int o = 0; o < outer; ++o) {
    for (int i = 0; i < inner; ++i) t[i * outer + o] = s[o * inner + i];
  }
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  int M = 256, N = 64, K = 512;  // out, tokens, in
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--m") M = std::atoi(argv[i + 1]);
    else if (a == "--n") N = std::atoi(argv[i + 1]);
    else if (a == "--k") K = std::atoi(argv[i + 1]);
  }
  if (M <= 0 || N <= 0 || K <= 0 || static_cast<int64_t>(M) * K > (int64_t{1} << 28) ||
      static_cast<int64_t>(N) * K > (int64_t{1} << 28)) {
    std::fprintf(stderr, "probe_cublaslt_fp8: --m, --n, --k must be positive (and M·K, N·K ≤ 2^28)\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("probe_cublaslt_fp8: no CUDA device\n");
    return 0;
  }
  std::printf("cuBLASLt version %zu, M (out) %d, N (tokens) %d, K %d\n", cublasLtGetVersion(), M, N, K);
  std::mt19937 rng(7);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> w(static_cast<size_t>(M) * K), x(static_cast<size_t>(N) * K);
  for (float& v : w) v = g(rng) * 0.05f * std::exp2(static_cast<float>(rng() % 6));
  for (float& v : x) v = g(rng) * std::exp2(static_cast<float>(rng() % 6) - 3);
  std::vector<uint8_t> w8, x8;
  std::vector<float> ws, xs;  // ws [M/128][K/128]; xs [N][K/128]
  Quantize(w, M, K, 128, 128, &w8, &ws);
  Quantize(x, N, K, 1, 128, &x8, &xs);
  const int kb = (K + 127) / 128, mb = (M + 127) / 128;
  // fp64 reference of the FP8 operands: y[n][m] = Σ_i x8·w8 · sx · sw.
  std::vector<double> ref(static_cast<size_t>(N) * M);
  for (int n = 0; n < N; ++n) {
    for (int m = 0; m < M; ++m) {
      double acc = 0;
      for (int i = 0; i < K; ++i) {
        acc += static_cast<double>(lockstep::kernels::Fp8E4m3ToF32(x8[n * K + i])) * xs[n * kb + i / 128] *
               static_cast<double>(lockstep::kernels::Fp8E4m3ToF32(w8[m * K + i])) * ws[(m / 128) * kb + i / 128];
      }
      ref[n * M + m] = acc;
    }
  }
  cublasLtHandle_t lt;
  if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) return 1;
  uint8_t *dw = ToDevice(w8), *dx = ToDevice(x8);
  float* dy = nullptr;
  CHECK_CUDA(cudaMalloc(&dy, static_cast<size_t>(N) * M * 4));
  void* workspace = nullptr;
  const size_t ws_bytes = 64 << 20;
  CHECK_CUDA(cudaMalloc(&workspace, ws_bytes));

  struct Candidate {
    const char* name;
    std::vector<float> a_scales, b_scales;  // A = weights, B = activations
  };
  const std::vector<Candidate> candidates = {
      {"A [M/128][K/128] (k fastest), B [N][K/128] (k fastest)", ws, xs},
      {"A [K/128][M/128] (m fastest), B [N][K/128] (k fastest)", Transpose(ws, mb, kb), xs},
      {"A [M/128][K/128] (k fastest), B [K/128][N] (n fastest)", ws, Transpose(xs, N, kb)},
      {"A [K/128][M/128] (m fastest), B [K/128][N] (n fastest)", Transpose(ws, mb, kb), Transpose(xs, N, kb)},
  };
  for (cudaDataType_t dtype : {CUDA_R_32F, CUDA_R_16BF}) {
    for (const Candidate& c : candidates) {
      float *dsa = ToDevice(c.a_scales), *dsb = ToDevice(c.b_scales);
      cublasLtMatmulDesc_t op;
      cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
      const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
      const cublasLtMatmulMatrixScale_t am = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                                        bm = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      cublasStatus_t st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof(am));
      if (st == CUBLAS_STATUS_SUCCESS) {
        st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof(bm));
      }
      const void* pa = dsa;
      const void* pb = dsb;
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &pa, sizeof(pa));
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &pb, sizeof(pb));
      cublasLtMatrixLayout_t la, lb, lc;
      cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, K, M, K);  // w row-major [M, K] = col-major [K, M]
      cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, K, N, K);  // x row-major [N, K] = col-major [K, N]
      cublasLtMatrixLayoutCreate(&lc, dtype, M, N, M);           // y row-major [N, M] = col-major [M, N]
      cublasLtMatmulPreference_t pref;
      cublasLtMatmulPreferenceCreate(&pref);
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                           sizeof(ws_bytes));
      cublasLtMatmulHeuristicResult_t h{};
      int found = 0;
      cublasStatus_t hs = st == CUBLAS_STATUS_SUCCESS
                              ? cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &h, &found)
                              : st;
      double worst = -1;
      cublasStatus_t ms = CUBLAS_STATUS_NOT_SUPPORTED;
      if (hs == CUBLAS_STATUS_SUCCESS && found > 0) {
        const float alpha = 1.0f, beta = 0.0f;
        CHECK_CUDA(cudaMemset(dy, 0, static_cast<size_t>(N) * M * 4));
        ms = cublasLtMatmul(lt, op, &alpha, dw, la, dx, lb, &beta, dy, lc, dy, lc, &h.algo, workspace, ws_bytes, 0);
        CHECK_CUDA(cudaDeviceSynchronize());
        if (ms == CUBLAS_STATUS_SUCCESS) {
          std::vector<float> y(static_cast<size_t>(N) * M);
          if (dtype == CUDA_R_32F) {
            CHECK_CUDA(cudaMemcpy(y.data(), dy, y.size() * 4, cudaMemcpyDeviceToHost));
          } else {
            std::vector<uint16_t> yb(y.size());
            CHECK_CUDA(cudaMemcpy(yb.data(), dy, yb.size() * 2, cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < y.size(); ++i) y[i] = lockstep::kernels::Bf16ToF32(yb[i]);
          }
          double num = 0, den = 0;
          for (size_t i = 0; i < y.size(); ++i) {
            num = std::max(num, std::fabs(y[i] - ref[i]));
            den = std::max(den, std::fabs(ref[i]));
          }
          worst = num / den;
        }
      }
      std::printf("%-4s | %-58s | heuristic %d (found %d), matmul %d | max|Δ|/max|ref| %s\n",
                  dtype == CUDA_R_32F ? "f32" : "bf16", c.name, static_cast<int>(hs), found, static_cast<int>(ms),
                  worst < 0 ? "—" : std::to_string(worst).c_str());
      cublasLtMatmulPreferenceDestroy(pref);
      cublasLtMatrixLayoutDestroy(la);
      cublasLtMatrixLayoutDestroy(lb);
      cublasLtMatrixLayoutDestroy(lc);
      cublasLtMatmulDescDestroy(op);
      CHECK_CUDA(cudaFree(dsa));
      CHECK_CUDA(cudaFree(dsb));
    }
  }
  cublasLtDestroy(lt);
  return 0;
}
