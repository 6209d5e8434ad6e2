// kernels/cuda/gemm.cu — y = x · wᵀ through cuBLASLt, with the algorithm pinned for batch
// invariance (ops.h explains why and how).
//
// Row-major y[rows, out] = x[rows, in] · w[out, in]ᵀ is, in cuBLAS's column-major terms,
// yᵀ[out, rows] = op(A) · B with A = w viewed as [in, out] (ld w_stride, op = T) and
// B = x viewed as [in, rows] (ld x_stride, op = N); m = out, n = rows, k = in.
//
// Pinning: the heuristic is asked once per (out, in, strides, alignments) at n =
// kGemmPinRows with split-K excluded; that algorithm is checked (cublasLtMatmulAlgoCheck)
// and used for every row count. An element's reduction over k then runs in one CTA through
// the same k-loop whatever n is. The choice itself depends on the device (its SM count
// steers the heuristic) and the cuBLAS version: Describe() names it so a trace can record it.
#include <cuda_runtime.h>

#include <array>
#include <map>
#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/cublaslt_api.h"
#include "kernels/cuda/ops.h"

namespace lockstep::kernels::cuda {
namespace {

// The API Gemm::Create loaded (every other use follows a successful Create).
const CublasLtApi& Lt() { return *LoadedCublasLt(); }

// Owns the four descriptors of one matmul.
struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  Descs() = default;
  Descs(const Descs&) = delete;
  Descs& operator=(const Descs&) = delete;
  ~Descs() { Reset(); }
  void Reset() {
    if (c) Lt().MatrixLayoutDestroy(c);
    if (b) Lt().MatrixLayoutDestroy(b);
    if (a) Lt().MatrixLayoutDestroy(a);
    if (op) Lt().MatmulDescDestroy(op);
    op = nullptr;
    a = b = c = nullptr;
  }
};

struct Preference {
  cublasLtMatmulPreference_t pref = nullptr;
  ~Preference() {
    if (pref) Lt().MatmulPreferenceDestroy(pref);
  }
};

// Largest power of two (≤ 256) dividing both the address and the row pitch in bytes.
uint32_t Alignment(const void* ptr, int64_t ld, int64_t elem_bytes) {
  uint64_t v = reinterpret_cast<uintptr_t>(ptr) | static_cast<uint64_t>(ld * elem_bytes) | 256u;
  return static_cast<uint32_t>(v & (~v + 1));
}

}  // namespace

struct Gemm::Impl {
  GemmOptions options;
  // fp32: CUBLAS_COMPUTE_32F_PEDANTIC first; if cuBLASLt offers no algorithm for it, plain
  // CUBLAS_COMPUTE_32F, which in cuBLASLt is also full fp32 (TF32 needs _FAST_TF32).
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cublasLtHandle_t lt = nullptr;
  DeviceBuffer workspace;
  // (out, in, x_stride, w_stride, y_stride, align x, align w, align y) → pinned algorithm.
  std::map<std::array<int64_t, 8>, cublasLtMatmulAlgo_t> pinned;

  ~Impl() {
    if (lt) Lt().Destroy(lt);
  }

  size_t elem() const { return options.variant == GemmVariant::kFp32Pedantic ? 4 : 2; }

  Status MakeDescs(int64_t rows, int64_t out, int64_t in, int64_t x_stride, int64_t w_stride, int64_t y_stride,
                   Descs* d) const {
    const bool fp32 = options.variant == GemmVariant::kFp32Pedantic;
    const cudaDataType_t in_type = fp32 ? CUDA_R_32F : CUDA_R_16BF;
    LS_CUBLAS_RETURN_IF_ERROR(Lt().MatmulDescCreate(&d->op, compute, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LS_CUBLAS_RETURN_IF_ERROR(Lt().MatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    LS_CUBLAS_RETURN_IF_ERROR(Lt().MatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    LS_CUBLAS_RETURN_IF_ERROR(Lt().MatrixLayoutCreate(&d->a, in_type, in, out, w_stride));
    LS_CUBLAS_RETURN_IF_ERROR(Lt().MatrixLayoutCreate(&d->b, in_type, in, rows, x_stride));
    LS_CUBLAS_RETURN_IF_ERROR(Lt().MatrixLayoutCreate(&d->c, CUDA_R_32F, out, rows, y_stride));
    return Status::Ok();
  }

  // The heuristic's first answer for these descriptors; `no_split_k` filters split-K out
  // (through the reduction-scheme mask, or, should the mask leave nothing, by forcing
  // SPLITK_NUM = 1 on the unfiltered answers).
  Result<cublasLtMatmulAlgo_t> Heuristic(const Descs& d, uint32_t align_a, uint32_t align_b, uint32_t align_c,
                                         bool no_split_k) const {
    Result<cublasLtMatmulAlgo_t> r = HeuristicOnce(d, align_a, align_b, align_c, no_split_k, /*mask=*/no_split_k);
    if (r.ok() || !no_split_k) return r;
    return HeuristicOnce(d, align_a, align_b, align_c, no_split_k, /*mask=*/false);
  }

  Result<cublasLtMatmulAlgo_t> HeuristicOnce(const Descs& d, uint32_t align_a, uint32_t align_b, uint32_t align_c,
                                             bool no_split_k, bool mask_split_k) const {
    Preference pr;
    LS_CUBLAS_RETURN_IF_ERROR(Lt().MatmulPreferenceCreate(&pr.pref));
    const uint64_t ws = workspace.size();
    LS_CUBLAS_RETURN_IF_ERROR(
        Lt().MatmulPreferenceSetAttribute(pr.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    LS_CUBLAS_RETURN_IF_ERROR(Lt().MatmulPreferenceSetAttribute(
        pr.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)));
    LS_CUBLAS_RETURN_IF_ERROR(Lt().MatmulPreferenceSetAttribute(
        pr.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)));
    LS_CUBLAS_RETURN_IF_ERROR(Lt().MatmulPreferenceSetAttribute(
        pr.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c)));
    LS_CUBLAS_RETURN_IF_ERROR(Lt().MatmulPreferenceSetAttribute(
        pr.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof(align_c)));
    if (mask_split_k) {
      const uint32_t mask = CUBLASLT_REDUCTION_SCHEME_NONE;
      LS_CUBLAS_RETURN_IF_ERROR(Lt().MatmulPreferenceSetAttribute(
          pr.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof(mask)));
    }
    constexpr int kAsk = 8;
    cublasLtMatmulHeuristicResult_t results[kAsk] = {};
    int n = 0;
    LS_CUBLAS_RETURN_IF_ERROR(
        Lt().MatmulAlgoGetHeuristic(lt, d.op, d.a, d.b, d.c, d.c, pr.pref, kAsk, results, &n));
    for (int i = 0; i < n; ++i) {
      if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
      cublasLtMatmulAlgo_t algo = results[i].algo;
      if (no_split_k) {
        // Belt and braces: whatever the filter did, run this algorithm without split-K.
        int32_t split = 0;
        size_t written = 0;
        LS_CUBLAS_RETURN_IF_ERROR(Lt().MatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split,
                                                                       sizeof(split), &written));
        if (split > 1) {
          const int32_t one = 1;
          const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
          if (Lt().MatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof(one)) !=
                  CUBLAS_STATUS_SUCCESS ||
              Lt().MatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &none,
                                                   sizeof(none)) != CUBLAS_STATUS_SUCCESS) {
            continue;
          }
          cublasLtMatmulHeuristicResult_t check{};
          if (Lt().MatmulAlgoCheck(lt, d.op, d.a, d.b, d.c, d.c, &algo, &check) != CUBLAS_STATUS_SUCCESS) continue;
        }
      }
      return algo;
    }
    return Status::Unsupported("Gemm: cuBLASLt's heuristic offered no usable algorithm (" + std::to_string(n) +
                               " candidates" + (no_split_k ? ", split-K excluded)" : ")"));
  }

  Result<cublasLtMatmulAlgo_t> Algorithm(const GemmParams& p, const Descs& d) {
    const uint32_t ax = Alignment(p.x, p.x_stride, elem()), aw = Alignment(p.w, p.w_stride, elem()),
                   ay = Alignment(p.y, p.y_stride, 4);
    if (!options.pin_algorithm) return Heuristic(d, aw, ax, ay, /*no_split_k=*/false);
    const std::array<int64_t, 8> key{p.out, p.in, p.x_stride, p.w_stride, p.y_stride, ax, aw, ay};
    auto it = pinned.find(key);
    if (it == pinned.end()) {
      Descs ref;
      LS_RETURN_IF_ERROR(MakeDescs(kGemmPinRows, p.out, p.in, p.x_stride, p.w_stride, p.y_stride, &ref));
      Result<cublasLtMatmulAlgo_t> algo = Heuristic(ref, aw, ax, ay, /*no_split_k=*/true);
      if (!algo.ok()) return algo.status();
      it = pinned.emplace(key, *algo).first;
    }
    cublasLtMatmulHeuristicResult_t check{};
    const cublasStatus_t st = Lt().MatmulAlgoCheck(lt, d.op, d.a, d.b, d.c, d.c, &it->second, &check);
    if (st != CUBLAS_STATUS_SUCCESS) {
      return Status::Unsupported("Gemm: the algorithm pinned for out=" + std::to_string(p.out) +
                                 " in=" + std::to_string(p.in) + " does not accept rows=" + std::to_string(p.rows) +
                                 " (cublasLtMatmulAlgoCheck: " + Lt().GetStatusName(st) + ")");
    }
    if (check.workspaceSize > workspace.size()) {
      return Status::Internal("Gemm: pinned algorithm needs " + std::to_string(check.workspaceSize) +
                              " bytes of workspace, have " + std::to_string(workspace.size()));
    }
    return it->second;
  }

  // Descriptors and algorithm for p, with the fp32 variant's fallback from PEDANTIC.
  Result<cublasLtMatmulAlgo_t> Prepare(const GemmParams& p, Descs* d) {
    LS_RETURN_IF_ERROR(MakeDescs(p.rows, p.out, p.in, p.x_stride, p.w_stride, p.y_stride, d));
    Result<cublasLtMatmulAlgo_t> algo = Algorithm(p, *d);
    if (algo.ok() || compute != CUBLAS_COMPUTE_32F_PEDANTIC) return algo;
    compute = CUBLAS_COMPUTE_32F;
    pinned.clear();
    d->Reset();
    LS_RETURN_IF_ERROR(MakeDescs(p.rows, p.out, p.in, p.x_stride, p.w_stride, p.y_stride, d));
    Result<cublasLtMatmulAlgo_t> retry = Algorithm(p, *d);
    if (!retry.ok()) return retry.status().WithContext("(after " + algo.status().message() + ") ");
    return retry;
  }
};

Gemm::Gemm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Gemm::~Gemm() = default;

Result<std::unique_ptr<Gemm>> Gemm::Create(const GemmOptions& options) {
  if (options.variant != GemmVariant::kFp32Pedantic && options.variant != GemmVariant::kBf16) {
    return Status::InvalidArgument("Gemm: variant " + std::to_string(static_cast<int>(options.variant)) +
                                   " is not kFp32Pedantic or kBf16");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->compute = options.variant == GemmVariant::kFp32Pedantic ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
  Result<const CublasLtApi*> api = LoadCublasLt();
  if (!api.ok()) return api.status().WithContext("Gemm: ");
  LS_CUBLAS_RETURN_IF_ERROR(Lt().Create(&impl->lt));
  Result<DeviceBuffer> ws = DeviceBuffer::Allocate(options.workspace_bytes);
  if (!ws.ok()) return ws.status().WithContext("Gemm: workspace: ");
  impl->workspace = std::move(ws).value();
  return std::unique_ptr<Gemm>(new Gemm(std::move(impl)));
}

Status Gemm::Run(const GemmParams& p, Stream stream) {
  constexpr const char* op = "Gemm::Run";
  LS_CHECK_ARG(p.rows >= 0 && p.rows < (int64_t{1} << 31), op, "rows", p.rows);
  LS_CHECK_ARG(p.out > 0 && p.out < (int64_t{1} << 31), op, "out", p.out);
  LS_CHECK_ARG(p.in > 0 && p.in < (int64_t{1} << 31), op, "in", p.in);
  LS_CHECK_ARG(p.x != nullptr, op, "x", p.x);
  LS_CHECK_ARG(p.w != nullptr, op, "w", p.w);
  LS_CHECK_ARG(p.y != nullptr, op, "y", p.y);
  LS_CHECK_ARG(p.x_stride >= p.in, op, "x_stride", p.x_stride);
  LS_CHECK_ARG(p.w_stride >= p.in, op, "w_stride", p.w_stride);
  LS_CHECK_ARG(p.y_stride >= p.out, op, "y_stride", p.y_stride);
  const int64_t e = static_cast<int64_t>(impl_->elem());
  LS_CHECK_ARG(reinterpret_cast<uintptr_t>(p.x) % e == 0, op, "x (element-aligned)", p.x);
  LS_CHECK_ARG(reinterpret_cast<uintptr_t>(p.w) % e == 0, op, "w (element-aligned)", p.w);
  LS_CHECK_ARG(reinterpret_cast<uintptr_t>(p.y) % 4 == 0, op, "y (4-byte aligned)", p.y);
  if (p.rows == 0) return Status::Ok();
  Descs d;
  Result<cublasLtMatmulAlgo_t> algo = impl_->Prepare(p, &d);
  if (!algo.ok()) return algo.status();
  const float alpha = 1.0f, beta = 0.0f;
  LS_CUBLAS_RETURN_IF_ERROR(Lt().Matmul(impl_->lt, d.op, &alpha, p.w, d.a, p.x, d.b, &beta, p.y, d.c, p.y, d.c,
                                           &algo.value(), impl_->workspace.data(), impl_->workspace.size(), stream));
  return Status::Ok();
}

Result<std::string> Gemm::Describe(int64_t rows, int64_t out, int64_t in) {
  // Describes the algorithm for contiguous, 256-byte-aligned operands.
  GemmParams p;
  p.rows = rows;
  p.out = out;
  p.in = in;
  p.x_stride = p.w_stride = in;
  p.y_stride = out;
  p.x = p.w = p.y = reinterpret_cast<float*>(uintptr_t{256});
  Descs d;
  Result<cublasLtMatmulAlgo_t> algo = impl_->Prepare(p, &d);
  if (!algo.ok()) return algo.status();
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t a) {
    uint32_t v = 0;  // every attribute read here is 32-bit (int32 or uint32)
    size_t written = 0;
    Lt().MatmulAlgoConfigGetAttribute(&algo.value(), a, &v, sizeof(v), &written);
    return std::to_string(v);
  };
  return std::string("algo ") + get(CUBLASLT_ALGO_CONFIG_ID) + " tile " + get(CUBLASLT_ALGO_CONFIG_TILE_ID) +
         " stages " + get(CUBLASLT_ALGO_CONFIG_STAGES_ID) + " splitK " + get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM) +
         " reduction " + get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME) + " swizzle " +
         get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING) + " custom " + get(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION) +
         (impl_->compute == CUBLAS_COMPUTE_32F_PEDANTIC ? " compute 32F_PEDANTIC" : " compute 32F") +
         (impl_->options.pin_algorithm ? " (pinned)" : " (heuristic)");
}

}  // namespace lockstep::kernels::cuda
