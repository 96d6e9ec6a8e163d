// Device and cluster presets, "name:N", --set overrides, reader errors and point-to-point links.
#include <filesystem>
#include <fstream>
#include <functional>

#include <unistd.h>

#include <gtest/gtest.h>

#include "tests/test_util.hpp"

#include "clusters/cluster.hpp"

namespace pw::clusters {
namespace {

namespace fs = std::filesystem;
using pw::testing::error_of;
using pw::testing::TempDir;

TEST(Devices, PresetsCarryPublishedFigures) {
  struct Row {
    const char* name;
    double fp16, fp32, hbm;
    std::int64_t gib;
  };
  const Row rows[] = {{"V100-16GB", 125e12, 15.7e12, 900e9, 16},
                      {"V100-32GB", 125e12, 15.7e12, 900e9, 32},
                      {"A100-40GB", 312e12, 19.5e12, 1.555e12, 40},
                      {"A100-80GB", 312e12, 19.5e12, 2.039e12, 80},
                      {"H100-SXM", 989e12, 67e12, 3.35e12, 80},
                      {"H200", 989e12, 67e12, 4.8e12, 141},
                      {"A100-80GB-cal", 312e12, 19.5e12, 2.039e12, 80},
                      {"GH200-96GB", 989e12, 67e12, 4.0e12, 96}};
  EXPECT_EQ(device_preset_names().size(), std::size(rows));
  for (const auto& row : rows) {
    SCOPED_TRACE(row.name);
    DeviceSpec d = load_device(row.name);
    EXPECT_EQ(d.name, row.name);
    EXPECT_DOUBLE_EQ(d.peak_fp16_flops_per_s, row.fp16);
    EXPECT_DOUBLE_EQ(d.peak_fp32_flops_per_s, row.fp32);
    EXPECT_DOUBLE_EQ(d.memory_bandwidth_bytes_per_s, row.hbm);
    EXPECT_EQ(d.memory_bytes, row.gib << 30);
    EXPECT_EQ(parse_device(common::JsonReader(to_json(d), "round trip")), d);
  }
}

TEST(Devices, UnknownPresetListsTheNames) {
  std::string msg = error_of([] { load_device("B200"); });
  EXPECT_NE(msg.find("unknown device \"B200\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("H100-SXM"), std::string::npos) << msg;
}

TEST(Clusters, PresetsCarryTheirFigures) {
  Cluster p3 = load_cluster("p3.16xlarge");
  EXPECT_EQ(p3.devices(), 8);
  EXPECT_EQ(p3.device.name, "V100-16GB");
  EXPECT_EQ(p3.intra_node.kind, IntraKind::nvlink_mesh);
  EXPECT_DOUBLE_EQ(p3.network.bandwidth_bytes_per_s, 3.125e9);  // 25 Gb/s per instance
  EXPECT_EQ(p3.nics_per_node(), 1);

  Cluster a100 = load_cluster("dgx-a100");
  EXPECT_EQ(a100.device.name, "A100-80GB");
  EXPECT_EQ(a100.intra_node.kind, IntraKind::nvswitch);
  EXPECT_DOUBLE_EQ(a100.intra_node.bandwidth_bytes_per_s, 300e9);  // 600 GB/s bidirectional
  EXPECT_DOUBLE_EQ(a100.network.bandwidth_bytes_per_s, 25e9);      // 200 Gb/s HDR
  EXPECT_EQ(a100.nics_per_node(), 8);

  Cluster h100 = load_cluster("dgx-h100");
  EXPECT_EQ(h100.device.name, "H100-SXM");
  EXPECT_DOUBLE_EQ(h100.intra_node.bandwidth_bytes_per_s, 450e9);  // 900 GB/s bidirectional
  EXPECT_DOUBLE_EQ(h100.network.bandwidth_bytes_per_s, 50e9);      // 400 Gb/s NDR

  for (const char* name : {"h100-x1", "h200-x1"}) {
    Cluster one = load_cluster(name);
    EXPECT_EQ(one.devices(), 1) << name;
    EXPECT_EQ(one.intra_node.kind, IntraKind::none) << name;
  }
  EXPECT_EQ(load_cluster("h200-x1").device.name, "H200");
}

TEST(Clusters, HostSidesOfThePresets) {
  struct Row {
    const char* name;
    HostLinkKind link;
    double per_gpu;
    int per_uplink;
    double uplink;
    int cores;
  };
  const Row rows[] = {{"p3.16xlarge", HostLinkKind::pcie3, 15.75e9, 2, 15.75e9, 32},
                      {"dgx-a100", HostLinkKind::pcie4, 31.5e9, 2, 31.5e9, 128},
                      {"dgx-h100", HostLinkKind::pcie5, 63e9, 2, 63e9, 112},
                      {"gh200", HostLinkKind::nvlink_c2c, 450e9, 1, 450e9, 72},
                      {"v100-32gb-ws", HostLinkKind::pcie3, 15.75e9, 1, 15.75e9, 20}};
  for (const auto& row : rows) {
    SCOPED_TRACE(row.name);
    const Host h = load_cluster(row.name).host;
    EXPECT_EQ(h.link, row.link);
    EXPECT_DOUBLE_EQ(h.pcie_bandwidth_bytes_per_s, row.per_gpu);
    EXPECT_EQ(h.gpus_per_uplink, row.per_uplink);
    EXPECT_DOUBLE_EQ(h.uplink_bandwidth_bytes_per_s, row.uplink);
    EXPECT_EQ(h.cpu_cores, row.cores);
    // ZeRO-Offload's CPU-Adam: 1e9 parameters in 0.22 s on 48 cores.
    EXPECT_DOUBLE_EQ(h.cpu_adam_params_per_s_per_core, 9.5e7);
    EXPECT_DOUBLE_EQ(h.cpu_adam_params_per_s(), row.cores * 9.5e7);
    EXPECT_EQ(h.pinned_memory_bytes, h.memory_bytes);
  }
  const Cluster ws = load_cluster("v100-32gb-ws");
  EXPECT_EQ(ws.devices(), 1);
  EXPECT_EQ(ws.device.name, "V100-32GB");
  EXPECT_EQ(ws.host.memory_bytes, 240'000'000'000);
  const Cluster gh = load_cluster("gh200");
  EXPECT_EQ(gh.device.name, "GH200-96GB");
  EXPECT_EQ(gh.host.memory_bytes, 480'000'000'000);
}

// A file written before the host-link fields existed loads with the documented defaults.
TEST(Clusters, OldFileWithoutHostLinkFieldsGetsDefaults) {
  TempDir dir("clusters");
  common::Json j = to_json(load_cluster("dgx-a100"));
  for (const char* k :
       {"link", "pinned_memory_bytes", "gpus_per_uplink", "uplink_bandwidth_bytes_per_s",
        "cpu_cores", "cpu_adam_params_per_s_per_core"})
    j["host"].erase(k);
  const Cluster c = load_cluster(dir.write("old.json", j));
  EXPECT_EQ(c.host.link, HostLinkKind::pcie);
  EXPECT_EQ(c.host.pinned_memory_bytes, c.host.memory_bytes);
  EXPECT_EQ(c.host.gpus_per_uplink, 1);
  EXPECT_DOUBLE_EQ(c.host.uplink_bandwidth_bytes_per_s, 31.5e9);  // 1 x the per-GPU link
  EXPECT_EQ(c.host.cpu_cores, 0);
  EXPECT_EQ(c.host.cpu_adam_params_per_s(), 0);
  // --set may add the optional host fields to such a file.
  const Cluster set = load_cluster(dir.file("old.json"), {},
                                   {"host.cpu_cores=8", "host.cpu_adam_params_per_s_per_core=1e8",
                                    "host.gpus_per_uplink=4", "host.link=pcie4"});
  EXPECT_EQ(set.host.cpu_cores, 8);
  EXPECT_DOUBLE_EQ(set.host.cpu_adam_params_per_s(), 8e8);
  EXPECT_EQ(set.host.gpus_per_uplink, 4);
  EXPECT_DOUBLE_EQ(set.host.uplink_bandwidth_bytes_per_s, 4 * 31.5e9);
  std::string msg = error_of([&] { load_cluster(dir.file("old.json"), {}, {"host.cores=8"}); });
  EXPECT_NE(msg.find("unknown key \"host.cores\""), std::string::npos) << msg;
}

// A send's occupancy of its rank (network.send_overhead_*): optional, 0 by default and then not
// written; set, it round-trips; out of range, one line naming the field.
TEST(Clusters, SendOverheadIsOptionalCheckedAndRoundTrips) {
  const Cluster plain = load_cluster("dgx-a100", 2);
  EXPECT_EQ(plain.network.send_overhead_s, 0);
  EXPECT_EQ(plain.network.send_overhead_time_s(1e6), 0);
  EXPECT_FALSE(to_json(plain)["network"].contains("send_overhead_s"));
  const Cluster set = load_cluster(
      "dgx-a100", 2, {"network.send_overhead_s=1e-5", "network.send_overhead_bytes_per_s=1e8"});
  EXPECT_DOUBLE_EQ(set.network.send_overhead_time_s(1e6), 1e-5 + 1e-2);
  EXPECT_EQ(parse_cluster(to_json(set), "round trip"), set);
  for (const char* bad : {"network.send_overhead_s=-1", "network.send_overhead_s=2",
                          "network.send_overhead_bytes_per_s=-5"}) {
    const std::string msg = error_of([&] { load_cluster("dgx-a100", 2, {bad}); });
    EXPECT_NE(msg.find("/network/send_overhead"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

TEST(Clusters, EveryPresetRoundTripsThroughCanonicalJson) {
  for (const auto& name : cluster_preset_names()) {
    SCOPED_TRACE(name);
    Cluster c = load_cluster(name);
    EXPECT_EQ(c.name, name);
    EXPECT_EQ(parse_cluster(to_json(c), "round trip"), c);
    EXPECT_NE(describe(c).find(c.device.name), std::string::npos);
  }
}

TEST(Clusters, NodeCountFromSpecOrArgument) {
  EXPECT_EQ(load_cluster("dgx-a100:4").nodes, 4);
  EXPECT_EQ(load_cluster("dgx-a100:4").devices(), 32);
  EXPECT_EQ(load_cluster("dgx-a100", 2).nodes, 2);
  EXPECT_EQ(load_cluster("dgx-a100:4", 3).nodes, 3);  // the argument wins
  std::string msg = error_of([] { load_cluster("nope:2"); });
  EXPECT_NE(msg.find("unknown cluster \"nope\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("dgx-h100"), std::string::npos) << msg;
}

TEST(Clusters, SingleGpuPresetNeedsANetworkForMoreNodes) {
  std::string msg = error_of([] { load_cluster("h100-x1:2"); });
  EXPECT_NE(msg.find("/network/bandwidth_bytes_per_s"), std::string::npos) << msg;
  Cluster c = load_cluster("h100-x1:2", {}, {"network.bandwidth_bytes_per_s=12.5e9"});
  EXPECT_EQ(c.devices(), 2);
}

TEST(Overrides, SetANumber) {
  Cluster c = load_cluster("dgx-a100", {}, {"network.bandwidth_bytes_per_s=1.25e10", "nodes=4"});
  EXPECT_DOUBLE_EQ(c.network.bandwidth_bytes_per_s, 1.25e10);
  EXPECT_EQ(c.nodes, 4);
}

TEST(Overrides, SwapTheDevicePreset) {
  Cluster c = load_cluster("p3.16xlarge", {}, {"device=H100-SXM"});
  EXPECT_EQ(c.device, load_device("H100-SXM"));
}

TEST(Overrides, EditADeviceField) {
  Cluster c = load_cluster("p3.16xlarge", {}, {"device.memory_bytes=3.2e10"});
  EXPECT_EQ(c.device.name, "V100-16GB");
  EXPECT_EQ(c.device.memory_bytes, 32000000000);
  // Swap, then edit the swapped device.
  c = load_cluster("p3.16xlarge", {},
                   {"device=A100-40GB", "device.memory_bandwidth_bytes_per_s=2e12"});
  EXPECT_EQ(c.device.name, "A100-40GB");
  EXPECT_DOUBLE_EQ(c.device.memory_bandwidth_bytes_per_s, 2e12);
}

TEST(Overrides, StringsAndBools) {
  Cluster c = load_cluster("dgx-a100", {}, {"network.nic_per=node", "name=my cluster"});
  EXPECT_EQ(c.network.nic_per, NicPer::node);
  EXPECT_EQ(c.name, "my cluster");
}

TEST(Overrides, UnknownKeyIsNamed) {
  std::string msg =
      error_of([] { load_cluster("dgx-a100", {}, {"network.bandwith_bytes_per_s=1"}); });
  EXPECT_NE(msg.find("unknown key \"network.bandwith_bytes_per_s\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("bandwidth_bytes_per_s"), std::string::npos) << msg;  // lists the real ones
  msg = error_of([] { load_cluster("dgx-a100", {}, {"device.flops=1"}); });
  EXPECT_NE(msg.find("unknown key \"device.flops\""), std::string::npos) << msg;
  msg = error_of([] { load_cluster("dgx-a100", {}, {"network=5"}); });
  EXPECT_NE(msg.find("is an object"), std::string::npos) << msg;
  msg = error_of([] { load_cluster("dgx-a100", {}, {"nodes"}); });
  EXPECT_NE(msg.find("expected dotted.path=value"), std::string::npos) << msg;
}

TEST(Overrides, ABadValueIsReportedAtItsPath) {
  std::string msg = error_of([] { load_cluster("dgx-a100", {}, {"network.efficiency=1.5"}); });
  EXPECT_NE(msg.find("/network/efficiency"), std::string::npos) << msg;
  EXPECT_NE(msg.find("(0, 1]"), std::string::npos) << msg;
}

TEST(Reader, ErrorsNameTheFileAndJsonPath) {
  TempDir dir("clusters");
  const common::Json good = to_json(load_cluster("dgx-a100"));
  struct Case {
    const char* what;
    std::function<void(common::Json&)> edit;
    const char* path;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"format", [](auto& j) { j["format"] = "pipewright.cluster/9"; }, "/format",
       "unknown format"},
      {"missing", [](auto& j) { j["network"].erase("latency_s"); }, "/network/latency_s",
       "missing required field"},
      {"type", [](auto& j) { j["gpus_per_node"] = "8"; }, "/gpus_per_node", "expected a number"},
      {"negative", [](auto& j) { j["host"]["memory_bytes"] = -1; }, "/host/memory_bytes",
       "must not be negative"},
      {"device", [](auto& j) { j["device"]["memory_bytes"] = -5; }, "/device/memory_bytes",
       "must be at least 1"},
      {"device name", [](auto& j) { j["device"] = "TPUv4"; }, "/device", "unknown device"},
      {"kind", [](auto& j) { j["intra_node"]["kind"] = "ethernet"; }, "/intra_node/kind",
       "unknown kind"},
      {"oversub", [](auto& j) { j["network"]["oversubscription"] = 0.5; },
       "/network/oversubscription", "must be >= 1"},
      {"pinned", [](auto& j) { j["host"]["pinned_memory_bytes"] = 3e12; },
       "/host/pinned_memory_bytes", "is more than memory_bytes"},
      {"pinned negative", [](auto& j) { j["host"]["pinned_memory_bytes"] = -1; },
       "/host/pinned_memory_bytes", "must not be negative"},
      {"host huge", [](auto& j) { j["host"]["memory_bytes"] = 1e300; }, "/host/memory_bytes",
       "expected an integer"},
      {"link", [](auto& j) { j["host"]["link"] = "pcie6"; }, "/host/link", "unknown host link"},
      {"link too fast", [](auto& j) { j["host"]["pcie_bandwidth_bytes_per_s"] = 64e9; },
       "/host/pcie_bandwidth_bytes_per_s", "more than a pcie4 link's"},
      {"uplink", [](auto& j) { j["host"]["gpus_per_uplink"] = 3; }, "/host/gpus_per_uplink",
       "must divide gpus_per_node (8)"},
      {"uplink zero", [](auto& j) { j["host"]["gpus_per_uplink"] = 0; }, "/host/gpus_per_uplink",
       "1"},
      {"uplink bw", [](auto& j) { j["host"]["uplink_bandwidth_bytes_per_s"] = -1; },
       "/host/uplink_bandwidth_bytes_per_s", "must not be negative"},
      {"cores", [](auto& j) { j["host"]["cpu_cores"] = -4; }, "/host/cpu_cores", "-4"},
      {"cores huge", [](auto& j) { j["host"]["cpu_cores"] = 1e12; }, "/host/cpu_cores", "1000000"},
      {"adam", [](auto& j) { j["host"]["cpu_adam_params_per_s_per_core"] = -1; },
       "/host/cpu_adam_params_per_s_per_core", "must not be negative"},
      {"adam huge", [](auto& j) { j["host"]["cpu_adam_params_per_s_per_core"] = 1e20; },
       "/host/cpu_adam_params_per_s_per_core", "more than 1e12"},
      {"exponent",
       [](auto& j) {
         j["device"]["efficiency"] = {{"overhead_exponent", 0.5}};
       },
       "/device/efficiency/overhead_exponent", "or >= 1"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    common::Json j = good;
    c.edit(j);
    std::string file = dir.write(std::string("bad_") + c.what + ".json", j);
    std::string msg = error_of([&] { load_cluster(file); });
    EXPECT_NE(msg.find(file + ": " + c.path + ": "), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.message), std::string::npos) << msg;
  }
}

TEST(Reader, FileWithNodeSuffixAndRelativeDevicePath) {
  TempDir dir("clusters");
  dir.write("gpu.json", to_json(load_device("A100-40GB")).dump());
  common::Json j = to_json(load_cluster("dgx-a100"));
  j["device"] = "gpu.json";  // resolved beside the cluster file
  std::string file = dir.write("mine.json", j);
  Cluster c = load_cluster(file + ":3");
  EXPECT_EQ(c.nodes, 3);
  EXPECT_EQ(c.device.name, "A100-40GB");
  EXPECT_NE(error_of([&] { load_cluster(file + ".missing"); }).find("cannot open"),
            std::string::npos);
}

TEST(Links, SameGpuIsADeviceMemoryCopy) {
  Cluster c = load_cluster("dgx-h100:2");
  Link l = p2p_link(c, 1, 3, 1, 3);
  EXPECT_DOUBLE_EQ(l.bandwidth_bytes_per_s, 3.35e12 / 2);  // every byte read and written
  EXPECT_EQ(l.via, "device-memory");
}

TEST(Links, SameNodeUsesTheFabric) {
  Cluster c = load_cluster("dgx-h100:2");
  Link l = p2p_link(c, 0, 0, 0, 7);
  EXPECT_DOUBLE_EQ(l.bandwidth_bytes_per_s, 450e9 * 0.8);
  EXPECT_DOUBLE_EQ(l.latency_s, 3e-6);
  EXPECT_EQ(l.via, "nvswitch");
  EXPECT_DOUBLE_EQ(l.time_s(360e6), 3e-6 + 1e-3);
  // Hybrid cube-mesh: a pair gets a quarter of the GPU's NVLink bandwidth (1.5 of 6 links).
  Link mesh = p2p_link(load_cluster("p3.16xlarge"), 0, 0, 0, 1);
  EXPECT_DOUBLE_EQ(mesh.bandwidth_bytes_per_s, 150e9 * 0.8 / 4);
}

TEST(Links, AcrossNodesUsesTheNicWithOversubscription) {
  Cluster c = load_cluster("dgx-a100:2", {}, {"network.oversubscription=2"});
  Link l = p2p_link(c, 0, 5, 1, 5);
  EXPECT_DOUBLE_EQ(l.bandwidth_bytes_per_s, 25e9 * 0.9 / 2);
  EXPECT_DOUBLE_EQ(l.latency_s, 5e-6);
  EXPECT_EQ(l.via, "network");
  EXPECT_THROW(p2p_link(c, 2, 0, 0, 0), InputError);
  EXPECT_THROW(p2p_link(c, 0, 8, 0, 0), InputError);
}

}  // namespace
}  // namespace pw::clusters
