// The closed-form cost model (PipeDream-2BW, Appendix A): step time, throughput and per-device
// memory of a plan from a trace and a cluster. Every formula: docs/formulas.md.
#pragma once

#include <cstdint>
#include <vector>

#include "clusters/cluster.hpp"
#include "models/model.hpp"
#include "planner/plan.hpp"
#include "planner/report.hpp"
#include "traces/trace.hpp"

namespace pw::planner {

// What one model chunk (the layers of one virtual stage) costs for one microbatch of size b.
// The simulator replays these; the closed form sums them per stage.
struct ChunkCost {
  int stage = 0;
  int chunk = 0;
  int virtual_stage = 0;
  std::int64_t blocks = 0;
  bool has_embedding = false;
  bool has_head = false;
  double forward_s = 0;
  double backward_s = 0;   // without the recompute forward
  double recompute_s = 0;  // the recompute forward before the backward
  double optimizer_s = 0;
  std::int64_t parameters = 0;       // including the tied-embedding copy on the last stage
  std::int64_t stash_bytes = 0;      // one microbatch's stash without recompute
  std::int64_t input_bytes = 0;      // the chunk's input (all it keeps with recompute)
  std::int64_t output_bytes = 0;     // activation sent to the next virtual stage (0 for the last)
  std::int64_t workspace_bytes = 0;  // largest transient of its layers
};

ChunkCost chunk_cost(const models::ModelCosts& mc, const traces::Trace& trace, const Plan& plan,
                     int stage, int chunk);

// What one pipeline stage (all chunks a device holds) costs for one microbatch of size b.
struct StageCost {
  int stage = 0;
  std::int64_t blocks = 0;
  bool has_embedding = false;
  bool has_head = false;
  bool recompute = false;
  std::int64_t parameters = 0;   // including the tied-embedding copy on the last stage
  double forward_s = 0;          // t_f(s)
  double backward_s = 0;         // t_b(s), including the recompute forward when recomputing
  double optimizer_s = 0;        // AdamW over the stage's parameters
  double send_s = 0;             // activation to stage s+1 (and gradient back), one microbatch
  double allreduce_s = 0;        // ring all-reduce of the stage's gradients over w replicas
  std::int64_t in_flight = 0;    // microbatches stashed at once (n_s)
  std::int64_t stash_bytes = 0;  // A_s(b): one microbatch's stash without recompute
  std::int64_t input_bytes = 0;  // I_s(b): one microbatch's stage input (kept with recompute)
  MemoryBreakdown memory;        // one rank of this stage
};

struct Estimate {
  std::vector<StageCost> stages;
  double pipeline_s = 0;   // forward/backward part of a step, communication included
  double allreduce_s = 0;  // exposed data-parallel all-reduce (slowest stage)
  double tied_s = 0;       // exposed tied-embedding exchange (gradient, then new weights)
  double optimizer_s = 0;  // slowest stage's optimizer step
  RunReport report;        // source "analytic", with "estimate" details in report.extra
};

// `plan` must be placed (place()) and resolved (resolve_stages()); `trace` must hold plan.b.
// Throws InputError when the trace lacks the microbatch size, PlanError when the plan does not
// match the model or cluster.
Estimate estimate(const models::ModelSpec& model, const traces::Trace& trace,
                  const clusters::Cluster& cluster, const Plan& plan);

// Bytes of optimizer state per parameter: AdamW m and v in fp32, plus an fp32 master copy when
// the compute dtype is 16-bit.
std::int64_t optimizer_bytes_per_parameter(models::DType dtype);

// Fills samples/s, tokens/s, model FLOP/s and MFU of a report from its iteration time and plan.
void set_throughput(RunReport& r, const models::ModelSpec& model, const clusters::Cluster& cluster,
                    int gpus_used);

// Ring all-reduce time of `bytes` over n participants on a link: 2(n-1)(alpha + bytes/(n*beta)).
double ring_allreduce_s(double bytes, int n, const clusters::Link& link);

}  // namespace pw::planner
