// Internal to planner/: how the checker and the abstract run name an op in an error message.
#pragma once

#include <cstddef>
#include <string>

#include "common/error.hpp"
#include "planner/program.hpp"

namespace pw::planner::detail {

inline std::string where(const Programs& p, int rank, std::size_t index) {
  const Op& op = p.devices[std::size_t(rank)].ops[index];
  std::string s = "rank " + std::to_string(rank) + " op " + std::to_string(index) + " " +
                  format_op(op, p.plan) + " (step " + std::to_string(op.step);
  if (op.microbatch >= 0) s += ", microbatch " + std::to_string(op.microbatch);
  if (p.plan.v > 1) s += ", chunk " + std::to_string(op.chunk);
  return s + ")";
}

[[noreturn]] inline void fail(const Programs& p, int rank, std::size_t index,
                              const std::string& what) {
  throw ScheduleError(where(p, rank, index) + ": " + what);
}

inline bool in_range(int x, int n) {
  return x >= 0 && x < n;
}

}  // namespace pw::planner::detail
