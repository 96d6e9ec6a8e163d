// Simulator speed: three optimizer steps of GPT 3.9B on 8 x p3.16xlarge (64 GPUs, 2bw) and of a
// GPT-3 13B plan on 128 x dgx-a100 (1,024 GPUs, 2bw with recomputation). Each simulation runs in
// its own process (as `pipewright simulate` does); the counters give simulated activities per
// second and the simulating process's peak memory.
#include <benchmark/benchmark.h>

#include "sim/simulator.hpp"
#include "traces/analytic.hpp"

namespace {

using namespace pw;

void BM_Simulate(benchmark::State& state, const char* model_name, const char* cluster_name,
                 int nodes, int d, int m, bool recompute) {
  const models::ModelSpec model = models::load_model(model_name);
  const clusters::Cluster cluster = clusters::load_cluster(cluster_name, nodes);
  planner::Plan plan;
  plan.schedule = planner::Schedule::two_bw;
  plan.d = d;
  plan.m = m;
  plan.b = 1;
  plan.w = cluster.devices() / d;
  if (recompute) plan.recompute.assign(std::size_t(d), pw::planner::Recompute::full);
  planner::resolve_stages(plan, model.layers);
  planner::place(plan, {cluster.nodes, cluster.gpus_per_node});
  const traces::Trace trace = traces::analytic_trace(model, cluster.device, {1});
  sim::SimResult r;
  for (auto _ : state)
    r = sim::simulate(model, trace, cluster, plan);
  state.counters["devices"] = plan.ranks();
  state.counters["activities"] = double(r.activities);
  state.counters["activities_per_s"] = double(r.activities) / r.wall_s;
  state.counters["sim_wall_s"] = r.wall_s;
  state.counters["peak_rss_MiB"] = double(r.peak_rss_bytes) / (1 << 20);
  state.counters["step_s"] = r.report.iteration_time_s;
}

BENCHMARK_CAPTURE(BM_Simulate, gpt39b_64xV100_2bw, "pd2bw-gpt-3.9b", "p3.16xlarge", 8, 8, 64, false)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK_CAPTURE(BM_Simulate, gpt3_13b_1024xA100_2bw, "gpt3-13b", "dgx-a100", 128, 8, 32, true)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);

}  // namespace
