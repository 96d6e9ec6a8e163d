// fp32 CPU kernels of a GPT-2 block, forward and backward, in the style of llm.c's train_gpt2.c.
#pragma once

#include <cstdint>

namespace pw::exec::cpu {

// Shapes: B samples, T tokens, C channels, OC output channels, NH heads, V vocabulary, N rows.
// Backward kernels ADD into parameter gradients; whether they add into or overwrite the input
// gradient is said per kernel. Every matrix multiply is a row-major cblas_sgemm.

// out = wte[tokens] + wpe[t]. Token ids outside [0, V) throw pw::InputError.
void embedding_forward(float* out,                  // (B, T, C)
                       const std::int32_t* tokens,  // (B, T)
                       const float* wte,            // (V, C)
                       const float* wpe,            // (maxT, C)
                       int B, int T, int C, int V);
// dwte[tokens] += dout; dwpe[t] += dout. Like every kernel's parameter gradients here, each element
// is summed from zero over the call's rows and then added once (so adding a call's gradients on a
// zeroed buffer into an accumulator gives the bits of a call on the accumulator); matmul_backward's
// dweight relies on OpenBLAS's sgemm (beta = 1) adding its product to C once (observed
// bit-identical up to N = b*T = 2048 rows, docs/formulas.md section 9).
// With a vocabulary shard (tensor parallelism) dwte holds rows [row_begin, row_begin + rows) only
// and tokens outside it add nothing to it (rows < 0: every row).
void embedding_backward(float* dwte, float* dwpe, const float* dout, const std::int32_t* tokens,
                        int B, int T, int C, std::int32_t row_begin = 0, std::int32_t rows = -1);

// out = (inp - mean) * rstd * weight + bias per row; keeps mean and rstd for the backward.
void layernorm_forward(float* out, float* mean, float* rstd,  // (N, C), (N), (N)
                       const float* inp, const float* weight, const float* bias, int N, int C);
// dinp = (accumulate ? dinp : 0) + d(inp). In place (dinp == dout, accumulate false) is allowed:
// each row reads dout before it writes dinp.
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C, bool accumulate);

// out = residual + inp · weight^T + bias, with weight (OC, C) as in PyTorch's nn.Linear. bias and
// residual may be null. The residual add is fused: its backward is the identity, which the caller
// realises by adding every branch's input gradient into one residual-stream gradient.
void matmul_forward(float* out,             // (N, OC)
                    const float* inp,       // (N, C)
                    const float* weight,    // (OC, C)
                    const float* bias,      // (OC) or null
                    const float* residual,  // (N, OC) or null; may alias out
                    int N, int C, int OC);
// dinp = dout · weight (overwritten; added to with accumulate_input); dweight += dout^T · inp;
// dbias += column sums of dout. dbias may be null (no bias).
void matmul_backward(float* dinp,          // (N, C)
                     float* dweight,       // (OC, C)
                     float* dbias,         // (OC)
                     const float* dout,    // (N, OC)
                     const float* inp,     // (N, C)
                     const float* weight,  // (OC, C)
                     int N, int C, int OC, bool accumulate_input = false);

// GELU, tanh approximation (GPT-2): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
void gelu_forward(float* out, const float* inp, std::int64_t n);
// dinp = gelu'(inp) * dout (overwritten; dinp may alias dout).
void gelu_backward(float* dinp, const float* inp, const float* dout, std::int64_t n);

// Causal multi-head attention. qkv holds [q | k | v] per token, heads side by side in each.
// att = softmax(q k^T / sqrt(hd)) with zeros above the diagonal; out = att · v. Both directions
// work in blocks of 64 query rows and skip the key columns past each block's last row, so they
// do a bit more than half of the full T x T products at large T.
// Selective recomputation (Korthikanti et al. 2022): `selective` true keeps no att; it is one
// block's rows (attention_block_floats(T)), reused block after block, and the backward makes each
// block of att again from q and k exactly as the forward made it (the same products and softmax
// per block: the same bits).
void attention_forward(float* out,        // (B, T, C)
                       float* att,        // (B, NH, T, T); selective: attention_block_floats(T)
                       const float* qkv,  // (B, T, 3C)
                       int B, int T, int C, int NH, bool selective = false);
std::int64_t attention_block_floats(int T);  // one block of att's rows (64 rows of T)
// att (B, NH, T, T) made again whole from qkv, exactly as a forward without `selective` writes it
// (the same blocks and calls: the same bits): a selective backward that re-makes the whole
// attention core of a layer before it (offload chunks, whose moments count the core then).
void attention_probabilities(float* att, const float* qkv, int B, int T, int C, int NH);
// dqkv = d(qkv) (overwritten). scratch holds rows of dS (T floats each); scratch_floats >= T.
// Up to 64 rows are used; less scratch means smaller blocks (one row at T floats). att null: the
// forward was selective, and scratch also holds the block of att made again (scratch_floats >=
// 2 attention_block_floats(T); Error otherwise).
void attention_backward(float* dqkv,        // (B, T, 3C)
                        const float* dout,  // (B, T, C)
                        const float* qkv,   // (B, T, 3C)
                        const float* att,   // (B, NH, T, T), or null (selective)
                        float* scratch, std::int64_t scratch_floats, int B, int T, int C, int NH);

// Softmax over V in place (logits become probabilities) and losses = -log p[target]. Targets
// outside [0, V) throw pw::InputError. Returns the sum of the N losses (accumulated in double).
double softmax_crossentropy_forward(float* probs,   // (N, V): logits in, probabilities out
                                    float* losses,  // (N)
                                    const std::int32_t* targets,  // (N)
                                    int N, int V);
// dlogits = (probs - onehot(target)) * scale, the gradient of scale * sum of the losses.
void softmax_crossentropy_backward(float* dlogits,      // (N, V)
                                   const float* probs,  // (N, V)
                                   const std::int32_t* targets, float scale, int N, int V);

}  // namespace pw::exec::cpu
