// The GPU profiler and probes (exec/cuda/profile.*, exec/cuda/probe.*): the trace has every entry
// and layer kind with positive times and the stages' exact sizes; a microbatch size that does not
// fit is skipped; the LocalTransport fit is sane; the gpu-host cluster names this GPU. Sizes and
// the checks made before the GPU is touched run everywhere; the rest need a GPU. Timing is never
// asserted beyond "positive".
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "clusters/cluster.hpp"
#include "common/error.hpp"
#include "cuda_test_util.hpp"
#include "exec/cuda/probe.hpp"
#include "exec/cuda/profile.hpp"
#include "exec/gpt_layout.hpp"
#include "exec/profile_driver.hpp"
#include "models/model.hpp"
#include "traces/trace.hpp"

namespace pw::testing {
namespace {

using models::LayerKind;
namespace cu = exec::cuda;
namespace profiling = exec::profiling;

models::ModelSpec tiny_bf16() {
  models::ModelSpec m = models::load_model("gpt-tiny");
  m.dtype = models::DType::bf16;
  return m;
}

using exec::StageSizes;

StageSizes stage_sizes(const models::ModelSpec& m, bool embedding, bool head, int b) {
  return pw::exec::GptLayout(profiling::single_block_stage(m, embedding, head),
                             pw::models::DType::bf16, "cuda")
      .sizes(b);
}

// The entry's memory fields against the CUDA stages' own sizes (bf16 elements x 2): the lone
// block's, and what the embedding and head stages hold beyond it.
void expect_stage_sizes(const models::ModelSpec& m, const traces::Entry& e) {
  const int b = int(e.microbatch_size);
  const StageSizes block = stage_sizes(m, false, false, b), emb = stage_sizes(m, true, false, b),
                   head = stage_sizes(m, false, true, b);
  const auto& K = e.layers[LayerKind::block];
  const auto& E = e.layers[LayerKind::embedding];
  const auto& H = e.layers[LayerKind::head];
  EXPECT_EQ(K.activation_bytes, 2 * block.stash);
  EXPECT_EQ(K.activation_recompute_bytes, 2 * block.stash_recompute);
  EXPECT_EQ(K.output_bytes, 2 * block.output);
  EXPECT_EQ(K.workspace_bytes, 2 * block.workspace);
  EXPECT_EQ(E.activation_bytes, 2 * (emb.stash - block.stash));
  EXPECT_EQ(E.activation_recompute_bytes, 2 * emb.stash_recompute);  // the token ids
  EXPECT_EQ(E.output_bytes, 2 * emb.output);
  EXPECT_EQ(H.activation_bytes, 2 * (head.stash - block.stash));
  EXPECT_EQ(std::max(K.workspace_bytes, H.workspace_bytes), 2 * head.workspace);
}

// ---- without a GPU -----------------------------------------------------------------------------

TEST(CudaProfile, EntrySizesAreTheCudaStagesSizes) {
  for (const char* name : {"gpt-tiny", "gpt2-124m"}) {
    models::ModelSpec m = exec::as_executed(models::load_model(name));
    m.dtype = models::DType::bf16;
    const models::ModelCosts mc = models::derive_costs(m);
    for (const std::int64_t b : {1, 3})
      expect_stage_sizes(m, profiling::measured_entry(mc, b, {}));
  }
}

TEST(CudaProfile, RejectsWhatItCannotRunBeforeTouchingTheGpu) {
  try {
    cu::profile_cuda(models::load_model("gpt-tiny"), {1}, 1);  // fp32
    FAIL() << "fp32 accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("2-byte"), std::string::npos) << e.what();
  }
  models::ModelSpec odd = tiny_bf16();
  odd.seq_len = 63;
  EXPECT_THROW(cu::profile_cuda(odd, {1}, 1), InputError);
  EXPECT_THROW(cu::profile_cuda(tiny_bf16(), {1}, 0), InputError);
  // A TP size that does not divide the heads: the model check's line, before any GPU call.
  try {
    cu::profile_cuda(tiny_bf16(), {1}, 1, exec::ProfileStatistic::median, {3, false});
    FAIL() << "t = 3 accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("3"), std::string::npos) << e.what();
  }
}

TEST(CudaProfile, WithoutAGpuTheProbesSayWhy) {
  if (cu::cuda_device_count() > 0) GTEST_SKIP() << "skipped: a GPU is present";
  try {
    cu::current_gpu();
    FAIL() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("no CUDA device"), std::string::npos) << e.what();
  }
  EXPECT_THROW(cu::profile_cuda(tiny_bf16(), {1}, 1), InputError);
  EXPECT_THROW(cu::measure_local_transport({2, 4096}, 3), InputError);
  EXPECT_THROW(cu::measure_host({4096, 1 << 20}, exec::TrainOptions{}), InputError);
}

// The host probe's own input checks come before the device's.
TEST(CudaProbe, HostProbeNeedsTwoSizesAndARepeat) {
  EXPECT_THROW(cu::measure_host({4096}, exec::TrainOptions{}), InputError);
  EXPECT_THROW(cu::measure_host({1, 2}, exec::TrainOptions{}), InputError);  // both round to 2
  EXPECT_THROW(cu::measure_host({4096, 8192}, exec::TrainOptions{}, 1 << 10, 0), InputError);
}

// ---- on a GPU ----------------------------------------------------------------------------------

TEST(CudaProfile, TraceHasEveryEntryAndLayerKind) {
  PW_SKIP_WITHOUT_GPU();
  const models::ModelSpec m = tiny_bf16();
  const traces::Trace t = cu::profile_cuda(m, {2, 1, 2}, 2, exec::ProfileStatistic::median);
  const cu::GpuInfo gpu = cu::current_gpu();
  EXPECT_EQ(t.model, m.name);
  EXPECT_EQ(t.device, gpu.name);
  EXPECT_EQ(t.source.device_name, gpu.name);
  EXPECT_EQ(t.source.kind, "measured");
  EXPECT_NE(t.source.driver.find("CUDA driver"), std::string::npos) << t.source.driver;
  EXPECT_NE(t.source.tool.find("--backend cuda"), std::string::npos) << t.source.tool;
  EXPECT_EQ(t.dtype, models::DType::bf16);
  ASSERT_EQ(t.microbatch_sizes(), (std::vector<std::int64_t>{1, 2}));
  const models::ModelCosts mc = models::derive_costs(m);
  for (LayerKind k : traces::kLayerKinds) {
    EXPECT_EQ(t.statics[k].parameters, mc.layer(k).parameters);
    EXPECT_EQ(t.statics[k].parameter_bytes, 2 * mc.layer(k).parameters);
    if (mc.layer(k).parameters > 0) {
      EXPECT_GT(t.statics[k].optimizer_step_s, 0);
    }
  }
  for (const traces::Entry& e : t.entries) {
    const auto& block = e.layers[LayerKind::block];
    EXPECT_GT(block.forward_s, 0);
    EXPECT_GT(block.backward_s, 0);
    EXPECT_GT(block.recompute_s, 0);
    for (LayerKind k : {LayerKind::embedding, LayerKind::head}) {
      EXPECT_GE(e.layers[k].forward_s, 0);
      EXPECT_GE(e.layers[k].backward_s, 0);
      EXPECT_GE(e.layers[k].recompute_s, 0);
      EXPECT_TRUE(std::isfinite(e.layers[k].forward_s + e.layers[k].backward_s));
    }
    expect_stage_sizes(m, e);
  }
  // What profile --out writes reads back to the same trace.
  EXPECT_EQ(traces::parse_trace(traces::to_json(t), "t.json"), t);
}

// fp16 presets run as bf16 (same bytes); the trace keeps the model's dtype.
TEST(CudaProfile, Fp16ModelRunsAsBf16) {
  PW_SKIP_WITHOUT_GPU();
  models::ModelSpec m = tiny_bf16();
  m.dtype = models::DType::fp16;
  const traces::Trace t = cu::profile_cuda(m, {1}, 1);
  EXPECT_EQ(t.dtype, models::DType::fp16);
  expect_stage_sizes(m, t.at(1));
}

// A size whose activations cannot fit in any GPU is skipped (a note on stderr); when none fits,
// one line says so.
TEST(CudaProfile, SkipsASizeThatDoesNotFit) {
  PW_SKIP_WITHOUT_GPU();
  const models::ModelSpec m = tiny_bf16();
  const std::int64_t huge = 1 << 24;  // 16M samples of gpt-tiny: terabytes of activations
  const traces::Trace t = cu::profile_cuda(m, {1, huge}, 1);
  EXPECT_EQ(t.microbatch_sizes(), (std::vector<std::int64_t>{1}));
  try {
    cu::profile_cuda(m, {huge}, 1);
    FAIL() << "no error";
  } catch (const InputError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("no microbatch size"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

// One TP rank's shard (t = 2, SP) timed alone, and a selective block's extra backward: the
// trace says its sharding, its memory fields are the shard's stages' sizes (derive_costs at that
// sharding), the selective stash is smaller than the plain one and its extra time is measured.
// GPU-owed: never ran.
TEST(CudaProfile, ShardAndSelectiveAreTimed) {
  PW_SKIP_WITHOUT_GPU();
  const models::ModelSpec m = tiny_bf16();
  const models::Sharding sharding{2, true};
  const traces::Trace t =
      cu::profile_cuda(m, {2}, 2, exec::ProfileStatistic::median, sharding, true);
  EXPECT_EQ(t.sharding.t, 2);
  EXPECT_TRUE(t.sharding.sp);
  const traces::Entry& e = t.at(2);
  const auto& K = e.layers[LayerKind::block];
  const traces::Entry expected =
      profiling::measured_entry(models::derive_costs(m, sharding), 2, {}, 0.0);
  EXPECT_EQ(K.activation_bytes, expected.layers[LayerKind::block].activation_bytes);
  EXPECT_EQ(K.output_bytes, expected.layers[LayerKind::block].output_bytes);
  EXPECT_LT(K.activation_selective_bytes, K.activation_bytes);
  EXPECT_GT(K.forward_s, 0);
  EXPECT_GT(K.backward_s, 0);
  EXPECT_GE(K.selective_recompute_s, 0);
}

TEST(CudaProfile, ArenaOutOfRoomIsDeviceMemoryError) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(1 << 20);
  EXPECT_THROW(DeviceBuffer(arena, Category::activations, 2 << 20), cu::DeviceMemoryError);
  DeviceBuffer fits(arena, Category::activations, 1 << 19);  // and it is still usable
  EXPECT_NE(fits.data(), nullptr);
}

TEST(CudaProbe, LocalTransportFitIsSane) {
  PW_SKIP_WITHOUT_GPU();
  const exec::TransportFit f = cu::measure_local_transport({1, 1 << 16, 1 << 20, 1 << 22}, 20);
  ASSERT_EQ(f.samples.size(), 4u);
  EXPECT_EQ(f.samples[0].bytes, 2);  // whole bf16 elements
  EXPECT_EQ(f.samples[3].bytes, 1 << 22);
  for (const auto& s : f.samples) {
    EXPECT_GT(s.one_way_s, 0);
    EXPECT_LT(s.one_way_s, 1.0);
  }
  EXPECT_GE(f.latency_s, 0);
  EXPECT_LT(f.latency_s, 1e-2);
  EXPECT_GT(f.bandwidth_bytes_per_s, 1e9);  // device copies: hundreds of GB/s on an H100
  EXPECT_TRUE(std::isfinite(f.bandwidth_bytes_per_s));
}

// Pinned copies each way and the host's optimizer rate: positive, finite, PCIe-like (over
// 1 GB/s on any GPU host of this decade); the gpu-host cluster takes them as its host side and
// still reads back from its file. GPU-owed: never ran.
TEST(CudaProbe, HostSideOfOffloadIsMeasured) {
  PW_SKIP_WITHOUT_GPU();
  const exec::HostFit h =
      cu::measure_host({4096, 1 << 20, 4 << 20}, exec::TrainOptions{}, 1 << 16, 5);
  ASSERT_EQ(h.copy.samples.size(), 6u);  // each size down and up
  for (const auto& s : h.copy.samples) {
    EXPECT_GT(s.one_way_s, 0);
    EXPECT_LT(s.one_way_s, 1.0);
  }
  EXPECT_GT(h.copy.bandwidth_bytes_per_s, 1e9);
  EXPECT_TRUE(std::isfinite(h.copy.bandwidth_bytes_per_s));
  EXPECT_GE(h.copy.latency_s, 0);
  EXPECT_GT(h.optimizer_params_per_s, 0);
  exec::TransportFit link;
  link.latency_s = 1e-5;
  link.bandwidth_bytes_per_s = 1e11;
  const cu::GpuInfo gpu = cu::current_gpu();
  if (exec::gpu_device_preset(gpu.name).empty()) GTEST_SKIP() << "no preset for " << gpu.name;
  clusters::Cluster c = cu::gpu_host_cluster(1, link);
  exec::add_host(c, h, 1);
  EXPECT_EQ(c.host.pcie_bandwidth_bytes_per_s, h.copy.bandwidth_bytes_per_s);
  EXPECT_EQ(c.host.cpu_cores, 1);
  EXPECT_EQ(clusters::parse_cluster(clusters::to_json(c), "gpu-host.json"), c);
}

TEST(CudaProbe, GpuHostClusterNamesThisGpu) {
  PW_SKIP_WITHOUT_GPU();
  const cu::GpuInfo gpu = cu::current_gpu();
  EXPECT_FALSE(gpu.name.empty());
  EXPECT_GT(gpu.memory_bytes, 0);
  exec::TransportFit link;
  link.latency_s = 1e-5;
  link.bandwidth_bytes_per_s = 1e11;
  if (exec::gpu_device_preset(gpu.name).empty()) {
    EXPECT_THROW(cu::gpu_host_cluster(2, link), InputError) << gpu.name;
    GTEST_SKIP() << "skipped: no device preset for " << gpu.name;
  }
  const clusters::Cluster c = cu::gpu_host_cluster(3, link);
  EXPECT_EQ(c.devices(), 3);
  EXPECT_EQ(c.device.name, gpu.name);
  EXPECT_EQ(c.device.memory_bytes, gpu.memory_bytes);
  EXPECT_GT(cu::device_peak_flops(gpu.name, models::DType::bf16), 0);
  EXPECT_EQ(clusters::parse_cluster(clusters::to_json(c), "gpu-host.json"), c);
}

}  // namespace
}  // namespace pw::testing
