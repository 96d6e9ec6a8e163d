// One measured run -> model, plan, cluster -> closed-form iteration time.
#include "calibrate/predict.hpp"

#include <fmt/format.h>

#include "planner/cost_model.hpp"
#include "traces/analytic.hpp"

namespace pw::calibrate {

models::ModelSpec row_model(const Measurement& m) {
  models::ModelSpec s;
  s.name = fmt::format("gpt-h{}-l{}-s{}", m.hidden, m.layers, m.seq_len);
  s.arch = models::Arch::gpt;
  s.layers = m.layers;
  s.hidden = m.hidden;
  s.heads = m.heads;
  s.kv_heads = m.heads;
  s.ffn = m.ffn.value_or(4 * m.hidden);
  s.seq_len = m.seq_len;
  s.vocab = m.vocab.value_or(50257);
  s.max_positions = m.seq_len;
  s.dtype = m.dtype ? models::parse_dtype(*m.dtype) : models::DType::fp16;
  s.attention = models::Attention::unfused;
  if (m.attention && *m.attention == "fused")
    s.attention = models::Attention::fused;
  else if (m.attention && *m.attention != "unfused")
    throw InputError(
        fmt::format("{}: attention: \"{}\" is neither fused nor unfused", m.where, *m.attention));
  s.dropout = m.dropout.value_or(true);
  s.vocab_multiple = m.vocab_multiple.value_or(128);
  s.description = "measured run " + m.where;
  models::validate(s, m.where);
  return s;
}

RowSetup setup_row(const Measurement& m, const clusters::Cluster& cluster) {
  RowSetup r;
  r.model = row_model(m);
  r.cluster = cluster;
  if (m.gpus <= cluster.gpus_per_node) {
    r.cluster.nodes = 1;  // a plan may use the first GPUs of a node
  } else if (m.gpus % cluster.gpus_per_node == 0) {
    r.cluster.nodes = m.gpus / cluster.gpus_per_node;
  } else {
    throw PlanError(fmt::format("{}: {} GPUs are not whole nodes of {} ({})", m.where, m.gpus,
                                cluster.gpus_per_node, cluster.name));
  }
  planner::Plan& p = r.plan;
  p.schedule = planner::Schedule::one_f_one_b;
  p.t = m.t;
  p.w = m.w;
  p.d = m.d;
  p.b = int(m.micro_batch);
  p.m = int(m.global_batch / (m.micro_batch * m.w));
  p.recompute.assign(std::size_t(p.d), planner::Recompute::full);
  planner::resolve_stages(p, r.model.layers);
  return r;
}

double predict_s(const RowSetup& row, const clusters::DeviceSpec& device) {
  const traces::Trace trace =
      traces::analytic_trace(row.model, device, {row.plan.b}, {row.plan.t, false});
  clusters::Cluster cluster = row.cluster;
  cluster.device = device;
  planner::Plan plan = row.plan;
  planner::place(plan, {cluster.nodes, cluster.gpus_per_node});
  return planner::estimate(row.model, trace, cluster, plan).report.iteration_time_s;
}

}  // namespace pw::calibrate
