// cuBLASLt matmuls on row-major bf16 operands (exec/cuda/gemm.hpp).
#include "exec/cuda/gemm.hpp"

#include <cstdint>
#include <string>

#include <fmt/format.h>

#include "exec/cuda/kernels.cuh"

namespace pw::exec::cuda {

namespace {

// The largest power of two (at most 256) dividing the address, and with batches the stride in
// bytes too (batch k starts at p + k * stride): cuBLASLt's heuristic assumes 256 unless told, and
// an algorithm that needs more alignment than an operand has would fault.
std::uint32_t alignment(const void* p, std::int64_t stride_bytes = 0) {
  const auto a = reinterpret_cast<std::uintptr_t>(p) | std::uintptr_t(stride_bytes);
  std::uint32_t r = 256;
  while (r > 1 && a % r != 0)
    r /= 2;
  return r;
}

// How many of cuBLASLt's ranked algorithms to look at.
constexpr int kCandidates = 8;

// True unless the algorithm splits K and adds the parts in the output type (bf16): its "in place"
// and "output type" reductions would round partial sums, breaking fp32 accumulation.
bool fp32_partials(const cublasLtMatmulAlgo_t& algo) {
  std::int32_t splits = 1;
  std::uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
  std::size_t written = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits,
                                                    sizeof(splits), &written));
  CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                                                    &scheme, sizeof(scheme), &written));
  return splits <= 1 || scheme == CUBLASLT_REDUCTION_SCHEME_NONE ||
         scheme == CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
}

struct Desc {
  cublasLtMatmulDesc_t d = nullptr;
  Desc() { CUBLAS_CHECK(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F)); }
  ~Desc() { cublasLtMatmulDescDestroy(d); }
  template <class T>
  void set(cublasLtMatmulDescAttributes_t attr, const T& v) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof(v)));
  }
};

struct Layout {
  cublasLtMatrixLayout_t l = nullptr;
  Layout(cudaDataType type, std::int64_t rows, std::int64_t cols, std::int64_t ld, int batch,
         std::int64_t stride) {
    CUBLAS_CHECK(
        cublasLtMatrixLayoutCreate(&l, type, std::uint64_t(rows), std::uint64_t(cols), ld));
    if (batch > 1) {
      const std::int32_t count = batch;
      CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                    sizeof(count)));
      CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                    &stride, sizeof(stride)));
    }
  }
  ~Layout() { cublasLtMatrixLayoutDestroy(l); }
};

struct Preference {
  cublasLtMatmulPreference_t p = nullptr;
  Preference() { CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&p)); }
  ~Preference() { cublasLtMatmulPreferenceDestroy(p); }
  template <class T>
  void set(cublasLtMatmulPreferenceAttributes_t attr, const T& v) {
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p, attr, &v, sizeof(v)));
  }
};

std::string describe(const MatmulArgs& g) {
  return fmt::format("m={} n={} k={} batch={} lda={}{} ldb={}{} ldd={} out={} beta={} bias={}", g.m,
                     g.n, g.k, g.batch, g.lda, g.trans_a ? " (T)" : "", g.ldb,
                     g.trans_b ? " (T)" : "", g.ldd, g.d_fp32 ? "fp32" : "bf16", g.beta,
                     g.bias ? "yes" : "no");
}

}  // namespace

Gemm::Gemm(cudaStream_t stream, void* workspace, std::int64_t workspace_bytes)
    : stream_(stream), workspace_(workspace), workspace_bytes_(workspace_bytes) {
  CUBLAS_CHECK(cublasLtCreate(&handle_));
}

Gemm::~Gemm() {
  if (handle_) cublasLtDestroy(handle_);
}

void Gemm::matmul(const MatmulArgs& g) {
  if (g.m <= 0 || g.n <= 0 || g.k <= 0 || g.batch <= 0 || !g.a || !g.b || !g.d)
    throw Error("cuda matmul: empty shape or null operand: " + describe(g));
  if (g.bias && g.d_fp32) throw Error("cuda matmul: a bias needs bf16 output: " + describe(g));
  if (run(g, g.bias != nullptr)) return;
  // No algorithm with the bias epilogue for this shape: plain GEMM, then a bias kernel.
  if (g.bias && g.batch == 1 && run(g, false)) {
    add_bias(static_cast<bf16*>(g.d), g.bias, g.m, g.n, g.ldd, stream_);
    return;
  }
  throw Error("cuda matmul: cuBLASLt has no algorithm for " + describe(g));
}

// Row-major d = op(a) op(b) is column-major d^T = op(b)^T op(a)^T: cuBLASLt's "A" is our b and
// its "B" our a, each already transposed by reading row-major memory as column-major.
bool Gemm::run(const MatmulArgs& g, bool with_bias) {
  const void* c = g.c ? g.c : g.d;
  const std::int64_t ldc = g.ldc ? g.ldc : g.ldd;
  const cudaDataType out_type = g.d_fp32 ? CUDA_R_32F : CUDA_R_16BF;

  Desc desc;
  const cublasOperation_t op_a = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, op_a);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, op_b);
  if (with_bias) {
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(g.bias));
    desc.set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, std::int32_t(CUDA_R_16BF));
  }
  // Column-major shapes: "A" (n x k) from b, "B" (k x m) from a, C and D (n x m).
  Layout la(CUDA_R_16BF, g.trans_b ? g.k : g.n, g.trans_b ? g.n : g.k, g.ldb, g.batch, g.stride_b);
  Layout lb(CUDA_R_16BF, g.trans_a ? g.m : g.k, g.trans_a ? g.k : g.m, g.lda, g.batch, g.stride_a);
  Layout lc(out_type, g.n, g.m, ldc, g.batch, g.stride_d);
  Layout ld(out_type, g.n, g.m, g.ldd, g.batch, g.stride_d);

  const std::int64_t out_bytes = g.d_fp32 ? 4 : 2, batched = g.batch > 1 ? 1 : 0;
  const std::uint32_t align_a = alignment(g.a, batched * g.stride_a * 2);
  const std::uint32_t align_b = alignment(g.b, batched * g.stride_b * 2);
  const std::uint32_t align_c = alignment(c, batched * g.stride_d * out_bytes);
  const std::uint32_t align_d = alignment(g.d, batched * g.stride_d * out_bytes);
  const std::uint32_t align_bias = with_bias ? alignment(g.bias) : 0;
  const Key key = {g.m,        g.n,        g.k,        g.batch,
                   g.lda,      g.ldb,      g.ldd,      ldc,
                   g.stride_a, g.stride_b, g.stride_d, g.trans_a,
                   g.trans_b,  g.d_fp32,   with_bias,  g.c != nullptr,
                   align_a,    align_b,    align_c,    align_d,
                   align_bias, 0};
  auto it = algos_.find(key);
  if (it == algos_.end()) {
    Preference pref;
    pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, std::uint64_t(workspace_bytes_));
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_b);  // cuBLASLt's A is our b
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_a);
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c);
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d);
    cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
    int found = 0;
    const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(handle_, desc.d, la.l, lb.l, lc.l, ld.l,
                                                            pref.p, kCandidates, results, &found);
    if (s != CUBLAS_STATUS_SUCCESS && s != CUBLAS_STATUS_NOT_SUPPORTED)
      throw_cublas_error(__FILE__, __LINE__, "cublasLtMatmulAlgoGetHeuristic", s);
    // The fastest with fp32 partial sums, else the fastest.
    int any = -1, best = -1;
    for (int r = 0; s == CUBLAS_STATUS_SUCCESS && r < found && best < 0; ++r) {
      if (results[r].state != CUBLAS_STATUS_SUCCESS) continue;
      if (any < 0) any = r;
      if (fp32_partials(results[r].algo)) best = r;
    }
    const int pick = best >= 0 ? best : any;
    Cached entry;
    if (pick >= 0) {
      entry.found = true;
      entry.algo = results[pick].algo;
    }
    it = algos_.emplace(key, entry).first;
  }
  if (!it->second.found) return false;
  CUBLAS_CHECK(cublasLtMatmul(handle_, desc.d, &g.alpha, g.b, la.l, g.a, lb.l, &g.beta, c, lc.l,
                              g.d, ld.l, &it->second.algo, workspace_,
                              std::size_t(workspace_bytes_), stream_));
  return true;
}

}  // namespace pw::exec::cuda
