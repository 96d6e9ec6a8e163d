// The local transport's collective kernel; host launcher only, so plain C++ files can call it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pw::exec::cuda {

// What one launch does with the members' buffers (n <= 16, count elements each, aliasing nothing
// but themselves). Sums run over k = 0..n-1 in that order, in fp32 (bf16 values widened, the sum
// rounded once), so every member, run and kind gives the same bits for an element.
//  - all_reduce: buffers[k][i] = the sum, for every k.
//  - reduce_scatter: the sum goes only into the owner's buffer, the member k with
//    bounds[k] <= i < bounds[k + 1]; the others' elements stay as they were.
//  - all_gather: every member's buffers[k][i] = buffers[owner][i].
// bounds: n + 1 ascending offsets from 0 to count (ignored by all_reduce).
enum class Collective { all_reduce, reduce_scatter, all_gather };

// Enqueued on `stream`; returns the launch error (cudaSuccess if none).
cudaError_t collective_bf16(Collective kind, void* const* buffers, int n,
                            const std::int64_t* bounds, std::int64_t count, cudaStream_t stream);
cudaError_t collective_fp32(Collective kind, void* const* buffers, int n,
                            const std::int64_t* bounds, std::int64_t count, cudaStream_t stream);

}  // namespace pw::exec::cuda
