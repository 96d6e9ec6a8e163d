// Run report JSON: writer and strict reader.
#include "planner/report.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "common/format.hpp"
#include "common/limits.hpp"

namespace pw::planner {

using common::Json;
using common::JsonReader;

MemoryBreakdown& MemoryBreakdown::operator+=(const MemoryBreakdown& o) {
  // Co-located ranks' memory adds up: checked, at most kMaxBytes per term (so total() fits too).
  auto add = [](std::int64_t a, std::int64_t b) {
    return common::checked_add(a, b, "plan: bytes per device", common::kMaxBytes);
  };
  weights = add(weights, o.weights);
  weight_versions = add(weight_versions, o.weight_versions);
  gradients = add(gradients, o.gradients);
  optimizer = add(optimizer, o.optimizer);
  activations = add(activations, o.activations);
  workspace = add(workspace, o.workspace);
  return *this;
}

bool RunReport::fits() const {
  return std::all_of(devices.begin(), devices.end(),
                     [](const DeviceReport& d) { return d.fits; }) &&
         std::all_of(hosts.begin(), hosts.end(), [](const HostReport& h) { return h.fits(); });
}

namespace {

Json memory_json(const MemoryBreakdown& m) {
  return {{"weights", m.weights},         {"weight_versions", m.weight_versions},
          {"gradients", m.gradients},     {"optimizer", m.optimizer},
          {"activations", m.activations}, {"workspace", m.workspace}};
}

std::int64_t bytes(const JsonReader& r, const std::string& key) {
  return r.get_int_in(key, 0, common::kMaxBytes);
}

MemoryBreakdown parse_memory(const JsonReader& r) {
  MemoryBreakdown m;
  m.weights = bytes(r, "weights");
  m.weight_versions = bytes(r, "weight_versions");
  m.gradients = bytes(r, "gradients");
  m.optimizer = bytes(r, "optimizer");
  m.activations = bytes(r, "activations");
  m.workspace = bytes(r, "workspace");
  return m;
}

}  // namespace

Json to_json(const RunReport& r) {
  Json devices = Json::array();
  for (const auto& d : r.devices)
    devices.push_back({{"rank", d.rank},
                       {"node", d.node},
                       {"gpu", d.gpu},
                       {"stage", d.stage},
                       {"replica", d.replica},
                       {"peak_memory_bytes", d.peak_memory_bytes},
                       {"capacity_bytes", d.capacity_bytes},
                       {"fits", d.fits},
                       {"memory_breakdown_bytes", memory_json(d.memory)},
                       {"busy_s", d.busy_s},
                       {"bubble_fraction", d.bubble_fraction}});
  Json j = {{"format", "pipewright.report/1"},
            {"source", r.source},
            {"model", r.model},
            {"cluster", r.cluster},
            {"plan", to_json(r.plan)},
            {"iteration_time_s", r.iteration_time_s},
            {"samples_per_s", r.samples_per_s},
            {"tokens_per_s", r.tokens_per_s},
            {"model_flops_per_s", r.model_flops_per_s},
            {"mfu", r.mfu},
            {"fits", r.fits()},
            {"devices", devices}};
  if (!r.hosts.empty()) {
    Json hosts = Json::array();
    for (const auto& h : r.hosts)
      hosts.push_back({{"node", h.node},
                       {"peak_memory_bytes", h.peak_memory_bytes},
                       {"capacity_bytes", h.capacity_bytes},
                       {"pinned_bytes", h.pinned_bytes},
                       {"pinned_capacity_bytes", h.pinned_capacity_bytes},
                       {"fits", h.fits()}});
    j["hosts"] = hosts;
  }
  if (!r.timeline.empty()) j["timeline"] = r.timeline;
  for (auto it = r.extra.begin(); it != r.extra.end(); ++it)
    j[it.key()] = it.value();
  return j;
}

RunReport parse_report(const Json& json, const std::string& source) {
  JsonReader r(json, source);
  r.expect_format("pipewright.report/1");
  RunReport rep;
  rep.source = r.get_string("source");
  if (rep.source != "analytic" && rep.source != "simulated" && rep.source != "measured")
    r.fail_member("source",
                  "expected analytic, simulated or measured, found \"" + rep.source + "\"");
  rep.model = r.get_string("model");
  rep.cluster = r.get_string("cluster");
  rep.plan = parse_plan(r.at("plan").value(), source);
  rep.iteration_time_s = r.get_nonnegative("iteration_time_s");
  rep.samples_per_s = r.get_nonnegative("samples_per_s");
  rep.tokens_per_s = r.get_nonnegative("tokens_per_s");
  rep.model_flops_per_s = r.get_nonnegative("model_flops_per_s");
  rep.mfu = r.get_nonnegative("mfu");
  auto devs = r.at("devices");
  for (std::size_t i = 0; i < devs.size(); ++i) {
    auto d = devs.at(i);
    DeviceReport dr;
    dr.rank = d.get_index("rank");
    dr.node = d.get_index("node");
    dr.gpu = d.has("gpu") ? d.get_index("gpu") : 0;
    dr.stage = d.get_index("stage");
    dr.replica = d.get_index("replica");
    dr.peak_memory_bytes = bytes(d, "peak_memory_bytes");
    if (d.has("capacity_bytes")) dr.capacity_bytes = bytes(d, "capacity_bytes");
    if (d.has("fits")) dr.fits = d.get_bool("fits");
    dr.memory = parse_memory(d.at("memory_breakdown_bytes"));
    dr.busy_s = d.get_nonnegative("busy_s");
    dr.bubble_fraction = d.get_number("bubble_fraction");
    rep.devices.push_back(dr);
  }
  if (auto hosts = r.find("hosts"))
    for (std::size_t i = 0; i < hosts->size(); ++i) {
      auto h = hosts->at(i);
      HostReport hr;
      hr.node = h.get_index("node");
      hr.peak_memory_bytes = bytes(h, "peak_memory_bytes");
      hr.capacity_bytes = bytes(h, "capacity_bytes");
      hr.pinned_bytes = bytes(h, "pinned_bytes");
      hr.pinned_capacity_bytes = bytes(h, "pinned_capacity_bytes");
      rep.hosts.push_back(hr);
    }
  if (r.has("timeline")) rep.timeline = r.get_string("timeline");
  // Source-specific sections ("estimate", "simulation", ...) are kept as they are.
  static const char* const known[] = {"format",        "source",       "model",
                                      "cluster",       "plan",         "iteration_time_s",
                                      "samples_per_s", "tokens_per_s", "model_flops_per_s",
                                      "mfu",           "fits",         "devices",
                                      "timeline",      "hosts"};
  for (auto it = json.begin(); it != json.end(); ++it)
    if (std::find(std::begin(known), std::end(known), it.key()) == std::end(known))
      rep.extra[it.key()] = it.value();
  return rep;
}

std::string describe_oom(const RunReport& r) {
  for (const auto& d : r.devices) {
    if (d.fits) continue;
    const std::pair<const char*, std::int64_t> terms[] = {
        {"weights", d.memory.weights},         {"weight_versions", d.memory.weight_versions},
        {"gradients", d.memory.gradients},     {"optimizer", d.memory.optimizer},
        {"activations", d.memory.activations}, {"workspace", d.memory.workspace}};
    auto biggest = *std::max_element(std::begin(terms), std::end(terms),
                                     [](auto& a, auto& b) { return a.second < b.second; });
    return fmt::format(
        "rank {} (stage {}) needs {} on node {} gpu {}, which has {} (largest term: {} {})", d.rank,
        d.stage, common::human_bytes(double(d.peak_memory_bytes)), d.node, d.gpu,
        common::human_bytes(double(d.capacity_bytes)), biggest.first,
        common::human_bytes(double(biggest.second)));
  }
  for (const auto& h : r.hosts) {
    if (h.fits()) continue;
    const bool memory = h.peak_memory_bytes > h.capacity_bytes;
    const std::int64_t need = memory ? h.peak_memory_bytes : h.pinned_bytes;
    const std::int64_t have = memory ? h.capacity_bytes : h.pinned_capacity_bytes;
    return fmt::format("the {} of node {}: offload needs {}, which has {} (short by {})",
                       memory ? "host memory" : "pinned host memory", h.node,
                       common::human_bytes(double(need)), common::human_bytes(double(have)),
                       common::human_bytes(double(need - have)));
  }
  return "";
}

}  // namespace pw::planner
