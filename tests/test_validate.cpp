// validate's pieces: the comparison of two run reports, the transport fit and probe, and the
// cluster description of this machine.
#include <cmath>
#include <csignal>
#include <thread>

#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "clusters/cluster.hpp"
#include "exec/gpt_layout.hpp"
#include "exec/machine_load.hpp"
#include "exec/probe.hpp"
#include "exec/profile.hpp"
#include "models/model.hpp"
#include "planner/validation.hpp"
#include "test_util.hpp"

namespace pw {
namespace {

using planner::Plan;
using planner::RunReport;
using testing::error_of;

Plan two_stage_plan() {
  Plan p;
  p.schedule = planner::Schedule::two_bw;
  p.d = 2;
  p.m = 4;
  p.b = 4;
  p.stage_blocks = {1, 1};
  return p;
}

RunReport report(const std::string& source, double step_s, std::vector<double> busy_s,
                 std::vector<std::int64_t> activations) {
  RunReport r;
  r.source = source;
  r.model = "gpt-tiny";
  r.cluster = source == "measured" ? "cpu:2" : "cpu-host:1";
  r.plan = two_stage_plan();
  r.iteration_time_s = step_s;
  r.samples_per_s = double(r.plan.global_batch()) / step_s;
  for (int rank = 0; rank < 2; ++rank) {
    planner::DeviceReport d;
    d.rank = rank;
    d.stage = rank;
    d.busy_s = busy_s[std::size_t(rank)];
    d.bubble_fraction = 1 - d.busy_s / step_s;
    d.memory.weights = 1000;
    d.memory.activations = activations[std::size_t(rank)];
    d.peak_memory_bytes = d.memory.total();
    r.devices.push_back(d);
  }
  return r;
}

TEST(Compare, RelativeErrorOfThePrediction) {
  EXPECT_DOUBLE_EQ(planner::compare(11, 10).error, 0.1);
  EXPECT_DOUBLE_EQ(planner::compare(9, 10).error, -0.1);
  EXPECT_EQ(planner::compare(0, 0).error, 0);
  EXPECT_TRUE(std::isnan(planner::compare(1, 0).error));
}

TEST(PlanDifference, NamesTheFirstDifferingField) {
  Plan a = two_stage_plan(), b = two_stage_plan();
  EXPECT_EQ(planner::plan_difference(a, b, "A", "B"), "");
  b.recompute = {planner::Recompute::none, planner::Recompute::none};  // the same as no list
  EXPECT_EQ(planner::plan_difference(a, b, "A", "B"), "");
  b.placement = {{0, 0}, {0, 1}};  // placement is not compared
  EXPECT_EQ(planner::plan_difference(a, b, "A", "B"), "");
  b.m = 8;
  EXPECT_EQ(planner::plan_difference(a, b, "A", "B"), "/plan/m: 4 in A but 8 in B");
  b = two_stage_plan();
  b.recompute = {planner::Recompute::full, planner::Recompute::none};
  EXPECT_EQ(planner::plan_difference(a, b, "A", "B"),
            "/plan/recompute: [none, none] in A but [full, none] in B");
  b = two_stage_plan();
  b.schedule = planner::Schedule::one_f_one_b;
  EXPECT_NE(planner::plan_difference(a, b, "A", "B").find("/plan/schedule: 2bw in A but 1f1b"),
            std::string::npos);
}

TEST(Validate, ErrorsPerRankAndOverall) {
  const RunReport sim = report("simulated", 0.030, {0.020, 0.030}, {3000, 1000});
  const RunReport meas = report("measured", 0.040, {0.025, 0.030}, {3000, 1000});
  const planner::Validation v = planner::validate(sim, meas);
  EXPECT_DOUBLE_EQ(v.iteration_time_s.error, -0.25);
  EXPECT_DOUBLE_EQ(v.samples_per_s.error, 1.0 / 3.0);
  ASSERT_EQ(v.devices.size(), 2u);
  EXPECT_DOUBLE_EQ(v.devices[0].busy_s.error, -0.2);
  EXPECT_DOUBLE_EQ(v.devices[1].busy_s.error, 0.0);
  EXPECT_DOUBLE_EQ(v.devices[0].peak_memory_bytes.predicted, 4000);
  EXPECT_DOUBLE_EQ(v.max_abs_busy_error, 0.2);
  EXPECT_DOUBLE_EQ(v.max_abs_memory_error, 0.0);
  // Bubble: an absolute difference of fractions.
  EXPECT_NEAR(v.devices[0].bubble_fraction.error, (1 - 0.02 / 0.03) - (1 - 0.025 / 0.04), 1e-12);

  const common::Json j = planner::to_json(v, nullptr, {{"predicted", "s.json"}});
  EXPECT_EQ(j["format"], "pipewright.validation/1");
  EXPECT_EQ(j["model"], "gpt-tiny");
  EXPECT_EQ(j["plan"]["d"], 2);
  EXPECT_TRUE(j["machine"].is_null());
  EXPECT_EQ(j["files"]["predicted"], "s.json");
  EXPECT_DOUBLE_EQ(j["iteration_time_s"]["error"].get<double>(), -0.25);
  EXPECT_EQ(j["devices"][1]["peak_memory_bytes"]["measured"], 2000);
  EXPECT_EQ(j["devices"][0]["memory_breakdown_bytes"]["predicted"]["activations"], 3000);
  EXPECT_EQ(j["predicted"]["source"], "simulated");
  EXPECT_EQ(j["measured"]["cluster"], "cpu:2");
}

// Offload: the bytes the copies moved per step (both directions, over the ranks) are compared when
// both reports have them; without an offload section there is nothing to compare (null in JSON).
TEST(Validate, OffloadBytesMovedPerStep) {
  RunReport sim = report("simulated", 0.030, {0.020, 0.030}, {3000, 1000});
  RunReport meas = report("measured", 0.040, {0.025, 0.030}, {3000, 1000});
  EXPECT_FALSE(planner::validate(sim, meas).has_copies);
  EXPECT_TRUE(planner::to_json(planner::validate(sim, meas))["copy_bytes_per_step"].is_null());
  sim.extra["offload"] = {{"copy_out_bytes_per_step", 3000}, {"copy_in_bytes_per_step", 1000}};
  meas.extra["offload"] = {{"copy_out_bytes_per_step", 3000}, {"copy_in_bytes_per_step", 2000}};
  const planner::Validation v = planner::validate(sim, meas);
  ASSERT_TRUE(v.has_copies);
  EXPECT_DOUBLE_EQ(v.copy_bytes_per_step.predicted, 4000);
  EXPECT_DOUBLE_EQ(v.copy_bytes_per_step.measured, 5000);
  EXPECT_DOUBLE_EQ(v.copy_bytes_per_step.error, -0.2);
  EXPECT_EQ(planner::to_json(v)["copy_bytes_per_step"]["measured"], 5000);
}

// Tensor parallelism: the prediction has a row per rank (one GPU of its group), the measurement
// one per GPU (device rank * t + TP index); each GPU is compared with its rank's prediction, a
// report listing the ranks only is compared rank by rank, and anything else is one line.
TEST(Validate, TensorParallelMeasurementsPerGpu) {
  RunReport sim = report("simulated", 0.030, {0.020, 0.030}, {3000, 1000});
  RunReport meas = report("measured", 0.040, {0.025, 0.030}, {3000, 1000});
  sim.plan.t = meas.plan.t = 2;
  std::vector<planner::DeviceReport> gpus;
  for (int device = 0; device < 4; ++device) {
    planner::DeviceReport d = meas.devices[std::size_t(device / 2)];
    d.rank = device;
    d.busy_s = 0.020 + 0.001 * device;
    d.memory.activations += device % 2;  // the second GPU of each group one byte more
    gpus.push_back(d);
  }
  RunReport per_gpu = meas;
  per_gpu.devices = gpus;
  const planner::Validation v = planner::validate(sim, per_gpu);
  ASSERT_EQ(v.devices.size(), 4u);
  for (int device = 0; device < 4; ++device) {
    const planner::DeviceValidation& d = v.devices[std::size_t(device)];
    EXPECT_EQ(d.rank, device / 2);
    EXPECT_EQ(d.tp, device % 2);
    EXPECT_EQ(d.stage, device / 2);
    EXPECT_DOUBLE_EQ(d.busy_s.predicted, device < 2 ? 0.020 : 0.030);
    EXPECT_DOUBLE_EQ(d.busy_s.measured, 0.020 + 0.001 * device);
    EXPECT_DOUBLE_EQ(d.peak_memory_bytes.measured - d.peak_memory_bytes.predicted, device % 2);
  }
  const common::Json j = planner::to_json(v, common::Json::object(), common::Json::object());
  EXPECT_EQ(j["devices"][3]["tp"], 1);
  EXPECT_EQ(j["devices"][3]["rank"], 1);
  // The ranks only: compared as at t = 1.
  EXPECT_EQ(planner::validate(sim, meas).devices.size(), 2u);
  // Three GPUs of four: not a list per GPU, so read as ranks, where device 2 is none: one line.
  RunReport three = per_gpu;
  three.devices.pop_back();
  const std::string msg = error_of([&] { planner::validate(sim, three); });
  EXPECT_NE(msg.find("/devices/2/rank: 2 is not a rank of a plan of 2 ranks"), std::string::npos)
      << msg;
}

TEST(Validate, MedianMeasuredStep) {
  const RunReport sim = report("simulated", 0.030, {0.02, 0.03}, {1, 1});
  RunReport meas = report("measured", 0.040, {0.02, 0.03}, {1, 1});
  EXPECT_FALSE(planner::validate(sim, meas).has_median_step);
  // The first step (the pipeline's warm-up) is left out: the median of 0.02, 0.03, 0.1.
  meas.extra["step_times_s"] = {0.5, 0.02, 0.1, 0.03};
  const planner::Validation v = planner::validate(sim, meas);
  ASSERT_TRUE(v.has_median_step);
  EXPECT_DOUBLE_EQ(v.median_step_time_s.measured, 0.03);
  EXPECT_DOUBLE_EQ(v.median_step_time_s.error, 0.0);
  EXPECT_EQ(v.measured_step_times_s.size(), 4u);
  EXPECT_DOUBLE_EQ(planner::to_json(v)["median_step_time_s"]["measured"].get<double>(), 0.03);
  meas.extra["step_times_s"] = {0.5, 0.02, 0.04};  // even count: the mean of the middle two
  EXPECT_DOUBLE_EQ(planner::validate(sim, meas).median_step_time_s.measured, 0.03);
}

TEST(Validate, RejectsReportsThatAreNotAPredictionAndAMeasurementOfOnePlan) {
  const RunReport sim = report("simulated", 0.03, {0.02, 0.03}, {1, 1});
  const RunReport meas = report("measured", 0.04, {0.02, 0.03}, {1, 1});
  EXPECT_NE(
      error_of([&] { planner::validate(meas, meas, "m.json", "m.json"); }).find("m.json: /source"),
      std::string::npos);
  EXPECT_NE(
      error_of([&] { planner::validate(sim, sim, "s.json", "s2.json"); }).find("s2.json: /source"),
      std::string::npos);
  RunReport other = meas;
  other.plan.d = 4;
  other.plan.stage_blocks = {1, 1, 1, 1};
  EXPECT_EQ(error_of([&] { planner::validate(sim, other, "s.json", "m.json"); }),
            "the plans differ: /plan/d: 2 in s.json but 4 in m.json");
  other = meas;
  other.model = "gpt2-124m";
  EXPECT_NE(error_of([&] { planner::validate(sim, other); }).find("/model"), std::string::npos);
  other = meas;
  other.devices.pop_back();
  EXPECT_NE(error_of([&] {
              planner::validate(sim, other, "s.json", "m.json");
            }).find("m.json: /devices: no entry for rank 1"),
            std::string::npos);
}

TEST(TransportFit, RecoversLatencyAndBandwidth) {
  std::vector<exec::TransportSample> s;
  for (std::int64_t bytes : {4, 16384, 65536, 262144})
    s.push_back({bytes, 5e-6 + double(bytes) / 2e9});
  const exec::TransportFit f = exec::fit_transport(s);
  EXPECT_NEAR(f.latency_s, 5e-6, 1e-12);
  EXPECT_NEAR(f.bandwidth_bytes_per_s, 2e9, 1);
  // Noise that makes larger messages no slower: finite figures, never a negative latency.
  const exec::TransportFit flat = exec::fit_transport({{4, 3e-6}, {65536, 2.9e-6}});
  EXPECT_DOUBLE_EQ(flat.latency_s, 2.9e-6);
  EXPECT_GT(flat.bandwidth_bytes_per_s, 0);
  EXPECT_TRUE(std::isfinite(flat.bandwidth_bytes_per_s));
  EXPECT_THROW(exec::fit_transport({{4, 1e-6}}), Error);
  EXPECT_THROW(exec::fit_transport({{4, 1e-6}, {4, 2e-6}}), Error);
}

// The send calls' durations as overhead + bytes / rate: recovered exactly; no size effect gives the
// mean per message and no per-byte part; a negative intercept gives the slope through the origin;
// nothing measured (threads, GPUs) gives zeros.
TEST(TransportFit, SendOverheadPerMessageAndPerByte) {
  exec::TransportFit f;
  for (std::int64_t bytes : {4, 16384, 65536, 262144})
    f.send_samples.push_back({bytes, 1e-5 + double(bytes) / 1e8});
  exec::fit_send_overhead(f);
  EXPECT_NEAR(f.send_overhead_s, 1e-5, 1e-12);
  EXPECT_NEAR(f.send_overhead_bytes_per_s, 1e8, 1e2);
  f.send_samples = {{4, 3e-6}, {65536, 2e-6}};
  exec::fit_send_overhead(f);
  EXPECT_DOUBLE_EQ(f.send_overhead_s, 2.5e-6);
  EXPECT_EQ(f.send_overhead_bytes_per_s, 0);
  f.send_samples = {{1000, 1e-6}, {2000, 3e-6}};  // intercept -1 us
  exec::fit_send_overhead(f);
  EXPECT_EQ(f.send_overhead_s, 0);
  EXPECT_NEAR(f.send_overhead_bytes_per_s, 5e6 / 7e-3, 1e3);
  f.send_samples.clear();
  exec::fit_send_overhead(f);
  EXPECT_EQ(f.send_overhead_s, 0);
  EXPECT_EQ(f.send_overhead_bytes_per_s, 0);
}

// Timing is never asserted: only that the probe runs and gives usable figures.
TEST(TransportProbe, PingPongGivesPositiveFigures) {
  const exec::TransportFit f = exec::measure_in_process_transport({4, 4096, 65536}, 20);
  ASSERT_EQ(f.samples.size(), 3u);
  EXPECT_EQ(f.samples[2].bytes, 65536);
  for (const auto& s : f.samples)
    EXPECT_GT(s.one_way_s, 0);
  EXPECT_GE(f.latency_s, 0);
  EXPECT_GT(f.bandwidth_bytes_per_s, 0);
  EXPECT_GT(exec::measure_sgemm_flops_per_s(64, 1), 0);
  EXPECT_GE(exec::hardware_threads(), 1);
  EXPECT_GT(exec::host_memory_bytes(), 0);
}

// The profile feeds each stage real activations and gradients and summarises by the statistic
// asked for; timing is not asserted.
TEST(Profile, MeanOrMedianOfRoundRobinRuns) {
  const models::ModelSpec model = models::load_model("gpt-tiny");
  for (auto statistic : {exec::ProfileStatistic::median, exec::ProfileStatistic::mean}) {
    const traces::Trace t = exec::profile_cpu(model, {2}, 2, statistic);
    const auto& block = t.at(2).layers[models::LayerKind::block];
    EXPECT_GT(block.forward_s, 0);
    EXPECT_GT(block.backward_s, 0);
    EXPECT_GT(block.recompute_s, 0);
    EXPECT_NE(
        t.source.tool.find(statistic == exec::ProfileStatistic::mean ? "mean of 2" : "median of 2"),
        std::string::npos)
        << t.source.tool;
  }
}

// With `selective` the profile times a selective block too: the trace's block stash is the one
// without the scores (models/'s figure), its extra backward time not negative; without it the
// trace says nothing is dropped or re-run. Timing is not asserted beyond that.
TEST(Profile, SelectiveRecomputeIsTimedWhenAsked) {
  const models::ModelSpec model = exec::as_executed(models::load_model("gpt-tiny"));
  const models::ModelCosts mc = models::derive_costs(model);
  const traces::Trace with =
      exec::profile_cpu(model, {2}, 2, exec::ProfileStatistic::median, {}, true);
  const auto& block = with.at(2).layers[models::LayerKind::block];
  EXPECT_EQ(block.activation_selective_bytes, 2 * mc.block.activation_selective_bytes);
  EXPECT_LT(block.activation_selective_bytes, block.activation_bytes);
  EXPECT_GE(block.selective_recompute_s, 0);
  EXPECT_NE(with.source.tool.find("--selective"), std::string::npos) << with.source.tool;
  const auto& head = with.at(2).layers[models::LayerKind::head];
  EXPECT_EQ(head.activation_selective_bytes, head.activation_bytes);
  EXPECT_EQ(head.selective_recompute_s, 0);
  const traces::Trace without = exec::profile_cpu(model, {2}, 2);
  const auto& plain = without.at(2).layers[models::LayerKind::block];
  EXPECT_EQ(plain.activation_selective_bytes, plain.activation_bytes);
  EXPECT_EQ(plain.selective_recompute_s, 0);
}

TEST(CpuHostCluster, IsAValidClusterWithTheMeasuredLink) {
  exec::TransportFit f;
  f.latency_s = 4e-6;
  f.bandwidth_bytes_per_s = 1e10;
  const clusters::Cluster c = exec::cpu_host_cluster(4, f, 5e10);
  EXPECT_EQ(c.devices(), 4);
  EXPECT_EQ(c.device.name, "cpu");
  EXPECT_EQ(c.device.peak_fp32_flops_per_s, 5e10);
  // The file it would be written as reads back to the same cluster.
  EXPECT_EQ(clusters::parse_cluster(clusters::to_json(c), "cpu-host.json"), c);
  // Core to core: the transport; a core to itself (ranks sharing it): the transport's bandwidth.
  const clusters::Link across = clusters::p2p_link(c, 0, 0, 0, 3);
  EXPECT_DOUBLE_EQ(across.latency_s, 4e-6);
  EXPECT_DOUBLE_EQ(across.bandwidth_bytes_per_s, 1e10);
  EXPECT_DOUBLE_EQ(clusters::p2p_link(c, 0, 1, 0, 1).bandwidth_bytes_per_s, 1e10);
  const clusters::Cluster one = exec::cpu_host_cluster(1, f, 5e10);
  EXPECT_EQ(one.intra_node.kind, clusters::IntraKind::none);
  EXPECT_EQ(clusters::parse_cluster(clusters::to_json(one), "one.json"), one);
}

// The host side of offload on this machine: a copy engine's memcpy and one core's optimizer update,
// positive and finite; the cluster gets them as its host link and CPU Adam rate, one core per rank
// up to the machine's, and still reads back from its file.
TEST(CpuHostCluster, OffloadGetsTheMeasuredHostSide) {
  exec::TrainOptions o;
  const exec::HostFit h = exec::measure_host({4096, 1 << 20}, o, 1 << 16, 3);
  EXPECT_GT(h.copy.bandwidth_bytes_per_s, 0);
  EXPECT_TRUE(std::isfinite(h.copy.bandwidth_bytes_per_s));
  EXPECT_GE(h.copy.latency_s, 0);
  EXPECT_GT(h.optimizer_params_per_s, 0);
  EXPECT_TRUE(std::isfinite(h.optimizer_params_per_s));
  exec::TransportFit f;
  f.latency_s = 4e-6;
  f.bandwidth_bytes_per_s = 1e10;
  clusters::Cluster c = exec::cpu_host_cluster(2, f, 5e10);
  exec::add_host(c, h, 1);
  EXPECT_EQ(c.host.pcie_bandwidth_bytes_per_s, h.copy.bandwidth_bytes_per_s);
  EXPECT_EQ(c.host.cpu_cores, 1);
  EXPECT_EQ(c.host.cpu_adam_params_per_s(), h.optimizer_params_per_s);
  EXPECT_EQ(c.host.pinned_memory_bytes, c.host.memory_bytes);
  EXPECT_EQ(clusters::parse_cluster(clusters::to_json(c), "cpu-host.json"), c);
  exec::add_host(c, h, 1 << 20);  // more ranks than cores: the cores
  EXPECT_EQ(c.host.cpu_cores, exec::hardware_threads());
  EXPECT_THROW(exec::measure_host({4096}, o), pw::Error);
}

// /proc/stat's first line, in ticks: busy = user + nice + system + irq + softirq; total adds idle,
// iowait and steal.
TEST(MachineLoad, ProcStatLineInSeconds) {
  exec::CpuCounters c;
  ASSERT_TRUE(exec::parse_proc_stat(
      "cpu  100 20 30 400 5 1 2 7 0 0\ncpu0 50 10 15 200 2 0 1 3 0 0\nintr 1 2\n", 100, c));
  EXPECT_DOUBLE_EQ(c.busy_s, (100 + 20 + 30 + 1 + 2) / 100.0);
  EXPECT_DOUBLE_EQ(c.steal_s, 0.07);
  EXPECT_DOUBLE_EQ(c.total_s, (100 + 20 + 30 + 400 + 5 + 1 + 2 + 7) / 100.0);
  exec::CpuCounters none;
  EXPECT_FALSE(exec::parse_proc_stat("intr 1 2\n", 100, none));
  EXPECT_FALSE(exec::parse_proc_stat("cpu  1 2\n", 100, none));
}

// Others' share = (the machine's busy time - the job's CPU time) / (wall x CPUs), in [0, 1].
TEST(MachineLoad, OthersAreTheBusyTimeTheJobDidNotUse) {
  exec::CpuCounters a, b;
  a.wall_s = 10;
  b.wall_s = 12;  // 2 s on 4 CPUs: 8 CPU-seconds
  a.cpus = b.cpus = 4;
  a.busy_s = 100;
  b.busy_s = 105;  // 5 busy CPU-seconds, 3 of them the job's
  a.total_s = 1000;
  b.total_s = 1008;
  a.steal_s = 1;
  b.steal_s = 1.4;
  const exec::OtherLoad l = exec::other_load(a, b, 3.0);
  ASSERT_TRUE(l.known);
  EXPECT_DOUBLE_EQ(l.others, 2.0 / 8.0);
  EXPECT_DOUBLE_EQ(l.steal, 0.4 / 8.0);
  EXPECT_DOUBLE_EQ(l.wall_s, 2.0);
  EXPECT_DOUBLE_EQ(l.resolution, 0.01 / 2.0);
  // The job's CPU time can exceed the busy ticks counted (tick rounding): clamped at 0.
  EXPECT_EQ(exec::other_load(a, b, 9.0).others, 0.0);
  // Unreadable counters: unknown, not zero.
  EXPECT_FALSE(exec::other_load(exec::CpuCounters{}, exec::CpuCounters{}, 0).known);
}

// Live: a busy process beside this one shows up as others' load (at least half a CPU of the
// machine's, allowing for the counters' tick resolution).
TEST(MachineLoad, ABusyNeighbourIsSeen) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    volatile unsigned long spin = 0;
    for (;;)
      spin = spin + 1;
  }
  const exec::CpuCounters a = exec::read_cpu_counters();
  ::usleep(500000);
  const exec::CpuCounters b = exec::read_cpu_counters();
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  const exec::OtherLoad l = exec::other_load(a, b, b.process_cpu_s - a.process_cpu_s);
  if (!l.known) GTEST_SKIP() << "/proc/stat is not readable here";
  EXPECT_GE(l.others * b.cpus, 0.5) << "others " << l.others << " of " << b.cpus << " CPUs";
}

// Rank r on core r while there are enough; more ranks than cores: neighbours share, evenly.
TEST(PinCores, RanksOnCoresAsValidatePlacesThem) {
  EXPECT_EQ(exec::cores_for_ranks(2, {0, 1, 2, 3}), (std::vector<int>{0, 1}));
  EXPECT_EQ(exec::cores_for_ranks(4, {0, 1}), (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(exec::cores_for_ranks(3, {4, 6}), (std::vector<int>{4, 4, 6}));
  EXPECT_TRUE(exec::cores_for_ranks(2, {}).empty());
}

TEST(PinCores, AThreadRunsWhereItIsPinned) {
  const std::vector<int> cores = exec::allowed_cores();
  ASSERT_FALSE(cores.empty());
  int where = -1;
  std::thread t([&] {
    exec::pin_current_thread(cores.back());
    where = sched_getcpu();
  });
  t.join();
  EXPECT_EQ(where, cores.back());
  EXPECT_THROW(exec::pin_current_thread(-1), InputError);
  EXPECT_THROW(exec::pin_current_thread(1 << 20), InputError);
}

}  // namespace
}  // namespace pw
