// Gradient all-reduce on s4u (ring and hierarchical, as NCCL picks them) and its closed form.
//
// Ring model: in each of a phase's steps every member sends one chunk to its right neighbour; a
// chunk of S bytes over p parts carries chunk_bytes(S, p) = ceil(S / p) bytes (whole bytes). The
// steps are simulated pipelined, as NCCL runs them: one flow per member carries the phase's chunks
// after the latencies of the steps in between, which on a phase's uniform links takes exactly the
// lockstep time (each step: max over flows of latency + chunk / share) with 2(n-1) times fewer
// transfers.
//  - ring over n members: 2(n-1) steps of S/n. On uniform links (latency a, bandwidth B) this takes
//    2(n-1)(a + S/(n B)), the busbw model of nccl-tests.
//  - hierarchical over N nodes of k members: intra-node reduce-scatter (k-1 steps of S/k, all
//    nodes at once), inter-node rings among members of the same local index (2(N-1) steps of
//    S/(kN), all k rings at once), intra-node all-gather (k-1 steps of S/k).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <simgrid/s4u/Comm.hpp>
#include <simgrid/s4u/Host.hpp>

#include "clusters/cluster.hpp"
#include "sim/platform.hpp"

namespace pw::sim {

// A host-to-host flow of `bytes` from `from` to `to`, started now by the calling actor (who must
// wait or test it). Same transfer as sg4::Comm::sendto_async, which SimGrid 3.32 detaches into one
// list of the whole engine that every completion scans (quadratic in the flows in flight: 97% of
// a 16,384-GPU run); after start_flow_service() these flows are mailbox comms instead, kept in the
// calling actor's own short list. Without the service (tests of the collectives) it is
// sendto_async.
sg4::CommPtr start_flow(sg4::Host* from, sg4::Host* to, std::uint64_t bytes);
// Before the engine runs: one daemon actor (on `host`) receives every flow. Once per simulation.
void start_flow_service(sg4::Host* host);
void stop_flow_service();
// True in the flow service's own actor (its completions are not simulated activities).
bool in_flow_service();

// These block the calling actor in simulated time; call them from inside an actor.
void ring_allreduce(const std::vector<sg4::Host*>& ring, double bytes);
// by_node[i][j]: member j of node i; every node has the same number of members.
void hierarchical_allreduce(const std::vector<std::vector<sg4::Host*>>& by_node, double bytes);

using Member = std::pair<int, int>;  // (node, gpu)

enum class AllreduceAlgorithm { none, ring, hierarchical };
std::string to_string(AllreduceAlgorithm a);  // "none", "ring", "hierarchical"

// What allreduce() runs. Members are grouped by node (nodes in order of first appearance, GPUs
// ascending inside a node, so co-located members sit side by side). One member: none. One node,
// or one member per node, or nodes with unequal member counts: a ring over the groups in order.
// Several nodes with k > 1 members each: hierarchical, groups[i] = node i's members.
struct AllreducePlan {
  AllreduceAlgorithm algorithm = AllreduceAlgorithm::none;
  std::vector<std::vector<Member>> groups;  // ring: one group, in ring order
};
AllreducePlan plan_allreduce(const std::vector<Member>& members);

// All-reduce of `bytes` among `members` (in replica order; the same GPU may appear several times:
// co-located replicas exchange through its device memory). Blocks the calling actor.
void allreduce(const Platform& platform, const std::vector<Member>& members, double bytes);

// All-gather of `bytes` (the whole gathered tensor; each member holds ceil(bytes / n) of it) among
// `members`, on the layout allreduce() picks: a ring of n - 1 steps of ceil(bytes / n), or, over N
// nodes of k members, inter-node rings among members of the same local index (N - 1 steps of
// ceil(bytes / (kN))) and then intra-node rings (k - 1 steps of ceil(bytes / k)): the all-gather
// half of each all-reduce. Blocks the calling actor.
void allgather(const Platform& platform, const std::vector<Member>& members, double bytes);
double allgather_time_s(const clusters::Cluster& c, const std::vector<Member>& members,
                        double bytes, const PlatformOptions& options = {});

// The time allreduce() takes with no other traffic, in closed form: each step takes
// max over its flows of (latency + chunk / share), a flow's share being min over its links of
// bandwidth / (flows of this step on that link). Exact for the layouts plan_allreduce produces on
// this platform's links (each link's flows in a step share one bottleneck).
double allreduce_time_s(const clusters::Cluster& c, const std::vector<Member>& members,
                        double bytes, const PlatformOptions& options = {});

std::uint64_t chunk_bytes(double bytes, int parts);  // ceil(bytes / parts)

}  // namespace pw::sim
