// libFuzzer target: read, then estimate. The input is one JSON object {"model": ..., "cluster":
// ..., "plan": ...} holding what `estimate --model FILE --cluster FILE --plan FILE` reads from its
// three files; each part is parsed by its reader, then the scenario is put together as
// cli/options.cpp's ScenarioOptions::resolve does (stages resolved, ranks placed, the analytic
// trace made) and the closed-form estimate runs.
#include "clusters/cluster.hpp"
#include "fuzz/fuzz_util.hpp"
#include "models/model.hpp"
#include "planner/cost_model.hpp"
#include "planner/plan.hpp"
#include "traces/analytic.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = pw::fuzz::write_input(data, size, "scenario.json");
  return pw::fuzz::guarded([&] {
    using pw::common::Json;
    const Json j = pw::common::read_json_file(path);
    // The one-file form is the harness's: other shapes are skipped.
    if (!j.is_object() || !j.contains("model") || !j.contains("cluster") || !j.contains("plan"))
      return;
    const Json& mj = j["model"];
    const pw::models::ModelSpec model = pw::models::is_hf_config(mj)
                                            ? pw::models::import_hf_config(mj, "model.json", "hf")
                                            : pw::models::parse_model(mj, "model.json");
    const pw::clusters::Cluster cluster = pw::clusters::parse_cluster(j["cluster"], "cluster.json");
    pw::planner::Plan plan = pw::planner::parse_plan(j["plan"], "plan.json");
    pw::planner::resolve_stages(plan, model.layers);
    pw::planner::place(plan, {cluster.nodes, cluster.gpus_per_node});
    const pw::traces::Trace trace =
        pw::traces::analytic_trace(model, cluster.device, {plan.b}, {plan.t, plan.sp});
    const pw::planner::Estimate est = pw::planner::estimate(model, trace, cluster, plan);
    (void)pw::planner::to_json(est.report).dump();
    (void)pw::planner::describe_oom(est.report);
  });
}
