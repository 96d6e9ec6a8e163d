// The CUDA runtime (exec/cuda/runtime.*, worker.*): the programs the CPU backend runs, on one GPU
// with every rank a thread. Its losses follow the CPU backend's on the same initial weights within
// bf16 tolerances; a pipeline split trains like one stage; 2BW follows the delayed-update rule
// (closer to the CPU's 2BW than to its 1F1B); a resumed run is bit-identical to an unbroken one;
// the per-rank memory counts are the planner's. The input checks run everywhere; the rest need a
// GPU and report themselves skipped without one.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "cuda_test_util.hpp"
#include "exec/cuda/runtime.hpp"
#include "exec/gpt_layout.hpp"
#include "exec/run_common.hpp"
#include "exec/runtime.hpp"
#include "planner/cost_model.hpp"
#include "planner/plan.hpp"
#include "test_util.hpp"
#include "traces/analytic.hpp"

namespace {

using pw::exec::TrainOptions;
using pw::exec::TrainResult;
using pw::planner::Plan;
using pw::planner::Schedule;
namespace fs = std::filesystem;

// gpt-tiny with 4 blocks (plans up to d = 4), in fp32 for the CPU and bf16 for the GPU.
const pw::models::ModelSpec kCpu = pw::testing::gpt_tiny(4);
const pw::models::ModelSpec kGpu = pw::testing::gpt_tiny(4, pw::models::DType::bf16);

Plan make_plan(Schedule s, int w, int d, int b, int m) {
  Plan p;
  p.schedule = s;
  p.w = w;
  p.d = d;
  p.b = b;
  p.m = m;
  pw::planner::resolve_stages(p, 4);
  return p;
}

TrainOptions sgd(int steps, float lr = 0.05f) {
  TrainOptions o;
  o.steps = steps;
  o.optimizer = "sgd";
  o.lr = lr;
  o.seed = 7;
  return o;
}

std::vector<double> losses(const TrainResult& r) {
  std::vector<double> out;
  for (const auto& s : r.steps)
    out.push_back(s.loss);
  return out;
}

// What `estimate` predicts per rank for plan p with every rank on one H100 (the runs below).
std::vector<pw::planner::DeviceReport> planned(const Plan& p) {
  const pw::clusters::Cluster one = pw::clusters::load_cluster("h100-x1");
  Plan placed = p;
  pw::planner::place(placed, {1, 1}, p.ranks());
  const auto t = pw::traces::analytic_trace(kGpu, one.device, {p.b});
  return pw::planner::estimate(kGpu, t, one, placed).report.devices;
}

// A device's measured memory against its rank's prediction: weights, versions, gradients and
// optimizer state exactly, activations within 5%.
void expect_planned_memory(const pw::planner::MemoryBreakdown& got,
                           const pw::planner::MemoryBreakdown& want, const std::string& who) {
  EXPECT_EQ(got.weights, want.weights) << who;
  EXPECT_EQ(got.weight_versions, want.weight_versions) << who;
  EXPECT_EQ(got.gradients, want.gradients) << who;
  EXPECT_EQ(got.optimizer, want.optimizer) << who;
  EXPECT_NEAR(double(got.activations), double(want.activations), 0.05 * want.activations) << who;
}

// A TP run's losses within 2e-2 per step of `want`, and every device's memory its rank's
// prediction (the plan on one dgx-h100 node, the trace sharded at the plan's t and SP).
void expect_follows_with_planned_memory(const pw::models::ModelSpec& model, const Plan& p,
                                        const TrainResult& r, const std::vector<double>& want) {
  const auto got = losses(r);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(got[i], want[i], 2e-2 * want[i]) << "step " << i;
  ASSERT_EQ(r.ranks.size(), std::size_t(p.ranks() * p.t));
  Plan placed = p;
  pw::planner::place(placed, {1, 8});
  const pw::clusters::Cluster node = pw::clusters::load_cluster("dgx-h100");
  const auto tr =
      pw::traces::analytic_trace(model, node.device, {p.b}, pw::models::Sharding{p.t, p.sp});
  const auto devices = pw::planner::estimate(model, tr, node, placed).report.devices;
  for (int device = 0; device < p.ranks() * p.t; ++device)
    expect_planned_memory(r.ranks[std::size_t(device)].memory,
                          devices[std::size_t(device / p.t)].memory,
                          "device " + std::to_string(device));
}

fs::path temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("pw-cuda-runtime-" + name);
  fs::remove_all(p);
  return p;
}

// ---- everywhere ------------------------------------------------------------------------------

TEST(CudaRuntime, RejectsAnFp32ModelWithOneLine) {
  try {
    pw::exec::cuda::train_cuda(kCpu, make_plan(Schedule::one_f_one_b, 1, 1, 1, 1), sgd(1));
    FAIL() << "no error";
  } catch (const pw::InputError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("bf16"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

TEST(CudaRuntime, WithoutAGpuSaysSo) {
  if (pw::exec::cuda::cuda_device_count() > 0) GTEST_SKIP() << "skipped: a CUDA device is present";
  try {
    pw::exec::cuda::train_cuda(kGpu, make_plan(Schedule::one_f_one_b, 1, 1, 1, 1), sgd(1));
    FAIL() << "no error";
  } catch (const pw::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("no CUDA device"), std::string::npos) << e.what();
  }
}

// Tensor and sequence parallelism reach the CUDA executor (one process; with optimizer and
// activation offload and offload chunks too); what it does not run yet is one line before
// anything starts.
TEST(CudaRuntime, TensorParallelPlansReachTheExecutorOrOneLine) {
  Plan p = make_plan(Schedule::one_f_one_b, 1, 2, 1, 2);
  p.t = 2;
  EXPECT_NO_THROW(pw::exec::detail::prepare_run(kGpu, p, sgd(1), "cuda"));
  // Each device's stage (what its worker builds): the plan's t, its TP rank, its shard's sizes.
  for (int device = 0; device < p.ranks() * p.t; ++device) {
    const pw::exec::GptLayout l(
        pw::exec::detail::shard_spec(kGpu, p, p.stage_of(device / p.t), 0, device % p.t),
        pw::models::DType::bf16, "cuda");
    EXPECT_EQ(l.t, 2);
    EXPECT_EQ(l.tp, device % 2);
    EXPECT_EQ(l.C_t, kGpu.hidden / 2);
    EXPECT_EQ(l.V_t, kGpu.vocab / 2);
  }
  const auto one_line = [](const std::string& msg, const std::string& want) {
    EXPECT_NE(msg.find(want), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  };
  Plan sp = p;
  sp.sp = true;
  EXPECT_NO_THROW(pw::exec::detail::prepare_run(kGpu, sp, sgd(1), "cuda"));
  Plan off = p;
  off.offload = pw::planner::Offload::optimizer;
  EXPECT_NO_THROW(pw::exec::detail::prepare_run(kGpu, off, sgd(1), "cuda"));
  Plan chunks = p;
  chunks.offload = pw::planner::Offload::chunks;
  pw::exec::TrainOptions roomy = sgd(1);
  roomy.optimizer = "adamw";
  roomy.device_memory = std::int64_t(1) << 30;
  EXPECT_NO_THROW(pw::exec::detail::prepare_run(kGpu, chunks, roomy, "cuda"));
  Plan replicas = chunks;
  replicas.w = 2;
  one_line(
      pw::testing::error_of([&] { pw::exec::detail::prepare_run(kGpu, replicas, roomy, "cuda"); }),
      "the cuda executor's offload chunks run one replica per stage (w = 2");
}

// ---- on a GPU --------------------------------------------------------------------------------

// Same initial weights (the CPU's, rounded to bf16), same batches: the first loss within 1e-2 and
// the next ones within 2e-2 of fp32 training.
TEST(CudaRuntime, LossesFollowTheCpuBackend) {
  PW_SKIP_WITHOUT_GPU();
  for (Schedule s : {Schedule::gpipe, Schedule::one_f_one_b}) {
    SCOPED_TRACE(pw::planner::to_string(s));
    const Plan p = make_plan(s, 1, 2, 2, 4);
    const auto cpu = losses(pw::exec::train_cpu(kCpu, p, sgd(4)));
    const auto gpu = losses(pw::exec::cuda::train_cuda(kGpu, p, sgd(4)));
    ASSERT_EQ(gpu.size(), cpu.size());
    EXPECT_NEAR(gpu[0], cpu[0], 1e-2 * cpu[0]);
    for (std::size_t i = 1; i < cpu.size(); ++i)
      EXPECT_NEAR(gpu[i], cpu[i], 2e-2 * cpu[i]) << "step " << i;
  }
}

// The same microbatches through 1, 2 or 4 stages on one GPU: the same layers' kernels in the same
// order; only the tied gradient's bf16 sum differs (one buffer on one stage, two summed at the end
// across stages).
TEST(CudaRuntime, PipelineSplitsTrainLikeOneStage) {
  PW_SKIP_WITHOUT_GPU();
  const auto one = losses(
      pw::exec::cuda::train_cuda(kGpu, make_plan(Schedule::one_f_one_b, 1, 1, 1, 4), sgd(4)));
  for (int d : {2, 4}) {
    const TrainResult r =
        pw::exec::cuda::train_cuda(kGpu, make_plan(Schedule::one_f_one_b, 1, d, 1, 4), sgd(4));
    const auto got = losses(r);
    for (std::size_t i = 0; i < one.size(); ++i)
      EXPECT_NEAR(got[i], one[i], 5e-3 * one[i]) << "d=" << d << " step " << i;
    EXPECT_EQ(r.ranks.size(), std::size_t(d));
    for (const auto& rank : r.ranks) {
      EXPECT_GT(rank.busy_s, 0) << "rank " << rank.rank;
      EXPECT_FALSE(rank.timeline.ops.empty()) << "rank " << rank.rank;
    }
  }
}

// 2BW's W(t+1) = W(t) - lr step(grad f(W(t-1))): with a large step the delayed update moves the
// losses visibly away from 1F1B's; the GPU's 2BW stays with the CPU's 2BW.
TEST(CudaRuntime, TwoBwFollowsTheVersionRule) {
  PW_SKIP_WITHOUT_GPU();
  const TrainOptions o = sgd(5, 0.3f);
  const auto cpu_2bw =
      losses(pw::exec::train_cpu(kCpu, make_plan(Schedule::two_bw, 1, 2, 2, 4), o));
  const auto cpu_1f1b =
      losses(pw::exec::train_cpu(kCpu, make_plan(Schedule::one_f_one_b, 1, 2, 2, 4), o));
  const TrainResult r =
      pw::exec::cuda::train_cuda(kGpu, make_plan(Schedule::two_bw, 1, 2, 2, 4), o);
  const auto gpu = losses(r);
  const std::size_t last = gpu.size() - 1;
  EXPECT_NEAR(gpu[last], cpu_2bw[last], 3e-2 * cpu_2bw[last]);
  EXPECT_LT(std::fabs(gpu[last] - cpu_2bw[last]), 0.5 * std::fabs(cpu_1f1b[last] - cpu_2bw[last]))
      << "2bw " << cpu_2bw[last] << " 1f1b " << cpu_1f1b[last] << " gpu " << gpu[last];
  for (const auto& rank : r.ranks)
    EXPECT_EQ(rank.memory.weight_versions, rank.memory.weights) << "rank " << rank.rank;
}

// Stop after 2 of 4 steps, resume: every later loss and the final weights of every rank are the
// unbroken run's, bit for bit.
TEST(CudaRuntime, ResumeIsExact) {
  PW_SKIP_WITHOUT_GPU();
  for (Schedule s : {Schedule::one_f_one_b, Schedule::two_bw}) {
    SCOPED_TRACE(pw::planner::to_string(s));
    TrainOptions o;
    o.seed = 7;
    pw::testing::expect_resume_is_exact(kGpu, make_plan(s, 1, 2, 2, 4), o,
                                        temp_dir("resumed").string());
  }
}

// Weights, gradients and optimizer state per rank are the planner's bf16 figures exactly (2 + 2 +
// 12 bytes per parameter); activations within 5% (messages in flight, recompute scratch).
TEST(CudaRuntime, MemoryMatchesThePlanner) {
  PW_SKIP_WITHOUT_GPU();
  for (Schedule s : {Schedule::gpipe, Schedule::one_f_one_b, Schedule::two_bw}) {
    SCOPED_TRACE(pw::planner::to_string(s));
    const Plan p = make_plan(s, 1, 2, 2, 4);
    TrainOptions o;
    o.steps = 2;
    const TrainResult r = pw::exec::cuda::train_cuda(kGpu, p, o);
    const auto devices = planned(p);
    for (int rank = 0; rank < p.ranks(); ++rank)
      expect_planned_memory(r.ranks[std::size_t(rank)].memory, devices[std::size_t(rank)].memory,
                            "rank " + std::to_string(rank));
  }
}

// ---- the distributed optimizer (ZeRO-1) --------------------------------------------------------

struct DoptCase {
  Schedule schedule;
  int w, d, v, m, buckets;
};

Plan dopt_plan(const DoptCase& c, bool sharded) {
  Plan p;
  p.schedule = c.schedule;
  p.w = c.w;
  p.d = c.d;
  p.v = c.v;
  p.b = 1;
  p.m = c.m;
  p.distributed_optimizer = sharded;
  pw::planner::resolve_stages(p, 4);
  return p;
}

TrainOptions adamw(int steps, int buckets) {
  TrainOptions o;
  o.steps = steps;
  o.seed = 7;
  o.lr = 3e-3f;
  o.gradient_buckets = buckets;
  return o;
}

// Gradients reduce-scattered by the shard rule, each replica's AdamW on its shard of the fp32
// master and moments, the new bf16 weights all-gathered: every loss and every rank's final
// weights equal plain data parallelism's, bit for bit (the local transport's reduce-scatter sums
// as its all-reduce does). Tied embeddings across stages (d > 1) and on one device (v > 1), shards
// of 2 and 3 replicas (uneven), buckets cutting the tied tensor, every schedule.
TEST(CudaRuntime, DistributedOptimizerGivesThePlainWeightsBitForBit) {
  PW_SKIP_WITHOUT_GPU();
  for (const DoptCase& c :
       {DoptCase{Schedule::one_f_one_b, 2, 2, 1, 2, 1}, DoptCase{Schedule::two_bw, 2, 2, 1, 2, 3},
        DoptCase{Schedule::gpipe, 3, 1, 1, 2, 2}, DoptCase{Schedule::interleaved, 2, 2, 2, 4, 1}}) {
    SCOPED_TRACE(fmt::format("{} w={} d={} v={} buckets={}", pw::planner::to_string(c.schedule),
                             c.w, c.d, c.v, c.buckets));
    const TrainResult plain =
        pw::exec::cuda::train_cuda(kGpu, dopt_plan(c, false), adamw(4, c.buckets));
    const TrainResult sharded =
        pw::exec::cuda::train_cuda(kGpu, dopt_plan(c, true), adamw(4, c.buckets));
    ASSERT_EQ(sharded.steps.size(), plain.steps.size());
    for (std::size_t i = 0; i < plain.steps.size(); ++i)
      EXPECT_EQ(sharded.steps[i].loss, plain.steps[i].loss) << "step " << i;
    ASSERT_EQ(sharded.ranks.size(), plain.ranks.size());
    for (std::size_t r = 0; r < plain.ranks.size(); ++r) {
      EXPECT_EQ(sharded.ranks[r].weights, plain.ranks[r].weights) << "rank " << r;
      // The state of ceil(P / w) parameters instead of P.
      EXPECT_LT(sharded.ranks[r].memory.optimizer, plain.ranks[r].memory.optimizer) << "rank " << r;
    }
  }
}

// Per rank: 12 bytes of optimizer state for ceil(P / w) parameters, the planner's figure, exactly.
TEST(CudaRuntime, DistributedOptimizerMemoryMatchesThePlanner) {
  PW_SKIP_WITHOUT_GPU();
  const Plan p = dopt_plan({Schedule::one_f_one_b, 3, 2, 1, 2, 1}, true);
  const TrainResult r = pw::exec::cuda::train_cuda(kGpu, p, adamw(2, 1));
  const auto devices = planned(p);
  for (int rank = 0; rank < p.ranks(); ++rank) {
    const auto& want = devices[std::size_t(rank)].memory;
    const auto& got = r.ranks[std::size_t(rank)].memory;
    EXPECT_EQ(got.weights, want.weights) << "rank " << rank;
    EXPECT_EQ(got.gradients, want.gradients) << "rank " << rank;
    EXPECT_EQ(got.optimizer, want.optimizer) << "rank " << rank;
  }
}

// Checkpoints hold each rank's shard of the state: stop after 2 of 4 steps, resume, and the
// losses and weights are the unbroken run's, bit for bit.
TEST(CudaRuntime, DistributedOptimizerResumeIsExact) {
  PW_SKIP_WITHOUT_GPU();
  for (Schedule s : {Schedule::one_f_one_b, Schedule::two_bw}) {
    SCOPED_TRACE(pw::planner::to_string(s));
    pw::testing::expect_resume_is_bit_identical(
        kGpu, dopt_plan({s, 2, 2, 1, 2, 1}, true), adamw(4, 1),
        "cuda_dopt_" + pw::planner::to_string(s), [](const auto& m, const auto& p, const auto& o) {
          return pw::exec::cuda::train_cuda(m, p, o);
        });
  }
}

// Tensor parallelism (Megatron's column-/row-parallel blocks, vocabulary-parallel embedding and
// cross-entropy; t devices per pipeline rank, every one a thread on this GPU): the losses of the
// same plan at t = 1 within bf16 tolerances (the TP sums add bf16 partial products, as Megatron's
// all-reduces do), with a padded vocabulary, in a pipeline, with data parallelism, 2bw and
// sequence parallelism; every device holds its shard, as the planner counts it at t.
TEST(CudaRuntime, TensorParallelFollowsOneDevice) {
  PW_SKIP_WITHOUT_GPU();
  struct Case {
    Schedule s;
    int t, w, d;
    bool padded, sp = false;
  };
  for (const Case& k :
       {Case{Schedule::one_f_one_b, 2, 1, 1, false}, Case{Schedule::gpipe, 4, 1, 1, true},
        Case{Schedule::one_f_one_b, 2, 1, 2, true}, Case{Schedule::two_bw, 2, 1, 2, false},
        Case{Schedule::one_f_one_b, 2, 2, 1, false},
        Case{Schedule::one_f_one_b, 2, 1, 2, true, true},
        Case{Schedule::gpipe, 4, 1, 1, false, true}}) {
    SCOPED_TRACE(fmt::format("{} t={} w={} d={}{}{}", pw::planner::to_string(k.s), k.t, k.w, k.d,
                             k.padded ? " padded" : "", k.sp ? " sp" : ""));
    pw::models::ModelSpec model = kGpu;
    if (k.padded) {
      model.vocab = 250;
      model.vocab_multiple = 4;
    }
    const Plan one = make_plan(k.s, k.w, k.d, 1, 4);
    Plan p = one;
    p.t = k.t;
    p.sp = k.sp;
    const auto want = losses(pw::exec::cuda::train_cuda(model, one, adamw(4, 1)));
    expect_follows_with_planned_memory(model, p, pw::exec::cuda::train_cuda(model, p, adamw(4, 1)),
                                       want);
  }
}

// Selective recompute (compile-checked only, never run on a GPU): the blocks keep no attention
// probabilities, the forward makes them 64 query rows at a time in the workspace and each block's
// backward makes them again with the same calls. Against the same plan without recompute: losses
// within the TP test's 2e-2 (the probabilities' GEMMs run in other shapes, dv and dk summed over
// the row blocks in bf16), at t = 1 and t = 2 with SP; every device's memory the planner's (its
// stash models' activation_selective_bytes).
TEST(CudaRuntime, SelectiveRecomputeFollowsNoRecompute) {
  PW_SKIP_WITHOUT_GPU();
  struct Case {
    Schedule s;
    int t, d;
    bool sp;
  };
  for (const Case& k :
       {Case{Schedule::one_f_one_b, 1, 2, false}, Case{Schedule::two_bw, 1, 2, false},
        Case{Schedule::one_f_one_b, 2, 2, true}}) {
    SCOPED_TRACE(
        fmt::format("{} t={} d={}{}", pw::planner::to_string(k.s), k.t, k.d, k.sp ? " sp" : ""));
    Plan plain = make_plan(k.s, 1, k.d, 2, 4);
    plain.t = k.t;
    plain.sp = k.sp;
    Plan p = plain;
    p.recompute.assign(std::size_t(k.d), pw::planner::Recompute::selective);
    pw::planner::check(p);
    const auto want = losses(pw::exec::cuda::train_cuda(kGpu, plain, adamw(4, 1)));
    expect_follows_with_planned_memory(kGpu, p, pw::exec::cuda::train_cuda(kGpu, p, adamw(4, 1)),
                                       want);
  }
}

}  // namespace
