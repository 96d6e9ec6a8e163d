// The local transport's deterministic collectives over the members of a group
// (transport_kernels.cuh).
#include <cuda_bf16.h>

#include <algorithm>

#include "exec/cuda/transport_kernels.cuh"

namespace pw::exec::cuda {

namespace {

constexpr int kMax = 16;
constexpr int kThreads = 256;

struct Buffers {
  void* p[kMax];
  std::int64_t bounds[kMax + 1];
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

// One element per thread and iteration: its reads happen before its writes and no other thread
// touches it, so writing in place is safe.
template <class T>
__global__ void group_collective(Buffers b, int n, int kind, std::int64_t count) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    int owner = 0;
    if (kind != int(Collective::all_reduce))
      while (owner + 1 < n && b.bounds[owner + 1] <= i)
        ++owner;
    if (kind == int(Collective::all_gather)) {
      const T x = static_cast<const T*>(b.p[owner])[i];
      for (int k = 0; k < n; ++k)
        if (k != owner) static_cast<T*>(b.p[k])[i] = x;
      continue;
    }
    float s = 0.0f;
    for (int k = 0; k < n; ++k)  // group order: the same sum on every member, every run
      s += widen(static_cast<const T*>(b.p[k])[i]);
    if (kind == int(Collective::reduce_scatter)) {
      narrow(static_cast<T*>(b.p[owner]) + i, s);
      continue;
    }
    for (int k = 0; k < n; ++k)
      narrow(static_cast<T*>(b.p[k]) + i, s);
  }
}

template <class T>
cudaError_t launch(Collective kind, void* const* buffers, int n, const std::int64_t* bounds,
                   std::int64_t count, cudaStream_t stream) {
  if (n < 1 || n > kMax) return cudaErrorInvalidValue;
  if (count <= 0) return cudaSuccess;
  Buffers b{};
  for (int k = 0; k < n; ++k)
    b.p[k] = buffers[k];
  if (kind != Collective::all_reduce) {
    if (!bounds || bounds[0] != 0 || bounds[n] != count) return cudaErrorInvalidValue;
    for (int k = 0; k <= n; ++k) {
      if (k > 0 && bounds[k] < bounds[k - 1]) return cudaErrorInvalidValue;
      b.bounds[k] = bounds[k];
    }
  }
  const auto blocks = unsigned(std::min<std::int64_t>((count + kThreads - 1) / kThreads, 65536));
  group_collective<T><<<blocks, kThreads, 0, stream>>>(b, n, int(kind), count);
  return cudaGetLastError();
}

}  // namespace

cudaError_t collective_bf16(Collective kind, void* const* buffers, int n,
                            const std::int64_t* bounds, std::int64_t count, cudaStream_t stream) {
  return launch<__nv_bfloat16>(kind, buffers, n, bounds, count, stream);
}

cudaError_t collective_fp32(Collective kind, void* const* buffers, int n,
                            const std::int64_t* bounds, std::int64_t count, cudaStream_t stream) {
  return launch<float>(kind, buffers, n, bounds, count, stream);
}

}  // namespace pw::exec::cuda
