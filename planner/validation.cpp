// Prediction against measurement: plan comparison, per-rank errors, the validation JSON.
#include "planner/validation.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace pw::planner {

using common::Json;

Compared compare(double predicted, double measured) {
  Compared c{predicted, measured, 0.0};
  if (measured != 0)
    c.error = (predicted - measured) / measured;
  else if (predicted != 0)
    c.error = std::numeric_limits<double>::quiet_NaN();
  return c;
}

namespace {

std::vector<std::string> recompute_list(const Plan& p) {
  std::vector<std::string> r;
  for (int s = 0; s < p.d; ++s)
    r.push_back(to_string(p.recompute_of(s)));
  return r;
}

template <typename T>
std::string show(const T& v) {
  return fmt::format("{}", v);
}

template <typename T>
std::string show(const std::vector<T>& v) {
  return fmt::format("[{}]", fmt::join(v, ", "));
}

Json compared_json(const Compared& c) {
  return {{"predicted", c.predicted}, {"measured", c.measured}, {"error", c.error}};
}

// Byte counts stay integers in the file.
Json compared_bytes_json(const Compared& c) {
  return {{"predicted", std::int64_t(c.predicted)},
          {"measured", std::int64_t(c.measured)},
          {"error", c.error}};
}

Json memory_json(const MemoryBreakdown& m) {
  return {{"weights", m.weights},         {"weight_versions", m.weight_versions},
          {"gradients", m.gradients},     {"optimizer", m.optimizer},
          {"activations", m.activations}, {"workspace", m.workspace}};
}

Json source_json(const std::string& source, const std::string& cluster, double iteration_time_s,
                 double samples_per_s) {
  return {{"source", source},
          {"cluster", cluster},
          {"iteration_time_s", iteration_time_s},
          {"samples_per_s", samples_per_s}};
}

}  // namespace

std::string plan_difference(const Plan& a, const Plan& b, const std::string& name_a,
                            const std::string& name_b) {
  auto differ = [&](const char* field, const std::string& x, const std::string& y) {
    return fmt::format("/plan/{}: {} in {} but {} in {}", field, x, name_a, y, name_b);
  };
  if (a.schedule != b.schedule)
    return differ("schedule", to_string(a.schedule), to_string(b.schedule));
  if (a.w != b.w) return differ("w", show(a.w), show(b.w));
  if (a.d != b.d) return differ("d", show(a.d), show(b.d));
  if (a.b != b.b) return differ("b", show(a.b), show(b.b));
  if (a.m != b.m) return differ("m", show(a.m), show(b.m));
  if (a.v != b.v) return differ("v", show(a.v), show(b.v));
  if (a.stage_blocks != b.stage_blocks)
    return differ("stage_blocks", show(a.stage_blocks), show(b.stage_blocks));
  if (recompute_list(a) != recompute_list(b))
    return differ("recompute", show(recompute_list(a)), show(recompute_list(b)));
  return "";
}

Validation validate(const RunReport& predicted, const RunReport& measured,
                    const std::string& predicted_name, const std::string& measured_name) {
  if (predicted.source != "simulated" && predicted.source != "analytic")
    throw InputError(
        fmt::format("{}: /source: the prediction must be simulated or analytic, found "
                    "\"{}\"",
                    predicted_name, predicted.source));
  if (measured.source != "measured")
    throw InputError(fmt::format("{}: /source: the measurement must be measured, found \"{}\"",
                                 measured_name, measured.source));
  if (predicted.model != measured.model)
    throw InputError(fmt::format("/model: \"{}\" in {} but \"{}\" in {}", predicted.model,
                                 predicted_name, measured.model, measured_name));
  const std::string diff =
      plan_difference(predicted.plan, measured.plan, predicted_name, measured_name);
  if (!diff.empty()) throw InputError("the plans differ: " + diff);
  const int ranks = predicted.plan.ranks();
  // A prediction has one entry per rank (a TP group's GPUs alike); a measurement with t > 1 one
  // per GPU, `rank` then the device: rank * t + TP index (the executor's numbering).
  const int t = predicted.plan.t;
  auto by_rank = [&](const RunReport& r, const std::string& name, int per) {
    const int entries = ranks * per;
    std::vector<const DeviceReport*> out(std::size_t(entries), nullptr);
    for (std::size_t i = 0; i < r.devices.size(); ++i) {
      const DeviceReport& d = r.devices[i];
      if (d.rank < 0 || d.rank >= entries)
        throw InputError(fmt::format("{}: /devices/{}/rank: {} is not a {} of a plan of {}", name,
                                     i, d.rank, per > 1 ? "device" : "rank",
                                     per > 1 ? fmt::format("{} ranks x t = {}", ranks, per)
                                             : fmt::format("{} ranks", ranks)));
      if (out[std::size_t(d.rank)])
        throw InputError(
            fmt::format("{}: /devices/{}/rank: rank {} appears twice", name, i, d.rank));
      out[std::size_t(d.rank)] = &d;
    }
    for (int rank = 0; rank < entries; ++rank)
      if (!out[std::size_t(rank)])
        throw InputError(fmt::format("{}: /devices: no entry for {} {}", name,
                                     per > 1 ? "device" : "rank", rank));
    return out;
  };
  const auto p = by_rank(predicted, predicted_name, 1);
  // A measurement of a TP plan may list its ranks (one GPU each) or every GPU.
  const int per = t > 1 && int(measured.devices.size()) == ranks * t ? t : 1;
  const auto m = by_rank(measured, measured_name, per);

  Validation v;
  v.model = predicted.model;
  v.plan = predicted.plan;
  v.predicted_source = predicted.source;
  v.measured_source = measured.source;
  v.predicted_cluster = predicted.cluster;
  v.measured_cluster = measured.cluster;
  v.iteration_time_s = compare(predicted.iteration_time_s, measured.iteration_time_s);
  v.samples_per_s = compare(predicted.samples_per_s, measured.samples_per_s);
  if (measured.extra.contains("step_times_s") && measured.extra["step_times_s"].is_array())
    for (const auto& t : measured.extra["step_times_s"])
      if (t.is_number()) v.measured_step_times_s.push_back(t.get<double>());
  if (v.measured_step_times_s.size() > 1) {
    std::vector<double> t(v.measured_step_times_s.begin() + 1, v.measured_step_times_s.end());
    std::sort(t.begin(), t.end());
    const std::size_t n = t.size();
    const double median = n % 2 == 1 ? t[n / 2] : (t[n / 2 - 1] + t[n / 2]) / 2;
    v.has_median_step = true;
    v.median_step_time_s = compare(predicted.iteration_time_s, median);
  }
  const auto copied = [](const RunReport& r) {
    const Json& o = r.extra["offload"];
    return o.value("copy_out_bytes_per_step", 0.0) + o.value("copy_in_bytes_per_step", 0.0);
  };
  if (predicted.extra.contains("offload") && measured.extra.contains("offload")) {
    v.has_copies = true;
    v.copy_bytes_per_step = compare(copied(predicted), copied(measured));
  }
  for (int device = 0; device < ranks * per; ++device) {
    const int rank = device / per;
    const DeviceReport& a = *p[std::size_t(rank)];
    const DeviceReport& b = *m[std::size_t(device)];
    DeviceValidation d;
    d.rank = rank;
    d.tp = device % per;
    d.stage = a.stage;
    d.replica = a.replica;
    d.busy_s = compare(a.busy_s, b.busy_s);
    d.bubble_fraction = {a.bubble_fraction, b.bubble_fraction,
                         a.bubble_fraction - b.bubble_fraction};
    d.predicted_memory = a.memory;
    d.measured_memory = b.memory;
    d.peak_memory_bytes = compare(double(a.memory.total()), double(b.memory.total()));
    v.max_abs_busy_error = std::max(v.max_abs_busy_error, std::abs(d.busy_s.error));
    v.max_abs_memory_error = std::max(v.max_abs_memory_error, std::abs(d.peak_memory_bytes.error));
    v.devices.push_back(d);
  }
  return v;
}

Json to_json(const Validation& v, const Json& machine, const Json& files) {
  Json devices = Json::array();
  for (const auto& d : v.devices) {
    devices.push_back({{"rank", d.rank},
                       {"stage", d.stage},
                       {"replica", d.replica},
                       {"busy_s", compared_json(d.busy_s)},
                       {"bubble_fraction", compared_json(d.bubble_fraction)},
                       {"peak_memory_bytes", compared_bytes_json(d.peak_memory_bytes)},
                       {"memory_breakdown_bytes",
                        {{"predicted", memory_json(d.predicted_memory)},
                         {"measured", memory_json(d.measured_memory)}}}});
    if (v.plan.t > 1) devices.back()["tp"] = d.tp;  // one row per GPU of the rank's TP group
  }
  Json measured = source_json(v.measured_source, v.measured_cluster, v.iteration_time_s.measured,
                              v.samples_per_s.measured);
  measured["step_times_s"] = v.measured_step_times_s;
  return {{"format", "pipewright.validation/1"},
          {"model", v.model},
          {"plan", to_json(v.plan)},
          {"machine", machine},
          {"files", files},
          {"predicted", source_json(v.predicted_source, v.predicted_cluster,
                                    v.iteration_time_s.predicted, v.samples_per_s.predicted)},
          {"measured", measured},
          {"iteration_time_s", compared_json(v.iteration_time_s)},
          {"median_step_time_s",
           v.has_median_step ? compared_json(v.median_step_time_s) : Json(nullptr)},
          {"samples_per_s", compared_json(v.samples_per_s)},
          {"max_abs_busy_error", v.max_abs_busy_error},
          {"max_abs_memory_error", v.max_abs_memory_error},
          {"copy_bytes_per_step",
           v.has_copies ? compared_bytes_json(v.copy_bytes_per_step) : Json(nullptr)},
          {"devices", devices}};
}

}  // namespace pw::planner
