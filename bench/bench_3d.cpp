// 3D parallelism at scale (issue 12), one core (run under `taskset -c 0`):
//  (a) a LLaMA-3-405B plan, TP 8 x PP 16 x DP 128 = 16,384 H100s (dgx-h100:2048), one optimizer
//      step simulated (target: under 120 s and 4 GB peak RSS);
//  (b) a 1,024-GPU TP 8 plan (llama3-8b on dgx-h100:128) simulated (target: under 10 s);
//  (c) the closed-form 3D plan search for 1,024 GPUs over t, d, w, b, schedule, recompute, SP and
//      the distributed optimizer, as `pipewright plan --top 0` (target: under 30 s).
// Simulations run in a child process (as `pipewright simulate` does); peak_rss_MiB is that
// process's maximum RSS (getrusage in the child), self_rss_MiB this process's.
#include <sys/resource.h>

#include <map>

#include <benchmark/benchmark.h>

#include "planner/search.hpp"
#include "sim/simulator.hpp"
#include "traces/analytic.hpp"

namespace {

using namespace pw;

double self_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

struct Shape {
  const char* model;
  int nodes;  // of dgx-h100
  int t, d, w, m;
  planner::Schedule schedule;
  planner::Recompute recompute;
  bool sp, distributed_optimizer;
  int steps;
};

void BM_Simulate3d(benchmark::State& state, Shape s) {
  const models::ModelSpec model = models::load_model(s.model);
  const clusters::Cluster cluster = clusters::load_cluster("dgx-h100", s.nodes);
  planner::Plan plan;
  plan.schedule = s.schedule;
  plan.t = s.t;
  plan.sp = s.sp;
  plan.distributed_optimizer = s.distributed_optimizer;
  plan.d = s.d;
  plan.w = s.w;
  plan.m = s.m;
  plan.b = 1;
  if (s.recompute != planner::Recompute::none) plan.recompute.assign(std::size_t(s.d), s.recompute);
  planner::resolve_stages(plan, model.layers);
  planner::place(plan, {cluster.nodes, cluster.gpus_per_node});
  const traces::Trace trace = traces::analytic_trace(model, cluster.device, {1}, {s.t, s.sp});
  sim::SimOptions options;
  options.steps = s.steps;
  sim::SimResult r;
  for (auto _ : state)
    r = sim::simulate(model, trace, cluster, plan, options);
  state.counters["gpus"] = plan.gpus();
  state.counters["activities"] = double(r.activities);
  state.counters["activities_per_s"] = double(r.activities) / r.wall_s;
  state.counters["sim_wall_s"] = r.wall_s;
  state.counters["peak_rss_MiB"] = double(r.peak_rss_bytes) / (1 << 20);
  state.counters["self_rss_MiB"] = self_rss_mib();
  state.counters["step_s"] = r.report.iteration_time_s;
}

// (a) Llama 3 405B as Meta trained it (TP 8, PP 16, DP 128; 16 M tokens = 2,048 sequences of 8,192
// per step: m = 16 microbatches of 1), SP, selective recomputation, distributed optimizer.
BENCHMARK_CAPTURE(BM_Simulate3d, llama3_405b_16384xH100_tp8_pp16_dp128,
                  Shape{"llama3-405b", 2048, 8, 16, 128, 16, planner::Schedule::one_f_one_b,
                        planner::Recompute::selective, true, true, 1})
    ->Unit(benchmark::kSecond)
    ->Iterations(1);
// (b) 1,024 GPUs with TP 8: llama3-8b, PP 4, DP 32, m = 32, SP, three steps (the default).
BENCHMARK_CAPTURE(BM_Simulate3d, llama3_8b_1024xH100_tp8_pp4_dp32,
                  Shape{"llama3-8b", 128, 8, 4, 32, 32, planner::Schedule::one_f_one_b,
                        planner::Recompute::none, true, false, 3})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);

// (c) The closed-form 3D search of `pipewright plan --top 0` for llama3-8b on 128 x dgx-h100
// (1,024 GPUs), global batch 1,024: every t (1, 2, 4, 8), d, w, b, schedule, recompute mode, SP
// and distributed optimizer; one analytic trace per sharding, as the CLI makes them.
void BM_PlanSearch3d(benchmark::State& state) {
  const models::ModelSpec model = models::load_model("llama3-8b");
  const clusters::Cluster cluster = clusters::load_cluster("dgx-h100", 128);
  planner::SearchOptions o;
  o.global_batch = 1024;
  o.schedules = {planner::Schedule::two_bw, planner::Schedule::one_f_one_b,
                 planner::Schedule::gpipe, planner::Schedule::interleaved};
  std::vector<std::int64_t> sizes;
  for (int b = 1; b <= o.max_microbatch; b *= 2)
    sizes.push_back(b);
  std::int64_t considered = 0, fitting = 0;
  for (auto _ : state) {
    std::map<std::pair<int, bool>, traces::Trace> traces;  // made inside the timing, as the CLI
    const planner::TraceFn trace_for = [&](const models::Sharding& s) {
      auto it = traces.find({s.t, s.sp});
      if (it == traces.end())
        it = traces
                 .emplace(std::make_pair(s.t, s.sp),
                          traces::analytic_trace(model, cluster.device, sizes, s))
                 .first;
      return it->second;
    };
    const planner::SearchResult res = planner::search_plans(model, trace_for, cluster, o);
    considered = res.considered;
    fitting = std::int64_t(res.fitting.size());
    benchmark::DoNotOptimize(res);
  }
  state.counters["candidates"] = double(considered);
  state.counters["fitting"] = double(fitting);
  state.counters["self_rss_MiB"] = self_rss_mib();
}
BENCHMARK(BM_PlanSearch3d)->Unit(benchmark::kMillisecond)->Iterations(1);

}  // namespace
