// measured_report: a TrainResult as a run report (see measured_report.hpp).
#include "cli/measured_report.hpp"

#include <cstdio>

#include <fmt/format.h>

namespace pw::cli {

planner::RunReport measured_report(const models::ModelSpec& model, const planner::Plan& plan,
                                   const exec::TrainResult& r, const MeasuredOn& on) {
  planner::RunReport rep;
  rep.source = "measured";
  rep.model = model.name;
  rep.cluster = on.cluster.empty() ? fmt::format("cpu:{}", plan.gpus()) : on.cluster;
  rep.plan = plan;
  // Steady state: the mean step after the first (which includes the pipeline's warm-up), leaving
  // out the first step of every later run appended (validate's blocks) too.
  std::vector<const exec::StepLog*> steady;  // the first step, then the steady ones
  for (std::size_t i = 0; i < r.steps.size(); ++i)
    if (i == 0 || !r.steps[i].warm_up) steady.push_back(&r.steps[i]);
  const std::size_t skip = steady.size() > 1 ? 1 : 0;
  double sum = 0;
  for (std::size_t i = skip; i < steady.size(); ++i)
    sum += steady[i]->seconds;
  rep.iteration_time_s = sum / double(steady.size() - skip);
  rep.samples_per_s = double(plan.global_batch()) / rep.iteration_time_s;
  rep.tokens_per_s = rep.samples_per_s * double(model.seq_len);
  rep.model_flops_per_s = rep.samples_per_s * models::derive_costs(model).flops_per_sample;
  rep.mfu = on.peak_flops_per_s > 0 ? rep.model_flops_per_s / on.peak_flops_per_s : 0;
  for (const auto& rank : r.ranks) {
    planner::DeviceReport d;
    d.rank = rank.rank;
    // One device per TP rank: device = pipeline rank * t + TP index.
    d.stage = plan.stage_of(rank.rank / plan.t);
    d.replica = plan.replica_of(rank.rank / plan.t);
    d.peak_memory_bytes = rank.peak_memory_bytes;
    d.memory = rank.memory;
    d.busy_s = rank.busy_s / double(r.steps.size());
    d.bubble_fraction = 1.0 - d.busy_s / rep.iteration_time_s;
    rep.devices.push_back(d);
  }
  common::Json losses = common::Json::array(), times = common::Json::array();
  for (const exec::StepLog* s : steady) {
    losses.push_back(s->loss);
    times.push_back(s->seconds);
  }
  rep.extra["losses"] = losses;
  rep.extra["step_times_s"] = times;
  if (steady.size() < r.steps.size()) {
    common::Json warm = common::Json::array();
    for (const auto& s : r.steps)
      if (s.warm_up) warm.push_back(s.seconds);
    rep.extra["warm_up_step_times_s"] = warm;
  }
  rep.extra["backend"] = on.backend;
  if (!on.device.empty()) rep.extra["device"] = on.device;
  rep.extra["first_step"] = r.first_step;
  // Offload: what the copy engines moved per step (over the run / steps; chunks with 2bw over
  // the steady segments, each run's first and last left out where there are others, as the
  // simulator counts) and the host pool's peak, per rank and summed (the fields of an estimate's
  // or simulation's "offload" report).
  if (plan.any_offload() && !r.steps.empty()) {
    const auto steps = std::int64_t(r.steps.size());
    std::int64_t out = 0, in = 0, activations = 0;
    common::Json ranks = common::Json::array();
    for (const auto& rank : r.ranks) {
      const std::int64_t steady = steps - rank.edge_steps;
      const auto per_step = [&](std::int64_t all, std::int64_t edges) {
        return rank.edge_steps > 0 && steady > 0 ? (all - edges) / steady : all / steps;
      };
      const std::int64_t rank_out = per_step(rank.copy_out_bytes, rank.edge_copy_out_bytes),
                         rank_in = per_step(rank.copy_in_bytes, rank.edge_copy_in_bytes);
      out += rank_out;
      in += rank_in;
      activations += rank.activation_out_bytes / steps;
      ranks.push_back({{"rank", rank.rank},
                       {"host_bytes", rank.host_peak_memory_bytes},
                       {"copy_out_bytes_per_step", rank_out},
                       {"copy_in_bytes_per_step", rank_in},
                       {"activation_bytes_per_step", rank.activation_out_bytes / steps}});
    }
    rep.extra["offload"] = {{"mode", planner::offload_name(plan)},
                            {"copy_out_bytes_per_step", out},
                            {"copy_in_bytes_per_step", in},
                            {"activation_bytes_per_step", activations},
                            {"ranks", ranks}};
  }
  return rep;
}

void print_step(const exec::StepLog& s) {
  fmt::print("step {:>4} | loss {:.6f} | {:>9.3f} ms | {:>10.0f} tok/s{}\n", s.step, s.loss,
             1e3 * s.seconds, s.tokens_per_s,
             s.checkpoint.empty() ? "" : " | saved " + s.checkpoint);
  std::fflush(stdout);
}

}  // namespace pw::cli
