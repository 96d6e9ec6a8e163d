// check_simulable: what SimGrid cannot take, refused before it starts (see simulator.hpp).
#include <algorithm>
#include <cmath>
#include <string>

#include <fmt/format.h>

#include "planner/cost_model.hpp"
#include "sim/platform.hpp"
#include "sim/simulator.hpp"

namespace pw::sim {

namespace {

// SimGrid aborts (in a context where no exception can be reported) on a non-finite or negative
// duration or size; these bounds keep every sum the replay makes finite and exact enough.
constexpr double kMaxSeconds = 1e9;                     // one op, latency or message: ~32 years
constexpr double kMaxBytes = 9007199254740992.0;        // 2^53: sizes are doubles in SimGrid
constexpr const char* kMaxBytesText = "2^53 (9.0e15)";  // for messages

bool bad_seconds(double s) {
  return !(s >= 0 && s <= kMaxSeconds);  // false for NaN too
}

bool bad_bytes(double b) {
  return !(b >= 0 && b <= kMaxBytes);
}

// The cluster fields a link of `kind` is made of (for the error message).
struct LinkFields {
  const char* bandwidth;
  const char* latency;
  double latency_s;  // the field's value
};

LinkFields fields_of(const clusters::Cluster& c, const std::string& kind) {
  if (kind == "memory") return {"device.memory_bandwidth_bytes_per_s", "", 0};
  if (kind == "intra")
    return {"intra_node.bandwidth_bytes_per_s (x efficiency)", "intra_node.latency_s",
            c.intra_node.latency_s};
  if (kind == "pcie")
    return {"host.pcie_bandwidth_bytes_per_s", "host.pcie_latency_s", c.host.pcie_latency_s};
  if (kind == "uplink") return {"host.uplink_bandwidth_bytes_per_s", "", 0};
  return {"network.bandwidth_bytes_per_s (x efficiency / oversubscription)", "network.latency_s",
          c.network.latency_s};
}

}  // namespace

void check_simulable(const models::ModelSpec& model, const traces::Trace& trace,
                     const clusters::Cluster& cluster, const planner::Plan& plan,
                     const SimOptions& options) {
  const planner::Plan& p = plan;
  const models::ModelCosts mc = models::derive_costs(model, {p.t, p.sp});
  const double e = double(models::dtype_bytes(model.dtype));
  const auto size_error = [&](int stage, int chunk, const char* what, double bytes) {
    return InputError(fmt::format(
        "model {}: stage {} chunk {}: {} of {} bytes, outside 0 to {}: the model's sizes (hidden "
        "{}, ffn {}, layers {}, seq_len {}, vocab {}) are too large to simulate",
        model.name, stage, chunk, what, bytes, kMaxBytesText, model.hidden, model.ffn, model.layers,
        model.seq_len, model.vocab));
  };
  double largest_message = 0;  // bytes, over any one link
  for (int s = 0; s < p.d; ++s) {
    double parameters = 0;
    for (int c = 0; c < p.v; ++c) {
      const planner::ChunkCost ch = planner::chunk_cost(mc, trace, p, s, c);
      const std::pair<const char*, double> sizes[] = {
          {"an activation", double(ch.output_bytes)},
          {"an input gradient", double(ch.input_bytes)},
          {"a stash", double(ch.stash_bytes)},
          {"a selective stash", double(ch.selective_bytes)},
          {"a workspace", double(ch.workspace_bytes)},
          {"a tensor-parallel forward", ch.tp_forward.equivalent_allreduce_bytes()},
          {"a tensor-parallel backward", ch.tp_backward.equivalent_allreduce_bytes()},
          {"a tensor-parallel backward beside the weight gradients",
           ch.tp_backward_wgrad.equivalent_allreduce_bytes()},
          {"a tensor-parallel backward beside the input gradients",
           ch.tp_backward_dgrad.equivalent_allreduce_bytes()},
          {"the parameters", double(ch.parameters) * e}};
      for (const auto& [what, bytes] : sizes)
        if (bad_bytes(bytes)) throw size_error(s, c, what, bytes);
      const std::pair<const char*, double> times[] = {
          {"forward", ch.forward_s},
          {"backward", ch.backward_s},
          {"backward weight-gradient GEMMs", ch.backward_weight_s},
          {"backward input-gradient GEMMs", ch.backward_input_s},
          {"recompute", ch.recompute_s},
          {"selective recompute", ch.selective_recompute_s},
          {"optimizer step", ch.optimizer_s}};
      for (const auto& [what, seconds] : times)
        if (bad_seconds(seconds))
          throw InputError(fmt::format(
              "{}: stage {} chunk {}: the {} of a microbatch of {} takes {} s, outside 0 to {:g} s "
              "(check the trace's times, or the device's peak_*_flops_per_s and "
              "memory_bandwidth_bytes_per_s an analytic trace is derived from)",
              trace.origin, s, c, what, p.b, seconds, kMaxSeconds));
      largest_message = std::max({largest_message, double(ch.output_bytes), double(ch.input_bytes),
                                  double(ch.parameters) * e});
      parameters += double(ch.parameters);
    }
    if (bad_bytes(parameters * e)) throw size_error(s, 0, "a weight version", parameters * e);
  }
  const double tied = double(mc.tied_copy_parameters) * e;
  if (bad_bytes(tied)) throw size_error(p.d - 1, p.v - 1, "the tied embedding", tied);
  largest_message = std::max(largest_message, tied);

  // Links: finite latencies within the bound, bandwidths that move the largest message within it.
  std::vector<LinkSpec> links = node_model(cluster, 0).links;
  if (has_backbone(cluster, {})) links.push_back(backbone_spec(cluster));
  for (const LinkSpec& l : links) {
    const LinkFields f = fields_of(cluster, l.kind);
    if (bad_seconds(l.latency_s) || bad_seconds(f.latency_s))
      throw InputError(fmt::format("cluster {}: {} = {} s, outside 0 to {:g} s", cluster.name,
                                   f.latency, f.latency_s, kMaxSeconds));
    const double bw = l.bandwidth_bytes_per_s;
    if (!(bw > 0) || !std::isfinite(bw) || bad_seconds(largest_message / bw))
      throw InputError(fmt::format(
          "cluster {}: {} gives link {} {} bytes/s, which moves the largest message ({} bytes) "
          "in {} s, outside 0 to {:g} s",
          cluster.name, f.bandwidth, l.name, bw, largest_message, largest_message / bw,
          kMaxSeconds));
  }
  if (options.steps < 1) throw InputError("--steps must be at least 1");
}

}  // namespace pw::sim
