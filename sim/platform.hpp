// A cluster as a SimGrid platform: a host per GPU and per node's host memory, links per GPU port.
//
// Model (the simulator's uncontended point-to-point time equals clusters::p2p_link(...).time_s):
//  - Host "n<node>g<gpu>" per GPU (speed kGpuSpeed: compute is execute(duration_s * kGpuSpeed))
//    and "n<node>cpu" per node (the host-memory side, for offload).
//  - Same GPU: an explicit route from the host to itself over "n<n>g<g>-mem", a shared link of
//    device memory bandwidth / 2, latency 0 (co-located ranks share it).
//  - Same node: each GPU has a split-duplex port "n<n>g<g>-nvlink" ("-intra" for a PCIe fabric)
//    of p2p_link's bandwidth (efficiency applied; nvlink-mesh divided by min(4, G-1)) and half the
//    intra-node latency each way; GPU a -> b = [a's port UP, b's port DOWN].
//  - Between nodes: a split-duplex NIC per node ("n<n>-nic") or per GPU ("n<n>g<g>-nic") with half
//    the network latency each way; GPU (n,a) -> (m,b) = [NIC of (n,a) UP, NIC of (m,b) DOWN].
//    Oversubscription s > 1 is each NIC's fair share of the shared uplinks: NIC bandwidth =
//    bandwidth * efficiency / s, as in p2p_link (the aggregate is nics * bw * eff / s). No link is
//    crossed by every flow, so SimGrid's solver stays fast. With PlatformOptions::shared_backbone
//    the NICs run at bandwidth * efficiency and one shared "backbone" link of that aggregate is
//    crossed by every inter-node flow instead (slower to solve; a lone flow is then faster than
//    p2p_link). The GPU-NIC PCIe hop is not modelled (as in p2p_link).
//  - Host memory: a split-duplex "n<n>g<g>-pcie" per GPU (host.pcie_bandwidth, pcie_latency_s
//    each way): GPU -> "n<n>cpu" = [pcie UP], back = [pcie DOWN]. With host.gpus_per_uplink k > 1
//    the k GPUs g with g / k = u also cross their shared "n<n>u<u>-uplink" (split-duplex,
//    host.uplink_bandwidth_bytes_per_s, latency 0): [pcie UP, uplink UP], back [uplink DOWN,
//    pcie DOWN]. The CPU host "n<n>cpu" runs CPU Adam: speed kCpuSpeed, an update of P
//    parameters is execute(P / host.cpu_adam_params_per_s() * kCpuSpeed), shared max-min fairly
//    by the ranks of the node (as cores shared by their threads).
//  - Zones: a full zone per node (its GPUs, CPU host and gateway router "n<n>-router") inside a
//    star zone with empty node-to-centre routes: O(nodes) routes, so 512 x 8 GPUs build fast.
#pragma once

#include <string>
#include <vector>

#include <simgrid/s4u/Host.hpp>
#include <simgrid/s4u/Link.hpp>

#include "clusters/cluster.hpp"

namespace pw::sim {

namespace sg4 = simgrid::s4u;

inline constexpr double kGpuSpeed = 1e9;  // flop/s: durations are replayed as duration * kGpuSpeed
inline constexpr double kCpuSpeed = 1e9;  // flop/s of the host-memory side

struct PlatformOptions {
  bool shared_backbone = false;  // with oversubscription > 1: one shared link (see above)
};

struct Platform {
  int nodes = 0, gpus_per_node = 0;
  std::vector<sg4::Host*> gpus;       // index node * gpus_per_node + gpu, named "n<node>g<gpu>"
  std::vector<sg4::Host*> host_cpus;  // per node, "n<node>cpu"
  sg4::Host* gpu(int node, int gpu) const;
  struct LinkInfo {
    sg4::Link* link;
    std::string name;  // SimGrid's name: "n3g5-nvlink_UP", "n3-nic_DOWN", "n3g5-mem", "backbone"
    std::string kind;  // "intra", "nic", "network", "pcie", "uplink", "memory"
    double bandwidth_bytes_per_s;
  };
  std::vector<LinkInfo> links;  // every link created, one entry per direction
};

// Builds the platform in the current engine: call after make_engine(), before running.
Platform build_platform(const clusters::Cluster& cluster, const PlatformOptions& options = {});
// The same platform as SimGrid XML (platform_4_1.dtd, with the engine configuration of
// make_engine), loadable by Engine::load_platform. The top zone is a full zone with a route per
// pair of nodes over a zero-latency fat-pipe "switch" link (XML has no star zone), so the file
// grows as nodes^2.
std::string platform_xml(const clusters::Cluster& cluster, const PlatformOptions& options = {});

// --- The model without SimGrid: what build_platform and platform_xml create, and routes. ---

enum class Dir { up, down, none };  // none: a one-way (shared) link
struct LinkSpec {
  std::string name, kind;
  double bandwidth_bytes_per_s = 0, latency_s = 0;  // latency per direction
  bool split_duplex = true;
};
struct LinkUse {
  int link;  // index into NodeModel::links
  Dir dir;
};
struct LocalRoute {  // a one-way route inside a node zone, between host or router names
  std::string src, dst;
  std::vector<LinkUse> links;
};
struct NodeModel {
  std::string zone, router, cpu;
  std::vector<std::string> gpus;
  std::vector<LinkSpec> links;
  std::vector<LocalRoute> routes;
};
NodeModel node_model(const clusters::Cluster& c, int node, const PlatformOptions& options = {});
bool has_backbone(const clusters::Cluster& c, const PlatformOptions& options);
LinkSpec backbone_spec(const clusters::Cluster& c);

// One directed link on a path, named as SimGrid names it ("n0g1-nvlink_UP", "n0g1-mem").
struct Hop {
  std::string link;
  double bandwidth_bytes_per_s;
};
struct Path {
  std::vector<Hop> hops;
  double latency_s = 0;
  double bandwidth_bytes_per_s() const;  // the bottleneck
  double time_s(double bytes) const { return latency_s + bytes / bandwidth_bytes_per_s(); }
};
// The route build_platform gives GPU (node_a, gpu_a) -> (node_b, gpu_b).
Path gpu_path(const clusters::Cluster& c, int node_a, int gpu_a, int node_b, int gpu_b,
              const PlatformOptions& options = {});

}  // namespace pw::sim
