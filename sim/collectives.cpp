// Gradient all-reduce on s4u (ring and hierarchical, as NCCL picks them) and its closed form.
#include "sim/collectives.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <unordered_map>

#include <fmt/format.h>
#include <simgrid/s4u/Actor.hpp>
#include <simgrid/s4u/Comm.hpp>
#include <simgrid/s4u/Mailbox.hpp>
#include <simgrid/simix.hpp>

#include "common/error.hpp"
#include "sim/observer.hpp"

namespace pw::sim {

namespace {

// The flow service: a mailbox whose permanent receiver is one daemon actor that only drains it.
sg4::Mailbox* flow_box = nullptr;
sg4::ActorPtr flow_sink;
int flow_token = 0;  // SimGrid needs a payload pointer; only the simulated size matters

}  // namespace

void start_flow_service(sg4::Host* host) {
  flow_box = sg4::Mailbox::by_name("pw-flows");
  flow_sink = sg4::Actor::create("flows", host, [] {
    sg4::Actor::self()->daemonize();
    for (;;)
      flow_box->get<int>();
  });
  flow_box->set_receiver(flow_sink);
}

void stop_flow_service() {
  flow_box = nullptr;
  flow_sink = nullptr;
}

bool in_flow_service() {
  return flow_sink && sg4::Actor::self() == flow_sink.get();
}

// A mailbox comm runs from its sender's host to its receiver's host, read when it starts. Both
// actors are moved to the flow's ends, the comm started and the sender moved back in one kernel
// call, so the flows start in the same order and at the same instants as sendto_async's would.
sg4::CommPtr start_flow(sg4::Host* from, sg4::Host* to, std::uint64_t bytes) {
  if (!flow_box) return sg4::Comm::sendto_async(from, to, bytes);
  sg4::CommPtr comm = flow_box->put_init(&flow_token, bytes);
  sg4::Actor* me = sg4::Actor::self();
  sg4::Host* home = me->get_host();
  // Actor::set_host walks the actor's activity list: move only what is not there already.
  simgrid::kernel::actor::simcall_answered([&] {
    if (flow_sink->get_host() != to) flow_sink->set_host(to);
    if (from != home) me->set_host(from);
    comm->start();
    if (from != home) me->set_host(home);
  });
  return comm;
}

namespace {

using HostFlow = std::pair<sg4::Host*, sg4::Host*>;

// An s4u actor keeps its pending comms in a list scanned on every completion (quadratic in the
// comms it waits on at once), so large phases are split over helper actors of this many flows.
constexpr std::size_t kFlowsPerActor = 64;

// One pipelined flow per (from, to) carrying all `steps` chunks, as NCCL pipelines a ring, after
// the (steps - 1) extra latencies the lockstep ring pays: on the uniform links of a ring phase this
// takes exactly steps x (latency + chunk / share), the lockstep time, with 2(n-1) times fewer
// simulated transfers (a ring of 1,024 members would otherwise be 2M transfers per bucket).
void run_pipelined(const std::vector<HostFlow>& flows, std::uint64_t bytes) {
  std::vector<sg4::CommPtr> comms;
  for (const auto& [from, to] : flows) {
    observe_transfer(from, to, double(bytes));
    comms.push_back(start_flow(from, to, bytes));
  }
  sg4::Comm::wait_all(comms);
}

double max_latency_s(const std::vector<HostFlow>& flows) {
  double worst = 0;
  std::vector<sg4::Link*> links;
  for (const auto& [from, to] : flows) {
    double latency = 0;
    links.clear();
    from->route_to(to, links, &latency);
    worst = std::max(worst, latency);
  }
  return worst;
}

// `steps` ring steps; in each, every member of every ring sends `chunk` bytes to its right
// neighbour, all at once.
void ring_steps(const std::vector<std::vector<sg4::Host*>>& rings, int steps, std::uint64_t chunk) {
  std::vector<HostFlow> flows;
  for (const auto& ring : rings)
    for (std::size_t i = 0; i < ring.size(); ++i)
      flows.emplace_back(ring[i], ring[(i + 1) % ring.size()]);
  if (steps <= 0 || flows.empty()) return;
  sg4::this_actor::sleep_for((steps - 1) * max_latency_s(flows));
  const std::uint64_t bytes = std::uint64_t(steps) * chunk;
  if (flows.size() <= kFlowsPerActor) return run_pipelined(flows, bytes);
  std::vector<sg4::ActorPtr> actors;
  for (std::size_t h = 0; h * kFlowsPerActor < flows.size(); ++h) {
    std::vector<HostFlow> part(flows.begin() + h * kFlowsPerActor,
                               flows.begin() + std::min(flows.size(), (h + 1) * kFlowsPerActor));
    actors.push_back(sg4::Actor::create("allreduce", sg4::this_actor::get_host(),
                                        [part, bytes] { run_pipelined(part, bytes); }));
  }
  for (const auto& a : actors)
    a->join();
}

template <class T>
std::vector<std::vector<T>> transpose(const std::vector<std::vector<T>>& by_node) {
  std::vector<std::vector<T>> rings(by_node[0].size());
  for (const auto& node : by_node)
    for (std::size_t j = 0; j < node.size(); ++j)
      rings[j].push_back(node[j]);
  return rings;
}

template <class T>
void check_rectangular(const std::vector<std::vector<T>>& by_node) {
  if (by_node.empty() || by_node[0].empty())
    throw InputError("hierarchical all-reduce: no members");
  for (std::size_t i = 0; i < by_node.size(); ++i)
    if (by_node[i].size() != by_node[0].size())
      throw InputError(
          fmt::format("hierarchical all-reduce: node group {} has {} members, node group 0 has {}",
                      i, by_node[i].size(), by_node[0].size()));
}

// Closed form of one lockstep step: max over flows of latency + chunk / equal share.
double step_time_s(const clusters::Cluster& c, const std::vector<std::pair<Member, Member>>& flows,
                   std::uint64_t chunk, const PlatformOptions& options) {
  std::vector<Path> paths;
  std::unordered_map<std::string, int> load;
  for (const auto& [a, b] : flows) {
    paths.push_back(gpu_path(c, a.first, a.second, b.first, b.second, options));
    for (const Hop& h : paths.back().hops)
      ++load[h.link];
  }
  double t = 0;
  for (const Path& p : paths) {
    double share = p.hops[0].bandwidth_bytes_per_s;
    for (const Hop& h : p.hops)
      share = std::min(share, h.bandwidth_bytes_per_s / load[h.link]);
    t = std::max(t, p.latency_s + double(chunk) / share);
  }
  return t;
}

std::vector<std::pair<Member, Member>> ring_flows(const std::vector<std::vector<Member>>& rings) {
  std::vector<std::pair<Member, Member>> flows;
  for (const auto& ring : rings)
    for (std::size_t i = 0; i < ring.size(); ++i)
      flows.emplace_back(ring[i], ring[(i + 1) % ring.size()]);
  return flows;
}

std::vector<sg4::Host*> hosts_of(const Platform& p, const std::vector<Member>& members) {
  std::vector<sg4::Host*> hosts;
  for (const auto& [node, gpu] : members)
    hosts.push_back(p.gpu(node, gpu));
  return hosts;
}

}  // namespace

std::uint64_t chunk_bytes(double bytes, int parts) {
  if (!(bytes >= 0) || parts < 1)
    throw InputError(fmt::format("all-reduce: bad size {} bytes over {} parts", bytes, parts));
  return std::uint64_t(std::ceil(bytes / parts));
}

std::string to_string(AllreduceAlgorithm a) {
  switch (a) {
    case AllreduceAlgorithm::ring:
      return "ring";
    case AllreduceAlgorithm::hierarchical:
      return "hierarchical";
    default:
      return "none";
  }
}

void ring_allreduce(const std::vector<sg4::Host*>& ring, double bytes) {
  const int n = int(ring.size());
  if (n <= 1) return;
  ring_steps({ring}, 2 * (n - 1), chunk_bytes(bytes, n));
}

void hierarchical_allreduce(const std::vector<std::vector<sg4::Host*>>& by_node, double bytes) {
  check_rectangular(by_node);
  const int N = int(by_node.size()), k = int(by_node[0].size());
  ring_steps(by_node, k - 1, chunk_bytes(bytes, k));                       // reduce-scatter
  ring_steps(transpose(by_node), 2 * (N - 1), chunk_bytes(bytes, k * N));  // inter-node rings
  ring_steps(by_node, k - 1, chunk_bytes(bytes, k));                       // all-gather
}

AllreducePlan plan_allreduce(const std::vector<Member>& members) {
  AllreducePlan plan;
  if (members.size() <= 1) return plan;
  std::map<int, std::size_t> slot;  // node -> its group
  for (const Member& m : members) {
    auto [it, fresh] = slot.emplace(m.first, plan.groups.size());
    if (fresh) plan.groups.emplace_back();
    plan.groups[it->second].push_back(m);
  }
  for (auto& g : plan.groups)
    std::stable_sort(g.begin(), g.end());
  const std::size_t k = plan.groups[0].size();
  bool rectangular = std::all_of(plan.groups.begin(), plan.groups.end(),
                                 [k](const auto& g) { return g.size() == k; });
  if (plan.groups.size() > 1 && k > 1 && rectangular) {
    plan.algorithm = AllreduceAlgorithm::hierarchical;
    return plan;
  }
  std::vector<Member> ring;
  for (const auto& g : plan.groups)
    ring.insert(ring.end(), g.begin(), g.end());
  plan.groups = {ring};
  plan.algorithm = AllreduceAlgorithm::ring;
  return plan;
}

void allreduce(const Platform& platform, const std::vector<Member>& members, double bytes) {
  const AllreducePlan plan = plan_allreduce(members);
  if (plan.algorithm == AllreduceAlgorithm::ring) {
    ring_allreduce(hosts_of(platform, plan.groups[0]), bytes);
  } else if (plan.algorithm == AllreduceAlgorithm::hierarchical) {
    std::vector<std::vector<sg4::Host*>> by_node;
    for (const auto& g : plan.groups)
      by_node.push_back(hosts_of(platform, g));
    hierarchical_allreduce(by_node, bytes);
  }
}

double allreduce_time_s(const clusters::Cluster& c, const std::vector<Member>& members,
                        double bytes, const PlatformOptions& options) {
  const AllreducePlan plan = plan_allreduce(members);
  if (plan.algorithm == AllreduceAlgorithm::none) return 0;
  if (plan.algorithm == AllreduceAlgorithm::ring) {
    const int n = int(plan.groups[0].size());
    return 2 * (n - 1) * step_time_s(c, ring_flows(plan.groups), chunk_bytes(bytes, n), options);
  }
  const int N = int(plan.groups.size()), k = int(plan.groups[0].size());
  const double intra = step_time_s(c, ring_flows(plan.groups), chunk_bytes(bytes, k), options);
  const double inter =
      step_time_s(c, ring_flows(transpose(plan.groups)), chunk_bytes(bytes, k * N), options);
  return 2 * (k - 1) * intra + 2 * (N - 1) * inter;
}

void allgather(const Platform& platform, const std::vector<Member>& members, double bytes) {
  const AllreducePlan plan = plan_allreduce(members);
  if (plan.algorithm == AllreduceAlgorithm::ring) {
    const int n = int(plan.groups[0].size());
    ring_steps({hosts_of(platform, plan.groups[0])}, n - 1, chunk_bytes(bytes, n));
  } else if (plan.algorithm == AllreduceAlgorithm::hierarchical) {
    std::vector<std::vector<sg4::Host*>> by_node;
    for (const auto& g : plan.groups)
      by_node.push_back(hosts_of(platform, g));
    const int N = int(by_node.size()), k = int(by_node[0].size());
    ring_steps(transpose(by_node), N - 1, chunk_bytes(bytes, k * N));  // inter-node rings
    ring_steps(by_node, k - 1, chunk_bytes(bytes, k));                 // intra-node rings
  }
}

double allgather_time_s(const clusters::Cluster& c, const std::vector<Member>& members,
                        double bytes, const PlatformOptions& options) {
  const AllreducePlan plan = plan_allreduce(members);
  if (plan.algorithm == AllreduceAlgorithm::none) return 0;
  if (plan.algorithm == AllreduceAlgorithm::ring) {
    const int n = int(plan.groups[0].size());
    return (n - 1) * step_time_s(c, ring_flows(plan.groups), chunk_bytes(bytes, n), options);
  }
  const int N = int(plan.groups.size()), k = int(plan.groups[0].size());
  const double intra = step_time_s(c, ring_flows(plan.groups), chunk_bytes(bytes, k), options);
  const double inter =
      step_time_s(c, ring_flows(transpose(plan.groups)), chunk_bytes(bytes, k * N), options);
  return (k - 1) * intra + (N - 1) * inter;
}

}  // namespace pw::sim
