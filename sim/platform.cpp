// A cluster as a SimGrid platform: the link model (pure) and the builder (s4u). Model:
// platform.hpp.
#include "sim/platform.hpp"

#include <algorithm>
#include <unordered_map>

#include <fmt/format.h>
#include <simgrid/s4u/Engine.hpp>
#include <simgrid/s4u/NetZone.hpp>

#include "common/error.hpp"

namespace pw::sim {

namespace {

using clusters::Cluster;

std::string gpu_name(int node, int gpu) {
  return fmt::format("n{}g{}", node, gpu);
}

std::string port_name(const Cluster& c, int node, int gpu) {
  const char* suffix = c.intra_node.kind == clusters::IntraKind::pcie ? "intra" : "nvlink";
  return fmt::format("{}-{}", gpu_name(node, gpu), suffix);
}

std::string nic_name(const Cluster& c, int node, int gpu) {
  if (c.network.nic_per == clusters::NicPer::gpu) return gpu_name(node, gpu) + "-nic";
  return fmt::format("n{}-nic", node);
}

double nic_bandwidth(const Cluster& c, const PlatformOptions& options) {
  const clusters::Network& n = c.network;
  if (has_backbone(c, options)) return n.bandwidth_bytes_per_s * n.efficiency;
  return clusters::p2p_link(c, 0, 0, 1, 0).bandwidth_bytes_per_s;
}

}  // namespace

bool has_backbone(const Cluster& c, const PlatformOptions& options) {
  return options.shared_backbone && c.nodes > 1 && c.network.oversubscription > 1;
}

LinkSpec backbone_spec(const Cluster& c) {
  const clusters::Network& n = c.network;
  double aggregate = double(c.nodes) * c.nics_per_node() * n.bandwidth_bytes_per_s * n.efficiency /
                     n.oversubscription;
  return {"backbone", "network", aggregate, 0.0, false};
}

NodeModel node_model(const Cluster& c, int node, const PlatformOptions& options) {
  const int G = c.gpus_per_node;
  NodeModel m;
  m.zone = fmt::format("n{}", node);
  m.router = m.zone + "-router";
  m.cpu = m.zone + "cpu";
  for (int g = 0; g < G; ++g)
    m.gpus.push_back(gpu_name(node, g));
  auto add = [&m](LinkSpec s) {
    m.links.push_back(std::move(s));
    return int(m.links.size()) - 1;
  };
  auto route = [&m](const std::string& src, const std::string& dst, std::vector<LinkUse> uses) {
    m.routes.push_back({src, dst, std::move(uses)});
  };
  const clusters::Link mem = clusters::p2p_link(c, node, 0, node, 0);
  for (int g = 0; g < G; ++g) {
    int l = add({m.gpus[g] + "-mem", "memory", mem.bandwidth_bytes_per_s, 0.0, false});
    route(m.gpus[g], m.gpus[g], {{l, Dir::none}});
  }
  if (G > 1) {
    const clusters::Link in = clusters::p2p_link(c, node, 0, node, 1);
    std::vector<int> port(G);
    for (int g = 0; g < G; ++g)
      port[g] = add({port_name(c, node, g), "intra", in.bandwidth_bytes_per_s, in.latency_s / 2});
    for (int a = 0; a < G; ++a)
      for (int b = 0; b < G; ++b)
        if (a != b) route(m.gpus[a], m.gpus[b], {{port[a], Dir::up}, {port[b], Dir::down}});
  }
  if (c.host.pcie_bandwidth_bytes_per_s > 0) {
    // GPUs behind one switch share its uplink to the CPU: "n<n>u<k>-uplink" after their links.
    // One GPU per uplink needs it only where it is narrower than the GPU's own link.
    const int per_uplink = c.host.gpus_per_uplink;
    std::vector<int> uplink;
    if ((per_uplink > 1 ||
         c.host.uplink_bandwidth_bytes_per_s < c.host.pcie_bandwidth_bytes_per_s) &&
        c.host.uplink_bandwidth_bytes_per_s > 0)
      for (int k = 0; k < G / per_uplink; ++k)
        uplink.push_back(add({fmt::format("n{}u{}-uplink", node, k), "uplink",
                              c.host.uplink_bandwidth_bytes_per_s, 0.0}));
    for (int g = 0; g < G; ++g) {
      int l = add(
          {m.gpus[g] + "-pcie", "pcie", c.host.pcie_bandwidth_bytes_per_s, c.host.pcie_latency_s});
      if (uplink.empty()) {
        route(m.gpus[g], m.cpu, {{l, Dir::up}});
        route(m.cpu, m.gpus[g], {{l, Dir::down}});
      } else {
        const int u = uplink[std::size_t(g / per_uplink)];
        route(m.gpus[g], m.cpu, {{l, Dir::up}, {u, Dir::up}});
        route(m.cpu, m.gpus[g], {{u, Dir::down}, {l, Dir::down}});
      }
    }
  }
  if (c.nodes > 1) {
    const double bw = nic_bandwidth(c, options), lat = c.network.latency_s / 2;
    int shared = c.network.nic_per == clusters::NicPer::node
                     ? add({nic_name(c, node, 0), "nic", bw, lat})
                     : -1;
    for (int g = 0; g < G; ++g) {
      int l = shared >= 0 ? shared : add({nic_name(c, node, g), "nic", bw, lat});
      route(m.gpus[g], m.router, {{l, Dir::up}});
      route(m.router, m.gpus[g], {{l, Dir::down}});
    }
  }
  return m;
}

double Path::bandwidth_bytes_per_s() const {
  double bw = hops.empty() ? 0 : hops[0].bandwidth_bytes_per_s;
  for (const Hop& h : hops)
    bw = std::min(bw, h.bandwidth_bytes_per_s);
  return bw;
}

Path gpu_path(const Cluster& c, int node_a, int gpu_a, int node_b, int gpu_b,
              const PlatformOptions& options) {
  const clusters::Link p2p = clusters::p2p_link(c, node_a, gpu_a, node_b, gpu_b);  // checks ids
  Path p;
  if (node_a == node_b && gpu_a == gpu_b) {
    p.hops = {{gpu_name(node_a, gpu_a) + "-mem", p2p.bandwidth_bytes_per_s}};
    return p;
  }
  if (node_a == node_b) {
    const double bw = p2p.bandwidth_bytes_per_s, half = c.intra_node.latency_s / 2;
    p.hops = {{port_name(c, node_a, gpu_a) + "_UP", bw},
              {port_name(c, node_b, gpu_b) + "_DOWN", bw}};
    p.latency_s = half + half;
    return p;
  }
  const double bw = nic_bandwidth(c, options), half = c.network.latency_s / 2;
  p.hops.push_back({nic_name(c, node_a, gpu_a) + "_UP", bw});
  if (has_backbone(c, options)) {
    LinkSpec b = backbone_spec(c);
    p.hops.push_back({b.name, b.bandwidth_bytes_per_s});
  }
  p.hops.push_back({nic_name(c, node_b, gpu_b) + "_DOWN", bw});
  p.latency_s = half + half;
  return p;
}

sg4::Host* Platform::gpu(int node, int gpu) const {
  if (node < 0 || node >= nodes || gpu < 0 || gpu >= gpus_per_node)
    throw InputError(fmt::format("platform: no GPU at node {} gpu {} ({} nodes x {} GPUs)", node,
                                 gpu, nodes, gpus_per_node));
  return gpus[std::size_t(node) * gpus_per_node + gpu];
}

namespace {

struct MadeLink {
  sg4::Link* link;  // the split-duplex pair or the one-way link
  bool split_duplex;
};

MadeLink make_link(sg4::NetZone* zone, const LinkSpec& s, Platform& p) {
  if (!s.split_duplex) {
    sg4::Link* l = zone->create_link(s.name, s.bandwidth_bytes_per_s);
    l->set_latency(s.latency_s)->seal();
    p.links.push_back({l, s.name, s.kind, s.bandwidth_bytes_per_s});
    return {l, false};
  }
  sg4::SplitDuplexLink* l = zone->create_split_duplex_link(s.name, s.bandwidth_bytes_per_s);
  l->set_latency(s.latency_s)->seal();
  p.links.push_back({l->get_link_up(), s.name + "_UP", s.kind, s.bandwidth_bytes_per_s});
  p.links.push_back({l->get_link_down(), s.name + "_DOWN", s.kind, s.bandwidth_bytes_per_s});
  return {l, true};
}

sg4::LinkInRoute use_of(const MadeLink& l, Dir d) {
  using D = sg4::LinkInRoute::Direction;
  if (!l.split_duplex) return sg4::LinkInRoute(l.link);
  return sg4::LinkInRoute(l.link, d == Dir::up ? D::UP : D::DOWN);
}

using NetPoint = simgrid::kernel::routing::NetPoint;
struct NodeZone {
  NetPoint* zone;
  NetPoint* gateway;
};

// One node's full zone, its hosts, links and routes.
NodeZone build_node(sg4::NetZone* top, const NodeModel& m, Platform& p) {
  sg4::NetZone* zone = sg4::create_full_zone(m.zone);
  zone->set_parent(top);
  std::unordered_map<std::string, NetPoint*> points;
  for (const std::string& g : m.gpus) {
    sg4::Host* h = zone->create_host(g, kGpuSpeed);
    p.gpus.push_back(h);
    points[g] = h->get_netpoint();
  }
  sg4::Host* cpu = zone->create_host(m.cpu, kCpuSpeed);
  p.host_cpus.push_back(cpu);
  points[m.cpu] = cpu->get_netpoint();
  points[m.router] = zone->create_router(m.router);
  std::vector<MadeLink> made;
  made.reserve(m.links.size());
  for (const LinkSpec& s : m.links)
    made.push_back(make_link(zone, s, p));
  for (const LocalRoute& r : m.routes) {
    std::vector<sg4::LinkInRoute> uses;
    for (const LinkUse& u : r.links)
      uses.push_back(use_of(made[u.link], u.dir));
    zone->add_route(points.at(r.src), points.at(r.dst), nullptr, nullptr, uses, false);
  }
  zone->seal();
  return {zone->get_netpoint(), points.at(m.router)};
}

}  // namespace

Platform build_platform(const Cluster& c, const PlatformOptions& options) {
  if (!sg4::Engine::has_instance())
    throw Error("build_platform: no SimGrid engine (call make_engine() first)");
  if (c.nodes < 1 || c.gpus_per_node < 1)
    throw InputError(fmt::format("cluster {}: no GPUs to simulate", c.name));
  Platform p;
  p.nodes = c.nodes;
  p.gpus_per_node = c.gpus_per_node;
  p.gpus.reserve(std::size_t(c.devices()));
  sg4::NetZone* top = sg4::create_star_zone("pipewright");
  sg4::Link* backbone = nullptr;
  if (has_backbone(c, options)) backbone = make_link(top, backbone_spec(c), p).link;
  for (int n = 0; n < c.nodes; ++n) {
    const NodeZone z = build_node(top, node_model(c, n, options), p);
    if (backbone) {  // every inter-node flow crosses it once: on the way up
      top->add_route(z.zone, nullptr, z.gateway, nullptr, {sg4::LinkInRoute(backbone)}, false);
      top->add_route(nullptr, z.zone, nullptr, z.gateway, {}, false);
    } else {
      top->add_route(z.zone, nullptr, z.gateway, nullptr, {}, true);
    }
  }
  top->seal();
  return p;
}

}  // namespace pw::sim
