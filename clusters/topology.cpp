// Point-to-point paths between GPUs of a cluster, and a short human-readable description.
#include <algorithm>

#include <fmt/format.h>

#include "clusters/cluster.hpp"

namespace pw::clusters {

namespace {

void check_gpu(const Cluster& c, int node, int gpu) {
  if (node < 0 || node >= c.nodes || gpu < 0 || gpu >= c.gpus_per_node)
    throw InputError(fmt::format("cluster {}: no GPU at node {} gpu {} ({} nodes x {} GPUs)",
                                 c.name, node, gpu, c.nodes, c.gpus_per_node));
}

// In a hybrid cube-mesh (DGX-1, p3.16xlarge) each GPU spreads its NVLinks over 4 peers, so one
// pair gets on average a quarter of the GPU's NVLink bandwidth (6 links / 4 peers = 1.5 links).
int mesh_degree(int gpus_per_node) {
  return std::max(1, std::min(4, gpus_per_node - 1));
}

// 3.125e9 -> "3.12 GB/s"; 3e11 -> "300 GB/s".
std::string rate(double v, const char* unit) {
  const char* prefixes[] = {"", "k", "M", "G", "T", "P"};
  int i = 0;
  while (v >= 1000 && i < 5) {
    v /= 1000;
    ++i;
  }
  return fmt::format("{:.3g} {}{}", v, prefixes[i], unit);
}

std::string gib(std::int64_t bytes) {
  return fmt::format("{:.4g} GiB", double(bytes) / double(1LL << 30));
}

std::string usec(double s) {
  return fmt::format("{:.3g} us", s * 1e6);
}

}  // namespace

Link p2p_link(const Cluster& c, int node_a, int gpu_a, int node_b, int gpu_b) {
  check_gpu(c, node_a, gpu_a);
  check_gpu(c, node_b, gpu_b);
  if (node_a == node_b && gpu_a == gpu_b)
    return {c.device.memory_bandwidth_bytes_per_s / 2, 0.0, "device-memory"};
  if (node_a == node_b) {
    const IntraNode& in = c.intra_node;
    double bw = in.bandwidth_bytes_per_s * in.efficiency;
    if (in.kind == IntraKind::nvlink_mesh) bw /= mesh_degree(c.gpus_per_node);
    return {bw, in.latency_s, to_string(in.kind)};
  }
  const Network& n = c.network;
  return {n.bandwidth_bytes_per_s * n.efficiency / n.oversubscription, n.latency_s, "network"};
}

std::string describe(const Cluster& c) {
  const DeviceSpec& d = c.device;
  std::string out =
      fmt::format("{}: {} node{} x {} GPU{} = {} x {}\n", c.name, c.nodes, c.nodes == 1 ? "" : "s",
                  c.gpus_per_node, c.gpus_per_node == 1 ? "" : "s", c.devices(), d.name);
  out +=
      fmt::format("  device: {} fp16/bf16, {} fp32, {} memory bandwidth, {}\n",
                  rate(d.peak_fp16_flops_per_s, "FLOP/s"), rate(d.peak_fp32_flops_per_s, "FLOP/s"),
                  rate(d.memory_bandwidth_bytes_per_s, "B/s"), gib(d.memory_bytes));
  const IntraNode& in = c.intra_node;
  if (in.kind != IntraKind::none)
    out += fmt::format("  intra-node: {}, {} per GPU per direction x {} efficiency, latency {}\n",
                       to_string(in.kind), rate(in.bandwidth_bytes_per_s, "B/s"), in.efficiency,
                       usec(in.latency_s));
  const Network& n = c.network;
  if (n.bandwidth_bytes_per_s > 0)
    out += fmt::format(
        "  network: {} NIC{} per node ({}), {} each per direction x {} efficiency, latency {}, "
        "oversubscription {}\n",
        c.nics_per_node(), c.nics_per_node() == 1 ? "" : "s",
        n.nic_per == NicPer::gpu ? "one per GPU" : "shared by the node",
        rate(n.bandwidth_bytes_per_s, "B/s"), n.efficiency, usec(n.latency_s), n.oversubscription);
  const Host& h = c.host;
  out += fmt::format("  host: {} memory ({} pinnable), {} {} per GPU, latency {}",
                     gib(h.memory_bytes), gib(h.pinned_memory_bytes), to_string(h.link),
                     rate(h.pcie_bandwidth_bytes_per_s, "B/s"), usec(h.pcie_latency_s));
  if (h.gpus_per_uplink > 1)
    out += fmt::format(", {} GPUs per {} uplink", h.gpus_per_uplink,
                       rate(h.uplink_bandwidth_bytes_per_s, "B/s"));
  out += h.cpu_adam_params_per_s() > 0 ? fmt::format(", {} cores x {:.3g} Adam params/s\n",
                                                     h.cpu_cores, h.cpu_adam_params_per_s_per_core)
                                       : std::string(", CPU Adam rate unknown\n");
  return out;
}

}  // namespace pw::clusters
