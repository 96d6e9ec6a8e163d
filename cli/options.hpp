// Options shared by several subcommands: model, cluster, plan (file or flags), trace, output.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "clusters/cluster.hpp"
#include "common/format.hpp"
#include "common/limits.hpp"
#include "models/model.hpp"
#include "planner/plan.hpp"
#include "planner/report.hpp"
#include "traces/trace.hpp"

namespace pw::cli {

// CLI11 validators with the limits of common/limits.hpp, the same as for files and --set:
// counts are 1 .. kMaxCount; a real number must be finite (CLI::Range lets NaN through).
inline CLI::Range count_range() {
  return CLI::Range(std::int64_t{1}, common::kMaxCount);
}
CLI::Validator finite_range(double lo, double hi, bool lo_open = false);

struct ClusterOptions {
  std::string cluster;
  std::optional<int> nodes;
  std::vector<std::string> sets;
  void add(CLI::App& app, const std::string& default_cluster);
  clusters::Cluster load() const;
};

// A plan file (--plan) or the flags -w -d -m -b --schedule -v --tp --sp --recompute
// --distributed-optimizer --stage-blocks --offload.
struct PlanOptions {
  std::string plan_file;
  std::string schedule = "1f1b";
  std::optional<int> w, d, m, v;
  int b = 1;
  int t = 1;
  bool sp = false;
  bool distributed_optimizer = false;
  bool overlap_param_gather = false;
  std::string offload = "none";          // planner::parse_offload_modes
  std::int64_t chunk_size = 0;           // --chunk-size (offload chunks); 0: the default
  bool chunk_shard = false;              // --chunk-shard (offload chunks, w > 1)
  std::optional<std::string> recompute;  // a mode; a bare --recompute means "full"
  std::vector<std::int64_t> stage_blocks;
  int ranks_per_gpu = 1;
  void add(CLI::App& app);
  bool given_as_flags(const CLI::App& app) const;
  // A plan from the file or the flags, stages resolved for `layers` blocks (0: not resolved).
  // `devices` x --ranks-per-gpu gives the default w. Unplaced.
  planner::Plan build(std::int64_t layers, int devices) const;
};

struct Scenario {
  models::ModelSpec model;
  clusters::Cluster cluster;
  planner::Plan plan;  // resolved and placed
  traces::Trace trace;
};

// --model, the cluster options, the plan options, --trace, --out and --allow-oom, shared by
// estimate and simulate. With none of model, cluster and plan given, the built-in default
// scenario: the PipeDream-2BW paper's GPT 3.9B on 8 x p3.16xlarge (64 V100s), 2bw, w=8 d=8 b=1
// m=64 (global batch 512).
struct ScenarioOptions {
  std::string model = "pd2bw-gpt-3.9b";
  std::optional<std::int64_t> seq_len;
  ClusterOptions cluster;
  PlanOptions plan;
  std::string trace;
  std::string out;
  bool allow_oom = false;
  void add(CLI::App& app);
  Scenario resolve(const CLI::App& app);
  // What the run was made from, for a report's "inputs" section: the model and cluster as given,
  // every --set, --nodes and --seq-len, and the device used (its whole description), so a run can
  // be reproduced from its report.
  common::Json inputs(const Scenario& sc) const;
};

// "1f1b t=4 sp w=4 d=2 b=1 m=16 distributed-optimizer": the plan's shape in one phrase.
std::string plan_summary(const planner::Plan& p);

// With offload, per node "  host (offload optimizer): node 0 172.3 GiB of 223.5 GiB, pinned 19.1
// GiB of 223.5 GiB; moved per step 153.2 GiB to the host, 19.1 GiB back" lines; "" without.
std::string offload_summary(const planner::RunReport& r);
// "swap,recompute,...": a plan's activation choices per stage.
std::string activation_list(const planner::Plan& p);

// "the plan does not fit: rank 3 (stage 3) needs ... (largest term: ...)" + what to try.
std::string oom_message(const planner::RunReport& r);

// A progress bar on stderr ("[#####.....] 3/8 plans simulated"), or an empty function when
// stderr is not a terminal (CI logs stay clean).
std::function<void(int, int)> progress_bar(const std::string& what);

// Analytic trace for the cluster's device, or --trace FILE (checked against the model), for one
// GPU of a TP group of `sharding`'s shape (none given: the file's, or t = 1 for analytic).
traces::Trace load_or_make_trace(const std::string& trace_file, const models::ModelSpec& model,
                                 const clusters::DeviceSpec& device, std::int64_t b,
                                 std::optional<models::Sharding> sharding = std::nullopt);

// A model preset or file, its sequence length replaced by `seq_len` when given (re-validated).
models::ModelSpec load_model_with(const std::string& name, std::optional<std::int64_t> seq_len);

std::vector<std::int64_t> parse_int_list(const std::string& text, const std::string& option);

using common::human_bytes;
using common::human_rate;
using common::human_seconds;

}  // namespace pw::cli
