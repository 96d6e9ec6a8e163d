// `pipewright schedule`: each device's program and an ASCII timeline at unit op times.
#include <fmt/format.h>

#include "cli/commands.hpp"
#include "cli/options.hpp"
#include "planner/checker.hpp"
#include "planner/unit_timeline.hpp"

namespace pw::cli {

void add_schedule_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "schedule", "print each device's program and an ASCII timeline at unit op times");
  struct Args {
    PlanOptions plan;
    int steps = 1;
    int buckets = 1;
    std::int64_t layers = 0;
    int columns = 160;
    bool comm = false;
    bool programs_only = false;
    bool timeline_only = false;
  };
  auto a = std::make_shared<Args>();
  a->plan.add(*cmd);
  cmd->add_option("--steps", a->steps, "optimizer steps to lay out")
      ->capture_default_str()
      ->check(count_range());
  cmd->add_option("--buckets", a->buckets, "gradient all-reduce buckets per stage")
      ->capture_default_str()
      ->check(count_range());
  cmd->add_option("--layers", a->layers, "blocks in the model (default: d*v, one per stage)")
      ->check(count_range());
  cmd->add_option("--columns", a->columns, "width of the timeline (20 .. 100000)")
      ->capture_default_str()
      ->check(CLI::Range(20, 100'000));
  cmd->add_flag("--show-comm", a->comm, "draw communication ops in the timeline");
  cmd->add_flag("--programs-only", a->programs_only, "print only the programs");
  cmd->add_flag("--timeline-only", a->timeline_only, "print only the timeline");
  cmd->callback([a] {
    // Without a cluster every rank is its own device: w defaults to 1.
    planner::Plan plan = a->plan.build(0, 1);
    planner::resolve_stages(plan, a->layers > 0 ? a->layers : plan.virtual_stages());
    planner::Programs programs = planner::generate_programs(plan, a->steps, a->buckets);
    planner::CheckReport check = planner::check_programs(programs);
    fmt::print(
        "{} w={} d={} b={} m={}{}{}: {} ranks, {} steps, {} ops; checker: ok (max stash {}, "
        "max live weight versions {})\n",
        to_string(plan.schedule), plan.w, plan.d, plan.b, plan.m,
        plan.v > 1 ? fmt::format(" v={}", plan.v) : "", plan.recompute.empty() ? "" : " recompute",
        plan.ranks(), a->steps, check.ops, check.max_stash, check.max_live_versions);
    if (!a->timeline_only) fmt::print("\n{}", planner::print_programs(programs, a->columns));
    if (!a->programs_only) {
      planner::Timeline tl = planner::run_unit_timeline(programs);
      planner::RenderOptions ro;
      ro.max_columns = a->columns;
      ro.show_comm = a->comm;
      fmt::print(
          "\ntimeline (forward = 1, backward = 2, recompute = 1 unit; communication free):\n"
          "{}",
          planner::render_timeline(programs, tl, ro));
      // Flush schedules: one step's window. 2bw's steps overlap, so its steady-state step is the
      // interval between two optimizer steps of rank 0 in the middle of the run.
      const int step = a->steps / 2;
      planner::StepTiming st = planner::step_timing(programs, tl, step);
      double time = st.time;
      if (plan.schedule == planner::Schedule::two_bw && a->steps >= 3) {
        std::vector<double> opt = planner::optimizer_times(programs, tl, 0);
        time = opt[step] - opt[step - 1];
      }
      fmt::print("step {} of {}: {:.2f} units, busiest device computes {:.2f}, bubble {:.1f}%\n",
                 step, a->steps, time, st.compute, time > 0 ? 100 * (1 - st.compute / time) : 0.0);
    }
  });
}

}  // namespace pw::cli
