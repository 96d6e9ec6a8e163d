// The timed walk of compute orders (planner/order_walk.hpp).
#include "planner/order_walk.hpp"

#include <algorithm>
#include <stdexcept>

namespace pw::planner {

OrderWalk walk_compute_orders(const Plan& p, const std::vector<std::vector<ComputeSlot>>& order,
                              const std::vector<std::vector<double>>& duration,
                              const std::vector<double>& hop_s, int steps, const AfterOp& after) {
  const std::size_t d = order.size(), v = std::size_t(p.v);
  if (d != std::size_t(p.d) || duration.size() != d || hop_s.size() != d || steps < 1)
    throw std::logic_error("walk_compute_orders: one order, durations and hop per stage");
  const std::size_t mbs = std::size_t(steps) * std::size_t(p.m);
  // When stage s's forward and backward of microbatch j (over the run) of model chunk c ended, at
  // [s][c mbs + j]; -1: not yet.
  std::vector<std::vector<double>> forward_end(d, std::vector<double>(v * mbs, -1.0));
  std::vector<std::vector<double>> backward_end = forward_end;
  OrderWalk out;
  out.start.assign(d, -1.0);
  out.end.assign(d, 0.0);
  std::vector<std::size_t> next(d, 0);
  for (bool moved = true; moved;) {
    moved = false;
    for (std::size_t s = 0; s < d; ++s)
      for (std::size_t& i = next[s]; i < order[s].size(); ++i) {
        const ComputeSlot& op = order[s][i];
        const std::size_t j = std::size_t(op.step) * std::size_t(p.m) + std::size_t(op.microbatch);
        double ready = out.end[s];
        const std::size_t vs = std::size_t(op.chunk) * d + s;
        if (op.backward ? vs + 1 < v * d : vs > 0) {
          const std::size_t from_vs = op.backward ? vs + 1 : vs - 1, from = from_vs % d;
          const double sent =
              (op.backward ? backward_end : forward_end)[from][(from_vs / d) * mbs + j];
          if (sent < 0) break;  // not yet: the other stages go on first
          ready = std::max(ready, sent + hop_s[op.backward ? s : from]);
        }
        if (out.start[s] < 0) out.start[s] = ready;
        const double end = ready + duration[s].at(i);
        (op.backward ? backward_end : forward_end)[s][std::size_t(op.chunk) * mbs + j] = end;
        out.end[s] = after ? after(s, op, end) : end;
        moved = true;
      }
  }
  for (std::size_t s = 0; s < d; ++s)
    if (next[s] < order[s].size())
      throw std::logic_error("walk_compute_orders: the stages' orders wait for each other");
  return out;
}

}  // namespace pw::planner
