// Speed of the closed-form path the planner will call for every candidate: analytic trace
// generation and estimate() for the PipeDream-2BW paper's GPT 3.9B on 8 x p3.16xlarge (64 V100s)
// and a GPT-3 13B plan on 128 x dgx-a100 (1,024 A100s).
#include <benchmark/benchmark.h>

#include "planner/cost_model.hpp"
#include "traces/analytic.hpp"

namespace {

using namespace pw;

struct Scenario {
  models::ModelSpec model;
  clusters::Cluster cluster;
  planner::Plan plan;
  traces::Trace trace;
};

Scenario scenario(const char* model, const char* cluster, int nodes, int d, int m, int b) {
  Scenario s{models::load_model(model), clusters::load_cluster(cluster, nodes), {}, {}};
  s.plan.schedule = planner::Schedule::two_bw;
  s.plan.d = d;
  s.plan.m = m;
  s.plan.b = b;
  s.plan.w = s.cluster.devices() / d;
  planner::resolve_stages(s.plan, s.model.layers);
  planner::place(s.plan, {s.cluster.nodes, s.cluster.gpus_per_node});
  s.trace = traces::analytic_trace(s.model, s.cluster.device, {b});
  return s;
}

void BM_AnalyticTrace(benchmark::State& state) {
  models::ModelSpec m = models::load_model("pd2bw-gpt-3.9b");
  clusters::DeviceSpec d = clusters::load_device("V100-16GB");
  for (auto _ : state)
    benchmark::DoNotOptimize(traces::analytic_trace(m, d, {1, 2, 4, 8, 16}));
}
BENCHMARK(BM_AnalyticTrace)->Unit(benchmark::kMicrosecond);

void BM_Estimate(benchmark::State& state, const char* model, const char* cluster, int nodes, int d,
                 int m, int b) {
  Scenario s = scenario(model, cluster, nodes, d, m, b);
  for (auto _ : state)
    benchmark::DoNotOptimize(planner::estimate(s.model, s.trace, s.cluster, s.plan));
  state.counters["devices"] = s.plan.ranks();
  state.counters["plans_per_s"] =
      benchmark::Counter(double(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK_CAPTURE(BM_Estimate, gpt39b_64xV100_2bw, "pd2bw-gpt-3.9b", "p3.16xlarge", 8, 8, 64, 1)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Estimate, gpt3_13b_1024xA100_2bw, "gpt3-13b", "dgx-a100", 128, 8, 32, 1)
    ->Unit(benchmark::kMicrosecond);

}  // namespace
