// Speed of schedule generation and checking for large plans (ops per second as a counter).
#include <benchmark/benchmark.h>

#include "planner/checker.hpp"
#include "planner/unit_timeline.hpp"

namespace {

using pw::planner::Plan;
using pw::planner::Schedule;

Plan make_plan(Schedule schedule, int w, int d, int m, int v = 1) {
  Plan plan;
  plan.schedule = schedule;
  plan.w = w;
  plan.d = d;
  plan.m = m;
  plan.v = v;
  return plan;
}

// Plans: 2BW d=8 m=64 w=8 (64 devices); 1F1B d=16 m=64 w=64 (1024 devices); interleaved d=8 v=4
// m=64 w=8 (64 devices, 4x the point-to-point ops).
Plan plan_for(int index) {
  switch (index) {
    case 0:
      return make_plan(Schedule::two_bw, 8, 8, 64);
    case 1:
      return make_plan(Schedule::one_f_one_b, 64, 16, 64);
    default:
      return make_plan(Schedule::interleaved, 8, 8, 64, 4);
  }
}

void set_counters(benchmark::State& state, std::int64_t ops) {
  state.counters["ops"] = double(ops);
  state.counters["ops_per_s"] =
      benchmark::Counter(double(ops), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Generate(benchmark::State& state) {
  const Plan plan = plan_for(int(state.range(0)));
  std::int64_t ops = 0;
  for (auto _ : state) {
    const auto programs = pw::planner::generate_programs(plan, 3, 4);
    ops = pw::planner::total_ops(programs);
    benchmark::DoNotOptimize(ops);
  }
  set_counters(state, ops);
}

void BM_GenerateAndCheck(benchmark::State& state) {
  const Plan plan = plan_for(int(state.range(0)));
  std::int64_t ops = 0;
  for (auto _ : state) {
    const auto programs = pw::planner::generate_programs(plan, 3, 4);
    const auto report = pw::planner::check_programs(programs);
    ops = report.ops;
    benchmark::DoNotOptimize(report.max_stash);
  }
  set_counters(state, ops);
}

void BM_UnitTimeline(benchmark::State& state) {
  const auto programs = pw::planner::generate_programs(plan_for(int(state.range(0))), 3, 4);
  for (auto _ : state) {
    const auto timeline = pw::planner::run_unit_timeline(programs);
    benchmark::DoNotOptimize(timeline.makespan);
  }
  set_counters(state, pw::planner::total_ops(programs));
}

// Arg: 0 = 2bw 64 devices, 1 = 1f1b 1024 devices, 2 = interleaved v=4 64 devices.
BENCHMARK(BM_Generate)->DenseRange(0, 2)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_GenerateAndCheck)->DenseRange(0, 2)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_UnitTimeline)->DenseRange(0, 2)->Unit(benchmark::kMillisecond);

}  // namespace
