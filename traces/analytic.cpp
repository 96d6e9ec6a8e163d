// Roofline trace generator: GEMM time at a size-dependent fraction of peak plus elementwise
// traffic at HBM bandwidth, per layer kind and microbatch size.
#include "traces/analytic.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "common/limits.hpp"

namespace pw::traces {

namespace {

// GPU time g with the launch floor o: max(g, o) when p = 0, else (g^p + o^p)^(1/p), which is
// above both and approaches max(g, o) as p grows (scaled by the larger, so no underflow).
double with_floor(double g, double o, double p) {
  const double top = std::max(g, o);
  if (p == 0 || top == 0) return top;
  return top * std::pow(std::pow(g / top, p) + std::pow(o / top, p), 1 / p);
}

double dim_factor(std::int64_t x, double half_dim) {
  return double(x) / (double(x) + half_dim);
}

struct GemmTimes {
  double weight_s = 0;     // GEMMs with a weight operand
  double attention_s = 0;  // activation x activation matmuls
  double scores_s = 0;     // Q K^T alone (FlashAttention's backward recomputes it)
};

GemmTimes layer_gemm_times(const models::ModelSpec& spec, models::LayerKind kind, std::int64_t b,
                           const models::Sharding& sharding, const clusters::DeviceSpec& d) {
  GemmTimes t;
  for (const auto& g : models::forward_gemms(spec, kind, b, sharding)) {
    const double s = gemm_time_s(g, d, spec.dtype);
    (is_weight_gemm(g) ? t.weight_s : t.attention_s) += s;
    if (g.label == "attn_scores") t.scores_s += s;
  }
  return t;
}

LayerTimes layer_times(const models::ModelSpec& spec, const models::LayerCosts& costs,
                       std::int64_t b, const models::Sharding& sharding,
                       const clusters::DeviceSpec& d) {
  const GemmTimes g = layer_gemm_times(spec, costs.kind, b, sharding, d);
  const double bw = d.memory_bandwidth_bytes_per_s * d.efficiency.elementwise;
  const double elementwise_s = costs.elementwise_bytes * double(b) / bw;
  const double overhead_s = d.efficiency.layer_overhead_s;
  const bool fused = spec.attention == models::Attention::fused;
  LayerTimes t;
  // The host issues a layer's kernels at a bounded rate while the GPU runs them: a layer takes at
  // least the issue time (launch-bound), else its GPU time (layer_overhead_s, 0 by default).
  t.forward_s = with_floor(g.weight_s + g.attention_s + elementwise_s, overhead_s,
                           d.efficiency.overhead_exponent);
  // dX of each weight GEMM has its forward shape; each attention matmul needs two (dQ and dK,
  // dP and dV), of shapes with the same efficiency and traffic as the forward one. Fused
  // attention recomputes Q K^T in its backward (time here, not model FLOPs).
  t.backward_input_s = g.weight_s + 2 * g.attention_s + (fused ? g.scores_s : 0.0);
  t.backward_weight_s = g.weight_s;
  // The elementwise backward reads the saved input and the incoming gradient and writes one.
  // A backward issues about twice a forward's kernels: twice the floor.
  t.backward_s = with_floor(t.backward_input_s + t.backward_weight_s + 2 * elementwise_s,
                            2 * overhead_s, d.efficiency.overhead_exponent);
  t.recompute_s = t.forward_s;
  // Selective recompute re-runs the unfused attention core (its matmuls, softmax and dropout);
  // fused attention stashes nothing to drop.
  t.selective_recompute_s =
      costs.selective_recompute_flops > 0
          ? g.attention_s + costs.selective_recompute_elementwise_bytes * double(b) / bw
          : 0.0;
  // Checked: a per-sample size (< 2^53) times b (<= 10^6) may pass int64.
  auto times_b = [&](std::int64_t bytes, const char* what) {
    return common::checked_mul(bytes, b,
                               fmt::format("analytic trace: {} {} bytes per sample x b",
                                           models::to_string(costs.kind), what),
                               common::kMaxBytes);
  };
  t.activation_bytes = times_b(costs.activation_bytes, "activation");
  t.activation_recompute_bytes = times_b(costs.activation_recompute_bytes, "activation");
  t.activation_selective_bytes = times_b(costs.activation_selective_bytes, "activation");
  t.output_bytes = times_b(costs.output_bytes, "output");
  t.workspace_bytes = times_b(costs.workspace_bytes, "workspace");
  return t;
}

std::vector<std::int64_t> checked_sizes(std::vector<std::int64_t> sizes) {
  if (sizes.empty()) throw InputError("analytic trace: no microbatch sizes given");
  std::sort(sizes.begin(), sizes.end());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 1 || sizes[i] > common::kMaxCount)
      throw InputError(fmt::format("analytic trace: microbatch size must be in 1 .. {}, found {}",
                                   common::kMaxCount, sizes[i]));
    if (i > 0 && sizes[i] == sizes[i - 1])
      throw InputError(fmt::format("analytic trace: microbatch size {} given twice", sizes[i]));
  }
  return sizes;
}

}  // namespace

double peak_flops_per_s(const clusters::DeviceSpec& d, models::DType t) {
  return t == models::DType::fp32 ? d.peak_fp32_flops_per_s : d.peak_fp16_flops_per_s;
}

bool is_weight_gemm(const models::Gemm& g) {
  return g.has_weight;
}

double gemm_efficiency(const models::Gemm& g, const clusters::DeviceSpec& d, models::DType t) {
  const clusters::DeviceEfficiency& e = d.efficiency;
  // Same association as before the parameters moved into the device: defaults are bit-identical.
  const double compute = e.gemm_max * dim_factor(g.m, e.gemm_half_dim) *
                         dim_factor(g.n, e.gemm_half_dim) * dim_factor(g.k, e.gemm_half_dim) *
                         (is_weight_gemm(g) ? 1.0 : e.attention);
  // Memory roofline: A, B and C each cross HBM once.
  const double bytes = double(models::dtype_bytes(t)) * double(g.batch) *
                       (double(g.m) * g.k + double(g.k) * g.n + double(g.m) * g.n);
  const double intensity_flops_per_byte = g.flops() / bytes;
  const double memory =
      intensity_flops_per_byte * d.memory_bandwidth_bytes_per_s / peak_flops_per_s(d, t);
  return std::min(compute, memory);
}

double gemm_time_s(const models::Gemm& g, const clusters::DeviceSpec& d, models::DType t) {
  if (g.flops() <= 0) return 0;
  return g.flops() / (peak_flops_per_s(d, t) * gemm_efficiency(g, d, t));
}

double adamw_bytes_per_parameter(models::DType t) {
  const double moments = 16;                             // m and v, fp32, read + write
  if (t == models::DType::fp32) return moments + 8 + 4;  // weights r+w, fp32 gradient read
  const double e = models::dtype_bytes(t);
  return moments + 8 + e + e;  // fp32 master r+w, 16-bit gradient read, 16-bit weight write
}

Trace analytic_trace(const models::ModelSpec& spec, const clusters::DeviceSpec& device,
                     const std::vector<std::int64_t>& microbatch_sizes,
                     const models::Sharding& sharding) {
  const auto sizes = checked_sizes(microbatch_sizes);
  const models::ModelCosts costs = models::derive_costs(spec, sharding);
  // Bytes scale with b: refuse a b that would wrap them.
  for (auto k : kLayerKinds) {
    const auto& c = costs.layer(k);
    const std::int64_t widest =
        std::max({c.activation_bytes, c.workspace_bytes, c.output_bytes, std::int64_t(1)});
    if (sizes.back() > std::numeric_limits<std::int64_t>::max() / widest)
      throw InputError(fmt::format("analytic trace: microbatch size {} is too large for {}",
                                   sizes.back(), spec.name));
  }
  Trace t;
  t.model = spec.name;
  t.device = device.name;
  t.dtype = spec.dtype;
  t.sharding = sharding;
  t.source = {"analytic", device.name, "", "",
              fmt::format("pipewright {} analytic roofline", PW_VERSION)};
  t.origin =
      fmt::format("analytic({}, {}, {})", spec.name, device.name, models::to_string(spec.dtype));
  for (auto k : kLayerKinds) {
    const auto p = costs.layer(k).parameters;
    t.statics[k] = {p, p * models::dtype_bytes(spec.dtype),
                    adamw_bytes_per_parameter(spec.dtype) * double(p) /
                        (device.memory_bandwidth_bytes_per_s * device.efficiency.optimizer)};
  }
  for (auto b : sizes) {
    Entry e;
    e.microbatch_size = b;
    for (auto k : kLayerKinds)
      e.layers[k] = layer_times(spec, costs.layer(k), b, sharding, device);
    t.entries.push_back(e);
  }
  return t;
}

}  // namespace pw::traces
