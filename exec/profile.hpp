// Measured traces: time each layer kind's forward, backward and recompute on this backend for
// several microbatch sizes, in the traces/ format, so the planner and the simulator can use them.
#pragma once

#include <cstdint>
#include <vector>

#include "models/model.hpp"
#include "traces/trace.hpp"

namespace pw::exec {

// Stages of embedding + 1 block, 1 block, and 1 block + head are timed (median of `repeats`
// after a warm-up); the embedding and head times are the differences with the lone block
// (never below 0). Memory fields are the stage's exact sizes. Optimizer times are AdamW over each
// layer's parameters. backward_input_s / backward_weight_s are not separated (0).
traces::Trace profile_cpu(const models::ModelSpec& model,
                          const std::vector<std::int64_t>& microbatch_sizes, int repeats = 3);

}  // namespace pw::exec
