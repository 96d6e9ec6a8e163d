// Options shared by several subcommands: model, cluster, plan (file or flags), trace, output.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "clusters/cluster.hpp"
#include "models/model.hpp"
#include "planner/plan.hpp"
#include "traces/trace.hpp"

namespace pw::cli {

struct ClusterOptions {
  std::string cluster;
  std::optional<int> nodes;
  std::vector<std::string> sets;
  void add(CLI::App& app, const std::string& default_cluster);
  clusters::Cluster load() const;
};

// A plan file (--plan) or the flags -w -d -m -b --schedule -v --recompute --stage-blocks.
struct PlanOptions {
  std::string plan_file;
  std::string schedule = "1f1b";
  std::optional<int> w, d, m, v;
  int b = 1;
  bool recompute = false;
  std::vector<std::int64_t> stage_blocks;
  int ranks_per_gpu = 1;
  void add(CLI::App& app);
  bool given_as_flags(const CLI::App& app) const;
  // A plan from the file or the flags, stages resolved for `layers` blocks (0: not resolved).
  // `devices` x --ranks-per-gpu gives the default w. Unplaced.
  planner::Plan build(std::int64_t layers, int devices) const;
};

// Analytic trace for the cluster's device, or --trace FILE (checked against the model).
traces::Trace load_or_make_trace(const std::string& trace_file, const models::ModelSpec& model,
                                 const clusters::DeviceSpec& device, std::int64_t b);

std::vector<std::int64_t> parse_int_list(const std::string& text, const std::string& option);

// Human figures: "1.23 GiB", "12.3 ms", "4.56 TFLOP/s".
std::string human_bytes(double bytes);
std::string human_seconds(double s);
std::string human_rate(double per_s, const std::string& unit);

}  // namespace pw::cli
