// Where training runs: nodes of identical GPUs, the fabric inside a node, the network between
// nodes and the host (memory, PCIe). Format "pipewright.cluster/1"; presets in
// clusters/presets/*.json. Field meanings and preset sources: docs/formats.md.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "clusters/device.hpp"
#include "common/json_reader.hpp"

namespace pw::clusters {

// nvlink-mesh: direct GPU-to-GPU links (DGX-1 / p3.16xlarge hybrid cube-mesh); nvswitch: every
// GPU has a full-bandwidth port to a switch; pcie: GPUs talk through the PCIe tree; none: a
// single GPU per node.
enum class IntraKind { nvlink_mesh, nvswitch, pcie, none };
enum class NicPer { node, gpu };
std::string to_string(IntraKind k);  // "nvlink-mesh", "nvswitch", "pcie", "none"
std::string to_string(NicPer n);     // "node", "gpu"

struct IntraNode {
  IntraKind kind = IntraKind::none;
  double bandwidth_bytes_per_s = 0;  // per GPU, one direction (sum over its links)
  double latency_s = 0;
  double efficiency = 1;  // achievable fraction of bandwidth_bytes_per_s, (0, 1]
  bool operator==(const IntraNode&) const = default;
};

struct Network {
  NicPer nic_per = NicPer::node;
  double bandwidth_bytes_per_s = 0;  // per NIC, one direction
  double latency_s = 0;
  double oversubscription = 1;  // >= 1; one switch whose uplinks are shared this many ways
  double efficiency = 1;        // (0, 1]
  // How long a message sent over the network occupies its sending rank (LogGP's o): the host's
  // own work of a send (e.g. a TCP stack on the rank's core), send_overhead_s per message plus
  // bytes / send_overhead_bytes_per_s (0: no per-byte part). Optional; 0 for GPUs, whose NICs and
  // NCCL kernels send beside the compute. validate measures it under mpirun (docs/formulas.md §7).
  double send_overhead_s = 0;
  double send_overhead_bytes_per_s = 0;
  double send_overhead_time_s(double bytes) const {
    return send_overhead_s +
           (send_overhead_bytes_per_s > 0 ? bytes / send_overhead_bytes_per_s : 0.0);
  }
  bool operator==(const Network&) const = default;
};

// How a GPU reaches host memory: a PCIe link of a generation (x16), a PCIe link of unstated
// generation, or NVLink-C2C (Grace Hopper). Descriptive, and the ceiling of the bandwidth given.
enum class HostLinkKind { pcie, pcie3, pcie4, pcie5, nvlink_c2c };
std::string to_string(HostLinkKind k);  // "pcie", "pcie3", "pcie4", "pcie5", "nvlink-c2c"
// Peak bandwidth of one direction of the link kind (x16 for PCIe); 0 for "pcie" (no ceiling).
double host_link_peak_bytes_per_s(HostLinkKind k);

// The host side of a node: memory (the offload target), its host-device links and CPU Adam.
// Fields after pcie_latency_s are optional in files, with the defaults given here
// (docs/formats.md).
struct Host {
  std::int64_t memory_bytes = 0;          // host DRAM per node
  double pcie_bandwidth_bytes_per_s = 0;  // host link per GPU, one direction (host <-> device)
  double pcie_latency_s = 0;
  HostLinkKind link = HostLinkKind::pcie;  // what pcie_bandwidth_bytes_per_s is a link of
  // Page-locked (pinned) memory the copy engines can use, at most memory_bytes; a file without
  // it gets memory_bytes.
  std::int64_t pinned_memory_bytes = 0;
  // GPUs behind one uplink to the CPU (a PCIe switch), dividing gpus_per_node; default 1.
  int gpus_per_uplink = 1;
  // One direction of that shared uplink; default gpus_per_uplink x pcie_bandwidth (no contention).
  double uplink_bandwidth_bytes_per_s = 0;
  int cpu_cores = 0;  // host CPU cores per node; 0: unknown (offload is then refused)
  // Adam updates per second per core (fp32 master, m, v; ZeRO-Offload's CPU-Adam); 0: unknown.
  double cpu_adam_params_per_s_per_core = 0;
  double cpu_adam_params_per_s() const { return cpu_cores * cpu_adam_params_per_s_per_core; }
  bool operator==(const Host&) const = default;
};

struct Cluster {
  std::string name;
  int nodes = 1;
  int gpus_per_node = 1;
  DeviceSpec device;
  IntraNode intra_node;
  Network network;
  Host host;
  std::string notes;  // sources and assumptions (optional)
  // At most kMaxDevices for a parsed cluster (parse_cluster checks the product).
  int devices() const { return int(std::int64_t(nodes) * gpus_per_node); }
  int nics_per_node() const { return network.nic_per == NicPer::gpu ? gpus_per_node : 1; }
  bool operator==(const Cluster&) const = default;
};

// Parses a cluster document; `source` names it in errors. A string "device" is a device preset
// name or a path (relative paths resolve against `base_dir` when it is not empty).
Cluster parse_cluster(const common::Json& json, const std::string& source,
                      const std::string& base_dir = "");
// Canonical form: the device inline as an object, every field present.
common::Json to_json(const Cluster& c);

// `spec`: a preset name ("dgx-a100"), "name:N" (N nodes), or a path to a cluster JSON file
// (also "path:N"). Then `nodes` (if given) replaces the node count, then each of `sets`
// ("dotted.path=value", see apply_set) edits the document before it is parsed.
Cluster load_cluster(const std::string& spec, std::optional<int> nodes = {},
                     const std::vector<std::string>& sets = {});
std::vector<std::string> cluster_preset_names();

// Applies one "dotted.path=value" override to a cluster document. The value is a JSON number or
// bool when it parses as one, else a string. The path must name an existing field (an unknown key
// is an InputError naming it). A "device" that is a preset name is expanded to its object first,
// so both "device=H100-SXM" and "device.memory_bytes=3.2e10" work.
void apply_set(common::Json& doc, const std::string& set);

// Effective point-to-point path between two GPUs (bandwidth already times efficiency).
struct Link {
  double bandwidth_bytes_per_s = 0;
  double latency_s = 0;
  std::string via;  // "device-memory", "nvlink-mesh", "nvswitch", "pcie", "network"
  double time_s(double bytes) const { return latency_s + bytes / bandwidth_bytes_per_s; }
};
// Same GPU: a device-memory copy (memory bandwidth / 2: every byte is read and written). Same
// node: the intra-node fabric. Different nodes: the NIC path, bandwidth / oversubscription.
Link p2p_link(const Cluster& c, int node_a, int gpu_a, int node_b, int gpu_b);

// A few lines for people: GPUs, device peaks, fabric, network, host.
std::string describe(const Cluster& c);

}  // namespace pw::clusters
