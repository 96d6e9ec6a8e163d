// Cluster documents: parsing with file + JSON-path errors, the canonical JSON form, and loading
// from a preset name, "name:N" or a file.
#include "clusters/cluster.hpp"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <limits>

#include <fmt/format.h>

#include "common/limits.hpp"
#include "common/presets.hpp"

namespace pw::clusters {

namespace {

constexpr const char* kClusterFormat = "pipewright.cluster/1";

using common::Json;
using common::JsonReader;

double get_efficiency(const JsonReader& r) {
  double v = r.get_positive("efficiency");
  if (v > 1) r.fail_member("efficiency", fmt::format("must be in (0, 1], found {}", v));
  return v;
}

IntraKind parse_intra_kind(const JsonReader& r) {
  std::string s = r.get_string("kind");
  for (auto k : {IntraKind::nvlink_mesh, IntraKind::nvswitch, IntraKind::pcie, IntraKind::none})
    if (s == to_string(k)) return k;
  r.fail_member("kind", fmt::format("unknown kind \"{}\"; expected nvlink-mesh, nvswitch, pcie "
                                    "or none",
                                    s));
}

NicPer parse_nic_per(const JsonReader& r) {
  std::string s = r.get_string("nic_per");
  if (s == "node") return NicPer::node;
  if (s == "gpu") return NicPer::gpu;
  r.fail_member("nic_per", fmt::format("unknown value \"{}\"; expected node or gpu", s));
}

IntraNode parse_intra(const JsonReader& r, int gpus_per_node) {
  IntraNode in;
  in.kind = parse_intra_kind(r);
  in.bandwidth_bytes_per_s = r.get_nonnegative("bandwidth_bytes_per_s");
  in.latency_s = r.get_nonnegative("latency_s");
  in.efficiency = get_efficiency(r);
  if (gpus_per_node > 1 && in.kind == IntraKind::none)
    r.fail_member("kind", fmt::format("\"none\" needs gpus_per_node 1, found {}", gpus_per_node));
  if (gpus_per_node > 1 && in.bandwidth_bytes_per_s <= 0)
    r.fail_member("bandwidth_bytes_per_s", "must be positive when gpus_per_node > 1");
  return in;
}

Network parse_network(const JsonReader& r, int nodes) {
  Network n;
  n.nic_per = parse_nic_per(r);
  n.bandwidth_bytes_per_s = r.get_nonnegative("bandwidth_bytes_per_s");
  n.latency_s = r.get_nonnegative("latency_s");
  n.oversubscription = r.get_number("oversubscription");
  if (n.oversubscription < 1)
    r.fail_member("oversubscription", fmt::format("must be >= 1, found {}", n.oversubscription));
  n.efficiency = get_efficiency(r);
  if (r.has("send_overhead_s")) {
    n.send_overhead_s = r.get_nonnegative("send_overhead_s");
    if (n.send_overhead_s > 1)
      r.fail_member(
          "send_overhead_s",
          fmt::format("must be in [0, 1] seconds per message, found {}", n.send_overhead_s));
  }
  if (r.has("send_overhead_bytes_per_s"))
    n.send_overhead_bytes_per_s = r.get_nonnegative("send_overhead_bytes_per_s");
  if (nodes > 1 && n.bandwidth_bytes_per_s <= 0)
    r.fail_member("bandwidth_bytes_per_s", "must be positive when nodes > 1");
  return n;
}

HostLinkKind parse_host_link(const JsonReader& r) {
  std::string s = r.get_string("link");
  for (auto k : {HostLinkKind::pcie, HostLinkKind::pcie3, HostLinkKind::pcie4, HostLinkKind::pcie5,
                 HostLinkKind::nvlink_c2c})
    if (s == to_string(k)) return k;
  r.fail_member("link", fmt::format("unknown host link \"{}\"; expected pcie, pcie3, pcie4, pcie5 "
                                    "or nvlink-c2c",
                                    s));
}

// The host fields after the first three are optional (defaults in cluster.hpp). Each is checked
// as hostile input: in range, finite, consistent with the node (common/limits.hpp).
Host parse_host(const JsonReader& r, int gpus_per_node) {
  Host h;
  h.memory_bytes = r.get_int_in("memory_bytes", 0, common::kMaxBytes);
  h.pcie_bandwidth_bytes_per_s = r.get_nonnegative("pcie_bandwidth_bytes_per_s");
  h.pcie_latency_s = r.get_nonnegative("pcie_latency_s");
  if (r.has("link")) h.link = parse_host_link(r);
  const double peak = host_link_peak_bytes_per_s(h.link);
  if (peak > 0 && h.pcie_bandwidth_bytes_per_s > peak)
    r.fail_member("pcie_bandwidth_bytes_per_s",
                  fmt::format("{:g} B/s is more than a {} link's {:g} B/s per direction",
                              h.pcie_bandwidth_bytes_per_s, to_string(h.link), peak));
  h.pinned_memory_bytes = r.has("pinned_memory_bytes")
                              ? r.get_int_in("pinned_memory_bytes", 0, common::kMaxBytes)
                              : h.memory_bytes;
  if (h.pinned_memory_bytes > h.memory_bytes)
    r.fail_member("pinned_memory_bytes", fmt::format("{} is more than memory_bytes ({})",
                                                     h.pinned_memory_bytes, h.memory_bytes));
  if (r.has("gpus_per_uplink")) {
    h.gpus_per_uplink = r.get_count("gpus_per_uplink");
    if (h.gpus_per_uplink > gpus_per_node || gpus_per_node % h.gpus_per_uplink != 0)
      r.fail_member("gpus_per_uplink", fmt::format("must divide gpus_per_node ({}), found {}",
                                                   gpus_per_node, h.gpus_per_uplink));
  }
  // 0 (allowed, as for the per-GPU link) is a host side without a link: offload refuses it.
  h.uplink_bandwidth_bytes_per_s = r.has("uplink_bandwidth_bytes_per_s")
                                       ? r.get_nonnegative("uplink_bandwidth_bytes_per_s")
                                       : h.gpus_per_uplink * h.pcie_bandwidth_bytes_per_s;
  if (r.has("cpu_cores")) h.cpu_cores = int(r.get_int_in("cpu_cores", 0, common::kMaxCount));
  if (r.has("cpu_adam_params_per_s_per_core")) {
    h.cpu_adam_params_per_s_per_core = r.get_nonnegative("cpu_adam_params_per_s_per_core");
    // A core updating more than 10^12 parameters a second is a typo, not a CPU (one core does
    // about 10^8, docs/formats.md).
    if (h.cpu_adam_params_per_s_per_core > 1e12)
      r.fail_member("cpu_adam_params_per_s_per_core",
                    fmt::format("{:g} is more than 1e12 parameters/s per core",
                                h.cpu_adam_params_per_s_per_core));
  }
  return h;
}

DeviceSpec parse_device_field(const JsonReader& r, const std::string& base_dir) {
  JsonReader d = r.at("device");
  if (d.value().is_object()) return parse_device(d, /*require_format=*/false);
  if (!d.value().is_string()) d.fail("expected a device preset name or a device object");
  std::string name = d.as_string();
  if (common::looks_like_path(name) && !base_dir.empty() &&
      std::filesystem::path(name).is_relative())
    name = (std::filesystem::path(base_dir) / name).string();
  try {
    return load_device(name);
  } catch (const InputError& e) {
    d.fail(e.what());
  }
}

// "dgx-a100:4" -> ("dgx-a100", 4); "dgx-a100" -> ("dgx-a100", none).
std::pair<std::string, std::optional<int>> split_node_suffix(const std::string& spec) {
  auto colon = spec.rfind(':');
  if (colon == std::string::npos || colon + 1 == spec.size()) return {spec, std::nullopt};
  std::string tail = spec.substr(colon + 1);
  if (!std::all_of(tail.begin(), tail.end(), [](unsigned char ch) { return std::isdigit(ch); }))
    return {spec, std::nullopt};
  if (tail.size() > 9 || std::stoi(tail) < 1 || std::stoi(tail) > common::kMaxCount)
    throw InputError(
        fmt::format("cluster \"{}\": node count must be 1 .. {}", spec, common::kMaxCount));
  return {spec.substr(0, colon), std::stoi(tail)};
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names)
    out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

std::string to_string(IntraKind k) {
  switch (k) {
    case IntraKind::nvlink_mesh:
      return "nvlink-mesh";
    case IntraKind::nvswitch:
      return "nvswitch";
    case IntraKind::pcie:
      return "pcie";
    case IntraKind::none:
      return "none";
  }
  return "?";
}

std::string to_string(HostLinkKind k) {
  switch (k) {
    case HostLinkKind::pcie:
      return "pcie";
    case HostLinkKind::pcie3:
      return "pcie3";
    case HostLinkKind::pcie4:
      return "pcie4";
    case HostLinkKind::pcie5:
      return "pcie5";
    case HostLinkKind::nvlink_c2c:
      return "nvlink-c2c";
  }
  return "?";
}

// x16 per direction: 8, 16 and 32 GT/s per lane with 128b/130b encoding (PCIe 3.0, 4.0, 5.0
// base specifications); NVLink-C2C 900 GB/s bidirectional (NVIDIA Grace Hopper whitepaper).
double host_link_peak_bytes_per_s(HostLinkKind k) {
  switch (k) {
    case HostLinkKind::pcie:
      return 0;
    case HostLinkKind::pcie3:
      return 15.75e9;
    case HostLinkKind::pcie4:
      return 31.5e9;
    case HostLinkKind::pcie5:
      return 63e9;
    case HostLinkKind::nvlink_c2c:
      return 450e9;
  }
  return 0;
}

std::string to_string(NicPer n) {
  return n == NicPer::gpu ? "gpu" : "node";
}

Cluster parse_cluster(const Json& json, const std::string& source, const std::string& base_dir) {
  JsonReader r(json, source);
  r.expect_format(kClusterFormat);
  Cluster c;
  c.name = r.get_string("name");
  c.nodes = r.get_count("nodes");
  c.gpus_per_node = r.get_count("gpus_per_node");
  if (std::int64_t(c.nodes) * c.gpus_per_node > common::kMaxDevices)
    r.fail(fmt::format("nodes x gpus_per_node = {} x {} GPUs is more than {}", c.nodes,
                       c.gpus_per_node, common::kMaxDevices));
  c.device = parse_device_field(r, base_dir);
  c.intra_node = parse_intra(r.at("intra_node"), c.gpus_per_node);
  c.network = parse_network(r.at("network"), c.nodes);
  c.host = parse_host(r.at("host"), c.gpus_per_node);
  if (auto notes = r.find("notes")) c.notes = notes->as_string();
  return c;
}

Json to_json(const Cluster& c) {
  Json j = Json::object();
  j["format"] = kClusterFormat;
  j["name"] = c.name;
  j["nodes"] = c.nodes;
  j["gpus_per_node"] = c.gpus_per_node;
  j["device"] = to_json(c.device);
  j["intra_node"] = {{"kind", to_string(c.intra_node.kind)},
                     {"bandwidth_bytes_per_s", c.intra_node.bandwidth_bytes_per_s},
                     {"latency_s", c.intra_node.latency_s},
                     {"efficiency", c.intra_node.efficiency}};
  j["network"] = {{"nic_per", to_string(c.network.nic_per)},
                  {"bandwidth_bytes_per_s", c.network.bandwidth_bytes_per_s},
                  {"latency_s", c.network.latency_s},
                  {"oversubscription", c.network.oversubscription},
                  {"efficiency", c.network.efficiency}};
  if (c.network.send_overhead_s > 0 || c.network.send_overhead_bytes_per_s > 0) {
    j["network"]["send_overhead_s"] = c.network.send_overhead_s;
    j["network"]["send_overhead_bytes_per_s"] = c.network.send_overhead_bytes_per_s;
  }
  j["host"] = {{"memory_bytes", c.host.memory_bytes},
               {"pcie_bandwidth_bytes_per_s", c.host.pcie_bandwidth_bytes_per_s},
               {"pcie_latency_s", c.host.pcie_latency_s},
               {"link", to_string(c.host.link)},
               {"pinned_memory_bytes", c.host.pinned_memory_bytes},
               {"gpus_per_uplink", c.host.gpus_per_uplink},
               {"uplink_bandwidth_bytes_per_s", c.host.uplink_bandwidth_bytes_per_s},
               {"cpu_cores", c.host.cpu_cores},
               {"cpu_adam_params_per_s_per_core", c.host.cpu_adam_params_per_s_per_core}};
  if (!c.notes.empty()) j["notes"] = c.notes;
  return j;
}

std::vector<std::string> cluster_preset_names() {
  std::vector<std::string> names;
  for (const auto& f : common::embedded_clusters())
    names.push_back(f.name);
  return names;
}

Cluster load_cluster(const std::string& spec, std::optional<int> nodes,
                     const std::vector<std::string>& sets) {
  auto [base, spec_nodes] = split_node_suffix(spec);
  Json doc;
  std::string source, base_dir;
  if (common::looks_like_path(base)) {
    doc = common::read_json_file(base);
    source = base;
    base_dir = std::filesystem::path(base).parent_path().string();
  } else {
    const auto* file = common::find_embedded(common::embedded_clusters(), base);
    if (file == nullptr)
      throw InputError(
          fmt::format("unknown cluster \"{}\"; presets: {} (or a path to a .json file)", base,
                      joined(cluster_preset_names())));
    source = "cluster preset " + base;
    doc = common::parse_json(file->text, source);
  }
  if (!nodes) nodes = spec_nodes;
  if (nodes && doc.is_object()) {
    if (*nodes < 1 || *nodes > common::kMaxCount)
      throw InputError(
          fmt::format("{}: nodes must be in 1 .. {}, found {}", source, common::kMaxCount, *nodes));
    doc["nodes"] = *nodes;
  }
  for (const auto& s : sets)
    apply_set(doc, s);
  if (!sets.empty()) source += " (with --set)";
  return parse_cluster(doc, source, base_dir);
}

}  // namespace pw::clusters
