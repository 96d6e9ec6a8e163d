// sim/collectives: ring and hierarchical all-reduce against their hand formulas and closed form.
// SimGrid allows one engine per process: every TEST that simulates makes its own and runs once.
#include <functional>

#include <simgrid/s4u.hpp>

#include "clusters/cluster.hpp"
#include "sim/collectives.hpp"
#include "sim/engine.hpp"
#include "sim/platform.hpp"
#include "test_util.hpp"

namespace pw::sim {
namespace {

using clusters::Cluster;
using clusters::load_cluster;

// Runs `body` in one actor on the first GPU; returns the simulated time it took.
double simulate(const Platform& p, const std::function<void()>& body) {
  double elapsed = -1;
  sg4::Actor::create("collective", p.gpus[0], [&] {
    const double start = sg4::Engine::get_clock();
    body();
    elapsed = sg4::Engine::get_clock() - start;
  });
  sg4::Engine::get_instance()->run();
  return elapsed;
}

std::vector<Member> node_members(int node, int count) {
  std::vector<Member> m;
  for (int g = 0; g < count; ++g)
    m.emplace_back(node, g);
  return m;
}

// dgx-a100 with round numbers: alpha = 10 us per message, beta = 300e9 B/s per GPU port.
const std::vector<std::string> kRoundA100 = {"intra_node.latency_s=1e-5",
                                             "intra_node.efficiency=1"};

// Ring over n GPUs of one node: 2(n-1) steps, each sends S/n over its own NVSwitch ports (no link
// carries two flows), so T = 2(n-1)(alpha + S/(n beta)).
void expect_ring(int n, double bytes) {
  const Cluster c = load_cluster("dgx-a100", 1, kRoundA100);
  const double alpha = 1e-5, beta = 300e9;
  auto engine = make_engine();
  const Platform p = build_platform(c);
  std::vector<sg4::Host*> ring(p.gpus.begin(), p.gpus.begin() + n);
  const double t = simulate(p, [&] { ring_allreduce(ring, bytes); });
  const double want = 2 * (n - 1) * (alpha + bytes / (n * beta));
  EXPECT_NEAR(t, want, 1e-12 * want);
  EXPECT_NEAR(allreduce_time_s(c, node_members(0, n), bytes), want, 1e-12 * want);
}

TEST(SimCollectives, Ring2) {
  expect_ring(2, 6e8);
}  // 2 (10 us + 1 ms) = 2.02 ms
TEST(SimCollectives, Ring4) {
  expect_ring(4, 6e8);
}  // 6 (10 us + 0.5 ms) = 3.06 ms
// design.md's example: 8 GPUs, 1 GB: 14 (10 us + 1e9 / 2.4e12 s) = 14 (10 us + 416.67 us) = 5.973
// ms.
TEST(SimCollectives, Ring8OneGigabyte) {
  expect_ring(8, 1e9);
}

// A ring over one member per node (dgx-a100:4, NIC per GPU): 2(N-1)(5 us + S/(N * 22.5e9)).
TEST(SimCollectives, RingAcrossNodes) {
  const Cluster c = load_cluster("dgx-a100", 4);
  const std::vector<Member> members = {{0, 0}, {1, 0}, {2, 0}, {3, 0}};
  EXPECT_EQ(plan_allreduce(members).algorithm, AllreduceAlgorithm::ring);
  auto engine = make_engine();
  const Platform p = build_platform(c);
  const double S = 4.5e8, t = simulate(p, [&] { allreduce(p, members, S); });
  const double want = 2 * 3 * (5e-6 + S / (4 * 22.5e9));  // 6 (5 us + 5 ms)
  EXPECT_NEAR(t, want, 1e-12 * want);
  EXPECT_NEAR(allreduce_time_s(c, members, S), want, 1e-12 * want);
}

// All-gather (the tied exchange's gathers): the all-reduce's second half. A ring over n GPUs of
// one node: (n-1)(alpha + S/(n beta)).
TEST(SimCollectives, AllgatherRing8) {
  const Cluster c = load_cluster("dgx-a100", 1, kRoundA100);
  const double S = 1e9, want = 7 * (1e-5 + S / (8 * 300e9));
  auto engine = make_engine();
  const Platform p = build_platform(c);
  const double t = simulate(p, [&] { allgather(p, node_members(0, 8), S); });
  EXPECT_NEAR(t, want, 1e-12 * want);
  EXPECT_NEAR(allgather_time_s(c, node_members(0, 8), S), want, 1e-12 * want);
  EXPECT_EQ(allgather_time_s(c, {{0, 3}}, S), 0.0);
}

// Over 2 nodes of 4 (p3.16xlarge:2, one NIC per node): inter-node rings first, the 4 sharing each
// NIC, (N-1)(50 us + (S/(kN)) / (B/k)), then the intra-node rings, (k-1)(5 us + S/(k 30e9)).
TEST(SimCollectives, AllgatherHierarchicalSharesTheNodeNic) {
  const Cluster c = load_cluster("p3.16xlarge", 2);
  std::vector<Member> members = node_members(0, 4);
  for (const Member& m : node_members(1, 4))
    members.push_back(m);
  const double S = 4e8, k = 4, N = 2;
  const double want = (N - 1) * (50e-6 + S / (N * 2.5e9)) + (k - 1) * (5e-6 + S / (k * 30e9));
  auto engine = make_engine();
  const Platform p = build_platform(c);
  const double t = simulate(p, [&] { allgather(p, members, S); });
  EXPECT_NEAR(t, want, 1e-12 * want);
  EXPECT_NEAR(allgather_time_s(c, members, S), want, 1e-12 * want);
}

// Hierarchical on 2 x 8 (dgx-a100:2, round intra figures, NIC per GPU 25e9 * 0.9, 5 us):
// reduce-scatter and all-gather: 2 (k-1) (alpha + S/(k beta)) = 14 (10 us + 1.6e9/8/300e9 s);
// inter-node: the 8 rings of 2 each use their own NICs: 2 (N-1) (5 us + S/(kN) / 22.5e9).
TEST(SimCollectives, Hierarchical2x8) {
  const Cluster c = load_cluster("dgx-a100", 2, kRoundA100);
  const double S = 1.6e9, k = 8, N = 2;
  const double want =
      2 * (k - 1) * (1e-5 + S / k / 300e9) + 2 * (N - 1) * (5e-6 + S / (k * N) / 22.5e9);
  auto engine = make_engine();
  const Platform p = build_platform(c);
  std::vector<std::vector<sg4::Host*>> by_node(2);
  for (int n = 0; n < 2; ++n)
    for (int g = 0; g < 8; ++g)
      by_node[n].push_back(p.gpu(n, g));
  const double t = simulate(p, [&] { hierarchical_allreduce(by_node, S); });
  EXPECT_NEAR(t, want, 1e-12 * want);
  std::vector<Member> members = node_members(0, 8);
  for (const Member& m : node_members(1, 8))
    members.push_back(m);
  EXPECT_NEAR(allreduce_time_s(c, members, S), want, 1e-12 * want);
}

// With one NIC per node (p3.16xlarge:2) the k = 4 inter-node rings share each node's NIC, so each
// flow gets B/k: 2 (N-1) (50 us + (S/(kN)) / (B/k)) = 2 (50 us + S / (N B)), B = 2.5e9. Intra: the
// mesh gives each pair 150e9 * 0.8 / 4 = 30e9: 2 (k-1) (5 us + S/(k 30e9)). Through allreduce().
TEST(SimCollectives, HierarchicalSharesTheNodeNic) {
  const Cluster c = load_cluster("p3.16xlarge", 2);
  std::vector<Member> members;
  for (int g = 0; g < 4; ++g) {  // replica order alternates nodes; the plan groups them
    members.emplace_back(0, g);
    members.emplace_back(1, g);
  }
  const AllreducePlan plan = plan_allreduce(members);
  ASSERT_EQ(plan.algorithm, AllreduceAlgorithm::hierarchical);
  EXPECT_EQ(plan.groups[1], node_members(1, 4));
  const double S = 4e8, k = 4, N = 2;
  const double want =
      2 * (k - 1) * (5e-6 + S / (k * 30e9)) + 2 * (N - 1) * (50e-6 + S / (N * 2.5e9));
  auto engine = make_engine();
  const Platform p = build_platform(c);
  const double t = simulate(p, [&] { allreduce(p, members, S); });
  EXPECT_NEAR(t, want, 1e-12 * want);
  EXPECT_NEAR(allreduce_time_s(c, members, S), want, 1e-12 * want);
}

// Four replicas on one GPU: every step's 4 copies share its memory (2.039e12 / 2 B/s), so a step
// of S/4 each takes S / (2.039e12 / 2), and 2 (4-1) steps take 6 S / 1.0195e12, no latency.
TEST(SimCollectives, CoLocatedReplicasUseDeviceMemory) {
  const Cluster c = load_cluster("dgx-a100");
  const std::vector<Member> members(4, Member{0, 2});
  const double S = 1e9, want = 6 * S / (c.device.memory_bandwidth_bytes_per_s / 2);
  auto engine = make_engine();
  const Platform p = build_platform(c);
  const double t = simulate(p, [&] { allreduce(p, members, S); });
  EXPECT_NEAR(t, want, 1e-12 * want);
  EXPECT_NEAR(allreduce_time_s(c, members, S), want, 1e-12 * want);
}

// Two GPUs holding two replicas each: the ring 0,0,1,1 alternates copies in device memory with
// NVSwitch hops; a step lasts as long as its NVSwitch hop: 6 (3 us + (S/4) / 240e9).
TEST(SimCollectives, MixedCoLocatedRing) {
  const Cluster c = load_cluster("dgx-a100");
  const std::vector<Member> members = {{0, 1}, {0, 0}, {0, 1}, {0, 0}};
  const double S = 1e9, want = 6 * (3e-6 + S / 4 / 240e9);
  auto engine = make_engine();
  const Platform p = build_platform(c);
  const double t = simulate(p, [&] { allreduce(p, members, S); });
  EXPECT_NEAR(t, want, 1e-12 * want);
  EXPECT_NEAR(allreduce_time_s(c, members, S), want, 1e-12 * want);
}

// 16 DGX A100 nodes, all 128 GPUs (steps of 128 flows run on helper actors): intra 2 (8-1)
// (3 us + 1.25e8 / 240e9) plus inter 2 (16-1) (5 us + (1e9 / 128) / 22.5e9).
TEST(SimCollectives, Hierarchical16x8) {
  const Cluster c = load_cluster("dgx-a100", 16);
  std::vector<Member> members;
  for (int n = 0; n < 16; ++n)
    for (const Member& m : node_members(n, 8))
      members.push_back(m);
  const double S = 1e9, want = 14 * (3e-6 + 1.25e8 / 240e9) + 30 * (5e-6 + 7812500 / 22.5e9);
  auto engine = make_engine();
  const Platform p = build_platform(c);
  const double t = simulate(p, [&] { allreduce(p, members, S); });
  EXPECT_NEAR(t, want, 1e-12 * want);
  EXPECT_NEAR(allreduce_time_s(c, members, S), want, 1e-12 * want);
}

TEST(SimCollectives, OneMemberTakesNoTime) {
  const Cluster c = load_cluster("dgx-a100");
  auto engine = make_engine();
  const Platform p = build_platform(c);
  EXPECT_EQ(simulate(p, [&] { allreduce(p, {{0, 3}}, 1e9); }), 0.0);
  EXPECT_EQ(allreduce_time_s(c, {{0, 3}}, 1e9), 0.0);
  EXPECT_EQ(allreduce_time_s(c, {}, 1e9), 0.0);
}

// NCCL's choice: one node or one member per node -> ring; several nodes with several members
// each -> hierarchical; unequal groups -> one ring, grouped by node.
TEST(SimCollectives, PlanPicksByTopology) {
  EXPECT_EQ(plan_allreduce({}).algorithm, AllreduceAlgorithm::none);
  EXPECT_EQ(plan_allreduce({{1, 2}}).algorithm, AllreduceAlgorithm::none);
  EXPECT_EQ(plan_allreduce(node_members(0, 8)).algorithm, AllreduceAlgorithm::ring);
  EXPECT_EQ(plan_allreduce({{0, 0}, {1, 0}, {2, 0}}).algorithm, AllreduceAlgorithm::ring);
  const AllreducePlan h = plan_allreduce({{0, 1}, {1, 1}, {0, 0}, {1, 0}});
  EXPECT_EQ(h.algorithm, AllreduceAlgorithm::hierarchical);
  EXPECT_EQ(h.groups, (std::vector<std::vector<Member>>{{{0, 0}, {0, 1}}, {{1, 0}, {1, 1}}}));
  const AllreducePlan r = plan_allreduce({{0, 0}, {1, 0}, {0, 1}});
  EXPECT_EQ(r.algorithm, AllreduceAlgorithm::ring);
  EXPECT_EQ(r.groups[0], (std::vector<Member>{{0, 0}, {0, 1}, {1, 0}}));
  EXPECT_EQ(to_string(AllreduceAlgorithm::hierarchical), "hierarchical");
  EXPECT_EQ(chunk_bytes(10, 4), 3u);
  EXPECT_THROW(chunk_bytes(-1, 4), InputError);
}

TEST(SimCollectives, HierarchicalRejectsUnequalNodes) {
  auto engine = make_engine();
  const Platform p = build_platform(load_cluster("dgx-a100", 2));
  std::string message;
  simulate(p, [&] {
    message = testing::error_of([&] {
      hierarchical_allreduce({{p.gpu(0, 0), p.gpu(0, 1)}, {p.gpu(1, 0)}}, 1e6);
    });
  });
  EXPECT_NE(message.find("node group 1 has 1 members"), std::string::npos) << message;
}

}  // namespace
}  // namespace pw::sim
