// Closed-form step time and memory of a plan (PipeDream-2BW Appendix A, extended to uneven
// stages, co-located ranks and interleaving). Formulas: docs/formulas.md.
#include "planner/cost_model.hpp"

#include <algorithm>
#include <map>

#include <fmt/format.h>

namespace pw::planner {

using models::LayerKind;

std::int64_t optimizer_bytes_per_parameter(models::DType dtype) {
  return dtype == models::DType::fp32 ? 8 : 12;
}

double ring_allreduce_s(double bytes, int n, const clusters::Link& link) {
  if (n <= 1) return 0;
  return 2.0 * (n - 1) * (link.latency_s + bytes / (n * link.bandwidth_bytes_per_s));
}

namespace {

// Microbatches (or, interleaved, microbatch-chunks) a device stashes at its peak.
std::int64_t in_flight(const Plan& p, int s) {
  switch (p.schedule) {
    case Schedule::gpipe:
      return p.m;
    case Schedule::one_f_one_b:
    case Schedule::two_bw:
      return std::min(p.d - s, p.m);
    case Schedule::dp:
      return 1;
    case Schedule::interleaved:
      return std::min<std::int64_t>(std::int64_t(p.d - s - 1) * 2 + std::int64_t(p.v - 1) * p.d + 1,
                                    std::int64_t(p.m) * p.v);
  }
  return p.m;
}

clusters::Link rank_link(const clusters::Cluster& c, const Plan& p, int ra, int rb) {
  const auto& a = p.placement[ra];
  const auto& b = p.placement[rb];
  return clusters::p2p_link(c, a.node, a.gpu, b.node, b.gpu);
}

// Slowest neighbour link of the ring over the w replicas of stage s.
clusters::Link replica_ring_link(const clusters::Cluster& c, const Plan& p, int s) {
  clusters::Link worst = rank_link(c, p, p.rank_of(s, 0), p.rank_of(s, 1 % p.w));
  for (int r = 1; r < p.w; ++r) {
    clusters::Link l = rank_link(c, p, p.rank_of(s, r), p.rank_of(s, (r + 1) % p.w));
    if (l.bandwidth_bytes_per_s < worst.bandwidth_bytes_per_s ||
        (l.bandwidth_bytes_per_s == worst.bandwidth_bytes_per_s && l.latency_s > worst.latency_s))
      worst = l;
  }
  return worst;
}

// Adds one layer's per-microbatch costs (trace entry at b) to a stage.
void add_layer(StageCost& st, const traces::Trace& trace, const traces::LayerTimes& t,
               LayerKind kind, std::int64_t count, std::int64_t parameters, bool chunk_input) {
  st.forward_s += count * t.forward_s;
  st.backward_s += count * (t.backward_s + (st.recompute ? t.recompute_s : 0.0));
  st.optimizer_s += count * trace.statics[kind].optimizer_step_s;
  st.parameters += count * parameters;
  st.stash_bytes += count * t.activation_bytes;
  if (chunk_input) st.input_bytes += t.activation_recompute_bytes;
  st.memory.workspace = std::max(st.memory.workspace, t.workspace_bytes);
}

StageCost stage_cost(const models::ModelSpec& model, const models::ModelCosts& mc,
                     const traces::Trace& trace, const clusters::Cluster& cluster, const Plan& p,
                     int s) {
  const traces::Entry& e = trace.at(p.b);
  StageCost st;
  st.stage = s;
  st.recompute = p.recomputes(s);
  const int last_vs = p.virtual_stages() - 1;
  for (int c = 0; c < p.v; ++c) {
    const int vs = c * p.d + s;
    const std::int64_t blocks = p.stage_blocks[vs];
    st.blocks += blocks;
    if (vs == 0) {
      st.has_embedding = true;
      add_layer(st, trace, e.layers[LayerKind::embedding], LayerKind::embedding, 1,
                mc.embedding.parameters, true);
    }
    add_layer(st, trace, e.layers[LayerKind::block], LayerKind::block, blocks, mc.block.parameters,
              vs != 0);
    if (vs == last_vs) {
      st.has_head = true;
      add_layer(st, trace, e.layers[LayerKind::head], LayerKind::head, 1, mc.head.parameters,
                false);
      // The tied token embedding lives on stage 0; the head's stage keeps a synchronized copy.
      if (last_vs != 0) st.parameters += mc.tied_copy_parameters;
    }
  }
  const std::int64_t eb = models::dtype_bytes(model.dtype);
  st.memory.weights = st.parameters * eb;
  st.memory.weight_versions = p.schedule == Schedule::two_bw ? st.parameters * eb : 0;
  st.memory.gradients = st.parameters * eb;
  st.memory.optimizer = st.parameters * optimizer_bytes_per_parameter(model.dtype);
  st.in_flight = in_flight(p, s);
  // Interleaved stashes microbatch-chunks: each is on average 1/v of the device's stash.
  const std::int64_t per_unit = p.v > 1 ? st.stash_bytes / p.v : st.stash_bytes;
  const std::int64_t input_unit = p.v > 1 ? st.input_bytes / p.v : st.input_bytes;
  st.memory.activations =
      st.recompute ? st.in_flight * input_unit + st.stash_bytes : st.in_flight * per_unit;
  // Activation (forward) and gradient (backward) cross the link to s+1 once per microbatch-chunk.
  if (p.d > 1 && (s < p.d - 1 || p.v > 1)) {
    const int next = p.rank_of((s + 1) % p.d, 0);
    st.send_s = p.v * rank_link(cluster, p, p.rank_of(s, 0), next)
                          .time_s(double(e.layers[LayerKind::block].output_bytes));
  }
  if (p.w > 1)
    st.allreduce_s =
        ring_allreduce_s(double(st.memory.gradients), p.w, replica_ring_link(cluster, p, s));
  return st;
}

// Forward/backward part of one steady-state step. Uniform stages: (m+d-1)(t_f+t_b) for flush
// schedules, m(t_f+t_b) for 2BW, (m + (d-1)/v)(t_f+t_b) for interleaved.
double pipeline_time(const Plan& p, const std::vector<StageCost>& st) {
  double slowest = 0, sum = 0, comm = 0;
  for (const auto& s : st) {
    slowest = std::max({slowest, s.forward_s + s.backward_s, s.send_s});
    sum += s.forward_s + s.backward_s;
    if (s.stage < p.d - 1) comm += 2 * s.send_s / p.v;
  }
  switch (p.schedule) {
    case Schedule::dp:
      return p.m * slowest;
    case Schedule::two_bw:
      return p.m * slowest;
    case Schedule::interleaved:
      return (p.m - 1.0 / p.v) * slowest + sum / p.v + comm;
    case Schedule::gpipe:
    case Schedule::one_f_one_b:
      return (p.m - 1) * slowest + sum + comm;
  }
  return 0;
}

}  // namespace

Estimate estimate(const models::ModelSpec& model, const traces::Trace& trace,
                  const clusters::Cluster& cluster, const Plan& p) {
  check(p);
  if (int(p.placement.size()) != p.ranks())
    throw PlanError("plan: placement: the plan is not placed");
  if (int(p.stage_blocks.size()) != p.virtual_stages())
    throw PlanError("plan: stage_blocks: the plan's stages are not resolved");
  const models::ModelCosts mc = models::derive_costs(model);
  Estimate est;
  for (int s = 0; s < p.d; ++s)
    est.stages.push_back(stage_cost(model, mc, trace, cluster, p, s));

  // Ranks sharing a GPU serialize their work: a GPU can finish no sooner than its summed compute.
  std::map<std::pair<int, int>, double> gpu_work;
  std::map<std::pair<int, int>, MemoryBreakdown> gpu_memory;
  for (int r = 0; r < p.ranks(); ++r) {
    const auto& st = est.stages[p.stage_of(r)];
    auto key = std::make_pair(p.placement[r].node, p.placement[r].gpu);
    gpu_work[key] += p.m * (st.forward_s + st.backward_s);
    gpu_memory[key] += st.memory;
  }
  est.pipeline_s = pipeline_time(p, est.stages);
  for (const auto& [gpu, work] : gpu_work)
    est.pipeline_s = std::max(est.pipeline_s, work);
  for (const auto& st : est.stages) {
    est.allreduce_s = std::max(est.allreduce_s, st.allreduce_s);
    est.optimizer_s = std::max(est.optimizer_s, st.optimizer_s);
  }

  RunReport& rep = est.report;
  rep.source = "analytic";
  rep.model = model.name;
  rep.cluster = fmt::format("{}:{}", cluster.name, cluster.nodes);  // preset:nodes
  rep.plan = p;
  rep.iteration_time_s = est.pipeline_s + est.allreduce_s + est.optimizer_s;
  rep.samples_per_s = double(p.global_batch()) / rep.iteration_time_s;
  rep.tokens_per_s = rep.samples_per_s * double(model.seq_len);
  rep.model_flops_per_s = rep.samples_per_s * mc.flops_per_sample;
  const double peak = model.dtype == models::DType::fp32 ? cluster.device.peak_fp32_flops_per_s
                                                         : cluster.device.peak_fp16_flops_per_s;
  rep.mfu = rep.model_flops_per_s / (double(gpu_work.size()) * peak);
  for (int r = 0; r < p.ranks(); ++r) {
    const auto& st = est.stages[p.stage_of(r)];
    DeviceReport d;
    d.rank = r;
    d.node = p.placement[r].node;
    d.gpu = p.placement[r].gpu;
    d.stage = p.stage_of(r);
    d.replica = p.replica_of(r);
    d.memory = st.memory;
    d.peak_memory_bytes = gpu_memory[{d.node, d.gpu}].total();
    d.capacity_bytes = cluster.device.memory_bytes;
    d.fits = d.peak_memory_bytes <= d.capacity_bytes;
    d.busy_s = p.m * (st.forward_s + st.backward_s) + st.optimizer_s;
    d.bubble_fraction = 1.0 - d.busy_s / rep.iteration_time_s;
    rep.devices.push_back(d);
  }
  common::Json stages = common::Json::array();
  for (const auto& st : est.stages)
    stages.push_back({{"stage", st.stage},
                      {"blocks", st.blocks},
                      {"embedding", st.has_embedding},
                      {"head", st.has_head},
                      {"recompute", st.recompute},
                      {"parameters", st.parameters},
                      {"forward_s", st.forward_s},
                      {"backward_s", st.backward_s},
                      {"optimizer_s", st.optimizer_s},
                      {"send_s", st.send_s},
                      {"allreduce_s", st.allreduce_s},
                      {"in_flight_microbatches", st.in_flight},
                      {"stash_bytes_per_microbatch", st.stash_bytes},
                      {"input_bytes_per_microbatch", st.input_bytes}});
  rep.extra["estimate"] = {{"pipeline_s", est.pipeline_s},
                           {"allreduce_s", est.allreduce_s},
                           {"optimizer_s", est.optimizer_s},
                           {"trace_source", trace.source.kind},
                           {"stages", stages}};
  return est;
}

}  // namespace pw::planner
