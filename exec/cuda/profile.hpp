// Measured traces on the GPU: profile_cpu's method (exec/profile.hpp) with the bf16 CudaGptStage,
// each op timed with CUDA events. Header without CUDA types, so cli/ can include it.
#pragma once

#include <cstdint>
#include <vector>

#include "exec/profile.hpp"
#include "models/model.hpp"
#include "traces/trace.hpp"

namespace pw::exec::cuda {

// On the current GPU (one stream), as profile_cpu: stages of embedding + 1 block, 1 block, and
// 1 block + head, with real activations and gradients passed between them, timed round-robin
// (forward, backward, recompute; one warm-up, then `repeats` runs summarised by `statistic`); the
// embedding's and head's times are the differences with the lone block. Each op is timed with a
// cudaEvent pair on the stream around it (so host-side launch gaps inside the op count, as they do
// in training) and the stream is synchronised after it. Memory fields are the stages' exact sizes
// (sizes(b) x 2 bytes = b x models::derive_costs); optimizer times are adamw_update over each layer
// kind's parameters (fp32 master and moments, bf16 weights and gradients).
//
// The model must have a 2-byte dtype (fp16 or bf16; the backend computes in bf16 either way, same
// bytes) and be GPT-2 style (exec/gpt_layout.hpp); the trace keeps the model's dtype. The
// trace's device and source.device_name are the GPU's name (cudaGetDeviceProperties), source.driver
// the CUDA driver, runtime and cuBLASLt versions and the compute capability.
//
// Device memory: one arena of the free memory less a reserve; a microbatch size whose stages do
// not fit in it is skipped with a one-line note on stderr; when none fits, a one-line InputError.
//
// As profile_cpu: with `sharding` (t > 1, SP) one TP rank's shard of each stage, timed alone (its
// TP collectives do nothing, so only its compute counts; the simulator adds the collectives), and
// with `selective` also a selective block's extra backward time over the plain one's (pairs of
// backwards alternating, the same input and output gradient). Compile-checked only: never run on
// a GPU (`CudaProfile.ShardAndSelectiveAreTimed` is owed).
traces::Trace profile_cuda(const models::ModelSpec& model,
                           const std::vector<std::int64_t>& microbatch_sizes, int repeats = 3,
                           ProfileStatistic statistic = ProfileStatistic::median,
                           const models::Sharding& sharding = {}, bool selective = false);

}  // namespace pw::exec::cuda
