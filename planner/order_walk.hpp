// A timed walk of the stages' compute orders without contention: the closed form's pipeline for
// schedules whose ops it follows one by one (interleaved, offload chunks).
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "planner/plan.hpp"
#include "planner/program.hpp"

namespace pw::planner {

// order[s]: stage s's compute ops over `steps` steps (step_compute_order, run_compute_order);
// duration[s][i]: how long its op i takes. An op starts when its stage's previous op has ended
// and, but for virtual stage 0's forwards and the last virtual stage's backwards, hop_s[k] after
// the same microbatch's op ended on the virtual stage before it (a forward; k: that stage) or
// after it (a backward; k: its own stage), vs = chunk d + stage; hop_s[k] is one message between
// stage k and the next (stage 0 after the last with v > 1). after(s, op, end), when given, says
// where stage s goes on from after the op that ended at `end` (an optimizer step after a step's
// last backward). Per stage: start, its first op's start; end, where it went on from after its
// last op.
struct OrderWalk {
  std::vector<double> start, end;
};
using AfterOp = std::function<double(std::size_t stage, const ComputeSlot& op, double end)>;
OrderWalk walk_compute_orders(const Plan& plan, const std::vector<std::vector<ComputeSlot>>& order,
                              const std::vector<std::vector<double>>& duration,
                              const std::vector<double>& hop_s, int steps,
                              const AfterOp& after = {});

}  // namespace pw::planner
