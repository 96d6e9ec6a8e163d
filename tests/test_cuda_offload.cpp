// The CUDA executor with offload (issue 15, docs/formulas.md section 9; exec/cuda/worker.cpp):
// the programs and rules the CPU executor runs (tests/test_offload_exec.cpp), on a GPU with pinned
// host memory and copy streams. On a GPU: activation offload gives the run without offload's
// losses bit for bit (the same kernels on the same values; only copies between them); optimizer
// offload (gradients summed in fp32 on the host instead of bf16 on the device, CPU Adam instead of
// the device's) within the tolerance the CUDA runtime's own tests use for the same kernels in
// another order; the bytes moved are the simulator's exactly; the per-rank device memory is the
// planner's in every category but activations, and a run inside a --device-memory of its own
// peak stays inside with the same losses; a resumed run equals an unbroken one; sharded over
// replicas (w > 1) it trains as the distributed optimizer does, and with tensor parallelism
// (t = 2) as the same TP plan without offload; offload chunks (PatrickStar) train as the plan
// without them, each rank's peak the chunk schedule's plus its stages' fixed bytes, and resume
// exactly. Without a GPU the
// expectations themselves are computed (so a GPU run does not fail on the test's own setup) and
// the GPU cases report themselves skipped.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "clusters/cluster.hpp"
#include "common/error.hpp"
#include "cuda_test_util.hpp"
#include "exec/cuda/runtime.hpp"
#include "exec/gpu_host.hpp"
#include "exec/run_common.hpp"
#include "exec/runtime.hpp"
#include "planner/chunks.hpp"
#include "planner/cost_model.hpp"
#include "planner/plan.hpp"
#include "sim/simulator.hpp"
#include "test_util.hpp"
#include "traces/analytic.hpp"

namespace {

using pw::exec::RankResult;
using pw::exec::TrainOptions;
using pw::exec::TrainResult;
using pw::planner::ActivationChoice;
using pw::planner::Offload;
using pw::planner::Plan;
using pw::planner::Schedule;
namespace fs = std::filesystem;

// gpt-tiny with 4 blocks in bf16 (the CUDA backend's dtype).
const pw::models::ModelSpec kGpu = pw::testing::gpt_tiny(4, pw::models::DType::bf16);

enum Mode { kNone = 0, kOptimizer = 1, kActivations = 2, kBoth = 3 };

std::string mode_name(int mode) {
  const char* names[] = {"none", "optimizer", "activations", "optimizer,activations"};
  return names[mode];
}

Plan make_plan(Schedule s, int d, int b, int m, int mode) {
  Plan p;
  p.schedule = s;
  p.d = d;
  p.b = b;
  p.m = m;
  pw::planner::resolve_stages(p, kGpu.layers);
  if (mode & kOptimizer) p.offload = Offload::optimizer;
  if (mode & kActivations) {
    p.offload_activations = true;
    pw::planner::set_activations(
        p, std::vector<ActivationChoice>(std::size_t(d), ActivationChoice::swap));
  }
  pw::planner::check(p);
  return p;
}

// ZeRO-Offload's shards (w > 1, the distributed optimizer on) against the distributed optimizer
// without offload: `offload` picks which.
Plan sharded_plan(Schedule s, int w, int d, bool offload) {
  Plan p = make_plan(s, d, 1, 2, kNone);
  p.w = w;
  p.distributed_optimizer = true;
  if (offload) p.offload = Offload::optimizer;
  pw::planner::check(p);
  return p;
}

struct ShardedCase {
  Schedule schedule;
  int w, d;
};

// The CPU executor's sharded cases (tests/test_offload_exec.cpp) at w = 2.
const ShardedCase kSharded[] = {{Schedule::one_f_one_b, 2, 1},
                                {Schedule::one_f_one_b, 2, 2},
                                {Schedule::two_bw, 2, 2},
                                {Schedule::gpipe, 2, 2}};

std::string describe(const ShardedCase& c) {
  return pw::planner::to_string(c.schedule) + " w=" + std::to_string(c.w) +
         " d=" + std::to_string(c.d);
}

TrainOptions options(int steps) {
  TrainOptions o;
  o.steps = steps;
  o.optimizer = "adamw";
  o.lr = 3e-3f;
  o.weight_decay = 0.01f;
  o.seed = 11;
  return o;
}

std::vector<double> losses(const TrainResult& r) {
  std::vector<double> out;
  for (const auto& s : r.steps)
    out.push_back(s.loss);
  return out;
}

// A run with offload `mode` against the same plan without: activation offload only copies (the
// same bits); optimizer offload sums the bf16 gradients in fp32 on the host and runs CPU Adam
// (within 5e-3 relative, the runtime's tolerance for the same kernels in another order).
void expect_losses_follow(const std::vector<double>& got, const std::vector<double>& plain,
                          int mode) {
  ASSERT_EQ(got.size(), plain.size());
  for (std::size_t i = 0; i < plain.size(); ++i) {
    if (mode == kActivations) {
      EXPECT_EQ(got[i], plain[i]) << "step " << i;
    } else {
      EXPECT_NEAR(got[i], plain[i], 5e-3 * plain[i]) << "step " << i;
    }
  }
}

struct Case {
  Schedule schedule;
  int d, b, m;
};

// Activation offload swaps only where a stash waits 3 compute ops (kSwapGap): 1f1b and 2bw at
// d = 4 on their first stages, gpipe at d = 2 (as the CPU executor's tests).
const Case kCases[] = {
    {Schedule::one_f_one_b, 4, 1, 4}, {Schedule::two_bw, 4, 1, 4}, {Schedule::gpipe, 2, 2, 4}};

// The planner's and the simulator's figures of a plan of bf16 gpt-tiny on one H100 node (host
// link, CPU Adam rate), every rank on one GPU as the CUDA runtime runs them.
const pw::clusters::Cluster& node() {
  static const pw::clusters::Cluster c = pw::clusters::load_cluster("dgx-h100");
  return c;
}

Plan placed(const Plan& p) {
  Plan q = p;
  pw::planner::place(q, {1, 1}, p.ranks());
  return q;
}

pw::planner::Estimate predicted(const Plan& p) {
  const pw::traces::Trace t = pw::traces::analytic_trace(kGpu, node().device, {p.b});
  return pw::planner::estimate(kGpu, t, node(), placed(p));
}

pw::planner::RunReport simulated(const Plan& p, int steps) {
  const pw::traces::Trace t = pw::traces::analytic_trace(kGpu, node().device, {p.b});
  return pw::sim::simulate(kGpu, t, node(), placed(p), {.steps = steps}).report;
}

// What a rank of a run of `steps` steps must have moved: the simulator's bytes of the same
// programs (its per-step figures are the run's / steps).
struct Moved {
  std::int64_t out = 0, in = 0, activations_out = 0;
};

std::vector<Moved> expected_bytes(const Plan& p, int steps) {
  const pw::planner::RunReport sim = simulated(p, steps);
  const pw::common::Json& so = sim.extra["offload"];
  std::vector<Moved> out;
  for (int rank = 0; rank < p.ranks(); ++rank) {
    const pw::common::Json& r = so["ranks"][std::size_t(rank)];
    Moved m;
    m.out = steps * r["copy_out_bytes_per_step"].get<std::int64_t>();
    m.in = steps * r["copy_in_bytes_per_step"].get<std::int64_t>();
    if (p.offload_activations)
      m.activations_out = steps * r["activations"]["swapped_bytes_per_step"].get<std::int64_t>();
    out.push_back(m);
  }
  return out;
}

fs::path temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("pw-cuda-offload-" + name);
  fs::remove_all(p);
  return p;
}

// Offload chunks (PatrickStar) on the CUDA worker: the plans it runs (w = 1, m > 1), d = 1 and
// d = 2 with the tied embedding exchanged on the chunks, full and selective recompute, 2bw's
// parts, TP shards (t = 2, each device its own chunks), interleaving (v = 2).
using pw::planner::Recompute;
struct ChunkCase {
  Schedule schedule;
  int d;
  Recompute recompute = Recompute::none;
  int t = 1, v = 1;
};
const ChunkCase kChunkCases[] = {{Schedule::one_f_one_b, 1},
                                 {Schedule::one_f_one_b, 2},
                                 {Schedule::gpipe, 2, Recompute::full},
                                 {Schedule::two_bw, 2},
                                 {Schedule::one_f_one_b, 2, Recompute::none, 2},
                                 {Schedule::interleaved, 2, Recompute::none, 1, 2},
                                 {Schedule::one_f_one_b, 2, Recompute::selective}};

std::string describe(const ChunkCase& c) {
  return pw::planner::to_string(c.schedule) + " d=" + std::to_string(c.d) +
         (c.recompute != Recompute::none ? " " + pw::planner::to_string(c.recompute) : "") +
         (c.t > 1 ? " t=" + std::to_string(c.t) : "") +
         (c.v > 1 ? " v=" + std::to_string(c.v) : "");
}

// gpt-tiny's tensors in chunks of the largest one (the tied embedding's shard), b = 1, m = 4.
Plan chunk_plan(const ChunkCase& c) {
  Plan p;
  p.schedule = c.schedule;
  p.d = c.d;
  p.b = 1;
  p.m = 4;
  p.t = c.t;
  p.v = c.v;
  pw::planner::resolve_stages(p, kGpu.layers);
  p.offload = Offload::chunks;
  std::int64_t largest = 0;
  for (const pw::planner::ChunkTensor& t : pw::planner::model_tensors(kGpu, c.t))
    largest = std::max(largest, 2 * t.elements);
  p.chunk_bytes = largest;
  if (c.recompute != Recompute::none) p.recompute.assign(std::size_t(c.d), c.recompute);
  pw::planner::check(p);
  return p;
}

TrainOptions chunk_options(int steps, std::int64_t device_memory) {
  TrainOptions o = options(steps);
  o.device_memory = device_memory;
  return o;
}

// The schedules a run of `p` in --device-memory `budget` takes on the cuda backend (less what its
// stages keep besides the planner's figures: pw::exec::chunk_budget).
std::vector<pw::planner::ChunkSchedule> chunk_schedules(const Plan& p, std::int64_t budget) {
  return pw::exec::executor_chunk_schedules(kGpu, p, pw::exec::chunk_budget("cuda", p, budget));
}

// Two --device-memory sizes per plan: the smallest every stage's chunks fit (most evictions, CPU
// Adam for every chunk that does not fit beside them), and one with every chunk and some chunks'
// optimizer state on the device.
std::vector<std::int64_t> chunk_budgets(const Plan& p) {
  const std::int64_t kept = pw::exec::chunk_budget("cuda", p, std::int64_t(1) << 40);
  const std::int64_t reserve = (std::int64_t(1) << 40) - kept;
  std::int64_t lo = reserve, hi = std::int64_t(1) << 40;  // lo refused, hi fits
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    try {
      chunk_schedules(p, mid);
      hi = mid;
    } catch (const pw::InputError&) {
      lo = mid;
    }
  }
  std::int64_t roomy = hi;
  for (const pw::planner::ChunkSchedule& s : chunk_schedules(p, hi)) {
    std::int64_t non_model = 0;
    for (const pw::planner::ChunkMoment& k : s.moments)
      non_model = std::max(non_model, k.non_model_bytes);
    for (const pw::planner::ChunkSegmentPlan& g : s.segments)
      for (const pw::planner::ChunkMoment& k : g.moments)
        non_model = std::max(non_model, k.non_model_bytes);
    roomy = std::max(roomy, reserve + s.layout.units() * s.layout.move_bytes + non_model +
                                2 * s.layout.os_chunk_bytes);
  }
  return {hi, roomy};
}

// ---- everywhere ------------------------------------------------------------------------------

// The GPU chunk cases' expectations, computed here: every plan passes the CUDA backend's checks
// at both budgets, the smallest one moves chunks both ways on every stage and runs CPU Adam, the
// roomy one keeps some chunks' optimizer state on the device.
TEST(CudaOffload, ChunkExpectationsAreComputable) {
  for (const ChunkCase& c : kChunkCases) {
    SCOPED_TRACE(describe(c));
    const Plan p = chunk_plan(c);
    const std::vector<std::int64_t> budgets = chunk_budgets(p);
    for (std::int64_t budget : budgets)
      EXPECT_NO_THROW(pw::exec::detail::prepare_run(kGpu, p, chunk_options(3, budget), "cuda"))
          << budget;
    const auto tight = chunk_schedules(p, budgets[0]);
    ASSERT_EQ(tight.size(), std::size_t(p.d));  // one per stage (t > 1: each device's shard's)
    for (const pw::planner::ChunkSchedule& s : tight) {
      EXPECT_GT(s.copy_in_bytes, 0);
      EXPECT_GT(s.copy_out_bytes, 0);
      EXPECT_LT(s.device_adam_chunks, s.layout.chunks());
    }
    for (const pw::planner::ChunkSchedule& s : chunk_schedules(p, budgets[1]))
      EXPECT_GT(s.device_adam_chunks, 0);
  }
}

// The CUDA backend's checks let every mode through, optimizer offload sharded over replicas
// (w > 1) too, and offload chunks as the CUDA worker runs them (ChunkCase); the chunk plans it does
// not run yet are one line each.
TEST(CudaOffload, ChecksPassEveryModeAndRefuseWhatChunksDoNotRun) {
  for (int mode : {kOptimizer, kActivations, kBoth})
    EXPECT_NO_THROW(pw::exec::detail::prepare_run(
        kGpu, make_plan(Schedule::one_f_one_b, 4, 1, 4, mode), options(2), "cuda"))
        << mode_name(mode);
  for (const ShardedCase& c : kSharded)
    EXPECT_NO_THROW(pw::exec::detail::prepare_run(kGpu, sharded_plan(c.schedule, c.w, c.d, true),
                                                  options(2), "cuda"))
        << describe(c);
  const Plan runs = chunk_plan({Schedule::one_f_one_b, 1});
  const std::int64_t budget = chunk_budgets(runs)[0];
  EXPECT_NO_THROW(pw::exec::detail::prepare_run(kGpu, runs, chunk_options(2, budget), "cuda"));
  const auto refused = [&](Plan p, TrainOptions o, const std::string& what) {
    SCOPED_TRACE(what);
    const std::string msg =
        pw::testing::error_of([&] { pw::exec::detail::prepare_run(kGpu, p, o, "cuda"); });
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  };
  Plan wide = runs;
  wide.w = 2;
  refused(wide, chunk_options(2, budget), "chunks run one replica per stage (w = 2");
  Plan single = runs;
  single.m = 1;
  refused(single, chunk_options(2, budget), "need m > 1");
  refused(runs, chunk_options(2, std::int64_t(32) << 20), "leaves nothing for offload chunks");
}

// The GPU cases' expectations, computed here so that a GPU session does not fail on them: the
// simulator's bytes (bf16: 2 bytes per element) and the planner's memory of every case and mode.
TEST(CudaOffload, ExpectationsAreComputable) {
  for (const Case& k : kCases)
    for (int mode : {kOptimizer, kActivations, kBoth}) {
      SCOPED_TRACE(pw::planner::to_string(k.schedule) + " " + mode_name(mode));
      const Plan p = make_plan(k.schedule, k.d, k.b, k.m, mode);
      const std::vector<Moved> moved = expected_bytes(p, 3);
      ASSERT_EQ(moved.size(), std::size_t(p.ranks()));
      if (mode & kOptimizer) {
        for (const Moved& m : moved) {
          EXPECT_GT(m.out, 0);
          EXPECT_GT(m.in, 0);
        }
      }
      if (mode & kActivations) {
        EXPECT_GT(moved[0].activations_out, 0);
      }
      const pw::planner::Estimate e = predicted(p);
      ASSERT_EQ(e.report.devices.size(), std::size_t(p.ranks()));
      if (mode & kOptimizer) {
        EXPECT_EQ(e.report.devices[0].memory.optimizer, 0);
      }
    }
}

// The sharded GPU case's expectations: every rank moves bytes both ways, keeps no optimizer
// state on the device and has a host pool.
TEST(CudaOffload, ShardedExpectationsAreComputable) {
  for (const ShardedCase& c : kSharded) {
    SCOPED_TRACE(describe(c));
    const Plan p = sharded_plan(c.schedule, c.w, c.d, true);
    const std::vector<Moved> moved = expected_bytes(p, 3);
    ASSERT_EQ(moved.size(), std::size_t(p.ranks()));
    const pw::planner::Estimate e = predicted(p);
    ASSERT_EQ(e.report.devices.size(), std::size_t(p.ranks()));
    for (int rank = 0; rank < p.ranks(); ++rank) {
      EXPECT_GT(moved[std::size_t(rank)].out, 0) << "rank " << rank;
      EXPECT_GT(moved[std::size_t(rank)].in, 0) << "rank " << rank;
      EXPECT_EQ(e.report.devices[std::size_t(rank)].memory.optimizer, 0) << "rank " << rank;
      EXPECT_GT(
          e.report.extra["offload"]["ranks"][std::size_t(rank)]["host_bytes"].get<std::int64_t>(),
          0)
          << "rank " << rank;
    }
  }
}

// The TP GPU case's expectations (the simulator's and the planner's figures at t = 2 from the
// trace sharded at t), computed here; and the plans reach the CUDA executor.
TEST(CudaOffload, TensorParallelExpectationsAreComputable) {
  for (int mode : {kOptimizer, kActivations, kBoth}) {
    SCOPED_TRACE(mode_name(mode));
    Plan p = make_plan(Schedule::one_f_one_b, 4, 1, 4, mode);
    p.t = 2;
    pw::planner::check(p);
    EXPECT_NO_THROW(pw::exec::detail::prepare_run(kGpu, p, options(2), "cuda"));
    Plan placed = p;
    pw::planner::place(placed, {1, 8});
    const pw::traces::Trace tr =
        pw::traces::analytic_trace(kGpu, node().device, {p.b}, pw::models::Sharding{2, false});
    const pw::planner::RunReport sim =
        pw::sim::simulate(kGpu, tr, node(), placed, {.steps = 3}).report;
    ASSERT_EQ(sim.extra["offload"]["ranks"].size(), std::size_t(p.ranks()));
    EXPECT_GT(sim.extra["offload"]["ranks"][0]["copy_out_bytes_per_step"].get<std::int64_t>(), 0);
    EXPECT_EQ(pw::planner::estimate(kGpu, tr, node(), placed).report.devices.size(),
              std::size_t(p.ranks()));
  }
}

// ---- on a GPU --------------------------------------------------------------------------------

// Sharded optimizer offload (w = 2: each replica's bf16 gradient sums reduce-scattered on the
// device as the distributed optimizer's, its shard of each tile to its host, CPU Adam there, the
// shards uploaded and all-gathered) against the distributed optimizer on the GPU: CPU Adam on the
// same fp32 master and bf16 sums as GPU Adam, within LossesMatchNoOffload's 5e-3; the bytes moved
// are the simulator's, the device memory the planner's in weights, versions, gradients (whole,
// for the reduce-scatter) and optimizer state (none), the host pool the planner's.
TEST(CudaOffload, ShardedTrainsAsTheDistributedOptimizer) {
  PW_SKIP_WITHOUT_GPU();
  const int steps = 3;
  for (const ShardedCase& c : kSharded) {
    SCOPED_TRACE(describe(c));
    const Plan p = sharded_plan(c.schedule, c.w, c.d, true);
    const auto dopt = losses(pw::exec::cuda::train_cuda(
        kGpu, sharded_plan(c.schedule, c.w, c.d, false), options(steps)));
    const TrainResult r = pw::exec::cuda::train_cuda(kGpu, p, options(steps));
    const auto got = losses(r);
    ASSERT_EQ(got.size(), dopt.size());
    for (std::size_t i = 0; i < dopt.size(); ++i)
      EXPECT_NEAR(got[i], dopt[i], 5e-3 * dopt[i]) << "step " << i;
    const std::vector<Moved> moved = expected_bytes(p, steps);
    const pw::planner::Estimate e = predicted(p);
    const pw::common::Json& o = e.report.extra["offload"];
    for (int rank = 0; rank < p.ranks(); ++rank) {
      const RankResult& rr = r.ranks[std::size_t(rank)];
      EXPECT_LT(std::abs(rr.copy_out_bytes - moved[std::size_t(rank)].out), steps)
          << "rank " << rank;
      EXPECT_LT(std::abs(rr.copy_in_bytes - moved[std::size_t(rank)].in), steps) << "rank " << rank;
      const auto& wm = e.report.devices[std::size_t(rank)].memory;
      EXPECT_EQ(rr.memory.weights, wm.weights) << "rank " << rank;
      EXPECT_EQ(rr.memory.weight_versions, wm.weight_versions) << "rank " << rank;
      EXPECT_EQ(rr.memory.gradients, wm.gradients) << "rank " << rank;
      EXPECT_EQ(rr.memory.optimizer, 0) << "rank " << rank;
      EXPECT_EQ(rr.host_peak_memory_bytes,
                o["ranks"][std::size_t(rank)]["host_bytes"].get<std::int64_t>())
          << "rank " << rank;
    }
  }
}

// Every mode against the same plan without offload on the GPU. Activation offload: the same bits
// (copies only). Optimizer offload: the fp32 host sum of each microbatch's bf16 gradients and CPU
// Adam against the device's bf16 sum and GPU Adam: within 5e-3 relative, the runtime's tolerance
// for the same kernels summed in another order (CudaRuntime.PipelineSplitsTrainLikeOneStage).
TEST(CudaOffload, LossesMatchNoOffload) {
  PW_SKIP_WITHOUT_GPU();
  for (const Case& k : kCases) {
    const auto plain = losses(
        pw::exec::cuda::train_cuda(kGpu, make_plan(k.schedule, k.d, k.b, k.m, kNone), options(3)));
    for (int mode : {kOptimizer, kActivations, kBoth}) {
      SCOPED_TRACE(pw::planner::to_string(k.schedule) + " " + mode_name(mode));
      const TrainResult r =
          pw::exec::cuda::train_cuda(kGpu, make_plan(k.schedule, k.d, k.b, k.m, mode), options(3));
      const auto got = losses(r);
      expect_losses_follow(got, plain, mode);
      if (mode & kActivations) {
        EXPECT_GT(r.ranks[0].activation_out_bytes, 0);
        EXPECT_EQ(r.ranks[0].activation_out_bytes, r.ranks[0].activation_in_bytes);
      }
      if (mode & kOptimizer) {
        EXPECT_EQ(r.ranks[0].memory.optimizer, 0);  // on the host
        EXPECT_GT(r.ranks[0].host_peak_memory_bytes, 0);
      }
    }
  }
}

// Bytes moved: the simulator's exactly; device memory: the planner's in every category but
// activations (within 5% or three messages); the host pool of optimizer offload: the planner's
// (12 + 4 + 2) bytes per host-updated parameter; inside a budget of its own peak (plus three
// messages) the run stays inside it with the same losses, bit for bit.
TEST(CudaOffload, BytesAndMemoryMatchThePlanner) {
  PW_SKIP_WITHOUT_GPU();
  const int steps = 3;
  for (const Case& k : kCases)
    for (int mode : {kOptimizer, kActivations, kBoth}) {
      SCOPED_TRACE(pw::planner::to_string(k.schedule) + " " + mode_name(mode));
      const Plan p = make_plan(k.schedule, k.d, k.b, k.m, mode);
      const TrainResult r = pw::exec::cuda::train_cuda(kGpu, p, options(steps));
      const std::vector<Moved> moved = expected_bytes(p, steps);
      const pw::planner::Estimate e = predicted(p);
      const pw::common::Json& o = e.report.extra["offload"];
      std::int64_t peak = 0;
      for (int rank = 0; rank < p.ranks(); ++rank) {
        const RankResult& got = r.ranks[std::size_t(rank)];
        const Moved& want = moved[std::size_t(rank)];
        // The simulator's report gives bytes per step as its run's total / steps in whole bytes,
        // truncated: where the steps differ (2bw's first step swaps less) steps times it is up
        // to steps - 1 bytes short of the total (first run on an H100, 2026-11-27: 1,648,640
        // moved against 3 x 549,546).
        EXPECT_LT(std::abs(got.copy_out_bytes - want.out), steps) << "rank " << rank;
        EXPECT_LT(std::abs(got.copy_in_bytes - want.in), steps) << "rank " << rank;
        if (mode & kActivations) {
          EXPECT_LT(std::abs(got.activation_out_bytes - want.activations_out), steps)
              << "rank " << rank;
        }
        const auto& wm = e.report.devices[std::size_t(rank)].memory;
        EXPECT_EQ(got.memory.weights, wm.weights) << "rank " << rank;
        EXPECT_EQ(got.memory.weight_versions, wm.weight_versions) << "rank " << rank;
        EXPECT_EQ(got.memory.gradients, wm.gradients) << "rank " << rank;
        EXPECT_EQ(got.memory.optimizer, wm.optimizer) << "rank " << rank;
        // Activations: the planner's within 5% (the runtime's own test) or the activation-sized
        // messages on their way (at most three, as on the CPU), whichever is larger: with swaps
        // the planner's figure is small and the messages weigh more.
        const double message = 2.0 * p.b * kGpu.seq_len * kGpu.hidden;  // bf16 (b, T, C)
        EXPECT_NEAR(double(got.memory.activations), double(wm.activations),
                    std::max(0.05 * double(wm.activations), 3 * message))
            << "rank " << rank;
        if (mode == kOptimizer) {
          EXPECT_EQ(got.host_peak_memory_bytes,
                    o["ranks"][std::size_t(rank)]["host_bytes"].get<std::int64_t>())
              << "rank " << rank;
        }
        peak = std::max(peak, got.peak_memory_bytes);
      }
      // Blocks retired on a stream are freed when their event has passed, so a GPU run's peak
      // may vary by a message or two between runs: the budget leaves three.
      const std::int64_t limit =
          peak + 3 * std::int64_t(2) * p.b * kGpu.seq_len * kGpu.hidden;  // bf16 (b, T, C)
      TrainOptions budget = options(steps);
      budget.device_memory = limit;
      const TrainResult fitted = pw::exec::cuda::train_cuda(kGpu, p, budget);
      for (const RankResult& rank : fitted.ranks)
        EXPECT_LE(rank.peak_memory_bytes, limit) << "rank " << rank.rank;
      EXPECT_EQ(losses(fitted), losses(r));
    }
}

// Offload with tensor parallelism (t = 2, each GPU of a TP group its own shard, its own host tiles
// and swaps; compile-checked only, never run on a GPU): against the same TP plan without offload,
// activation offload bit for bit and optimizer offload within LossesMatchNoOffload's 5e-3; every
// device's bytes moved the simulator's per step for its rank (a TP group's devices move alike),
// its gradients and optimizer state the planner's.
TEST(CudaOffload, TensorParallelMatchesNoOffload) {
  PW_SKIP_WITHOUT_GPU();
  struct TpCase {
    Schedule schedule;
    int t, d;
    bool sp;
  };
  const int steps = 3;
  for (const TpCase& k :
       {TpCase{Schedule::one_f_one_b, 2, 4, false}, TpCase{Schedule::gpipe, 2, 2, false},
        TpCase{Schedule::gpipe, 2, 2, true}}) {
    const auto tp_plan = [&](int mode) {
      Plan p = make_plan(k.schedule, k.d, 1, 4, mode);
      p.t = k.t;
      p.sp = k.sp;
      pw::planner::check(p);
      return p;
    };
    const auto plain = losses(pw::exec::cuda::train_cuda(kGpu, tp_plan(kNone), options(steps)));
    for (int mode : {kOptimizer, kActivations, kBoth}) {
      SCOPED_TRACE(pw::planner::to_string(k.schedule) + " t=" + std::to_string(k.t) +
                   (k.sp ? " sp" : "") + " d=" + std::to_string(k.d) + " " + mode_name(mode));
      const Plan p = tp_plan(mode);
      const TrainResult r = pw::exec::cuda::train_cuda(kGpu, p, options(steps));
      const auto got = losses(r);
      expect_losses_follow(got, plain, mode);
      Plan placed = p;
      pw::planner::place(placed, {1, 8});
      const pw::traces::Trace tr =
          pw::traces::analytic_trace(kGpu, node().device, {p.b}, pw::models::Sharding{k.t, k.sp});
      const pw::planner::Estimate e = pw::planner::estimate(kGpu, tr, node(), placed);
      const pw::planner::RunReport sim =
          pw::sim::simulate(kGpu, tr, node(), placed, {.steps = steps}).report;
      ASSERT_EQ(r.ranks.size(), std::size_t(p.ranks() * k.t));
      for (int device = 0; device < p.ranks() * k.t; ++device) {
        const int rank = device / k.t;
        const RankResult& rr = r.ranks[std::size_t(device)];
        const pw::common::Json& sr = sim.extra["offload"]["ranks"][std::size_t(rank)];
        EXPECT_EQ(rr.copy_out_bytes / steps, sr["copy_out_bytes_per_step"].get<std::int64_t>())
            << "device " << device;
        EXPECT_EQ(rr.copy_in_bytes / steps, sr["copy_in_bytes_per_step"].get<std::int64_t>())
            << "device " << device;
        const auto& wm = e.report.devices[std::size_t(rank)].memory;
        EXPECT_EQ(rr.memory.gradients, wm.gradients) << "device " << device;
        EXPECT_EQ(rr.memory.optimizer, wm.optimizer) << "device " << device;
      }
    }
  }
}

// A 4-step run against the same run stopped after 2 steps and resumed, bit for bit
// (cuda_test_util.hpp).
void expect_resume_is_exact(const Plan& p, const TrainOptions& o, const std::string& name) {
  pw::testing::expect_resume_is_exact(kGpu, p, o, temp_dir(name).string());
}

// The host's optimizer state is in the checkpoint: stopped after 2 of 4 steps and resumed, the
// later losses and the final weights are the unbroken run's, bit for bit.
TEST(CudaOffload, ResumeIsExact) {
  PW_SKIP_WITHOUT_GPU();
  for (Schedule s : {Schedule::one_f_one_b, Schedule::two_bw}) {
    SCOPED_TRACE(pw::planner::to_string(s));
    expect_resume_is_exact(make_plan(s, 4, 1, 4, kBoth), options(4), pw::planner::to_string(s));
  }
}

// Offload chunks on the GPU: the same losses as the plan without chunks (CPU Adam for the chunks
// whose state is on the host: within LossesMatchNoOffload's 5e-3), at the smallest budget and a
// roomy one; each rank's measured peak is its stage's schedule's plus what the CUDA stages keep
// besides it (chunk_budget's reserve: the last stage's losses only there) and inside the budget;
// flush schedules move the schedule's bytes exactly (2bw's first and last segments differ from
// the steady one: moved both ways at least).
TEST(CudaOffload, ChunksTrainAsWithoutChunks) {
  PW_SKIP_WITHOUT_GPU();
  const int steps = 3;
  for (const ChunkCase& c : kChunkCases) {
    SCOPED_TRACE(describe(c));
    const Plan p = chunk_plan(c);
    Plan plain = p;
    plain.offload = Offload::none;
    const std::vector<double> want =
        losses(pw::exec::cuda::train_cuda(kGpu, plain, options(steps)));
    for (std::int64_t budget : chunk_budgets(p)) {
      SCOPED_TRACE(fmt::format("--device-memory {}", budget));
      const TrainResult r = pw::exec::cuda::train_cuda(kGpu, p, chunk_options(steps, budget));
      expect_losses_follow(losses(r), want, kOptimizer);
      const auto schedules = chunk_schedules(p, budget);
      ASSERT_EQ(r.ranks.size(), std::size_t(p.ranks() * p.t));
      for (int rank = 0; rank < p.ranks() * p.t; ++rank) {  // a device: rank · t + TP index
        const RankResult& got = r.ranks[std::size_t(rank)];
        const int stage = p.stage_of(rank / p.t);
        const pw::planner::ChunkSchedule& s = schedules[std::size_t(stage)];
        // The head's device keeps the losses (with interleaving: the last pipeline rank).
        const std::int64_t kept =
            p.v * (pw::exec::kCudaGemmWorkspaceBytes + pw::exec::kCudaStatusBytes) +
            (stage == p.d - 1 ? 8 * std::int64_t(p.m) : 0);
        EXPECT_EQ(got.peak_memory_bytes, s.device_peak_bytes + kept) << "rank " << rank;
        EXPECT_LE(got.peak_memory_bytes, budget) << "rank " << rank;
        if (c.schedule != Schedule::two_bw) {
          EXPECT_EQ(got.copy_in_bytes, steps * s.copy_in_bytes) << "rank " << rank;
          EXPECT_EQ(got.copy_out_bytes, steps * s.copy_out_bytes) << "rank " << rank;
        } else {
          EXPECT_GT(got.copy_in_bytes, 0) << "rank " << rank;
          EXPECT_GT(got.copy_out_bytes, 0) << "rank " << rank;
        }
      }
    }
  }
}

// Offload chunks' checkpoints (the shard's tensors as without chunks, out of and into the chunks):
// stopped after 2 of 4 steps and resumed at the tightest budget (CPU Adam for most chunks), the
// later losses and the final weights are the unbroken run's, bit for bit.
TEST(CudaOffload, ChunksResumeIsExact) {
  PW_SKIP_WITHOUT_GPU();
  for (const ChunkCase& c : {kChunkCases[1], kChunkCases[3]}) {  // 1f1b and 2bw, d = 2
    SCOPED_TRACE(describe(c));
    const Plan p = chunk_plan(c);
    expect_resume_is_exact(p, chunk_options(4, chunk_budgets(p)[0]),
                           "chunks-" + pw::planner::to_string(c.schedule));
  }
}

// A budget far below a rank's weights: the one-line error of the CPU backend.
TEST(CudaOffload, DeviceTooSmallIsOneLine) {
  PW_SKIP_WITHOUT_GPU();
  TrainOptions o = options(2);
  o.device_memory = 1000;
  const std::string msg = pw::testing::error_of([&] {
    pw::exec::cuda::train_cuda(kGpu, make_plan(Schedule::one_f_one_b, 2, 2, 4, kBoth), o);
  });
  EXPECT_NE(msg.find("--device-memory 1000 B"), std::string::npos) << msg;
  EXPECT_NE(msg.find("short by"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

}  // namespace
