// The optimizers on the GPU (exec/optimizer.cpp's AdamW and SGD with momentum): fp32 master
// weights and moments, bf16 gradients in, a bf16 working copy out.
#include "exec/cuda/optimizer.cuh"

#include <cmath>

#include "exec/cuda/launch.cuh"

namespace pw::exec::cuda {

namespace {

using namespace detail;

__global__ void adamw_kernel(float* master, bf16* weights, bf16* grads, float* m, float* v,
                             int64_t n, AdamWParams p, float c1, float c2) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float g = f32(grads[i]);
    const float mi = p.beta1 * m[i] + (1 - p.beta1) * g;
    const float vi = p.beta2 * v[i] + (1 - p.beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float w = master[i];
    const float step = (mi / c1) / (sqrtf(vi / c2) + p.eps) + p.weight_decay * w;
    const float out = w - p.lr * step;
    master[i] = out;
    weights[i] = b16(out);
    grads[i] = b16(0.0f);
  }
}

__global__ void sgd_kernel(float* master, bf16* weights, bf16* grads, float* m, int64_t n, float lr,
                           float momentum) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float mi = momentum * m[i] + f32(grads[i]);
    m[i] = mi;
    const float out = master[i] - lr * mi;
    master[i] = out;
    weights[i] = b16(out);
    grads[i] = b16(0.0f);
  }
}

}  // namespace

void adamw_update(float* master, bf16* weights, bf16* grads, float* m, float* v, std::int64_t n,
                  const AdamWParams& p, int update, cudaStream_t stream) {
  if (n <= 0) return;
  const float c1 = 1.0f - std::pow(p.beta1, float(update));
  const float c2 = 1.0f - std::pow(p.beta2, float(update));
  adamw_kernel<<<grid_for(n), kThreads, 0, stream>>>(master, weights, grads, m, v, n, p, c1, c2);
  check_launch();
}

void sgd_momentum_update(float* master, bf16* weights, bf16* grads, float* m, std::int64_t n,
                         float lr, float momentum, cudaStream_t stream) {
  if (n <= 0) return;
  sgd_kernel<<<grid_for(n), kThreads, 0, stream>>>(master, weights, grads, m, n, lr, momentum);
  check_launch();
}

}  // namespace pw::exec::cuda
