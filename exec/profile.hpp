// Measured traces: time each layer kind's forward, backward and recompute on this backend for
// several microbatch sizes, in the traces/ format, so the planner and the simulator can use them.
#pragma once

#include <cstdint>
#include <vector>

#include "models/model.hpp"
#include "traces/trace.hpp"

namespace pw::exec {

// The median (robust to a stray slow run) or the mean (what a long run averages: the statistic
// to predict a mean step time with) of the timed runs.
enum class ProfileStatistic { median, mean };

// Stages of embedding + 1 block, 1 block, and 1 block + head are timed round-robin (each repeat
// runs every stage's forward, backward and recompute once, so a slow spell of the machine falls
// on all three alike; `repeats` timed runs after a warm-up, summarised by `statistic`); the
// embedding and head times are the differences with the lone block (never below 0). Memory fields
// are the stage's exact sizes. Optimizer times are AdamW over each layer's parameters.
// backward_input_s / backward_weight_s are not separated (0).
// With `sharding.t` > 1: one GPU of a TP group of that shape (trace `tensor_parallel`): TP rank
// 0's shard of each stage, timed alone, its TP collectives doing nothing (the simulator and the
// closed form add them from the cluster's link, as for any TP trace: docs/formulas.md §3a, §4);
// sizes and parameters are the shard's.
// With `selective`: a lone block that keeps no attention probabilities (selective recompute,
// StageSpec::selective) is timed too, its backward against the plain block's in alternating pairs
// (each after its own forward); the block's selective_recompute_s is the statistic of the pairs'
// differences (never below 0) and activation_selective_bytes its stash. Without: as a trace
// without selective recompute reads (nothing dropped, nothing re-run).
traces::Trace profile_cpu(const models::ModelSpec& model,
                          const std::vector<std::int64_t>& microbatch_sizes, int repeats = 3,
                          ProfileStatistic statistic = ProfileStatistic::median,
                          const models::Sharding& sharding = {}, bool selective = false);

}  // namespace pw::exec
