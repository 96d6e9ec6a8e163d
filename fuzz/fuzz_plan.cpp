// libFuzzer target: a plan file (`--plan FILE`), then its stages resolved and its ranks placed (see
// fuzz_util.hpp and README "Fuzzing").
#include "fuzz/fuzz_util.hpp"
#include "planner/plan.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = pw::fuzz::write_input(data, size, "plan.json");
  return pw::fuzz::guarded([&] {
    pw::planner::Plan p = pw::planner::load_plan(path);
    pw::fuzz::check_round_trip(
        pw::planner::to_json(p),
        [](const auto& j) { return pw::planner::parse_plan(j, "written"); },
        [](const auto& s) { return pw::planner::to_json(s); }, "plan");
    // As `--plan FILE` is used: stages resolved for a model's blocks, ranks placed on the
    // smallest grid that holds them (one node; or the placement's own extent).
    pw::planner::resolve_stages(p, 24);
    pw::planner::DeviceGrid grid{1, p.gpus()};
    if (!p.placement.empty()) {
      grid = {0, 0};
      for (const auto& pl : p.placement) {
        grid.nodes = std::max(grid.nodes, pl.node + 1);
        grid.gpus_per_node = std::max(grid.gpus_per_node, pl.gpu + p.t);
      }
      if (std::int64_t(grid.nodes) * grid.gpus_per_node > pw::planner::kMaxGpus) return;
    }
    pw::planner::place(p, grid);
  });
}
