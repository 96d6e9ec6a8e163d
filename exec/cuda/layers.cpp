// Linear and causal-attention layers from cuBLASLt GEMMs and kernels (exec/cuda/layers.hpp).
#include "exec/cuda/layers.hpp"

#include <algorithm>
#include <cmath>

#include "exec/cuda/kernels.cuh"

namespace pw::exec::cuda {

using std::int64_t;

void linear_forward(Gemm& gemm, bf16* out, const bf16* inp, const bf16* weight, const bf16* bias,
                    const bf16* residual, int N, int C, int OC) {
  // out (N, OC) = inp (N, C) · weight^T (C, OC) + bias + residual
  gemm.matmul({.m = N,
               .n = OC,
               .k = C,
               .a = inp,
               .lda = C,
               .b = weight,
               .ldb = C,
               .trans_b = true,
               .d = out,
               .ldd = OC,
               .c = residual,
               .ldc = OC,
               .beta = residual ? 1.0f : 0.0f,
               .bias = bias});
}

void linear_backward(Gemm& gemm, bf16* dinp, bf16* dweight, bf16* dbias, const bf16* dout,
                     const bf16* inp, const bf16* weight, int N, int C, int OC) {
  // dinp (N, C) = dout (N, OC) · weight (OC, C)
  gemm.matmul(
      {.m = N, .n = C, .k = OC, .a = dout, .lda = OC, .b = weight, .ldb = C, .d = dinp, .ldd = C});
  // dweight (OC, C) += dout^T (OC, N) · inp (N, C)
  gemm.matmul({.m = OC,
               .n = C,
               .k = N,
               .a = dout,
               .lda = OC,
               .trans_a = true,
               .b = inp,
               .ldb = C,
               .d = dweight,
               .ldd = C,
               .beta = 1.0f});
  if (dbias) bias_backward(dbias, dout, N, OC, gemm.stream());
}

// Batches run over samples for one head: a sample's (T, hd) slices of q, k, v, y lie T rows apart
// and never interleave, while one sample's heads would share rows.
void attention_probabilities(Gemm& gemm, bf16* att, const bf16* qkv, int B, int T, int C, int NH) {
  const int64_t hd = C / NH, C3 = 3 * int64_t(C), TT = int64_t(T) * T;
  const float scale = 1.0f / std::sqrt(float(hd));
  for (int64_t h = 0; h < NH; ++h) {
    const bf16* q = qkv + h * hd;
    // S (T, T) = q (T, hd) · k^T (hd, T) * scale
    gemm.matmul({.m = T,
                 .n = T,
                 .k = hd,
                 .batch = B,
                 .a = q,
                 .lda = C3,
                 .stride_a = T * C3,
                 .b = q + C,
                 .ldb = C3,
                 .trans_b = true,
                 .stride_b = T * C3,
                 .d = att + h * TT,
                 .ldd = T,
                 .stride_d = NH * TT,
                 .alpha = scale});
  }
  causal_softmax_forward(att, int64_t(B) * NH * T, T, gemm.stream());
}

void attention_forward(Gemm& gemm, bf16* out, bf16* att, const bf16* qkv, int B, int T, int C,
                       int NH) {
  const int64_t hd = C / NH, C3 = 3 * int64_t(C), TT = int64_t(T) * T;
  attention_probabilities(gemm, att, qkv, B, T, C, NH);
  for (int64_t h = 0; h < NH; ++h) {
    // y (T, hd) = P (T, T) · v (T, hd)
    gemm.matmul({.m = T,
                 .n = hd,
                 .k = T,
                 .batch = B,
                 .a = att + h * TT,
                 .lda = T,
                 .stride_a = NH * TT,
                 .b = qkv + 2 * C + h * hd,
                 .ldb = C3,
                 .stride_b = T * C3,
                 .d = out + h * hd,
                 .ldd = C,
                 .stride_d = int64_t(T) * C});
  }
}

namespace {

// Query rows [r0, r0 + n) of g samples of one head (q, dy, dq: the head's columns in the samples'
// first rows; k, v and dk beside q and dq): dP = dy v^T in fp32, dS = the softmax backward of P's
// rows (matrix i at p + i p_stride, its first stored row query p_row0), dq = dS k * scale and
// dk += dS^T q * scale (written by the block at r0 = 0). dp and ds hold (g, n, T) each.
void scores_backward(Gemm& gemm, float* dp, bf16* ds, const bf16* p, int64_t p_stride, int p_row0,
                     const bf16* q, const bf16* dy, bf16* dq, int g, int n, int r0, int T,
                     int64_t hd, int C, float scale) {
  const int64_t C3 = 3 * int64_t(C), chunk = int64_t(n) * T;
  // dP (n, T) = dy[r0 : r0 + n] (n, hd) · v^T (hd, T), in fp32
  gemm.matmul({.m = n,
               .n = T,
               .k = hd,
               .batch = g,
               .a = dy + int64_t(r0) * C,
               .lda = C,
               .stride_a = int64_t(T) * C,
               .b = q + 2 * C,
               .ldb = C3,
               .trans_b = true,
               .stride_b = T * C3,
               .d = dp,
               .ldd = T,
               .stride_d = chunk,
               .d_fp32 = true});
  attention_softmax_backward(ds, dp, p, p_stride, g, n, r0, T, gemm.stream(), p_row0);
  // dq[r0 : r0 + n] (n, hd) = dS (n, T) · k (T, hd) * scale
  gemm.matmul({.m = n,
               .n = hd,
               .k = T,
               .batch = g,
               .a = ds,
               .lda = T,
               .stride_a = chunk,
               .b = q + C,
               .ldb = C3,
               .stride_b = T * C3,
               .d = dq + r0 * C3,
               .ldd = C3,
               .stride_d = T * C3,
               .alpha = scale});
  // dk (T, hd) += dS^T (T, n) · q[r0 : r0 + n] (n, hd) * scale
  gemm.matmul({.m = T,
               .n = hd,
               .k = n,
               .batch = g,
               .a = ds,
               .lda = T,
               .trans_a = true,
               .stride_a = chunk,
               .b = q + r0 * C3,
               .ldb = C3,
               .stride_b = T * C3,
               .d = dq + C,
               .ldd = C3,
               .stride_d = T * C3,
               .alpha = scale,
               .beta = r0 == 0 ? 0.0f : 1.0f});
}

}  // namespace

// dv = P^T dy; dP = dy v^T; dS = P * (dP - rowsum(P * dP)); dq = dS k / sqrt(hd);
// dk = dS^T q / sqrt(hd), as exec/cpu.
void attention_backward(Gemm& gemm, bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* att,
                        Carver scratch, int B, int T, int C, int NH) {
  const int64_t hd = C / NH, C3 = 3 * int64_t(C), TT = int64_t(T) * T;
  const float scale = 1.0f / std::sqrt(float(hd));
  const int64_t row_bytes = int64_t(T) * (sizeof(float) + sizeof(bf16));
  const int64_t avail = scratch.left() - 16;  // the second piece may need 16 bytes of alignment
  int group = 1, rows = T;
  if (avail >= row_bytes * T)
    group = int(std::min<int64_t>(B, avail / (row_bytes * T)));
  else
    rows = int(std::max<int64_t>(0, avail / row_bytes));
  if (rows < 1)
    throw Error("cuda attention backward: workspace too small for one row of scores (" +
                std::to_string(row_bytes) + " bytes)");
  float* dp = scratch.take<float>(int64_t(group) * rows * T);  // (group, rows, T)
  bf16* ds = scratch.take<bf16>(int64_t(group) * rows * T);    // (group, rows, T)
  for (int64_t h = 0; h < NH; ++h) {
    // dv (T, hd) = P^T (T, T) · dy (T, hd), every sample at once
    gemm.matmul({.m = T,
                 .n = hd,
                 .k = T,
                 .batch = B,
                 .a = att + h * TT,
                 .lda = T,
                 .trans_a = true,
                 .stride_a = NH * TT,
                 .b = dout + h * hd,
                 .ldb = C,
                 .stride_b = int64_t(T) * C,
                 .d = dqkv + 2 * C + h * hd,
                 .ldd = C3,
                 .stride_d = T * C3});
    for (int b0 = 0; b0 < B; b0 += group) {
      const int g = std::min(group, B - b0);
      const bf16* p = att + (int64_t(b0) * NH + h) * TT;
      for (int r0 = 0; r0 < T; r0 += rows)
        scores_backward(gemm, dp, ds, p, NH * TT, 0, qkv + b0 * T * C3 + h * hd,
                        dout + int64_t(b0) * T * C + h * hd, dqkv + b0 * T * C3 + h * hd, g,
                        std::min(rows, T - r0), r0, T, hd, C, scale);
    }
  }
}

namespace {

// Selective recompute's probabilities of head h for query rows [r0, r0 + n) of every sample:
// P (B, n, T) = causal softmax of q[r0 : r0 + n] k^T / sqrt(hd). The forward and the backward both
// make a block with this call (the same shapes, so the same GEMM algorithm).
void probabilities_block(Gemm& gemm, bf16* P, const bf16* qkv, int B, int T, int C, int NH,
                         int64_t h, int r0, int n) {
  const int64_t hd = C / NH, C3 = 3 * int64_t(C);
  const bf16* q = qkv + h * hd;
  gemm.matmul({.m = n,
               .n = T,
               .k = hd,
               .batch = B,
               .a = q + int64_t(r0) * C3,
               .lda = C3,
               .stride_a = T * C3,
               .b = q + C,
               .ldb = C3,
               .trans_b = true,
               .stride_b = T * C3,
               .d = P,
               .ldd = T,
               .stride_d = int64_t(n) * T,
               .alpha = 1.0f / std::sqrt(float(hd))});
  causal_softmax_rows(P, B, n, r0, T, gemm.stream());
}

}  // namespace

void attention_forward_selective(Gemm& gemm, bf16* out, const bf16* qkv, Carver scratch, int B,
                                 int T, int C, int NH) {
  const int64_t hd = C / NH, C3 = 3 * int64_t(C);
  const int rows = std::min(T, kSelectiveRows);
  bf16* P = scratch.take<bf16>(int64_t(B) * rows * T);
  for (int64_t h = 0; h < NH; ++h)
    for (int r0 = 0; r0 < T; r0 += rows) {
      const int n = std::min(rows, T - r0);
      probabilities_block(gemm, P, qkv, B, T, C, NH, h, r0, n);
      // y[r0 : r0 + n] (n, hd) = P (n, T) · v (T, hd)
      gemm.matmul({.m = n,
                   .n = hd,
                   .k = T,
                   .batch = B,
                   .a = P,
                   .lda = T,
                   .stride_a = int64_t(n) * T,
                   .b = qkv + 2 * C + h * hd,
                   .ldb = C3,
                   .stride_b = T * C3,
                   .d = out + int64_t(r0) * C + h * hd,
                   .ldd = C,
                   .stride_d = int64_t(T) * C});
    }
}

// As attention_backward, block by block of query rows: dv and dk accumulate over the blocks.
void attention_backward_selective(Gemm& gemm, bf16* dqkv, const bf16* dout, const bf16* qkv,
                                  Carver scratch, int B, int T, int C, int NH) {
  const int64_t hd = C / NH, C3 = 3 * int64_t(C);
  const float scale = 1.0f / std::sqrt(float(hd));
  const int rows = std::min(T, kSelectiveRows);
  const int64_t block = int64_t(B) * rows * T;
  bf16* P = scratch.take<bf16>(block);
  float* dp = scratch.take<float>(block);
  bf16* ds = scratch.take<bf16>(block);
  for (int64_t h = 0; h < NH; ++h)
    for (int r0 = 0; r0 < T; r0 += rows) {
      const int n = std::min(rows, T - r0);
      const int64_t chunk = int64_t(n) * T;
      probabilities_block(gemm, P, qkv, B, T, C, NH, h, r0, n);
      // dv (T, hd) += P^T (T, n) · dy[r0 : r0 + n] (n, hd), written by the block at r0 = 0
      gemm.matmul({.m = T,
                   .n = hd,
                   .k = n,
                   .batch = B,
                   .a = P,
                   .lda = T,
                   .trans_a = true,
                   .stride_a = chunk,
                   .b = dout + int64_t(r0) * C + h * hd,
                   .ldb = C,
                   .stride_b = int64_t(T) * C,
                   .d = dqkv + 2 * C + h * hd,
                   .ldd = C3,
                   .stride_d = T * C3,
                   .beta = r0 == 0 ? 0.0f : 1.0f});
      scores_backward(gemm, dp, ds, P, chunk, r0, qkv + h * hd, dout + h * hd, dqkv + h * hd, B, n,
                      r0, T, hd, C, scale);
    }
}

}  // namespace pw::exec::cuda
