// Device helpers shared by the .cu files of exec/cuda: bf16 <-> fp32, warp and block reductions,
// launch shapes. Internal: include only from .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "exec/cuda/device.hpp"

namespace pw::exec::cuda::detail {

using std::int64_t;

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int kRowsPerBlock = kThreads / kWarp;  // warp-per-row kernels
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float f32(bf16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ bf16 b16(float x) {
  return __float2bfloat16(x);  // round to nearest even
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o >>= 1)
    v += __shfl_xor_sync(kFull, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o >>= 1)
    v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// Reductions over a block whose size is a multiple of 32; every thread gets the result. `shared`
// holds 32 values; the leading barrier keeps a previous call's readers ahead of this call's writes.
template <class T, class Op>
__device__ T block_reduce(T v, T* shared, T identity, Op op) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
  for (int o = kWarp / 2; o > 0; o >>= 1)
    v = op(v, __shfl_xor_sync(kFull, v, o));
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : identity;
  for (int o = kWarp / 2; o > 0; o >>= 1)
    v = op(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

struct Add {
  template <class T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Grid of a grid-stride loop over n items.
inline unsigned grid_for(int64_t n, int threads = kThreads) {
  return unsigned(std::min<int64_t>((n + threads - 1) / threads, int64_t(1) << 20));
}

inline unsigned rows_grid(int64_t rows) {
  return unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock);
}

inline void check_launch() {
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace pw::exec::cuda::detail
