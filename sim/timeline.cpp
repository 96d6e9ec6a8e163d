// The simulated run's timeline: the ranks' recorded events through planner's Chrome-trace writer.
#include "sim/timeline.hpp"

#include <fmt/format.h>

#include "planner/timeline.hpp"

namespace pw::sim::detail {

common::Json chrome_trace(const World& w) {
  std::vector<planner::RankTimeline> ranks;
  for (const RankState& r : w.ranks) {
    planner::RankTimeline t;
    t.rank = r.rank;
    t.label = fmt::format("rank {} (node {} gpu {}, stage {}, replica {})", r.rank, r.node, r.gpu,
                          r.stage, r.replica);
    for (const Event& e : r.events)
      t.ops.push_back({e.stream, e.start, e.end, e.op});
    t.memory = r.memory.samples;
    // The host's bytes from the start when the rank has any there (optimizer offload's are static,
    // swapped stashes come and go; chunks: not tracked over time, the report has their peak).
    if (w.plan().offload != planner::Offload::chunks &&
        (r.offload.host_bytes > 0 || !r.host_samples.empty())) {
      t.host_memory.emplace_back(0.0, r.offload.host_bytes);
      t.host_memory.insert(t.host_memory.end(), r.host_samples.begin(), r.host_samples.end());
    }
    ranks.push_back(std::move(t));
  }
  return planner::chrome_trace(*w.programs, ranks);
}

}  // namespace pw::sim::detail
