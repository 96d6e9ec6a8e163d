// A GPT block's GEMM-built layers on the GPU: linear forward/backward and causal attention, each
// cuBLASLt GEMMs plus the kernels between them, as exec/cpu's matmul_* and attention_*.
#pragma once

#include <cstdint>

#include "exec/cuda/arena.hpp"
#include "exec/cuda/gemm.hpp"

namespace pw::exec::cuda {

// out = residual + inp · weight^T + bias, weight (OC, C) as in nn.Linear. bias and residual may be
// null; residual may alias out.
void linear_forward(Gemm& gemm, bf16* out,  // (N, OC)
                    const bf16* inp,        // (N, C)
                    const bf16* weight,     // (OC, C)
                    const bf16* bias,       // (OC) or null
                    const bf16* residual,   // (N, OC) or null
                    int N, int C, int OC);
// dinp = dout · weight (overwritten); dweight += dout^T · inp (fp32 accumulation, bf16 result);
// dbias += column sums of dout (dbias may be null).
void linear_backward(Gemm& gemm, bf16* dinp,  // (N, C)
                     bf16* dweight,           // (OC, C)
                     bf16* dbias,             // (OC)
                     const bf16* dout,        // (N, OC)
                     const bf16* inp,         // (N, C)
                     const bf16* weight,      // (OC, C)
                     int N, int C, int OC);

// Causal multi-head attention; qkv holds [q | k | v] per token, heads side by side in each.
// Per head, one batched GEMM over the samples for S = q k^T / sqrt(hd) into att, the causal
// softmax in place, one batched GEMM for out = att · v. The scores pass through bf16 (att's type)
// before the softmax, as in llm.c.
void attention_forward(Gemm& gemm, bf16* out,  // (B, T, C)
                       bf16* att,              // (B, NH, T, T)
                       const bf16* qkv,        // (B, T, 3C)
                       int B, int T, int C, int NH);
// The probabilities alone: att = causal softmax(q k^T / sqrt(hd)), attention_forward's first half
// (the same calls). Selective recompute with offload chunks re-makes a block's whole with it.
void attention_probabilities(Gemm& gemm, bf16* att,  // (B, NH, T, T)
                             const bf16* qkv,        // (B, T, 3C)
                             int B, int T, int C, int NH);
// dqkv = d(qkv) (overwritten). dP is built in fp32 and dS in bf16 in `scratch`, for as many samples
// of one head at a time as fit (6 T^2 bytes each), else in blocks of query rows (6 T bytes each).
void attention_backward(Gemm& gemm, bf16* dqkv,  // (B, T, 3C)
                        const bf16* dout,        // (B, T, C)
                        const bf16* qkv,         // (B, T, 3C)
                        const bf16* att,         // (B, NH, T, T)
                        Carver scratch, int B, int T, int C, int NH);

// Selective recompute (Korthikanti et al. 2022): attention that keeps no probabilities. The
// forward makes them kSelectiveRows query rows at a time, every sample of one head at once, in
// `scratch` (B x rows x T bf16) and multiplies each block by v; the backward makes each block again
// with the same calls (the same shapes) before its dv, dP, dS, dq and dk (B x rows x T each of P
// and dS in bf16 and dP in fp32 in `scratch`). Carver errors name the scratch when it is short.
inline constexpr int kSelectiveRows = 64;
void attention_forward_selective(Gemm& gemm, bf16* out,  // (B, T, C)
                                 const bf16* qkv,        // (B, T, 3C)
                                 Carver scratch, int B, int T, int C, int NH);
void attention_backward_selective(Gemm& gemm, bf16* dqkv,  // (B, T, 3C)
                                  const bf16* dout,        // (B, T, C)
                                  const bf16* qkv,         // (B, T, 3C)
                                  Carver scratch, int B, int T, int C, int NH);

}  // namespace pw::exec::cuda
