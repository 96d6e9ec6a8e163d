// The local transport's deterministic sum over the members of a group (transport_kernels.cuh).
#include <cuda_bf16.h>

#include <algorithm>

#include "exec/cuda/transport_kernels.cuh"

namespace pw::exec::cuda {

namespace {

constexpr int kMax = 16;
constexpr int kThreads = 256;

struct Buffers {
  void* p[kMax];
};

__device__ __forceinline__ float widen(float x) {
  return x;
}
__device__ __forceinline__ float widen(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ void narrow(float* p, float s) {
  *p = s;
}
__device__ __forceinline__ void narrow(__nv_bfloat16* p, float s) {
  *p = __float2bfloat16(s);  // round to nearest even
}

// One element per thread and iteration: the n reads happen before the n writes of the same
// element, and no other thread touches it, so writing the sum in place is safe.
template <class T>
__global__ void sum_into_all(Buffers b, int n, std::int64_t count) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    float s = 0.0f;
    for (int k = 0; k < n; ++k)  // group order: the same sum on every member, every run
      s += widen(static_cast<const T*>(b.p[k])[i]);
    for (int k = 0; k < n; ++k)
      narrow(static_cast<T*>(b.p[k]) + i, s);
  }
}

template <class T>
cudaError_t launch(void* const* buffers, int n, std::int64_t count, cudaStream_t stream) {
  if (n < 1 || n > kMax) return cudaErrorInvalidValue;
  if (count <= 0) return cudaSuccess;
  Buffers b{};
  for (int k = 0; k < n; ++k)
    b.p[k] = buffers[k];
  const auto blocks = unsigned(std::min<std::int64_t>((count + kThreads - 1) / kThreads, 65536));
  sum_into_all<T><<<blocks, kThreads, 0, stream>>>(b, n, count);
  return cudaGetLastError();
}

}  // namespace

cudaError_t sum_into_all_bf16(void* const* buffers, int n, std::int64_t count,
                              cudaStream_t stream) {
  return launch<__nv_bfloat16>(buffers, n, count, stream);
}

cudaError_t sum_into_all_fp32(void* const* buffers, int n, std::int64_t count,
                              cudaStream_t stream) {
  return launch<float>(buffers, n, count, stream);
}

}  // namespace pw::exec::cuda
