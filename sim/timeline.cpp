// Chrome trace event format writer for simulated runs.
#include "sim/timeline.hpp"

#include <fmt/format.h>

namespace pw::sim::detail {

namespace {

constexpr double kUs = 1e6;  // Chrome traces count microseconds

common::Json metadata(const char* name, int pid, int tid, const std::string& value) {
  return {{"ph", "M"}, {"name", name}, {"pid", pid}, {"tid", tid}, {"args", {{"name", value}}}};
}

}  // namespace

common::Json chrome_trace(const World& w) {
  const planner::Plan& plan = w.plan();
  common::Json events = common::Json::array();
  for (const RankState& r : w.ranks) {
    events.push_back(metadata("process_name", r.rank, 0,
                              fmt::format("rank {} (node {} gpu {}, stage {}, replica {})", r.rank,
                                          r.node, r.gpu, r.stage, r.replica)));
    events.push_back({{"ph", "M"},
                      {"name", "process_sort_index"},
                      {"pid", r.rank},
                      {"args", {{"sort_index", r.rank}}}});
    for (int s = 0; s < 4; ++s)
      events.push_back(metadata("thread_name", r.rank, s, kStreamNames[s]));
    const auto& ops = w.programs->devices[std::size_t(r.rank)].ops;
    for (const Event& e : r.events) {
      const planner::Op& op = ops[std::size_t(e.op)];
      common::Json args = {{"step", op.step}};
      if (op.microbatch >= 0) args["microbatch"] = op.microbatch;
      if (op.version >= 0) args["version"] = op.version;
      if (plan.v > 1) args["chunk"] = op.chunk;
      std::string name = e.stream == kCollective ? fmt::format("all_reduce s{}", op.step)
                                                 : planner::format_op(op, plan);
      events.push_back({{"ph", "X"},
                        {"name", name},
                        {"cat", kStreamNames[e.stream]},
                        {"pid", r.rank},
                        {"tid", e.stream},
                        {"ts", e.start * kUs},
                        {"dur", (e.end - e.start) * kUs},
                        {"args", args}});
    }
    for (const auto& [t, bytes] : r.memory.samples)
      events.push_back({{"ph", "C"},
                        {"name", "memory"},
                        {"pid", r.rank},
                        {"ts", t * kUs},
                        {"args", {{"bytes", bytes}}}});
  }
  return {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
}

}  // namespace pw::sim::detail
