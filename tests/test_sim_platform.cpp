// sim/platform: simulated point-to-point times equal clusters::p2p_link; routes, sharing, XML,
// scale. SimGrid allows one engine per process: every TEST that simulates makes its own (ctest runs
// each TEST in its own process) and runs one simulation.
#include <fmt/format.h>
#include <simgrid/s4u.hpp>

#include "clusters/cluster.hpp"
#include "sim/engine.hpp"
#include "sim/platform.hpp"
#include "test_util.hpp"

namespace pw::sim {
namespace {

using clusters::Cluster;
using clusters::load_cluster;
using clusters::p2p_link;

struct Transfer {
  int node_a, gpu_a, node_b, gpu_b;
};
constexpr double kBytes = 1e8;

// Runs the transfers one after another in one actor; returns each one's simulated duration.
std::vector<double> transfer_times(const Platform& p, const std::vector<Transfer>& ts,
                                   double bytes = kBytes) {
  std::vector<double> times;
  sg4::Actor::create("probe", p.gpus[0], [&] {
    for (const Transfer& t : ts) {
      const double start = sg4::Engine::get_clock();
      sg4::Comm::sendto(p.gpu(t.node_a, t.gpu_a), p.gpu(t.node_b, t.gpu_b), std::uint64_t(bytes));
      times.push_back(sg4::Engine::get_clock() - start);
    }
  });
  sg4::Engine::get_instance()->run();
  return times;
}

// Every transfer takes latency + S / bandwidth of p2p_link, exactly (to rounding).
void expect_p2p(const Cluster& c, const std::vector<Transfer>& ts, const PlatformOptions& o = {}) {
  auto engine = make_engine();
  const Platform p = build_platform(c, o);
  const std::vector<double> times = transfer_times(p, ts);
  for (std::size_t i = 0; i < ts.size(); ++i) {
    const Transfer& t = ts[i];
    const double want = p2p_link(c, t.node_a, t.gpu_a, t.node_b, t.gpu_b).time_s(kBytes);
    EXPECT_NEAR(times[i], want, 1e-12 * want) << c.name << " transfer " << i;
  }
}

// Same GPU: device memory bandwidth / 2, no latency: 1e8 / (2.039e12 / 2) = 98.08 us.
TEST(SimPlatform, SameGpuIsADeviceMemoryCopy) {
  expect_p2p(load_cluster("dgx-a100"), {{0, 3, 0, 3}});
}

// NVSwitch: 3 us + 1e8 / (300e9 * 0.8) = 3 us + 416.7 us, for every pair and both directions.
TEST(SimPlatform, SameNodeNvswitch) {
  expect_p2p(load_cluster("dgx-a100"), {{0, 0, 0, 1}, {0, 1, 0, 0}, {0, 7, 0, 2}});
}

// Hybrid cube-mesh: 5 us + 1e8 / (150e9 * 0.8 / 4) = 5 us + 3.333 ms.
TEST(SimPlatform, SameNodeNvlinkMesh) {
  expect_p2p(load_cluster("p3.16xlarge"), {{0, 0, 0, 5}, {0, 6, 0, 1}});
}

// One NIC per node: 50 us + 1e8 / (3.125e9 * 0.8) = 50 us + 40 ms.
TEST(SimPlatform, CrossNodeNicPerNode) {
  expect_p2p(load_cluster("p3.16xlarge", 3), {{0, 0, 1, 0}, {2, 7, 0, 3}});
}

// One NIC per GPU: 5 us + 1e8 / (25e9 * 0.9) = 5 us + 4.444 ms.
TEST(SimPlatform, CrossNodeNicPerGpu) {
  expect_p2p(load_cluster("dgx-a100", 2), {{0, 0, 1, 0}, {1, 5, 0, 2}});
}

// Oversubscription 4: 5 us + 1e8 / (25e9 * 0.9 / 4) = 5 us + 17.78 ms (the NIC's fair share).
TEST(SimPlatform, CrossNodeOversubscribedNicPerGpu) {
  expect_p2p(load_cluster("dgx-a100", 2, {"network.oversubscription=4"}), {{0, 1, 1, 6}});
}

// Oversubscription 2 on one NIC per node: 50 us + 1e8 / (3.125e9 * 0.8 / 2) = 50 us + 80 ms.
TEST(SimPlatform, CrossNodeOversubscribedNicPerNode) {
  expect_p2p(load_cluster("p3.16xlarge", 2, {"network.oversubscription=2"}), {{0, 0, 1, 4}});
}

// GPU <-> host memory over its PCIe link: 10 us + 1e8 / 31.5e9 = 10 us + 3.175 ms, both ways.
TEST(SimPlatform, GpuToHostMemoryOverPcie) {
  const Cluster c = load_cluster("dgx-a100");
  auto engine = make_engine();
  const Platform p = build_platform(c);
  std::vector<double> times;
  sg4::Actor::create("probe", p.gpus[0], [&] {
    for (auto [from, to] :
         {std::pair{p.gpu(0, 2), p.host_cpus[0]}, {p.host_cpus[0], p.gpu(0, 5)}}) {
      const double start = sg4::Engine::get_clock();
      sg4::Comm::sendto(from, to, std::uint64_t(kBytes));
      times.push_back(sg4::Engine::get_clock() - start);
    }
  });
  engine->run();
  const double want = c.host.pcie_latency_s + kBytes / c.host.pcie_bandwidth_bytes_per_s;
  ASSERT_EQ(times.size(), 2u);
  for (double t : times)
    EXPECT_NEAR(t, want, 1e-12 * want);
}

// GPUs behind one PCIe switch share its uplink to the host: on p3.16xlarge (2 GPUs per 15.75 GB/s
// uplink) GPUs 0 and 1 copying to host memory at once take 10 us + 2 x 1e8 / 15.75e9 each; GPUs 0
// and 2 (different switches) take 10 us + 1e8 / 15.75e9, as alone.
TEST(SimPlatform, GpusBehindOneSwitchShareItsUplink) {
  const Cluster c = load_cluster("p3.16xlarge");
  auto engine = make_engine();
  const Platform p = build_platform(c);
  double same = 0, different = 0;
  sg4::Actor::create("probe", p.gpus[0], [&] {
    for (auto [other, out] : {std::pair{1, &same}, std::pair{2, &different}}) {
      const double start = sg4::Engine::get_clock();
      auto a = sg4::Comm::sendto_async(p.gpu(0, 0), p.host_cpus[0], std::uint64_t(kBytes));
      auto b = sg4::Comm::sendto_async(p.gpu(0, other), p.host_cpus[0], std::uint64_t(kBytes));
      a->wait();
      b->wait();
      *out = sg4::Engine::get_clock() - start;
    }
  });
  engine->run();
  EXPECT_NEAR(same, 10e-6 + 2 * kBytes / 15.75e9, 1e-12);
  EXPECT_NEAR(different, 10e-6 + kBytes / 15.75e9, 1e-12);
}

// Two GPUs of a node with one shared NIC send to the other node at once: each gets half the NIC,
// 50 us + 2 * 1e8 / 2.5e9 = 80.05 ms, against 40.05 ms alone (both measured in one simulation).
TEST(SimPlatform, TwoFlowsShareANic) {
  const Cluster c = load_cluster("p3.16xlarge", 2);
  auto engine = make_engine();
  const Platform p = build_platform(c);
  double alone = 0, shared = 0;
  sg4::Actor::create("probe", p.gpus[0], [&] {
    double start = sg4::Engine::get_clock();
    sg4::Comm::sendto(p.gpu(0, 0), p.gpu(1, 0), std::uint64_t(kBytes));
    alone = sg4::Engine::get_clock() - start;
    start = sg4::Engine::get_clock();
    auto a = sg4::Comm::sendto_async(p.gpu(0, 0), p.gpu(1, 0), std::uint64_t(kBytes));
    auto b = sg4::Comm::sendto_async(p.gpu(0, 1), p.gpu(1, 1), std::uint64_t(kBytes));
    a->wait();
    b->wait();
    shared = sg4::Engine::get_clock() - start;
  });
  engine->run();
  const clusters::Link l = p2p_link(c, 0, 0, 1, 0);
  EXPECT_NEAR(alone, l.latency_s + kBytes / l.bandwidth_bytes_per_s, 1e-12);
  EXPECT_NEAR(shared, l.latency_s + 2 * kBytes / l.bandwidth_bytes_per_s, 1e-12);
}

// SimGrid's routes are the pure model's (gpu_path): same links in order, same latency.
void expect_routes_match(const Cluster& c, const PlatformOptions& o) {
  auto engine = make_engine();
  const Platform p = build_platform(c, o);
  for (auto [na, ga, nb, gb] : std::vector<Transfer>{{0, 0, 0, 0}, {0, 1, 0, 2}, {0, 3, 1, 4}}) {
    std::vector<sg4::Link*> links;
    double latency = 0;
    p.gpu(na, ga)->route_to(p.gpu(nb, gb), links, &latency);
    const Path want = gpu_path(c, na, ga, nb, gb, o);
    std::vector<std::string> got_names, want_names;
    for (const sg4::Link* l : links)
      got_names.push_back(l->get_name());
    for (const Hop& h : want.hops)
      want_names.push_back(h.link);
    EXPECT_EQ(got_names, want_names);
    EXPECT_DOUBLE_EQ(latency, want.latency_s);
    EXPECT_DOUBLE_EQ(want.time_s(kBytes), p2p_link(c, na, ga, nb, gb).time_s(kBytes));
  }
}

TEST(SimPlatform, RoutesMatchThePureModel) {
  expect_routes_match(load_cluster("dgx-a100", 2), {});
}

// The shared backbone variant: the NIC runs at 25e9 * 0.9 and the backbone (2 nodes x 8 NICs x
// 22.5e9 / 4 = 90e9) is on every inter-node route.
TEST(SimPlatform, RoutesMatchThePureModelWithBackbone) {
  const Cluster c = load_cluster("dgx-a100", 2, {"network.oversubscription=4"});
  const PlatformOptions o{.shared_backbone = true};
  auto engine = make_engine();
  const Platform p = build_platform(c, o);
  std::vector<sg4::Link*> links;
  double latency = 0;
  p.gpu(0, 3)->route_to(p.gpu(1, 4), links, &latency);
  ASSERT_EQ(links.size(), 3u);
  EXPECT_EQ(links[1]->get_name(), "backbone");
  EXPECT_DOUBLE_EQ(links[1]->get_bandwidth(), 90e9);
  EXPECT_DOUBLE_EQ(links[0]->get_bandwidth(), 22.5e9);
  const Path want = gpu_path(c, 0, 3, 1, 4, o);
  EXPECT_EQ(want.hops[1].link, "backbone");
  EXPECT_DOUBLE_EQ(want.bandwidth_bytes_per_s(), 22.5e9);
}

TEST(SimPlatform, NamesLinksAndCounts) {
  const Cluster c = load_cluster("dgx-a100", 2);
  auto engine = make_engine();
  const Platform p = build_platform(c);
  EXPECT_EQ(p.gpus.size(), 16u);
  EXPECT_EQ(p.host_cpus.size(), 2u);
  EXPECT_EQ(p.gpu(1, 5)->get_name(), "n1g5");
  EXPECT_EQ(p.host_cpus[1]->get_name(), "n1cpu");
  EXPECT_DOUBLE_EQ(p.gpus[0]->get_speed(), kGpuSpeed);
  // Per GPU: memory (1) + nvlink, pcie, nic split-duplex (2 each) = 7 directed links; per node
  // 4 PCIe-switch uplinks (2 GPUs each), split-duplex.
  EXPECT_EQ(p.links.size(), 16u * 7 + 2 * 4 * 2);
  int uplinks = 0;
  for (const auto& l : p.links)
    uplinks += l.kind == "uplink";
  EXPECT_EQ(uplinks, 16);
  EXPECT_THROW(p.gpu(2, 0), InputError);
  int nics = 0;
  for (const auto& l : p.links)
    nics += l.kind == "nic";
  EXPECT_EQ(nics, 32);
}

// A single-GPU machine: no fabric, no NIC; the GPU still copies to itself and to host memory.
TEST(SimPlatform, SingleGpuMachine) {
  expect_p2p(load_cluster("h100-x1"), {{0, 0, 0, 0}});
}

TEST(SimPlatform, MakeEngineTwiceThrows) {
  auto engine = make_engine();
  EXPECT_THROW(make_engine(), Error);
}

// 128 DGX A100 nodes = 1,024 GPUs: hosts, and a cross-node transfer at the p2p time.
TEST(SimPlatform, Builds1024Gpus) {
  const Cluster c = load_cluster("dgx-a100:128");
  auto engine = make_engine();
  const Platform p = build_platform(c);
  EXPECT_EQ(p.gpus.size(), 1024u);
  EXPECT_EQ(engine->get_host_count(), 1024u + 128);
  const std::vector<double> t = transfer_times(p, {{0, 0, 127, 7}, {64, 3, 64, 4}});
  EXPECT_NEAR(t[0], p2p_link(c, 0, 0, 127, 7).time_s(kBytes), 1e-12);
  EXPECT_NEAR(t[1], p2p_link(c, 64, 3, 64, 4).time_s(kBytes), 1e-12);
}

TEST(SimPlatformXml, WellFormedAndNamesEveryHost) {
  const Cluster c = load_cluster("dgx-a100", 3);
  const std::string xml = platform_xml(c);
  EXPECT_EQ(xml.rfind("<?xml version='1.0'?>\n<!DOCTYPE platform SYSTEM", 0), 0u);
  EXPECT_NE(xml.find("<platform version=\"4.1\">"), std::string::npos);
  for (int n = 0; n < 3; ++n) {
    EXPECT_NE(xml.find(fmt::format("<host id=\"n{}cpu\"", n)), std::string::npos);
    for (int g = 0; g < 8; ++g)
      EXPECT_NE(xml.find(fmt::format("<host id=\"n{}g{}\"", n, g)), std::string::npos);
  }
  EXPECT_EQ(xml.substr(xml.size() - 12), "</platform>\n");
  // Zones open and close in pairs.
  std::size_t open = 0, close = 0;
  for (std::size_t i = xml.find("<zone "); i != std::string::npos; i = xml.find("<zone ", i + 1))
    ++open;
  for (std::size_t i = xml.find("</zone>"); i != std::string::npos; i = xml.find("</zone>", i + 1))
    ++close;
  EXPECT_EQ(open, 4u);
  EXPECT_EQ(close, 4u);
}

// SimGrid loads the XML and gives the same point-to-point times as the in-memory platform.
TEST(SimPlatformXml, LoadsWithTheSameTimes) {
  const Cluster c = load_cluster("p3.16xlarge", 2, {"network.oversubscription=2"});
  testing::TempDir dir("sim_xml");
  const std::string path = dir.write("platform.xml", platform_xml(c));
  auto engine = make_engine();
  engine->load_platform(path);
  EXPECT_EQ(engine->get_host_count(), 18u);
  const std::vector<Transfer> ts = {{0, 0, 0, 0}, {0, 1, 0, 5}, {0, 2, 1, 7}, {1, 3, 0, 3}};
  std::vector<double> times;
  sg4::Actor::create("probe", engine->host_by_name("n0g0"), [&] {
    for (const Transfer& t : ts) {
      const double start = sg4::Engine::get_clock();
      sg4::Comm::sendto(engine->host_by_name(fmt::format("n{}g{}", t.node_a, t.gpu_a)),
                        engine->host_by_name(fmt::format("n{}g{}", t.node_b, t.gpu_b)),
                        std::uint64_t(kBytes));
      times.push_back(sg4::Engine::get_clock() - start);
    }
  });
  engine->run();
  ASSERT_EQ(times.size(), ts.size());
  for (std::size_t i = 0; i < ts.size(); ++i) {
    const Transfer& t = ts[i];
    const double want = p2p_link(c, t.node_a, t.gpu_a, t.node_b, t.gpu_b).time_s(kBytes);
    EXPECT_NEAR(times[i], want, 1e-12 * want) << "transfer " << i;
  }
}

}  // namespace
}  // namespace pw::sim
