// The optimizers on the GPU, as exec/optimizer.cpp: AdamW and SGD with momentum on fp32 master
// weights; host launchers only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "exec/cuda/device.hpp"

namespace pw::exec::cuda {

// The optimizer on fp32 master weights, as exec/optimizer.cpp: updates master (and m, v), writes
// the bf16 working copy `weights` (another weight version may be left untouched) and zeroes the
// bf16 gradients. AdamW's bias corrections c1 = 1 - beta1^t, c2 = 1 - beta2^t come from the host.
struct AdamWParams {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.0f;
};
void adamw_update(float* master, bf16* weights, bf16* grads, float* m, float* v, std::int64_t n,
                  const AdamWParams& p, int update, cudaStream_t stream);
void sgd_momentum_update(float* master, bf16* weights, bf16* grads, float* m, std::int64_t n,
                         float lr, float momentum, cudaStream_t stream);

}  // namespace pw::exec::cuda
