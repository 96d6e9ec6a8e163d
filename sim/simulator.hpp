// The simulator: replays a plan's per-device programs on a SimGrid platform built from a cluster,
// and writes the run report ("source": "simulated"), per-link statistics and a timeline.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "clusters/cluster.hpp"
#include "common/json_reader.hpp"
#include "models/model.hpp"
#include "planner/plan.hpp"
#include "planner/report.hpp"
#include "traces/trace.hpp"

namespace pw::sim {

struct SimOptions {
  int steps = 3;             // optimizer steps simulated; the report gives the steady state
  int gradient_buckets = 4;  // all-reduce buckets per chunk, overlapping the last backward
  bool timeline = false;     // build the Chrome-trace timeline (costs memory on big runs)
  // Ranks sharing a device run their compute ops one at a time, first ready first (the CPU
  // executor's --core-turns), instead of sharing it max-min fairly (streams on one GPU).
  bool device_turns = false;
};

struct LinkStat {
  std::string name;
  std::string kind;  // "intra", "nic", "network", "pcie", "loopback"
  double bandwidth_bytes_per_s = 0;
  double bytes = 0;        // carried over the whole simulation
  double utilization = 0;  // bytes / (bandwidth x simulated time)
};

struct SimResult {
  planner::RunReport report;        // "source": "simulated"; links and run figures in extra
  common::Json timeline;            // Chrome trace event format; null unless options.timeline
  std::vector<LinkStat> links;      // links that carried traffic, by name
  double simulated_s = 0;           // simulated time of all steps
  std::vector<double> step_end_s;   // when each optimizer step had finished on every rank
  std::int64_t activities = 0;      // simulated compute ops, transfers and collective steps
  double wall_s = 0;                // host time the simulation took (not in the report)
  std::int64_t peak_rss_bytes = 0;  // of the simulating process (not in the report)
};

// Simulates `plan` (placed and resolved) in a child process: SimGrid allows one engine per
// process, so this can be called any number of times. Throws InputError / PlanError for bad
// input (e.g. a trace without the plan's microbatch size) and Error if the simulation fails.
SimResult simulate(const models::ModelSpec& model, const traces::Trace& trace,
                   const clusters::Cluster& cluster, const planner::Plan& plan,
                   const SimOptions& options = {});

// The same, in this process. At most once per process (SimGrid's engine is a singleton).
SimResult simulate_in_process(const models::ModelSpec& model, const traces::Trace& trace,
                              const clusters::Cluster& cluster, const planner::Plan& plan,
                              const SimOptions& options = {});

// Refuses, before SimGrid starts, what would make it abort or overflow: a compute time, latency
// or transfer time that is not finite or above 1e9 s, a size that is negative (an overflow) or
// above 2^53 bytes. The InputError names the trace, model or cluster field it comes from.
// simulate_in_process calls it first.
void check_simulable(const models::ModelSpec& model, const traces::Trace& trace,
                     const clusters::Cluster& cluster, const planner::Plan& plan,
                     const SimOptions& options = {});

// Transport of a result between processes (and the report's "links" section).
common::Json to_json(const SimResult& r);
SimResult sim_result_from_json(const common::Json& j);

}  // namespace pw::sim

namespace pw::sim {

struct SimJob {
  models::ModelSpec model;
  traces::Trace trace;
  clusters::Cluster cluster;
  planner::Plan plan;
  SimOptions options;
};

// What became of one job: a result, or the one-line error it raised (the job is not retried).
struct SimOutcome {
  bool ok = false;
  SimResult result;
  std::string error;       // with ok == false
  std::string error_kind;  // "plan", "input" or "error"
};

// Runs the jobs in child processes, at most `parallel` at once (0: one per core), from this thread
// only (no threads: fork stays safe). `progress(done, total)` is called after each job finishes.
// Outcomes are in job order, whatever order the jobs finished in.
std::vector<SimOutcome> simulate_batch(const std::vector<SimJob>& jobs, int parallel = 0,
                                       const std::function<void(int, int)>& progress = {});

}  // namespace pw::sim
