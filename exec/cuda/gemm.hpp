// cuBLASLt matmuls for row-major bf16 operands with fp32 accumulation, bf16 or fp32 output,
// optional accumulate (beta) and bias epilogue; the workspace is a block of the device arena.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>

#include "exec/cuda/device.hpp"
#include "exec/gpu_host.hpp"

namespace pw::exec::cuda {

// d (m, n) = alpha * op(a) (m, k) · op(b) (k, n) + beta * c, all row-major, `batch` times with
// element strides between the batch items. a is stored (m, k), or (k, m) with trans_a; b is
// stored (k, n), or (n, k) with trans_b (a PyTorch nn.Linear weight). c defaults to d (in-place
// accumulate) and must have d's type. bias (n) is added to every row (bf16 output only).
// Leading dimensions are in elements and at least the stored row length.
struct MatmulArgs {
  std::int64_t m = 0, n = 0, k = 0;
  int batch = 1;
  const bf16* a = nullptr;
  std::int64_t lda = 0;
  bool trans_a = false;
  std::int64_t stride_a = 0;
  const bf16* b = nullptr;
  std::int64_t ldb = 0;
  bool trans_b = false;
  std::int64_t stride_b = 0;
  void* d = nullptr;
  std::int64_t ldd = 0;
  std::int64_t stride_d = 0;
  bool d_fp32 = false;
  const void* c = nullptr;  // null: c = d
  std::int64_t ldc = 0;     // 0: ldd
  float alpha = 1.0f, beta = 0.0f;
  const bf16* bias = nullptr;
};

// One cuBLASLt handle bound to a stream and a workspace. Algorithms come from cuBLASLt's
// heuristic once per shape (and operand alignment) and are cached. Not thread-safe: one per
// stream.
class Gemm {
 public:
  static constexpr std::int64_t kDefaultWorkspaceBytes = kCudaGemmWorkspaceBytes;
  Gemm(cudaStream_t stream, void* workspace, std::int64_t workspace_bytes);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  void matmul(const MatmulArgs& g);
  cudaStream_t stream() const { return stream_; }

 private:
  using Key = std::array<std::int64_t, 22>;
  struct Cached {
    bool found = false;
    cublasLtMatmulAlgo_t algo{};
  };
  bool run(const MatmulArgs& g, bool with_bias);

  cublasLtHandle_t handle_ = nullptr;
  cudaStream_t stream_;
  void* workspace_;
  std::int64_t workspace_bytes_;
  std::map<Key, Cached> algos_;
};

}  // namespace pw::exec::cuda
