// The local transport's reduction kernel; host launcher only, so plain C++ files can call it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pw::exec::cuda {

// For every i < count: s = sum over k = 0..n-1 of buffers[k][i] in that order, in fp32 (bf16 values
// widened, the sum rounded once); then buffers[k][i] = s for every k. The buffers may alias nothing
// but themselves. n <= 16. Enqueued on `stream`; returns the launch error (cudaSuccess if none).
cudaError_t sum_into_all_bf16(void* const* buffers, int n, std::int64_t count, cudaStream_t stream);
cudaError_t sum_into_all_fp32(void* const* buffers, int n, std::int64_t count, cudaStream_t stream);

}  // namespace pw::exec::cuda
