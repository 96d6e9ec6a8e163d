// The whole plan search of `pipewright plan` for the PipeDream-2BW paper's GPT 3.9B on 8 x
// p3.16xlarge (64 V100s), global batch 512: closed-form search over every candidate, then the
// best 8 simulated (two child processes at a time) and re-ranked. Target: under 10 s.
#include <benchmark/benchmark.h>

#include "planner/search.hpp"
#include "sim/simulator.hpp"
#include "traces/analytic.hpp"

namespace {

using namespace pw;

void BM_PlanSearch(benchmark::State& state) {
  const models::ModelSpec model = models::load_model("pd2bw-gpt-3.9b");
  const clusters::Cluster cluster = clusters::load_cluster("p3.16xlarge", 8);
  const traces::Trace trace = traces::analytic_trace(model, cluster.device, {1, 2, 4, 8, 16, 32});
  planner::SearchOptions o;
  o.global_batch = 512;
  const planner::SimulateFn simulate = [&](const std::vector<planner::Plan>& plans) {
    std::vector<sim::SimJob> jobs;
    for (const auto& p : plans)
      jobs.push_back({model, trace, cluster, p, {}});
    std::vector<planner::Simulated> out;
    for (const auto& r : sim::simulate_batch(jobs, 2))
      out.push_back({r.ok, r.error, r.ok ? r.result.report.samples_per_s : 0, 0, 0, r.ok});
    return out;
  };
  std::int64_t considered = 0;
  for (auto _ : state) {
    const planner::SearchResult res = planner::search_plans(model, trace, cluster, o);
    considered = res.considered;
    benchmark::DoNotOptimize(planner::rank_by_simulation(res, 8, simulate));
  }
  state.counters["candidates"] = double(considered);
}
BENCHMARK(BM_PlanSearch)->Unit(benchmark::kMillisecond)->Iterations(3);

void BM_ClosedFormSearchOnly(benchmark::State& state) {
  const models::ModelSpec model = models::load_model("pd2bw-gpt-3.9b");
  const clusters::Cluster cluster = clusters::load_cluster("p3.16xlarge", 8);
  const traces::Trace trace = traces::analytic_trace(model, cluster.device, {1, 2, 4, 8, 16, 32});
  planner::SearchOptions o;
  o.global_batch = 512;
  for (auto _ : state)
    benchmark::DoNotOptimize(planner::search_plans(model, trace, cluster, o));
}
BENCHMARK(BM_ClosedFormSearchOnly)->Unit(benchmark::kMillisecond);

}  // namespace
