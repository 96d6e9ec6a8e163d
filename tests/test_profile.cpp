// What every backend's profiler shares (exec/profile_driver.hpp), and this machine's GPU as a
// cluster (exec/gpu_host.hpp): host-only, so they run on every build, with or without CUDA.
#include <gtest/gtest.h>

#include <algorithm>

#include <cmath>
#include <string>
#include <vector>

#include "clusters/cluster.hpp"
#include "common/error.hpp"
#include "exec/gpu_host.hpp"
#include "exec/profile_driver.hpp"
#include "models/model.hpp"

namespace pw {
namespace {

using exec::ProfileStatistic;
namespace profiling = exec::profiling;

TEST(ProfileDriver, MedianAndMean) {
  EXPECT_DOUBLE_EQ(profiling::summarize({3, 1, 2}, ProfileStatistic::median), 2);
  EXPECT_DOUBLE_EQ(profiling::summarize({4, 1, 3, 2}, ProfileStatistic::median), 3);  // upper
  EXPECT_DOUBLE_EQ(profiling::summarize({1, 2, 6}, ProfileStatistic::mean), 3);
  EXPECT_THROW(profiling::summarize({}, ProfileStatistic::mean), Error);
  EXPECT_EQ(profiling::distinct_sorted({4, 1, 4, 2}), (std::vector<std::int64_t>{1, 2, 4}));
  EXPECT_EQ(profiling::today_utc().size(), 10u);  // YYYY-MM-DD
}

// A stage that logs what the driver asks of it; its "activations" are its name.
struct FakeStage {
  std::string name;
  std::vector<std::string>* log;
  std::string fed, fed_gradient;
  std::string output() const { return name + ".out"; }
  std::string d_input() const { return name + ".din"; }
  void feed(const std::string& x) { fed = x; }
  void feed_gradient(const std::string& g) { fed_gradient = g; }
  void keep() { log->push_back(name + " keep"); }
  void forward() { log->push_back(name + " forward"); }
  void backward() { log->push_back(name + " backward"); }
  void recompute() { log->push_back(name + " recompute"); }
};

// The stages get the activation the embedding stage sends on and the gradient the head stage sends
// back; after one warm-up of each op, every repeat runs each stage's forward, backward and
// recompute once (round robin); each stage's times are summarised on their own.
TEST(ProfileDriver, RoundRobinFeedsWarmsUpAndTimesEveryStage) {
  std::vector<std::string> log;
  FakeStage block{"block", &log, "", ""}, emb{"emb", &log, "", ""}, head{"head", &log, "", ""};
  double clock = 0;
  const auto seconds_of = [&](const auto& op) {
    op();
    return clock += 1;  // the n-th timed op takes n seconds
  };
  const auto t =
      profiling::time_round_robin(block, emb, head, 2, ProfileStatistic::mean, seconds_of);
  EXPECT_EQ(block.fed, "emb.out");
  EXPECT_EQ(head.fed, "emb.out");
  EXPECT_EQ(block.fed_gradient, "head.din");
  EXPECT_EQ(emb.fed_gradient, "head.din");
  const std::vector<std::string> want = {
      "emb forward",   "head forward",   "head backward",    // wiring
      "block keep",    "emb keep",       "head keep",        //
      "block forward", "block backward", "block recompute",  // warm-up
      "emb forward",   "emb backward",   "emb recompute",    //
      "head forward",  "head backward",  "head recompute",   //
      "block forward", "block backward", "block recompute",  // repeat 1
      "emb forward",   "emb backward",   "emb recompute",    //
      "head forward",  "head backward",  "head recompute",   //
      "block forward", "block backward", "block recompute",  // repeat 2
      "emb forward",   "emb backward",   "emb recompute",    //
      "head forward",  "head backward",  "head recompute"};
  EXPECT_EQ(log, want);
  // Timed ops 1..9 are the warm-up (timed, not kept), 10..27 the repeats: the block's forwards are
  // the 10th and 19th, the embedding's backwards the 14th and 23rd, the head's recomputes 18th,
  // 27th.
  EXPECT_DOUBLE_EQ(t[0].forward_s, (10 + 19) / 2.0);
  EXPECT_DOUBLE_EQ(t[1].backward_s, (14 + 23) / 2.0);
  EXPECT_DOUBLE_EQ(t[2].recompute_s, (18 + 27) / 2.0);
}

// With warm_up_s, warm-up rounds go on until that much time was timed (here 1 s per op, 9 per
// round: 10 s takes two rounds), then the repeats.
TEST(ProfileDriver, WarmUpRoundsLastWarmUpSeconds) {
  std::vector<std::string> log;
  FakeStage block{"block", &log, "", ""}, emb{"emb", &log, "", ""}, head{"head", &log, "", ""};
  const auto one_second = [&](const auto& op) {
    op();
    return 1.0;
  };
  (void)profiling::time_round_robin(block, emb, head, 3, ProfileStatistic::mean, one_second, 10.0);
  EXPECT_EQ(std::count(log.begin(), log.end(), "block forward"), 2 + 3);
  EXPECT_EQ(std::count(log.begin(), log.end(), "head recompute"), 2 + 3);
  log.clear();
  (void)profiling::time_round_robin(block, emb, head, 3, ProfileStatistic::mean, one_second, 0.0);
  EXPECT_EQ(std::count(log.begin(), log.end(), "block forward"), 1 + 3);
}

// Embedding and head are what their stage takes beyond the lone block, never below 0; memory fields
// are b x the per-sample sizes.
TEST(ProfileDriver, EntryIsDifferencesAndExactSizes) {
  models::ModelSpec m = models::load_model("gpt-tiny");
  m.dtype = models::DType::bf16;
  const models::ModelCosts mc = models::derive_costs(m);
  const traces::Entry e =
      profiling::measured_entry(mc, 3, {{{2.0, 4.0, 1.0}, {2.5, 4.0, 0.5}, {3.0, 7.0, 1.25}}});
  using models::LayerKind;
  EXPECT_EQ(e.microbatch_size, 3);
  EXPECT_DOUBLE_EQ(e.layers[LayerKind::block].forward_s, 2.0);
  EXPECT_DOUBLE_EQ(e.layers[LayerKind::embedding].forward_s, 0.5);
  EXPECT_DOUBLE_EQ(e.layers[LayerKind::embedding].backward_s, 0.0);
  EXPECT_DOUBLE_EQ(e.layers[LayerKind::embedding].recompute_s, 0.0);  // 0.5 - 1 clamps to 0
  EXPECT_DOUBLE_EQ(e.layers[LayerKind::head].backward_s, 3.0);
  EXPECT_DOUBLE_EQ(e.layers[LayerKind::head].recompute_s, 0.25);
  for (LayerKind k : traces::kLayerKinds) {
    EXPECT_EQ(e.layers[k].activation_bytes, 3 * mc.layer(k).activation_bytes);
    EXPECT_EQ(e.layers[k].activation_recompute_bytes, 3 * mc.layer(k).activation_recompute_bytes);
    EXPECT_EQ(e.layers[k].output_bytes, 3 * mc.layer(k).output_bytes);
    EXPECT_EQ(e.layers[k].workspace_bytes, 3 * mc.layer(k).workspace_bytes);
    EXPECT_EQ(e.layers[k].backward_input_s, 0);
  }
}

TEST(ProfileDriver, MeasuredTraceStatics) {
  models::ModelSpec m = models::load_model("gpt2-124m");
  const models::ModelCosts mc = models::derive_costs(m);
  std::vector<std::int64_t> asked;
  const traces::Trace t =
      profiling::measured_trace(m, "NVIDIA H100 80GB HBM3", m.dtype, "NVIDIA H100 80GB HBM3",
                                "CUDA 13.0", "a tool", 2, [&](std::int64_t n) {
                                  asked.push_back(n);
                                  return 1e-6 * double(asked.size());
                                });
  EXPECT_EQ(t.source.kind, "measured");
  EXPECT_EQ(t.device, "NVIDIA H100 80GB HBM3");
  EXPECT_EQ(t.dtype, models::DType::fp16);
  EXPECT_EQ(asked, (std::vector<std::int64_t>{mc.embedding.parameters, mc.block.parameters,
                                              mc.head.parameters}));
  for (models::LayerKind k : traces::kLayerKinds) {
    EXPECT_EQ(t.statics[k].parameters, mc.layer(k).parameters);
    EXPECT_EQ(t.statics[k].parameter_bytes, 2 * mc.layer(k).parameters);
  }
  EXPECT_DOUBLE_EQ(t.statics.head.optimizer_step_s, 3e-6);
}

TEST(ProfileDriver, SingleBlockStagesAndSyntheticBatch) {
  const models::ModelSpec m = models::load_model("gpt-tiny");
  const exec::StageSpec head = profiling::single_block_stage(m, false, true);
  EXPECT_EQ(head.first_block, m.layers - 1);
  EXPECT_EQ(head.blocks, 1);
  EXPECT_TRUE(head.has_head);
  EXPECT_FALSE(head.has_embedding);
  EXPECT_EQ(profiling::single_block_stage(m, true, false).first_block, 0);
  const profiling::Batch b = profiling::synthetic_batch(m, 3);
  ASSERT_EQ(b.tokens.size(), std::size_t(3 * m.seq_len));
  ASSERT_EQ(b.targets.size(), b.tokens.size());
  for (std::size_t i = 0; i < b.tokens.size(); ++i) {
    EXPECT_GE(b.tokens[i], 0);
    EXPECT_LT(b.tokens[i], m.vocab);
  }
  EXPECT_EQ(b.tokens, profiling::synthetic_batch(m, 3).tokens);  // deterministic
}

// ---- the GPU's name to its device preset -------------------------------------------------------

// What cudaGetDeviceProperties().name says on each part (NVIDIA's names; the SXM parts match).
TEST(GpuHost, PresetFromTheGpusName) {
  const std::pair<const char*, const char*> cases[] = {
      {"NVIDIA H100 80GB HBM3", "H100-SXM"},
      {"NVIDIA H200", "H200"},
      {"NVIDIA H200 141GB HBM3e", "H200"},
      {"NVIDIA A100-SXM4-40GB", "A100-40GB"},
      {"NVIDIA A100-SXM4-80GB", "A100-80GB"},
      {"Tesla V100-SXM2-16GB", "V100-16GB"},
      {"Tesla V100-SXM2-32GB", "V100-32GB"},
      {"nvidia h100 80gb hbm3", "H100-SXM"},
      // Other form factors and parts: other peaks, no preset.
      {"NVIDIA H100 PCIe", ""},
      {"NVIDIA H100 NVL", ""},
      {"NVIDIA H200 NVL", ""},
      {"NVIDIA A100-PCIE-40GB", ""},
      {"NVIDIA A100 80GB PCIe", ""},
      {"Tesla V100-PCIE-16GB", ""},
      {"Tesla V100S-PCIE-32GB", ""},
      {"NVIDIA GH200 480GB", ""},
      {"NVIDIA H800", ""},
      {"NVIDIA A100-SXM4", ""},  // which of the two sizes?
      {"NVIDIA H100 SXM5 64GB", ""},
      {"NVIDIA L40S", ""},
      {"", ""},
  };
  for (const auto& [name, preset] : cases)
    EXPECT_EQ(exec::gpu_device_preset(name), preset) << name;
}

TEST(GpuHost, DeviceSpecIsThePresetUnderTheGpusName) {
  const clusters::DeviceSpec d = exec::gpu_device_spec("NVIDIA H100 80GB HBM3");
  const clusters::DeviceSpec p = clusters::load_device("H100-SXM");
  EXPECT_EQ(d.name, "NVIDIA H100 80GB HBM3");
  EXPECT_EQ(d.peak_fp16_flops_per_s, p.peak_fp16_flops_per_s);
  EXPECT_EQ(d.memory_bandwidth_bytes_per_s, p.memory_bandwidth_bytes_per_s);
  EXPECT_NE(d.notes.find("H100-SXM"), std::string::npos);
  EXPECT_DOUBLE_EQ(exec::device_peak_flops("NVIDIA H200", models::DType::bf16), 989e12);
  EXPECT_DOUBLE_EQ(exec::device_peak_flops("NVIDIA H200", models::DType::fp16), 989e12);
  EXPECT_DOUBLE_EQ(exec::device_peak_flops("NVIDIA H100 80GB HBM3", models::DType::fp32), 67e12);
}

TEST(GpuHost, UnknownGpuIsAOneLineErrorNamingItAndThePresets) {
  try {
    exec::device_peak_flops("NVIDIA L40S", models::DType::bf16);
    FAIL() << "no error";
  } catch (const InputError& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    for (const char* s : {"\"NVIDIA L40S\"", "H100-SXM", "H200", "A100-80GB", "V100-16GB"})
      EXPECT_NE(what.find(s), std::string::npos) << s << " in " << what;
  }
  exec::TransportFit link;
  link.bandwidth_bytes_per_s = 1e12;
  EXPECT_THROW(exec::gpu_host_cluster("NVIDIA H100 PCIe", 80e9, 2, link, 1 << 30), InputError);
}

// The CUDA backend's model check (train, profile and validate): 2-byte dtypes pass, fp32 is one
// line naming the model and its dtype.
TEST(GpuHost, GpuModelsHaveTwoByteDtypes) {
  models::ModelSpec m = models::load_model("gpt-tiny");
  for (const models::DType ok : {models::DType::bf16, models::DType::fp16}) {
    m.dtype = ok;
    EXPECT_NO_THROW(exec::check_gpu_model(m));
  }
  m.dtype = models::DType::fp32;
  try {
    exec::check_gpu_model(m);
    FAIL() << "no error";
  } catch (const InputError& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    for (const char* s : {"gpt-tiny", "fp32", "bf16"})
      EXPECT_NE(what.find(s), std::string::npos) << s << " in " << what;
  }
}

// Every rank is the whole GPU (memory included), the ranks talk over the measured LocalTransport,
// the host's PCIe is the single-GPU preset's.
TEST(GpuHost, ClusterOfRanksOnOneGpu) {
  exec::TransportFit link;
  link.latency_s = 8e-6;
  link.bandwidth_bytes_per_s = 1.2e12;
  const std::string gpu = "NVIDIA H100 80GB HBM3";
  const clusters::Cluster c = exec::gpu_host_cluster(gpu, 85'021'163'520, 4, link, 1ll << 37);
  EXPECT_EQ(c.name, "gpu-host");
  EXPECT_EQ(c.nodes, 1);
  EXPECT_EQ(c.devices(), 4);
  EXPECT_EQ(c.device.name, gpu);  // as profile_cuda names its traces
  EXPECT_EQ(c.device.memory_bytes, 85'021'163'520);
  EXPECT_EQ(c.device.peak_fp16_flops_per_s, 989e12);
  EXPECT_EQ(c.device.memory_bandwidth_bytes_per_s, 3.35e12);
  EXPECT_EQ(c.host.memory_bytes, 1ll << 37);
  EXPECT_EQ(c.host.pcie_bandwidth_bytes_per_s,
            clusters::load_cluster("h100-x1").host.pcie_bandwidth_bytes_per_s);
  const clusters::Link between = clusters::p2p_link(c, 0, 0, 0, 3);
  EXPECT_DOUBLE_EQ(between.latency_s, 8e-6);
  EXPECT_DOUBLE_EQ(between.bandwidth_bytes_per_s, 1.2e12);
  // The file it would be written as reads back to the same cluster.
  EXPECT_EQ(clusters::parse_cluster(clusters::to_json(c), "gpu-host.json"), c);
  const clusters::Cluster one = exec::gpu_host_cluster(gpu, 85'021'163'520, 1, link, 1ll << 37);
  EXPECT_EQ(one.intra_node.kind, clusters::IntraKind::none);
  EXPECT_EQ(clusters::parse_cluster(clusters::to_json(one), "one.json"), one);
  // A100 presets have no single-GPU cluster: no PCIe figures.
  EXPECT_EQ(exec::gpu_host_cluster("NVIDIA A100-SXM4-80GB", 85e9, 2, link, 1ll << 37)
                .host.pcie_bandwidth_bytes_per_s,
            0);
  EXPECT_THROW(exec::gpu_host_cluster(gpu, 85e9, 0, link, 1ll << 37), InputError);
  EXPECT_THROW(exec::gpu_host_cluster(gpu, 85e9, 2, exec::TransportFit{}, 1ll << 37), InputError);
}

}  // namespace
}  // namespace pw
