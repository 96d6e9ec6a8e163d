// `pipewright simulate`: replay the plan's programs on a SimGrid platform of the cluster; write the
// run report ("source": "simulated"), optionally a Chrome-trace timeline and the platform XML.
#include <algorithm>

#include <fmt/format.h>

#include "cli/commands.hpp"
#include "cli/options.hpp"
#include "sim/platform.hpp"
#include "sim/simulator.hpp"

namespace pw::cli {

namespace {

void print_simulation(const sim::SimResult& res, const Scenario& sc) {
  const auto& r = res.report;
  const auto& p = r.plan;
  fmt::print("{} on {} ({} x {} x {}): {}, global batch {}\n", sc.model.name, sc.cluster.name,
             sc.cluster.nodes, sc.cluster.gpus_per_node, sc.cluster.device.name, plan_summary(p),
             p.global_batch());
  fmt::print("  simulated step time {} (steady state: step {} of {})\n",
             human_seconds(r.iteration_time_s), res.step_end_s.size() / 2, res.step_end_s.size());
  fmt::print("  {:.2f} samples/s, {}, {}, MFU {:.1f}%\n", r.samples_per_s,
             human_rate(r.tokens_per_s, "tokens"), human_rate(r.model_flops_per_s, "FLOP"),
             100 * r.mfu);
  fmt::print("  {:>5} {:>5} {:>10} {:>7} {:>12} {:>12} {:>12}  {}\n", "stage", "rank", "busy",
             "bubble", "activations", "peak", "capacity", "");
  for (int s = 0; s < p.d; ++s) {
    // The replica of the stage with the highest peak stands for the stage.
    const planner::DeviceReport* d = nullptr;
    for (const auto& dev : r.devices)
      if (dev.stage == s && (!d || dev.peak_memory_bytes > d->peak_memory_bytes)) d = &dev;
    fmt::print("  {:>5} {:>5} {:>10} {:>6.1f}% {:>12} {:>12} {:>12}  {}\n", s, d->rank,
               human_seconds(d->busy_s), 100 * d->bubble_fraction,
               human_bytes(double(d->memory.activations)),
               human_bytes(double(d->peak_memory_bytes)), human_bytes(double(d->capacity_bytes)),
               d->fits ? "" : "DOES NOT FIT");
  }
  fmt::print("{}", offload_summary(r));
  std::vector<sim::LinkStat> busiest = res.links;
  std::sort(busiest.begin(), busiest.end(), [](const auto& a, const auto& b) {
    return a.utilization != b.utilization ? a.utilization > b.utilization : a.name < b.name;
  });
  for (std::size_t i = 0; i < std::min<std::size_t>(3, busiest.size()); ++i)
    fmt::print("  link {:<18} {:<8} {:>12} carried, {:.1f}% utilized\n", busiest[i].name,
               busiest[i].kind, human_bytes(busiest[i].bytes), 100 * busiest[i].utilization);
  fmt::print("  simulated {} in {:.2f} s wall: {} activities ({:.0f}/s), peak memory {}\n",
             human_seconds(res.simulated_s), res.wall_s, res.activities,
             res.wall_s > 0 ? double(res.activities) / res.wall_s : 0.0,
             human_bytes(double(res.peak_rss_bytes)));
}

}  // namespace

void add_simulate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "simulate", "replay the plan on a SimGrid model of the cluster: step time, memory, timeline");
  struct Args {
    ScenarioOptions scenario;
    sim::SimOptions options;
    std::string timeline;
    std::string platform;
  };
  auto a = std::make_shared<Args>();
  a->scenario.add(*cmd);
  cmd->add_option("--steps", a->options.steps,
                  "optimizer steps to simulate (the report gives "
                  "the steady state)")
      ->capture_default_str()
      ->check(count_range());
  cmd->add_option("--buckets", a->options.gradient_buckets,
                  "gradient all-reduce buckets per stage, overlapping the last backward")
      ->capture_default_str()
      ->check(count_range());
  cmd->add_option("--timeline", a->timeline, "write a Chrome-trace timeline (Perfetto) here");
  cmd->add_option("--export-platform", a->platform, "write the SimGrid platform as XML here");
  cmd->callback([a, cmd] {
    Scenario sc = a->scenario.resolve(*cmd);
    a->options.timeline = !a->timeline.empty();
    sim::SimResult res = sim::simulate(sc.model, sc.trace, sc.cluster, sc.plan, a->options);
    print_simulation(res, sc);
    if (!res.report.fits() && !a->scenario.allow_oom) throw PlanError(oom_message(res.report));
    res.report.extra["inputs"] = a->scenario.inputs(sc);
    if (!a->platform.empty()) {
      common::write_file_atomic(a->platform, sim::platform_xml(sc.cluster));
      fmt::print("wrote {}\n", a->platform);
    }
    if (!a->timeline.empty()) {
      common::write_file_atomic(a->timeline, res.timeline.dump() + "\n");
      res.report.timeline = a->timeline;
      fmt::print("wrote {}\n", a->timeline);
    }
    if (!a->scenario.out.empty()) {
      common::write_json_file(a->scenario.out, planner::to_json(res.report));
      fmt::print("wrote {}\n", a->scenario.out);
    }
  });
}

}  // namespace pw::cli
