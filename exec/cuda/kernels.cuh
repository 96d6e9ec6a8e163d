// bf16 CUDA kernels of a GPT-2 block with fp32 arithmetic, mirroring exec/cpu/kernels.hpp; host
// launchers only, so plain C++ files can call them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>

#include "exec/cuda/device.hpp"

namespace pw::exec::cuda {

// Shapes: B samples, T tokens, C channels, OC output channels, NH heads, V vocabulary, N rows.
// Activations, weights and gradients are bf16; every sum is fp32; LayerNorm statistics and losses
// are fp32, ids int32. Backward kernels ADD into parameter gradients (bf16, read-add-write in
// fp32). Everything is enqueued on `stream`; nothing synchronises. Ids outside [0, V) cannot throw
// on the device: they give zero rows (zero loss) and are counted into `*bad_ids` (if not null).

// out = wte[tokens] + wpe[t].
void embedding_forward(bf16* out,                   // (B, T, C)
                       const std::int32_t* tokens,  // (B, T)
                       const bf16* wte,             // (V, C)
                       const bf16* wpe,             // (maxT, C)
                       int B, int T, int C, int V, int* bad_ids, cudaStream_t stream);
// Vocabulary-parallel (Megatron): wte holds rows [v_begin, v_begin + rows) of the table; out = that
// row of each id, zeros for ids outside it (the TP group's sum has every row; add_positions after).
// Ids outside [0, V) are counted as above.
void embedding_forward_vp(bf16* out, const std::int32_t* tokens, const bf16* wte, int v_begin,
                          int rows, int B, int T, int C, int V, int* bad_ids, cudaStream_t stream);
// Rows i of out (N, C) are tokens first + i of the microbatch (SP: a TP rank's rows): out[i] +=
// wpe[(first + i) % T].
void add_positions(bf16* out, const bf16* wpe, std::int64_t N, std::int64_t first, int T, int C,
                   cudaStream_t stream);
// dwte[tokens] += dout; dwpe[t] += dout. Each id's rows are summed in fp32 in position order by the
// block of its first position: deterministic, no atomics.
void embedding_backward(bf16* dwte, bf16* dwpe, const bf16* dout, const std::int32_t* tokens, int B,
                        int T, int C, int V, cudaStream_t stream);

// The same over wte's rows [v_begin, v_begin + rows): other ids add to dwpe only.
void embedding_backward_vp(bf16* dwte, bf16* dwpe, const bf16* dout, const std::int32_t* tokens,
                           int B, int T, int C, int v_begin, int rows, cudaStream_t stream);
// out = (inp - mean) * rstd * weight + bias per row; keeps mean and rstd (fp32) for the backward.
void layernorm_forward(bf16* out, float* mean, float* rstd,  // (N, C), (N), (N)
                       const bf16* inp, const bf16* weight, const bf16* bias, int N, int C,
                       cudaStream_t stream);
// dinp = (accumulate ? dinp : 0) + d(inp); dweight, dbias += their gradients. In place (dinp ==
// dout, accumulate false) is allowed, as on the CPU.
void layernorm_backward(bf16* dinp, bf16* dweight, bf16* dbias, const bf16* dout, const bf16* inp,
                        const bf16* weight, const float* mean, const float* rstd, int N, int C,
                        bool accumulate, cudaStream_t stream);

// GELU, tanh approximation (GPT-2), as exec/cpu.
void gelu_forward(bf16* out, const bf16* inp, std::int64_t n, cudaStream_t stream);
// dinp = gelu'(inp) * dout (dinp may alias dout).
void gelu_backward(bf16* dinp, const bf16* inp, const bf16* dout, std::int64_t n,
                   cudaStream_t stream);

// Row r of att (rows, T) holds the scaled scores of query t = r % T: softmax over j <= t in place,
// zeros for j > t.
void causal_softmax_forward(bf16* att, std::int64_t rows, int T, cudaStream_t stream);
// The same for query rows r0 .. r0 + n of G matrices stored as (G, n, T): row i of matrix g holds
// query r0 + i's scaled scores (selective recompute's blocks).
void causal_softmax_rows(bf16* att, int G, int n, int r0, int T, cudaStream_t stream);
// For query rows r0 .. r0+n of G probability matrices p + g * p_stride whose first stored row is
// query p_row0 ((T, T) matrices: 0; selective recompute's (n, T) blocks: r0):
// ds = p * (dp - rowsum(p * dp)), the softmax backward, with zeros above the diagonal.
void attention_softmax_backward(bf16* ds,         // (G, n, T)
                                const float* dp,  // (G, n, T)
                                const bf16* p, std::int64_t p_stride, int G, int n, int r0, int T,
                                cudaStream_t stream, int p_row0 = 0);

// Softmax over V in place (logits become probabilities) and losses = -log p[target].
void crossentropy_forward(bf16* probs,                  // (N, V): logits in, probabilities out
                          float* losses,                // (N)
                          const std::int32_t* targets,  // (N)
                          int N, int V, int* bad_ids, cudaStream_t stream);
// dlogits = (probs - onehot(target)) * scale.
void crossentropy_backward(bf16* dlogits,      // (N, V)
                           const bf16* probs,  // (N, V)
                           const std::int32_t* targets, float scale, int N, int V,
                           cudaStream_t stream);
// Vocabulary-parallel cross-entropy (Megatron) over this rank's logits (N, Vt), vocabulary rows
// v_begin + j, of which the first `valid` columns are real (the rest padding, probability 0):
// the row maxima, the sums of exponentials and the target logits summed over the TP group by
// `tp_sum` (fp32, enqueued on `stream`), then logits become probabilities in place and losses =
// -log p[target]. scratch: N (t + 2) floats of device memory.
void crossentropy_forward_vp(bf16* probs, float* losses, const std::int32_t* targets, int N, int Vt,
                             int valid, int t, int tp, int v_begin, int V, float* scratch,
                             const std::function<void(float*, std::int64_t)>& tp_sum, int* bad_ids,
                             cudaStream_t stream);
// dlogits = (probs - onehot(target - v_begin)) * scale over this rank's columns.
void crossentropy_backward_vp(bf16* dlogits, const bf16* probs, const std::int32_t* targets,
                              float scale, int N, int Vt, int v_begin, cudaStream_t stream);
// *out = mean of losses (N), summed in double in a fixed order.
void mean_loss(float* out, const float* losses, int N, cudaStream_t stream);

// dbias (OC) += column sums of dout (N, OC).
void bias_backward(bf16* dbias, const bf16* dout, int N, int OC, cudaStream_t stream);
// out (N, OC) with leading dimension ld += bias (OC) on every row.
void add_bias(bf16* out, const bf16* bias, std::int64_t N, std::int64_t OC, std::int64_t ld,
              cudaStream_t stream);
// out = a + b (out may alias a or b).
void residual_add(bf16* out, const bf16* a, const bf16* b, std::int64_t n, cudaStream_t stream);

void cast_to_bf16(bf16* out, const float* in, std::int64_t n, cudaStream_t stream);
void cast_to_float(float* out, const bf16* in, std::int64_t n, cudaStream_t stream);

}  // namespace pw::exec::cuda
