// `pipewright sweep`: a what-if study over the cross product of --vary lists; every point is
// planned and simulated, and the results are written as CSV and JSON (docs/formats.md, "Sweep").

#include <cstdio>

#include <fmt/format.h>

#include "cli/commands.hpp"
#include "cli/sweep.hpp"

namespace pw::cli {

namespace {

struct SweepArgs {
  sweep::SweepSpec spec;
  std::vector<std::string> vary;
  std::int64_t batch = 0;
  std::string csv;
  std::string json;
};

void add_options(CLI::App& cmd, SweepArgs& a) {
  a.spec.model = "pd2bw-gpt-3.9b";
  cmd.add_option("--model", a.spec.model, "model preset or JSON file")->capture_default_str();
  a.spec.cluster.add(cmd, "p3.16xlarge:8");
  a.spec.plan.add(cmd);
  cmd.add_flag("--plan-best", a.spec.plan_best,
               "at each point, simulate the planner's best fitting plan for --batch / B");
  cmd.add_option("--batch", a.batch,
                 "global batch B: the planner's batch, or m = B/(w*b) with a fixed plan")
      ->check(CLI::Range(std::int64_t{1}, common::kMaxCount * common::kMaxCount));
  cmd.add_option("--vary", a.vary,
                 "KEY=v1,v2,... (repeatable; the cross product is swept). KEY: a cluster field "
                 "as in --set (network.bandwidth_bytes_per_s, device, nodes, ...), model, "
                 "schedule, b, m, B, w, d or recompute")
      ->required();
  cmd.add_option("--out,-o", a.csv, "write the rows as CSV here");
  cmd.add_option("--json", a.json, "write the sweep as JSON (pipewright.sweep/1) here");
  cmd.add_option("--parallel,-j", a.spec.parallel, "simulations at once (default: cores)")
      ->check(CLI::Range(0, 1024));
  cmd.add_option("--steps", a.spec.steps, "optimizer steps simulated per point")
      ->capture_default_str()
      ->check(count_range());
}

void run(SweepArgs& a, const CLI::App& cmd) {
  auto& spec = a.spec;
  if (a.batch > 0) spec.batch = a.batch;
  if (spec.plan_best && (!spec.plan.plan_file.empty() || spec.plan.given_as_flags(cmd)))
    throw InputError("sweep: --plan-best chooses the plan; drop --plan and the plan flags");
  for (const auto& v : a.vary)
    spec.axes.push_back(sweep::parse_vary(v));
  sweep::validate(spec);
  const auto rows = sweep::run_sweep(spec, progress_bar("points"));
  sweep::print_table(spec, rows);
  // Render both before writing either, so a failure leaves no file behind.
  const std::string csv = sweep::to_csv(spec, rows);
  const std::string json = sweep::to_json(spec, rows).dump(2) + "\n";
  if (!a.csv.empty()) common::write_file_atomic(a.csv, csv);
  try {
    if (!a.json.empty()) common::write_file_atomic(a.json, json);
  } catch (const Error&) {
    if (!a.csv.empty()) std::remove(a.csv.c_str());  // both files or neither
    throw;
  }
  int failed = 0;
  for (const auto& r : rows)
    failed += r.error.empty() ? 0 : 1;
  if (!a.csv.empty()) fmt::print("wrote {}\n", a.csv);
  if (!a.json.empty()) fmt::print("wrote {}\n", a.json);
  fmt::print("{} point{}, {} failed{}\n", rows.size(), rows.size() == 1 ? "" : "s", failed,
             failed > 0 ? " (see the error column)" : "");
}

}  // namespace

void add_sweep_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "sweep", "what-if study: simulate the cross product of --vary lists, write CSV and JSON");
  auto a = std::make_shared<SweepArgs>();
  add_options(*cmd, *a);
  cmd->callback([a, cmd] { run(*a, *cmd); });
}

}  // namespace pw::cli
