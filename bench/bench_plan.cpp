// The whole plan search of `pipewright plan` for the PipeDream-2BW paper's GPT 3.9B on 8 x
// p3.16xlarge (64 V100s), global batch 512: closed-form search over every candidate, then the
// best 8 simulated (two child processes at a time) and re-ranked. Target: under 10 s.
#include <benchmark/benchmark.h>

#include "planner/chunks.hpp"
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

// The offload fallback's closed-form search for GPT-3 13B on one p3.16xlarge (8 V100-16GB),
// global batch 512: nothing fits without offload, so every offload mode is searched, chunks
// (PatrickStar) included: each chunks candidate runs its stages' eviction plans (m up to 512).
void BM_OffloadSearchOnly(benchmark::State& state) {
  const models::ModelSpec model = models::load_model("gpt3-13b");
  const clusters::Cluster cluster = clusters::load_cluster("p3.16xlarge");
  const traces::Trace trace = traces::analytic_trace(model, cluster.device, {1, 2, 4, 8, 16, 32});
  planner::SearchOptions o;
  o.global_batch = 512;
  o.offload_when_nothing_fits = true;
  std::int64_t considered = 0;
  for (auto _ : state) {
    const planner::SearchResult res = planner::search_plans(model, trace, cluster, o);
    considered = res.considered;
    benchmark::DoNotOptimize(res);
  }
  state.counters["candidates"] = double(considered);
}
BENCHMARK(BM_OffloadSearchOnly)->Unit(benchmark::kMillisecond)->Iterations(1);

// One chunks candidate of that search, its eviction plans: 2bw, t = 2 with SP, d = 4, b = 1,
// m = 512 (six segment shapes per stage, about 10^4 moments each).
void BM_ChunkSchedules(benchmark::State& state) {
  const models::ModelSpec model = models::load_model("gpt3-13b");
  const clusters::Cluster cluster = clusters::load_cluster("p3.16xlarge");
  const traces::Trace trace =
      traces::analytic_trace(model, cluster.device, {1}, models::Sharding{2, true});
  planner::Plan p;
  p.schedule = planner::Schedule::two_bw;
  p.t = 2;
  p.sp = true;
  p.w = 1;
  p.d = 4;
  p.b = 1;
  p.m = 512;
  p.offload = planner::Offload::chunks;
  p.chunk_bytes = planner::default_chunk_bytes(model);
  planner::resolve_stages(p, model.layers);
  planner::place(p, {cluster.nodes, cluster.gpus_per_node});
  planner::check(p);
  std::int64_t moments = 0;
  for (auto _ : state) {
    const std::vector<planner::ChunkSchedule> all =
        planner::chunk_schedules(model, trace, cluster, p);
    moments = 0;
    for (const planner::ChunkSchedule& s : all)
      for (const planner::ChunkSegmentPlan& g : s.segments)
        moments += std::int64_t(g.moments.size());
    benchmark::DoNotOptimize(all);
  }
  state.counters["moments"] = double(moments);
}
BENCHMARK(BM_ChunkSchedules)->Unit(benchmark::kMillisecond);

}  // namespace
