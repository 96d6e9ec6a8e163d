// Chrome trace event format writer shared by the simulator and the executor.
#include "planner/timeline.hpp"

#include <fmt/format.h>

namespace pw::planner {

namespace {

constexpr double kUs = 1e6;  // Chrome traces count microseconds

common::Json metadata(const char* name, int pid, int tid, const std::string& value) {
  return {{"ph", "M"}, {"name", name}, {"pid", pid}, {"tid", tid}, {"args", {{"name", value}}}};
}

}  // namespace

common::Json chrome_trace(const Programs& programs, const std::vector<RankTimeline>& ranks) {
  const Plan& plan = programs.plan;
  common::Json events = common::Json::array();
  for (const RankTimeline& r : ranks) {
    events.push_back(metadata("process_name", r.rank, 0, r.label));
    events.push_back({{"ph", "M"},
                      {"name", "process_sort_index"},
                      {"pid", r.rank},
                      {"args", {{"sort_index", r.rank}}}});
    for (int s = 0; s < (plan.t > 1 ? 5 : 4); ++s)
      events.push_back(metadata("thread_name", r.rank, s, kStreamNames[s]));
    if (plan.any_offload())
      for (int s : {kCopyOutStream, kCopyInStream, kHostStream}) {
        if (s == kHostStream && plan.offload == Offload::none) continue;  // no CPU Adam
        events.push_back(metadata("thread_name", r.rank, s, kStreamNames[s]));
      }
    const auto& ops = programs.devices[std::size_t(r.rank)].ops;
    for (const TimedOp& e : r.ops) {
      const Op& op = ops[std::size_t(e.op)];
      common::Json args = {{"step", op.step}};
      if (op.microbatch >= 0) args["microbatch"] = op.microbatch;
      if (op.version >= 0) args["version"] = op.version;
      if (plan.v > 1) args["chunk"] = op.chunk;
      const std::string name =
          e.stream == kCollectiveStream
              ? fmt::format("all_reduce s{}", op.step)
              : (e.stream == kTensorParallelStream ? fmt::format("tp {}", format_op(op, plan))
                                                   : format_op(op, plan));
      events.push_back({{"ph", "X"},
                        {"name", name},
                        {"cat", kStreamNames[e.stream]},
                        {"pid", r.rank},
                        {"tid", e.stream},
                        {"ts", e.start_s * kUs},
                        {"dur", (e.end_s - e.start_s) * kUs},
                        {"args", args}});
    }
    for (const auto& [t, bytes] : r.memory)
      events.push_back({{"ph", "C"},
                        {"name", "memory"},
                        {"pid", r.rank},
                        {"ts", t * kUs},
                        {"args", {{"bytes", bytes}}}});
    for (const auto& [t, bytes] : r.host_memory)
      events.push_back({{"ph", "C"},
                        {"name", "host memory"},
                        {"pid", r.rank},
                        {"ts", t * kUs},
                        {"args", {{"bytes", bytes}}}});
  }
  return {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
}

}  // namespace pw::planner
