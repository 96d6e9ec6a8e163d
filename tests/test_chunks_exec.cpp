// The CPU executor running PatrickStar's chunks (issue 15, --offload chunks; docs/formulas.md
// section 9, chunks): the model data in fixed-size chunks really moved between the budgeted
// emulated device and the host pool by the copy engines as the program's ops say, Adam per chunk
// on the device or on the host CPU engine. Losses and final weights bit-identical to the same
// plan without offload; the measured device peak equals the planner's and the simulator's and
// stays inside --device-memory; the bytes moved are the simulator's exactly; bad input is one
// line; resume is bit-identical.
#include <cstdio>
#include <functional>
#include <set>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "exec/gpt_layout.hpp"
#include "exec/machine_load.hpp"
#include "exec/run_common.hpp"
#include "exec/runtime.hpp"
#include "planner/chunks.hpp"
#include "planner/cost_model.hpp"
#include "planner/plan.hpp"
#include "sim/simulator.hpp"
#include "test_util.hpp"
#include "traces/analytic.hpp"

namespace pw::exec {
namespace {

using planner::Offload;
using planner::Plan;
using planner::Schedule;
using testing::adamw_options;
using testing::expect_identical;

// A case's recompute: true (full) or false (none), as most cases say, or a mode.
struct Rc {
  planner::Recompute mode = planner::Recompute::none;
  Rc(bool on) : mode(on ? planner::Recompute::full : planner::Recompute::none) {}
  Rc(planner::Recompute r) : mode(r) {}
  explicit operator bool() const { return mode != planner::Recompute::none; }
};
std::string rc_name(Rc r) {
  return r ? " recompute " + planner::to_string(r.mode) : "";
}
constexpr planner::Recompute kBlock = planner::Recompute::block;
constexpr planner::Recompute kSelective = planner::Recompute::selective;

Plan make_plan(const models::ModelSpec& model, Schedule s, int b, int m, std::int64_t chunk_bytes,
               int d = 1, Rc recompute = false, int w = 1, int t = 1, bool sp = false, int v = 1) {
  Plan p;
  p.schedule = s;
  p.d = d;
  p.v = v;
  p.w = w;
  p.t = t;
  p.sp = sp;
  p.b = b;
  p.m = m;
  if (recompute) p.recompute.assign(std::size_t(d), recompute.mode);
  planner::resolve_stages(p, model.layers);
  if (chunk_bytes >= 0) {
    p.offload = Offload::chunks;
    p.chunk_bytes = chunk_bytes;
  }
  planner::check(p);
  return p;
}

models::ModelSpec untied(models::ModelSpec m) {
  m.tied_embeddings = false;
  m.name += "-untied";
  return m;
}

// The node, placement and trace the executor plans on (chunk_cluster, chunk_placement: the
// emulated devices' budget; with t > 1 each device its own GPU, the trace sharded at t).
clusters::Cluster node_of(const Plan& p, std::int64_t budget) {
  return chunk_cluster(budget, p);
}
traces::Trace trace_of(const models::ModelSpec& model, const Plan& p, std::int64_t budget) {
  return traces::analytic_trace(model, node_of(p, budget).device, {p.b},
                                models::Sharding{p.t, p.sp});
}

planner::ChunkSchedule schedule_of(const models::ModelSpec& model, const Plan& p,
                                   std::int64_t budget, int stage = 0) {
  return planner::chunk_schedule(model, trace_of(model, p, budget), node_of(p, budget),
                                 chunk_placement(p), stage);
}

planner::RunReport simulated(const models::ModelSpec& model, const Plan& p, std::int64_t budget,
                             int steps) {
  return sim::simulate(model, trace_of(model, p, budget), node_of(p, budget), chunk_placement(p),
                       {.steps = steps})
      .report;
}

planner::Estimate estimated(const models::ModelSpec& model, const Plan& p, std::int64_t budget) {
  return planner::estimate(model, trace_of(model, p, budget), node_of(p, budget),
                           chunk_placement(p));
}

// The smallest device the chunks of the plan's stage fit (the planner's refusal below it).
std::int64_t smallest_budget(const models::ModelSpec& model, const Plan& p, int stage = 0) {
  std::int64_t lo = 1, hi = std::int64_t(1) << 40;  // lo refused, hi fits
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    try {
      schedule_of(model, p, mid, stage);
      hi = mid;
    } catch (const InputError&) {
      lo = mid;
    }
  }
  return hi;
}

// Three budgets per plan: the smallest that fits (the most evictions, every Adam on the host),
// a few chunks more, and every chunk with the state of some on the device (Adam there too).
std::vector<std::int64_t> budgets(const models::ModelSpec& model, const Plan& p) {
  const std::int64_t low = smallest_budget(model, p);
  const planner::ChunkSchedule s = schedule_of(model, p, low);
  const std::int64_t M = s.layout.move_bytes;
  const std::int64_t all = std::int64_t(s.layout.chunks()) * M + s.workspace_bytes;
  std::int64_t non_model = 0;
  for (const planner::ChunkMoment& k : s.moments)
    non_model = std::max(non_model, k.non_model_bytes);
  return {low, low + 2 * M, all + non_model + 2 * s.layout.os_chunk_bytes + 7};
}

struct Case {
  Schedule schedule;
  int b, m;
  std::int64_t chunk_bytes;
  bool untied;
};

// The same plan with and without chunks: the same losses and final weights, bit for bit, over
// several steps, for 1f1b, gpipe and dp, m = 1, 2 and 3, two chunk sizes (the largest tensor, 64
// KiB, and twice that), tied and untied, at three budgets; the measured peak is the planner's and
// the simulator's exactly and inside the budget; the bytes moved are the simulator's exactly.
TEST(ChunksExec, BitIdenticalPeakAndBytesAreThePlanners) {
  const int steps = 3;
  for (const Case& k :
       {Case{Schedule::one_f_one_b, 2, 1, 65536, false},
        Case{Schedule::one_f_one_b, 1, 3, 131072, false}, Case{Schedule::gpipe, 1, 3, 65536, false},
        Case{Schedule::gpipe, 2, 2, 131072, true}, Case{Schedule::one_f_one_b, 1, 3, 65536, true},
        Case{Schedule::dp, 2, 2, 65536, false}}) {
    const models::ModelSpec model = k.untied ? untied(testing::gpt_tiny(3)) : testing::gpt_tiny(3);
    const TrainResult plain =
        train_cpu(model, make_plan(model, k.schedule, k.b, k.m, -1), adamw_options(steps));
    const Plan p = make_plan(model, k.schedule, k.b, k.m, k.chunk_bytes);
    for (std::int64_t budget : budgets(model, p)) {
      SCOPED_TRACE(to_string(k.schedule) + " b=" + std::to_string(k.b) +
                   " m=" + std::to_string(k.m) + " chunk=" + std::to_string(k.chunk_bytes) +
                   (k.untied ? " untied" : " tied") + " budget=" + std::to_string(budget));
      const TrainResult r = train_cpu(model, p, adamw_options(steps, budget));
      expect_identical(r, plain);
      const planner::ChunkSchedule s = schedule_of(model, p, budget);
      const RankResult& got = r.ranks[0];
      EXPECT_LE(got.peak_memory_bytes, budget);
      EXPECT_EQ(got.peak_memory_bytes, s.device_peak_bytes);
      const planner::Estimate e = estimated(model, p, budget);
      EXPECT_EQ(got.memory.total(), e.report.devices[0].memory.total());
      EXPECT_EQ(got.memory.optimizer, e.report.devices[0].memory.optimizer);
      EXPECT_EQ(got.memory.workspace, e.report.devices[0].memory.workspace);
      EXPECT_EQ(got.memory.activations, e.report.devices[0].memory.activations);
      EXPECT_EQ(got.memory.weights + got.memory.gradients,
                e.report.devices[0].memory.weights + e.report.devices[0].memory.gradients);
      const planner::RunReport sim = simulated(model, p, budget, steps);
      EXPECT_EQ(got.peak_memory_bytes, sim.devices[0].memory.total());
      const common::Json& so = sim.extra["offload"];
      EXPECT_EQ(got.copy_out_bytes, steps * so["copy_out_bytes_per_step"].get<std::int64_t>());
      EXPECT_EQ(got.copy_in_bytes, steps * so["copy_in_bytes_per_step"].get<std::int64_t>());
      EXPECT_EQ(got.copy_out_bytes, steps * s.copy_out_bytes);
      EXPECT_EQ(got.copy_in_bytes, steps * s.copy_in_bytes);
      EXPECT_GT(got.copy_in_bytes, 0);  // chunks really moved
      // The host pool: the host-Adam chunks' m and v, and the chunks on the host, the planner's
      // count, except that a chunk on its way up is in both places until its upload has ended:
      // the planner's host peak plus, at most, a moment's uploads.
      const int n = s.layout.chunks();
      int most = n - s.device_adam_chunks;  // at the optimizer step
      for (const planner::ChunkMoment& mo : s.moments) {
        int up = 0;
        for (const planner::ChunkCopy& c : mo.copies)
          up += c.to_device ? 1 : 0;
        most = std::max(most, n - mo.resident + up);
      }
      EXPECT_EQ(got.host_peak_memory_bytes,
                (n - s.device_adam_chunks) * s.layout.os_chunk_bytes + most * s.layout.move_bytes);
      EXPECT_GE(got.host_peak_memory_bytes, s.host_peak_bytes);
      std::printf(
          "%s b=%d m=%d S_p=%lld budget=%lld: n=%d K=%d uploads=%d downloads=%d peak=%lld "
          "host %lld (planner %lld)\n",
          to_string(k.schedule).c_str(), k.b, k.m, (long long)k.chunk_bytes, (long long)budget,
          s.layout.chunks(), s.device_adam_chunks, s.uploads, s.downloads,
          (long long)got.peak_memory_bytes, (long long)got.host_peak_memory_bytes,
          (long long)s.host_peak_bytes);
      if (budget == budgets(model, p).front()) {
        EXPECT_EQ(s.device_adam_chunks, 0);
        EXPECT_GT(s.uploads, s.layout.chunks());  // evictions inside the step
      }
      if (budget == budgets(model, p).back()) {
        EXPECT_GT(s.device_adam_chunks, 0);  // Adam on the device too
      }
    }
  }
}

// Several more steps at the tightest budget, where every chunk goes down and comes back each
// step: still the same bits.
TEST(ChunksExec, ManyStepsAtTheTightestBudgetStayIdentical) {
  const models::ModelSpec model = testing::gpt_tiny(4);
  const Plan p = make_plan(model, Schedule::one_f_one_b, 2, 2, 65536);
  const TrainResult plain =
      train_cpu(model, make_plan(model, Schedule::one_f_one_b, 2, 2, -1), adamw_options(6));
  const std::int64_t budget = smallest_budget(model, p);
  const TrainResult r = train_cpu(model, p, adamw_options(6, budget));
  expect_identical(r, plain);
  EXPECT_EQ(r.ranks[0].peak_memory_bytes, schedule_of(model, p, budget).device_peak_bytes);
}

// Bad input: one line each, naming what does not fit and by how much (the planner's lines).
TEST(ChunksExec, BadInputIsOneLine) {
  const models::ModelSpec model = testing::gpt_tiny(3);
  const Plan p = make_plan(model, Schedule::one_f_one_b, 1, 1, 65536);
  const std::int64_t low = smallest_budget(model, p);
  std::string msg = testing::error_of([&] { train_cpu(model, p, adamw_options(2, low - 1)); });
  EXPECT_NE(msg.find("offload chunks: the device's "), std::string::npos) << msg;
  EXPECT_NE(msg.find("is smaller than the working set of the "), std::string::npos) << msg;
  EXPECT_NE(msg.find(") by 1 B"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  // A chunk smaller than the largest tensor (wte, fc, fc2: 16384 fp32 elements).
  const Plan small = make_plan(model, Schedule::one_f_one_b, 1, 1, 65532);
  msg = testing::error_of([&] { train_cpu(model, small, adamw_options(2, low)); });
  EXPECT_NE(msg.find("offload chunks: chunk size 65532 B (16383 elements of 4 B) is smaller than "
                     "tensor wte (16384 elements, 65536 B) by 4 B; use --chunk-size 65536 or more"),
            std::string::npos)
      << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  msg = testing::error_of([&] { train_cpu(model, p, adamw_options(2, 0)); });
  EXPECT_NE(msg.find("--offload chunks needs --device-memory BYTES"), std::string::npos) << msg;
  TrainOptions sgd = adamw_options(2, low);
  sgd.optimizer = "sgd";
  msg = testing::error_of([&] { train_cpu(model, p, sgd); });
  EXPECT_NE(msg.find("--offload chunks runs AdamW"), std::string::npos) << msg;
  // The CUDA executor's chunks need m > 1 (bf16 with m = 1: the gradient in its parameter's slot).
  msg = testing::error_of([&] { detail::prepare_run(model, p, adamw_options(2, low), "cuda"); });
  EXPECT_NE(msg.find("the cuda executor's offload chunks need m > 1"), std::string::npos) << msg;
  // t > 1: each device's shard is planned on its own device of the budget; one byte short of
  // the shard's working set is the same line.
  const Plan tp = make_plan(model, Schedule::one_f_one_b, 1, 1, 32768, 1, false, 1, 2);
  msg = testing::error_of(
      [&] { train_cpu(model, tp, adamw_options(2, smallest_budget(model, tp) - 1)); });
  EXPECT_NE(msg.find(") by 1 B"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  msg = testing::error_of([&] { detail::prepare_run(model, tp, adamw_options(2, low), "cuda"); });
  EXPECT_NE(msg.find("the cuda executor's offload chunks need m > 1"), std::string::npos) << msg;
}

// Checkpoints hold the same tensors as without chunks (the stage's weights, m and v, gathered
// from the chunks): a run stopped and resumed gives the bits of an unbroken one.
// Selective recompute runs on the CPU executor, with chunks too, and on the CUDA one (its layout
// without the probabilities; compile-checked only), not with activation offload nor on another
// backend: one line naming it.
TEST(ChunksExec, SelectiveRecomputeRefusalsAreOneLine) {
  const models::ModelSpec model = testing::gpt_tiny(2);
  auto expect_line = [](const std::string& msg, const std::string& want) {
    EXPECT_NE(msg.find(want), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  };
  Plan plain = make_plan(model, Schedule::one_f_one_b, 1, 2, -1);
  plain.recompute.assign(1, planner::Recompute::selective);
  EXPECT_NO_THROW(detail::prepare_run(model, plain, adamw_options(2), "cpu"));
  EXPECT_NO_THROW(detail::prepare_run(model, plain, adamw_options(2), "cuda"));
  expect_line(
      testing::error_of([&] { detail::prepare_run(model, plain, adamw_options(2), "tpu"); }),
      "the tpu executor recomputes whole stages (full), block by block (block) or "
      "nothing, not selective");
  StageSpec spec = detail::chunk_spec(model, plain, 0, 0);
  ASSERT_TRUE(spec.selective);
  // The CUDA layout keeps no probabilities: its stash is models' selective one, in bf16.
  const GptLayout cuda(spec, models::DType::bf16, "cuda");
  const GptLayout full_cuda(
      detail::chunk_spec(model, make_plan(model, Schedule::one_f_one_b, 1, 2, -1), 0, 0),
      models::DType::bf16, "cuda");
  EXPECT_LT(cuda.sizes(2).stash, full_cuda.sizes(2).stash);
  Plan chunks = make_plan(model, Schedule::one_f_one_b, 1, 2, 65536);
  chunks.recompute.assign(1, planner::Recompute::selective);
  EXPECT_NO_THROW(detail::prepare_run(model, chunks, adamw_options(2, 1 << 22), "cpu"));
  Plan swaps = plain;
  swaps.offload_activations = true;
  swaps.activations.assign(1, planner::ActivationChoice::swap);
  expect_line(
      testing::error_of([&] { detail::prepare_run(model, swaps, adamw_options(2), "cpu"); }),
      "selective recompute without activation offload only");
}

TEST(ChunksExec, ResumeIsBitIdentical) {
  const models::ModelSpec model = testing::gpt_tiny(3);
  for (Schedule s : {Schedule::one_f_one_b, Schedule::gpipe}) {
    SCOPED_TRACE(to_string(s));
    const Plan p = make_plan(model, s, 1, 3, 65536);
    const std::int64_t budget = smallest_budget(model, p) + 100000;
    testing::expect_resume_is_bit_identical(model, p, adamw_options(4, budget),
                                            "chunkexec_" + to_string(s));
  }
}

// Pipelines (d > 1): each stage plans its own chunks on its own device of --device-memory bytes.
// The smallest budget every stage fits (the largest of the stages' smallest).
std::int64_t pipeline_budget(const models::ModelSpec& model, const Plan& p) {
  std::int64_t budget = 0;
  for (int s = 0; s < p.d; ++s)
    budget = std::max(budget, smallest_budget(model, p, s));
  return budget;
}

// A budget holding every stage's chunks with room for the Adam state of two chunks beside them.
std::int64_t roomy_budget(const models::ModelSpec& model, const Plan& p) {
  std::int64_t budget = 0;
  for (int s = 0; s < p.d; ++s) {
    const planner::ChunkSchedule c = schedule_of(model, p, pipeline_budget(model, p), s);
    std::int64_t non_model = 0;
    for (const planner::ChunkMoment& k : c.moments)
      non_model = std::max(non_model, k.non_model_bytes);
    budget = std::max(budget, std::int64_t(c.layout.chunks()) * c.layout.move_bytes + non_model +
                                  2 * c.layout.os_chunk_bytes + 7);
  }
  return budget;
}

// One device's run against its stage's schedule and the simulator's report (its rank's entry of
// `ranks`, the report's per-rank offload figures, one device's): the measured peak inside the
// budget and the schedule's and the simulator's exactly; the bytes moved over `steps` the
// schedule's and the report's exactly.
void expect_device_is_predicted(const RankResult& got, const planner::ChunkSchedule& s,
                                const planner::RunReport& sim, const common::Json& ranks, int rank,
                                std::int64_t budget, int steps) {
  EXPECT_LE(got.peak_memory_bytes, budget);
  EXPECT_EQ(got.peak_memory_bytes, s.device_peak_bytes);
  EXPECT_EQ(got.peak_memory_bytes, sim.devices[std::size_t(rank)].memory.total());
  EXPECT_EQ(got.copy_out_bytes, steps * s.copy_out_bytes);
  EXPECT_EQ(got.copy_in_bytes, steps * s.copy_in_bytes);
  EXPECT_EQ(got.copy_out_bytes,
            steps * ranks[std::size_t(rank)]["copy_out_bytes_per_step"].get<std::int64_t>());
  EXPECT_EQ(got.copy_in_bytes,
            steps * ranks[std::size_t(rank)]["copy_in_bytes_per_step"].get<std::int64_t>());
}

struct PipeCase {
  Schedule schedule;
  int d, b, m;
  bool untied;
};

// Pipelines of d = 2 and 4 stages, gpipe and 1f1b, tied (the last stage's chunks hold the wte
// copy, which gets the weights stage 0's Adam made) and untied: the same losses and final weights
// as the plan without offload, bit for bit; each rank's measured peak is its stage's schedule peak
// and the simulator's exactly, inside the budget; each rank moves the bytes its stage's schedule
// and the simulator's rank move, exactly. At the tightest budget every stage evicts inside the
// step (1f1b with d = 4: its first two stages); at a roomy one some stage runs Adam on the device.
TEST(ChunksExec, PipelinesAreBitIdenticalWithEachStagesPeakAndBytes) {
  const int steps = 3;
  for (const PipeCase& k :
       {PipeCase{Schedule::gpipe, 2, 1, 3, false}, PipeCase{Schedule::one_f_one_b, 2, 1, 3, false},
        PipeCase{Schedule::gpipe, 2, 2, 2, true}, PipeCase{Schedule::one_f_one_b, 2, 1, 4, true},
        PipeCase{Schedule::one_f_one_b, 4, 1, 4, true},
        PipeCase{Schedule::gpipe, 4, 1, 4, false}}) {
    // Two blocks per stage: every stage evicts inside the step at the tightest budget.
    const models::ModelSpec model =
        k.untied ? untied(testing::gpt_tiny(2 * k.d)) : testing::gpt_tiny(2 * k.d);
    const TrainResult plain =
        train_cpu(model, make_plan(model, k.schedule, k.b, k.m, -1, k.d), adamw_options(steps));
    const Plan p = make_plan(model, k.schedule, k.b, k.m, 65536, k.d);
    const std::int64_t low = pipeline_budget(model, p), roomy = roomy_budget(model, p);
    for (std::int64_t budget : {low, low + 2 * 131072, roomy}) {
      SCOPED_TRACE(to_string(k.schedule) + " d=" + std::to_string(k.d) +
                   " b=" + std::to_string(k.b) + " m=" + std::to_string(k.m) +
                   (k.untied ? " untied" : " tied") + " budget=" + std::to_string(budget));
      const TrainResult r = train_cpu(model, p, adamw_options(steps, budget));
      expect_identical(r, plain);
      ASSERT_EQ(int(r.ranks.size()), k.d);
      const planner::RunReport sim = simulated(model, p, budget, steps);
      const common::Json& so = sim.extra["offload"]["ranks"];
      ASSERT_EQ(int(so.size()), k.d);
      int device_adam = 0;
      for (int stage = 0; stage < k.d; ++stage) {
        SCOPED_TRACE("stage " + std::to_string(stage));
        const int rank = p.rank_of(stage, 0);
        const RankResult& got = r.ranks[std::size_t(rank)];
        ASSERT_EQ(got.rank, rank);
        const planner::ChunkSchedule s = schedule_of(model, p, budget, stage);
        expect_device_is_predicted(got, s, sim, so, rank, budget, steps);
        // At the tightest budget every stage moves chunks, and evicts inside the step (more
        // uploads than chunks) except where 1f1b's later stages, holding d - s stashes of the
        // first stage's d under the same --device-memory, have room (d = 4: stages 2 and 3).
        if (budget == low) {
          EXPECT_GT(got.copy_in_bytes, 0);
          if (k.schedule == Schedule::gpipe || stage < k.d / 2) {
            EXPECT_GT(s.uploads, s.layout.chunks());
          }
        }
        device_adam += s.device_adam_chunks;
        std::printf(
            "%s d=%d m=%d %s budget=%lld stage %d: n=%d K=%d uploads=%d downloads=%d "
            "peak=%lld\n",
            to_string(k.schedule).c_str(), k.d, k.m, k.untied ? "untied" : "tied",
            (long long)budget, stage, s.layout.chunks(), s.device_adam_chunks, s.uploads,
            s.downloads, (long long)got.peak_memory_bytes);
      }
      if (budget == roomy) {
        EXPECT_GT(device_adam, 0);  // Adam on the device too
      }
    }
  }
}

// A budget one byte short of one stage's working set: the planner's line, naming that stage and
// by how much, from the executor. Here 1f1b's tightest stage is stage 0 (it holds the most
// stashes) and gpipe's stage 1: each names its own.
TEST(ChunksExec, PipelineBudgetTooSmallForOneStageIsOneLine) {
  std::set<int> named;
  for (Schedule schedule : {Schedule::one_f_one_b, Schedule::gpipe}) {
    const models::ModelSpec model = testing::gpt_tiny(4);
    const Plan p = make_plan(model, schedule, 1, 3, 65536, 2);
    const std::int64_t low0 = smallest_budget(model, p, 0), low1 = smallest_budget(model, p, 1);
    ASSERT_NE(low0, low1);
    const int tight = low1 > low0 ? 1 : 0;
    named.insert(tight);
    const std::string msg =
        testing::error_of([&] { train_cpu(model, p, adamw_options(2, std::max(low0, low1) - 1)); });
    EXPECT_NE(msg.find("offload chunks: stage " + std::to_string(tight) + ": the device's "),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find(") by 1 B"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    std::printf("%s: stage budgets %lld, %lld: %s\n", to_string(schedule).c_str(), (long long)low0,
                (long long)low1, msg.c_str());
  }
  EXPECT_EQ(named.size(), 2u);
}

// Pipelines resume bit-identically too: each rank's shard holds its stage's gathered chunks (the
// last stage's tied copy as zeros, taken from stage 0's shard on resume).
TEST(ChunksExec, PipelineResumeIsBitIdentical) {
  for (const PipeCase& k : {PipeCase{Schedule::one_f_one_b, 2, 1, 3, false},
                            PipeCase{Schedule::gpipe, 2, 1, 3, true}}) {
    SCOPED_TRACE(to_string(k.schedule));
    const models::ModelSpec model = k.untied ? untied(testing::gpt_tiny(4)) : testing::gpt_tiny(4);
    const Plan p = make_plan(model, k.schedule, k.b, k.m, 65536, k.d);
    testing::expect_resume_is_bit_identical(model, p,
                                            adamw_options(4, pipeline_budget(model, p) + 100000),
                                            "chunkexec_d2_" + to_string(k.schedule));
  }
}

// Chunks with full recompute (PatrickStar trains with activation checkpointing): a forward keeps
// only its stage input and runs its layers through one scratch, the recompute op before each
// backward re-makes the stash layer by layer, each of its layers after its own chunk copies. With
// block recompute (each layer's input kept, each layer re-made alone inside its own backward's
// moment, after that moment's copies) the recompute op has no moments. For d = 1 and 2, gpipe,
// 1f1b and dp, tied and untied, at the tightest and a roomy budget: losses and weights
// bit-identical to the same plan without offload (with recompute, itself bit-identical to the plan
// without it); each rank's measured peak is its stage's schedule peak and the simulator's exactly,
// inside the budget; the bytes moved are the schedule's and the simulator's. Recompute lets a
// smaller device hold the plan where several stashes were the peak (m = 3).
TEST(ChunksExec, RecomputeModesAreBitIdenticalWithEachStagesPeakAndBytes) {
  const int steps = 3;
  for (const planner::Recompute mode : {planner::Recompute::full, kBlock, kSelective})
    for (const PipeCase& k :
         {PipeCase{Schedule::gpipe, 1, 1, 3, false}, PipeCase{Schedule::one_f_one_b, 1, 2, 2, true},
          PipeCase{Schedule::dp, 1, 2, 2, false}, PipeCase{Schedule::gpipe, 2, 1, 3, true},
          PipeCase{Schedule::one_f_one_b, 2, 1, 4, false}}) {
      const bool block = mode == planner::Recompute::block;
      const int blocks = (block ? 4 : 2) * k.d;  // block: enough layers for a stage's inputs to add
      const models::ModelSpec model =
          k.untied ? untied(testing::gpt_tiny(blocks)) : testing::gpt_tiny(blocks);
      const TrainResult plain = train_cpu(
          model, make_plan(model, k.schedule, k.b, k.m, -1, k.d, mode), adamw_options(steps));
      expect_identical(plain, train_cpu(model, make_plan(model, k.schedule, k.b, k.m, -1, k.d),
                                        adamw_options(steps)));
      const Plan p = make_plan(model, k.schedule, k.b, k.m, 65536, k.d, mode);
      const std::int64_t low = pipeline_budget(model, p), roomy = roomy_budget(model, p);
      const std::int64_t without =
          pipeline_budget(model, make_plan(model, k.schedule, k.b, k.m, 65536, k.d));
      const std::int64_t full =
          pipeline_budget(model, make_plan(model, k.schedule, k.b, k.m, 65536, k.d, true));
      for (std::int64_t budget : {low, roomy}) {
        SCOPED_TRACE(to_string(mode) + " " + to_string(k.schedule) + " d=" + std::to_string(k.d) +
                     " b=" + std::to_string(k.b) + " m=" + std::to_string(k.m) +
                     (k.untied ? " untied" : " tied") + " budget=" + std::to_string(budget));
        const TrainResult r = train_cpu(model, p, adamw_options(steps, budget));
        expect_identical(r, plain);
        const planner::RunReport sim = simulated(model, p, budget, steps);
        const planner::Estimate e = estimated(model, p, budget);
        for (int stage = 0; stage < k.d; ++stage) {
          SCOPED_TRACE("stage " + std::to_string(stage));
          const int rank = p.rank_of(stage, 0);
          const RankResult& got = r.ranks[std::size_t(rank)];
          const planner::ChunkSchedule s = schedule_of(model, p, budget, stage);
          // Full: each backward has its recompute op's moments, one per layer. Block: none; each
          // backward moment re-makes its layer but the embedding. Selective: none; each block's
          // backward moment takes its attention core (b x heads x T x T floats) back.
          const bool selective = mode == kSelective;
          const std::int64_t core = std::int64_t(k.b) * model.heads * model.seq_len *
                                    model.seq_len * std::int64_t(sizeof(float));
          int again = 0, remade = 0;
          for (const planner::ChunkMoment& mo : s.moments) {
            again += mo.recompute ? 1 : 0;
            remade += mo.remake ? 1 : 0;
            EXPECT_EQ(mo.remake, block && mo.backward && mo.kind != models::LayerKind::embedding);
            if (selective && mo.backward) {
              EXPECT_EQ(mo.alloc_bytes, mo.kind == models::LayerKind::block ? core : 0);
            }
          }
          EXPECT_EQ(again, block || selective ? 0 : k.m * s.layout.layers());
          EXPECT_EQ(remade, block ? k.m * (s.layout.layers() - (stage == 0 ? 1 : 0)) : 0);
          EXPECT_LE(got.peak_memory_bytes, budget);
          EXPECT_EQ(got.peak_memory_bytes, s.device_peak_bytes);
          EXPECT_EQ(got.peak_memory_bytes, sim.devices[std::size_t(rank)].memory.total());
          EXPECT_EQ(got.memory.activations, e.report.devices[std::size_t(rank)].memory.activations);
          EXPECT_EQ(got.copy_out_bytes, steps * s.copy_out_bytes);
          EXPECT_EQ(got.copy_in_bytes, steps * s.copy_in_bytes);
          if (budget == low) {
            EXPECT_GT(got.copy_in_bytes, 0);
          }
          std::printf(
              "%s %s d=%d m=%d budget=%lld (without recompute %lld, full %lld) stage %d: n=%d K=%d "
              "uploads=%d peak=%lld at %s\n",
              to_string(mode).c_str(), to_string(k.schedule).c_str(), k.d, k.m, (long long)budget,
              (long long)without, (long long)full, stage, s.layout.chunks(), s.device_adam_chunks,
              s.uploads, (long long)got.peak_memory_bytes,
              s.moments[std::size_t(s.peak_moment)].label(s.layout).c_str());
        }
        const common::Json& so = sim.extra["offload"];
        const common::Json& ranks = k.d > 1 ? so["ranks"] : common::Json::array({so});
        for (int rank = 0; rank < k.d; ++rank) {
          EXPECT_EQ(
              r.ranks[std::size_t(rank)].copy_out_bytes,
              steps * ranks[std::size_t(rank)]["copy_out_bytes_per_step"].get<std::int64_t>());
          EXPECT_EQ(r.ranks[std::size_t(rank)].copy_in_bytes,
                    steps * ranks[std::size_t(rank)]["copy_in_bytes_per_step"].get<std::int64_t>());
        }
      }
      if (k.schedule == Schedule::gpipe) {
        EXPECT_LT(low, without);  // m stashes were the peak; now m kept inputs and one stash
      }
      if (block) {
        EXPECT_LT(low, full);  // one layer re-made at a time, not the stage's whole stash
      }
    }
}

struct DpCase {
  Schedule schedule;
  int d, w, b, m;
  bool untied;
  Rc recompute;
};

// Data parallelism (w > 1): every replica holds every chunk; each chunk step reduce-scatters the
// chunk's gradient over the stage's replicas, steps the replica's part (its Adam state only) and
// all-gathers the parameters. The same losses and weights as the plan without offload (plain
// data parallelism: an all-reduce's sums, in group order, are the reduce-scatter's), bit for bit;
// each rank's measured peak is its stage's schedule peak and the simulator's exactly, inside the
// budget (the device-Adam chunks' state a w-th of w = 1's); the bytes moved are the schedule's
// and the simulator's; the host holds a w-th of the host-Adam chunks' state.
TEST(ChunksExec, DataParallelShardsTheOptimizerStateBitIdentical) {
  const int steps = 3;
  for (const DpCase& k : {DpCase{Schedule::gpipe, 1, 2, 1, 3, false, false},
                          DpCase{Schedule::one_f_one_b, 1, 2, 2, 2, true, false},
                          DpCase{Schedule::dp, 1, 3, 2, 1, false, false},
                          DpCase{Schedule::one_f_one_b, 1, 2, 1, 2, false, true},
                          DpCase{Schedule::one_f_one_b, 2, 2, 1, 3, true, false},
                          DpCase{Schedule::one_f_one_b, 2, 2, 1, 3, false, false},
                          DpCase{Schedule::gpipe, 2, 3, 1, 2, false, true},
                          DpCase{Schedule::one_f_one_b, 2, 2, 1, 3, true, kBlock}}) {
    // d = 2 tied: the last stage's replicas reduce-scatter the head's copy's gradient, send their
    // shards, stage 0's replicas gather them and add them in the wte chunk's step.
    const bool untie = k.untied;
    const models::ModelSpec model =
        untie ? untied(testing::gpt_tiny(2 * k.d)) : testing::gpt_tiny(2 * k.d);
    const TrainResult plain =
        train_cpu(model, make_plan(model, k.schedule, k.b, k.m, -1, k.d, k.recompute, k.w),
                  adamw_options(steps));
    const Plan p = make_plan(model, k.schedule, k.b, k.m, 65536, k.d, k.recompute, k.w);
    const std::int64_t low = pipeline_budget(model, p), roomy = roomy_budget(model, p);
    for (std::int64_t budget : {low, roomy}) {
      SCOPED_TRACE(to_string(k.schedule) + " d=" + std::to_string(k.d) +
                   " w=" + std::to_string(k.w) + " b=" + std::to_string(k.b) +
                   " m=" + std::to_string(k.m) + (untie ? " untied" : " tied") +
                   rc_name(k.recompute) + " budget=" + std::to_string(budget));
      const TrainResult r = train_cpu(model, p, adamw_options(steps, budget));
      expect_identical(r, plain);
      ASSERT_EQ(int(r.ranks.size()), k.d * k.w);
      const planner::RunReport sim = simulated(model, p, budget, steps);
      const common::Json& so = sim.extra["offload"];
      const common::Json& ranks = p.ranks() > 1 ? so["ranks"] : common::Json::array({so});
      ASSERT_EQ(int(ranks.size()), p.ranks());
      for (int rank = 0; rank < p.ranks(); ++rank) {
        SCOPED_TRACE("rank " + std::to_string(rank));
        const int stage = p.stage_of(rank);
        const RankResult& got = r.ranks[std::size_t(rank)];
        const planner::ChunkSchedule s = schedule_of(model, p, budget, stage);
        EXPECT_EQ(s.layout.replicas, k.w);
        EXPECT_EQ(s.layout.os_chunk_bytes,
                  8 * ((s.layout.chunk_elements + k.w - 1) / k.w));  // fp32: m and v
        expect_device_is_predicted(got, s, sim, ranks, rank, budget, steps);
        EXPECT_EQ(got.memory.optimizer,
                  std::int64_t(s.device_adam_chunks) * s.layout.os_chunk_bytes);
        EXPECT_GE(got.host_peak_memory_bytes, s.host_peak_bytes);
        if (budget == low) {
          EXPECT_GT(got.copy_in_bytes, 0);
          EXPECT_EQ(s.device_adam_chunks, 0);
        }
        // The parts cover each chunk's stepped elements once.
        for (int c = 0; c < s.layout.chunks(); ++c) {
          const std::vector<std::int64_t> bounds = s.layout.shard_bounds(c);
          ASSERT_EQ(int(bounds.size()), k.w + 1);
          EXPECT_EQ(bounds.front(), 0);
          EXPECT_EQ(bounds.back(), s.layout.chunk_owned[std::size_t(c)]);
        }
        std::printf(
            "%s d=%d w=%d m=%d budget=%lld rank %d: n=%d K=%d S_os=%lld peak=%lld host %lld\n",
            to_string(k.schedule).c_str(), k.d, k.w, k.m, (long long)budget, rank,
            s.layout.chunks(), s.device_adam_chunks, (long long)s.layout.os_chunk_bytes,
            (long long)got.peak_memory_bytes, (long long)got.host_peak_memory_bytes);
      }
      if (budget == roomy) {
        EXPECT_GT(schedule_of(model, p, budget, 0).device_adam_chunks, 0);
      }
    }
  }
}

struct TpCase {
  Schedule schedule;
  int t, d, b, m;
  bool sp, untied;
  Rc recompute;
  int w = 1;
};

// Tensor parallelism (t > 1): each device of a TP group lays out and moves its own shard's chunks
// (planner::model_tensors at t) and runs its layers' TP collectives between its chunk moments.
// The same losses and final weights as the same TP plan without offload, bit for bit; each
// device's measured peak is its stage's schedule peak (planned at t) and the simulator's exactly,
// inside the budget; each device moves its schedule's and the simulator's bytes exactly. (2bw with
// t > 1: TwoBwIsBitIdenticalWithEachStagesPeakAndBytes.)
TEST(ChunksExec, TensorParallelShardsAreBitIdenticalWithEachDevicesPeakAndBytes) {
  const int steps = 3;
  for (const TpCase& k : {TpCase{Schedule::one_f_one_b, 2, 1, 2, 2, false, false, false},
                          TpCase{Schedule::gpipe, 4, 1, 1, 3, false, true, false},
                          TpCase{Schedule::one_f_one_b, 2, 2, 1, 3, true, false, false},
                          TpCase{Schedule::gpipe, 2, 2, 1, 2, false, true, true},
                          TpCase{Schedule::one_f_one_b, 2, 1, 1, 2, false, false, false, 2},
                          TpCase{Schedule::gpipe, 2, 2, 1, 3, true, false, false, 2},
                          TpCase{Schedule::one_f_one_b, 2, 2, 1, 2, false, false, true, 2},
                          TpCase{Schedule::one_f_one_b, 2, 2, 1, 2, false, false, kBlock},
                          TpCase{Schedule::gpipe, 2, 1, 1, 3, false, true, kBlock, 2},
                          TpCase{Schedule::gpipe, 2, 2, 1, 2, true, false, kBlock},
                          TpCase{Schedule::one_f_one_b, 2, 2, 1, 2, false, true, kSelective},
                          TpCase{Schedule::gpipe, 2, 1, 1, 3, true, false, kSelective, 2}}) {
    const models::ModelSpec model =
        k.untied ? untied(testing::gpt_tiny(2 * k.d)) : testing::gpt_tiny(2 * k.d);
    const TrainResult plain = train_cpu(
        model, make_plan(model, k.schedule, k.b, k.m, -1, k.d, k.recompute, k.w, k.t, k.sp),
        adamw_options(steps));
    const Plan p = make_plan(model, k.schedule, k.b, k.m, 32768, k.d, k.recompute, k.w, k.t, k.sp);
    const std::int64_t low = pipeline_budget(model, p), roomy = roomy_budget(model, p);
    for (std::int64_t budget : {low, roomy}) {
      SCOPED_TRACE(to_string(k.schedule) + " t=" + std::to_string(k.t) + (k.sp ? " sp" : "") +
                   " w=" + std::to_string(k.w) + " d=" + std::to_string(k.d) +
                   " b=" + std::to_string(k.b) + " m=" + std::to_string(k.m) +
                   (k.untied ? " untied" : " tied") + rc_name(k.recompute) +
                   " budget=" + std::to_string(budget));
      const TrainResult r = train_cpu(model, p, adamw_options(steps, budget));
      expect_identical(r, plain);
      ASSERT_EQ(int(r.ranks.size()), k.d * k.w * k.t);
      const planner::RunReport sim = simulated(model, p, budget, steps);
      const common::Json& so = sim.extra["offload"];
      const common::Json& ranks = so["ranks"];
      ASSERT_EQ(int(ranks.size()), p.ranks());
      std::int64_t out = 0;
      for (const RankResult& got : r.ranks)
        out += got.copy_out_bytes;
      EXPECT_EQ(out, steps * so["copy_out_bytes_per_step"].get<std::int64_t>());
      for (int device = 0; device < p.ranks() * k.t; ++device) {
        SCOPED_TRACE("device " + std::to_string(device));
        const int rank = device / k.t, stage = p.stage_of(rank);
        const RankResult& got = r.ranks[std::size_t(device)];
        const planner::ChunkSchedule s = schedule_of(model, p, budget, stage);
        // The report's per-rank figures are one device's; its totals the t devices' of each rank.
        expect_device_is_predicted(got, s, sim, ranks, rank, budget, steps);
        if (budget == low) {
          EXPECT_GT(got.copy_in_bytes, 0);
          EXPECT_EQ(s.device_adam_chunks, 0);
        }
        std::printf("%s t=%d%s d=%d m=%d budget=%lld device %d: n=%d K=%d uploads=%d peak=%lld\n",
                    to_string(k.schedule).c_str(), k.t, k.sp ? " sp" : "", k.d, k.m,
                    (long long)budget, device, s.layout.chunks(), s.device_adam_chunks, s.uploads,
                    (long long)got.peak_memory_bytes);
      }
      if (budget == roomy) {
        EXPECT_GT(schedule_of(model, p, budget, 0).device_adam_chunks, 0);
      }
    }
  }
}

// With w > 1 a checkpoint holds the whole state (each replica's parts all-gathered), as without
// chunks: a run stopped and resumed gives the bits of an unbroken one.
TEST(ChunksExec, DataParallelResumeIsBitIdentical) {
  const models::ModelSpec model = testing::gpt_tiny(3);
  const Plan p = make_plan(model, Schedule::one_f_one_b, 1, 2, 65536, 1, false, 2);
  testing::expect_resume_is_bit_identical(
      model, p, adamw_options(4, pipeline_budget(model, p) + 100000), "chunkexec_w2");
  // With t = 2 too: each TP index's replicas gather their own shard's state for the checkpoint.
  const Plan tp = make_plan(model, Schedule::one_f_one_b, 1, 2, 32768, 1, false, 2, 2);
  testing::expect_resume_is_bit_identical(
      model, tp, adamw_options(4, pipeline_budget(model, tp) + 100000), "chunkexec_w2_t2");
}

// Replicas taking turns on one core (--pin-cores, --core-turns) wait for each other in a chunk
// step's collectives without holding the core: with each chunk's state on the device (a roomy
// budget: Adam on the rank's thread) and on the host, the same bits as plain data parallelism.
// (Until the collectives let go of the core, the device-Adam case hung.)
TEST(ChunksExec, DataParallelReplicasTakingTurnsOnOneCore) {
  const models::ModelSpec model = testing::gpt_tiny(2);
  const Plan p = make_plan(model, Schedule::one_f_one_b, 1, 2, 65536, 1, false, 2);
  const TrainResult plain = train_cpu(
      model, make_plan(model, Schedule::one_f_one_b, 1, 2, -1, 1, false, 2), adamw_options(3));
  for (std::int64_t budget : {pipeline_budget(model, p), roomy_budget(model, p)}) {
    SCOPED_TRACE("budget " + std::to_string(budget));
    TrainOptions o = adamw_options(3, budget);
    o.cores.assign(2, allowed_cores().front());
    o.core_turns = true;
    expect_identical(train_cpu(model, p, o), plain);
  }
  EXPECT_GT(schedule_of(model, p, roomy_budget(model, p)).device_adam_chunks, 0);
}

// With w > 1 and tied embeddings across stages the exchange runs shard by shard; a checkpoint
// holds the last stage's copy as without chunks: a resumed run gives the bits of an unbroken one.
TEST(ChunksExec, DataParallelTiedPipelineResumeIsBitIdentical) {
  const models::ModelSpec model = testing::gpt_tiny(4);
  const Plan p = make_plan(model, Schedule::one_f_one_b, 1, 2, 65536, 2, false, 2);
  testing::expect_resume_is_bit_identical(
      model, p, adamw_options(4, pipeline_budget(model, p) + 100000), "chunkexec_w2_d2_tied");
}

// 2bw with chunks (docs/formulas.md section 9, chunks with 2bw): each chunk holds the two live
// weight versions and its gradient as three parts that move on their own, and each segment of the
// stream between optimizer steps runs its own plan from the same fixed point. d = 1, 2 and 4,
// tied and untied, w = 1 and 2, at the tightest budget and a roomy one: losses and final weights
// bit-identical to 2bw without offload (W(t+1) = W(t) - lr step(g(W(t-1)))); each rank's measured
// peak is the largest of its stage's segments in the run, inside the budget, and the simulator's;
// the bytes moved are the run's segments' plans' and the simulator's, exactly.
struct TwoBwCase {
  int d, m, w;
  bool untied;
  int t = 1;
  Rc recompute = false;
  bool shard = false;  // sharded chunks (Plan::chunk_shard)
};

// The bytes a rank's plan moves over a run of `steps` from step 0, each way, and its peak: the
// segments' (fill, steady ones, last). Sharded chunks: replica `replica`'s part of a version's
// slot up, nothing for a drop or a gradient's zero fill, the gradient's part down at the step.
struct RunFigures {
  std::int64_t out = 0, in = 0, peak = 0;
};
RunFigures run_figures(const planner::ChunkSchedule& s, int steps, int replica = 0) {
  const planner::ChunkLayout& L = s.layout;
  const auto [pb, pe] = L.part(replica);
  const std::int64_t part = (pe - pb) * std::int64_t(sizeof(float));
  RunFigures f;
  for (int t = 0; t < steps; ++t) {
    const auto g = std::size_t(planner::chunk_segment(0, steps, t));
    const planner::ChunkSegmentPlan& seg = s.segments.at(g);
    for (const planner::ChunkMoment& m : seg.moments)
      for (const planner::ChunkCopy& c : m.copies)
        (c.to_device ? f.in : f.out) += !c.part                                 ? L.move_bytes
                                        : c.to_device && L.version_unit(c.unit) ? part
                                                                                : 0;
    for (int u = 0; u < L.units(); ++u)
      if (seg.adam_download[std::size_t(u)])
        f.out += !L.is_sharded(u / L.parts) ? L.move_bytes : L.version_unit(u) ? 0 : part;
    f.peak = std::max(f.peak, seg.device_peak_bytes);
  }
  return f;
}

TEST(ChunksExec, TwoBwIsBitIdenticalWithEachStagesPeakAndBytes) {
  const int steps = 4;
  for (const TwoBwCase& k :
       {TwoBwCase{1, 2, 1, false}, TwoBwCase{2, 3, 1, true}, TwoBwCase{2, 2, 1, false},
        TwoBwCase{4, 4, 1, true}, TwoBwCase{2, 2, 2, true}, TwoBwCase{2, 2, 1, false, 2},
        TwoBwCase{1, 3, 1, true, 4}, TwoBwCase{1, 2, 2, false, 2},
        TwoBwCase{2, 3, 1, true, 1, kBlock}, TwoBwCase{1, 2, 2, false, 2, kBlock},
        TwoBwCase{1, 2, 2, false, 1, false, true}, TwoBwCase{1, 3, 3, true, 1, false, true},
        TwoBwCase{2, 2, 2, true, 1, false, true}, TwoBwCase{2, 3, 2, false, 1, kBlock, true},
        TwoBwCase{2, 3, 1, false, 1, kSelective}, TwoBwCase{1, 2, 2, true, 1, kSelective, true}}) {
    const models::ModelSpec model =
        k.untied ? untied(testing::gpt_tiny(2 * k.d)) : testing::gpt_tiny(2 * k.d);
    const TrainResult plain =
        train_cpu(model, make_plan(model, Schedule::two_bw, 1, k.m, -1, k.d, k.recompute, k.w, k.t),
                  adamw_options(steps));
    Plan p = make_plan(model, Schedule::two_bw, 1, k.m, k.t > 1 ? 32768 : 65536, k.d, k.recompute,
                       k.w, k.t);
    p.chunk_shard = k.shard;
    planner::check(p);
    const std::int64_t low = pipeline_budget(model, p);
    std::int64_t roomy = 0;  // every part of every stage's chunks, and two chunks' Adam state
    for (int s = 0; s < k.d; ++s) {
      const planner::ChunkSchedule c = schedule_of(model, p, low, s);
      std::int64_t non_model = 0;
      for (const planner::ChunkSegmentPlan& g : c.segments)
        for (const planner::ChunkMoment& mo : g.moments)
          non_model = std::max(non_model, mo.non_model_bytes);
      roomy = std::max(roomy, std::int64_t(c.layout.units()) * c.layout.move_bytes + non_model +
                                  2 * c.layout.os_chunk_bytes + 7);
    }
    for (std::int64_t budget : {low, roomy}) {
      SCOPED_TRACE(fmt::format("2bw d={} m={} w={} t={} {}{}{} budget={}", k.d, k.m, k.w, k.t,
                               k.untied ? "untied" : "tied", rc_name(k.recompute),
                               k.shard ? " sharded" : "", budget));
      const TrainResult r = train_cpu(model, p, adamw_options(steps, budget));
      expect_identical(r, plain);
      const planner::RunReport sim = simulated(model, p, budget, steps);
      int device_adam = 0;
      // Each device of a rank's TP group (t > 1) runs its own shard's plan of the same shape.
      for (int device = 0; device < p.ranks() * k.t; ++device) {
        const int rank = device / k.t, stage = p.stage_of(rank);
        SCOPED_TRACE("device " + std::to_string(device));
        const RankResult& got = r.ranks[std::size_t(device)];
        const planner::ChunkSchedule s = schedule_of(model, p, budget, stage);
        EXPECT_EQ(s.layout.parts, 3);
        const RunFigures f = run_figures(s, steps, p.replica_of(rank));
        EXPECT_LE(got.peak_memory_bytes, budget);
        EXPECT_EQ(got.peak_memory_bytes, f.peak);
        EXPECT_EQ(got.peak_memory_bytes, sim.devices[std::size_t(rank)].memory.total());
        EXPECT_EQ(got.copy_out_bytes, f.out);
        EXPECT_EQ(got.copy_in_bytes, f.in);
        // The simulator's per-step bytes are a steady segment's: the schedule's figures (one
        // device's of the rank's TP group).
        // Sharded: replica 0's part is P; another's may be shorter when w does not divide a chunk.
        const common::Json& sr = sim.extra["offload"]["ranks"][std::size_t(rank)];
        if (!k.shard || p.replica_of(rank) == 0 || s.layout.chunk_elements % k.w == 0) {
          EXPECT_EQ(sr["copy_out_bytes_per_step"].get<std::int64_t>(), s.copy_out_bytes);
          EXPECT_EQ(sr["copy_in_bytes_per_step"].get<std::int64_t>(), s.copy_in_bytes);
          // And the executor's, over its steady segments (what validate compares).
          EXPECT_EQ((got.copy_out_bytes - got.edge_copy_out_bytes) / (steps - 2), s.copy_out_bytes);
          EXPECT_EQ((got.copy_in_bytes - got.edge_copy_in_bytes) / (steps - 2), s.copy_in_bytes);
        }
        if (budget == low) {
          EXPECT_GT(got.copy_in_bytes, 0);
        }
        if (k.shard && budget == low) {  // parts and zero fills: fewer bytes than whole chunks
          Plan whole = p;
          whole.chunk_shard = false;
          const RunFigures a = run_figures(schedule_of(model, whole, budget, stage), steps);
          EXPECT_GT(s.part_uploads, 0);
          EXPECT_GT(s.zero_fills, 0);
          EXPECT_LT(got.copy_in_bytes, a.in);
          EXPECT_LT(got.copy_out_bytes, a.out);
        }
        device_adam += s.device_adam_chunks;
        std::printf(
            "2bw d=%d m=%d w=%d budget=%lld rank %d: n=%d K=%d uploads=%d downloads=%d "
            "peak=%lld moved in %lld out %lld\n",
            k.d, k.m, k.w, (long long)budget, rank, s.layout.chunks(), s.device_adam_chunks,
            s.uploads, s.downloads, (long long)got.peak_memory_bytes, (long long)got.copy_in_bytes,
            (long long)got.copy_out_bytes);
      }
      if (budget == roomy) {
        EXPECT_GT(device_adam, 0);  // Adam on the device too
      }
    }
  }
}

// 2bw with chunks resumes bit-identically: a checkpoint holds both live versions, each gathered
// from its part of the chunks, and a resumed run fills the pipeline again with its own segment
// plan.
TEST(ChunksExec, TwoBwResumeIsBitIdentical) {
  for (const TwoBwCase& k :
       {TwoBwCase{1, 2, 1, false}, TwoBwCase{2, 2, 1, true}, TwoBwCase{2, 2, 2, true},
        TwoBwCase{2, 2, 1, false, 2}, TwoBwCase{2, 2, 2, true, 2},
        TwoBwCase{1, 2, 2, false, 1, false, true}, TwoBwCase{2, 2, 2, true, 1, false, true}}) {
    SCOPED_TRACE(fmt::format("d={} w={} t={}{}", k.d, k.w, k.t, k.shard ? " sharded" : ""));
    const models::ModelSpec model =
        k.untied ? untied(testing::gpt_tiny(2 * k.d)) : testing::gpt_tiny(2 * k.d);
    Plan p =
        make_plan(model, Schedule::two_bw, 1, k.m, k.t > 1 ? 32768 : 65536, k.d, false, k.w, k.t);
    p.chunk_shard = k.shard;
    planner::check(p);
    testing::expect_resume_is_bit_identical(
        model, p, adamw_options(5, pipeline_budget(model, p)),
        fmt::format("chunkexec_2bw_d{}_w{}_t{}{}", k.d, k.w, k.t, k.shard ? "_shard" : ""));
  }
}

// Sharded chunks (Plan::chunk_shard): each replica's host holds its part of each host chunk's
// parameters; a chunk without a gradient is dropped and comes back as the replica's part and an
// all-gather; at the step its gradient is reduce-scattered on the device and only the part comes
// down. The same losses and final weights as the plan without offload, bit for bit (gpipe, 1f1b,
// dp; d = 1 and 2, tied: the wte chunks stay whole; full recompute); each rank's measured peak is
// its schedule's and the simulator's exactly, inside the budget; each rank moves its schedule's
// and the simulator's bytes exactly, fewer than with whole chunks.
TEST(ChunksExec, ShardedChunksAreBitIdenticalWithEachRanksPeakAndBytes) {
  const int steps = 3;
  for (const DpCase& k : {DpCase{Schedule::gpipe, 1, 2, 1, 3, false, false},
                          DpCase{Schedule::one_f_one_b, 1, 2, 2, 2, true, false},
                          DpCase{Schedule::dp, 1, 3, 1, 1, false, false},
                          DpCase{Schedule::one_f_one_b, 1, 2, 1, 2, false, true},
                          DpCase{Schedule::one_f_one_b, 2, 2, 1, 3, false, false},
                          DpCase{Schedule::gpipe, 2, 2, 1, 2, true, true},
                          DpCase{Schedule::gpipe, 2, 2, 1, 2, true, kBlock},
                          DpCase{Schedule::one_f_one_b, 1, 2, 1, 2, false, kBlock}}) {
    const models::ModelSpec model =
        k.untied ? untied(testing::gpt_tiny(2 * k.d)) : testing::gpt_tiny(2 * k.d);
    const TrainResult plain =
        train_cpu(model, make_plan(model, k.schedule, k.b, k.m, -1, k.d, k.recompute, k.w),
                  adamw_options(steps));
    const Plan whole = make_plan(model, k.schedule, k.b, k.m, 65536, k.d, k.recompute, k.w);
    Plan p = whole;
    p.chunk_shard = true;
    planner::check(p);
    const std::int64_t low = pipeline_budget(model, p), roomy = roomy_budget(model, p);
    for (std::int64_t budget : {low, low + 2 * 131072, roomy}) {
      SCOPED_TRACE(to_string(k.schedule) + " d=" + std::to_string(k.d) +
                   " w=" + std::to_string(k.w) + " m=" + std::to_string(k.m) +
                   (k.untied ? " untied" : " tied") + rc_name(k.recompute) +
                   " budget=" + std::to_string(budget));
      const TrainResult r = train_cpu(model, p, adamw_options(steps, budget));
      expect_identical(r, plain);
      ASSERT_EQ(int(r.ranks.size()), k.d * k.w);
      const planner::RunReport sim = simulated(model, p, budget, steps);
      const common::Json& so = sim.extra["offload"];
      const common::Json& ranks = p.ranks() > 1 ? so["ranks"] : common::Json::array({so});
      for (int rank = 0; rank < p.ranks(); ++rank) {
        SCOPED_TRACE("rank " + std::to_string(rank));
        const planner::ChunkSchedule s = schedule_of(model, p, budget, p.stage_of(rank));
        const planner::ChunkSchedule a = schedule_of(model, whole, budget, p.stage_of(rank));
        const RankResult& got = r.ranks[std::size_t(rank)];
        EXPECT_GT(s.layout.part_bytes, 0);
        // Replica 0's part is P; another's may be shorter when w does not divide a chunk.
        if (p.replica_of(rank) == 0 || s.layout.chunk_elements % k.w == 0)
          expect_device_is_predicted(got, s, sim, ranks, rank, budget, steps);
        if (budget == low) {
          EXPECT_GT(s.part_uploads, 0);
          EXPECT_LT(got.copy_in_bytes, steps * a.copy_in_bytes);
        }
        EXPECT_LE(got.copy_out_bytes, steps * a.copy_out_bytes);
        std::printf(
            "%s d=%d w=%d m=%d budget=%lld rank %d: parts up %d down %d, drops %d, "
            "in %lld out %lld (whole chunks %lld %lld)\n",
            to_string(k.schedule).c_str(), k.d, k.w, k.m, (long long)budget, rank, s.part_uploads,
            s.part_downloads, s.drops, (long long)got.copy_in_bytes, (long long)got.copy_out_bytes,
            (long long)(steps * a.copy_in_bytes), (long long)(steps * a.copy_out_bytes));
      }
    }
  }
}

// A checkpoint of sharded chunks gathers the replicas' parts: a resumed run gives the bits of an
// unbroken one (d = 1, and d = 2 with tied embeddings).
TEST(ChunksExec, ShardedChunksResumeIsBitIdentical) {
  for (int d : {1, 2}) {
    const models::ModelSpec model = testing::gpt_tiny(2 * d);
    Plan p = make_plan(model, Schedule::one_f_one_b, 1, 2, 65536, d, false, 2);
    p.chunk_shard = true;
    planner::check(p);
    testing::expect_resume_is_bit_identical(model, p,
                                            adamw_options(4, pipeline_budget(model, p) + 100000),
                                            fmt::format("chunkexec_shard_d{}", d));
  }
}

// Replicas taking turns on one core wait for each other in a part upload's all-gather and a part
// download's reduce-scatter without holding the core: the same bits as plain data parallelism.
TEST(ChunksExec, ShardedChunksWithReplicasTakingTurnsOnOneCore) {
  const models::ModelSpec model = testing::gpt_tiny(2);
  Plan p = make_plan(model, Schedule::one_f_one_b, 1, 2, 65536, 1, false, 2);
  p.chunk_shard = true;
  const TrainResult plain = train_cpu(
      model, make_plan(model, Schedule::one_f_one_b, 1, 2, -1, 1, false, 2), adamw_options(3));
  TrainOptions o = adamw_options(3, pipeline_budget(model, p));
  o.cores.assign(2, allowed_cores().front());
  o.core_turns = true;
  expect_identical(train_cpu(model, p, o), plain);
}

// Interleaving (Megatron's schedule, v = 2 model chunks per device): each device's chunks hold its
// model chunks' tensors one after the other (the last stage's tied copy last), each compute op
// runs its model chunk's layers with that model chunk's moments, and the tied exchange works on
// the model chunks holding the two ends. d = 2 and 4, tied and untied, and d = 1 (its model chunks'
// hand-overs held as pipeline messages; tied, the layout's one wte is both ends', whose gradients
// the executor without chunks adds in the same order), without recompute, with
// full and block recompute, and over two replicas with whole and sharded chunks: losses and
// weights bit-identical to the same interleaved plan without offload; each rank's measured peak is
// its stage's schedule peak and the simulator's exactly, inside the budget; the bytes moved are the
// schedule's and the simulator's. At the tightest budget every stage evicts inside the step.
struct InterleavedCase {
  int d, w, m;
  Rc recompute;
  bool untied, shard;
};

TEST(ChunksExec, InterleavedIsBitIdenticalWithEachRanksPeakAndBytes) {
  const int steps = 3, v = 2;
  for (const InterleavedCase& k :
       {InterleavedCase{1, 1, 2, false, true, false}, InterleavedCase{1, 1, 4, true, true, false},
        InterleavedCase{1, 2, 2, false, true, true}, InterleavedCase{1, 1, 2, false, false, false},
        InterleavedCase{1, 1, 4, kBlock, false, false},
        InterleavedCase{1, 2, 2, false, false, true}, InterleavedCase{2, 1, 2, false, false, false},
        InterleavedCase{2, 1, 4, false, true, false}, InterleavedCase{4, 1, 4, false, false, false},
        InterleavedCase{2, 1, 4, true, false, false}, InterleavedCase{2, 1, 2, kBlock, true, false},
        InterleavedCase{2, 2, 2, true, false, false},
        InterleavedCase{2, 2, 2, false, false, true}}) {
    // Two blocks per model chunk.
    const models::ModelSpec model =
        k.untied ? untied(testing::gpt_tiny(2 * k.d * v)) : testing::gpt_tiny(2 * k.d * v);
    const TrainResult plain = train_cpu(
        model,
        make_plan(model, Schedule::interleaved, 1, k.m, -1, k.d, k.recompute, k.w, 1, false, v),
        adamw_options(steps));
    Plan p =
        make_plan(model, Schedule::interleaved, 1, k.m, 65536, k.d, k.recompute, k.w, 1, false, v);
    p.chunk_shard = k.shard;
    planner::check(p);
    const std::int64_t low = pipeline_budget(model, p), roomy = roomy_budget(model, p);
    for (std::int64_t budget : {low, roomy}) {
      SCOPED_TRACE(fmt::format("d={} w={} m={}{}{}{} budget={}", k.d, k.w, k.m,
                               k.untied ? " untied" : " tied", rc_name(k.recompute),
                               k.shard ? " sharded" : "", budget));
      const TrainResult r = train_cpu(model, p, adamw_options(steps, budget));
      expect_identical(r, plain);
      ASSERT_EQ(int(r.ranks.size()), p.ranks());
      const planner::RunReport sim = simulated(model, p, budget, steps);
      const common::Json& so = sim.extra["offload"];
      const common::Json& ranks = p.ranks() > 1 ? so["ranks"] : common::Json::array({so});
      for (int rank = 0; rank < p.ranks(); ++rank) {
        SCOPED_TRACE("rank " + std::to_string(rank));
        const int stage = p.stage_of(rank);
        const planner::ChunkSchedule s = schedule_of(model, p, budget, stage);
        ASSERT_EQ(int(s.layout.chunk_bounds.size()), v + 1);
        const RankResult& got = r.ranks[std::size_t(rank)];
        // Replica 0's part is P; another's may be shorter when w does not divide a chunk.
        if (p.replica_of(rank) == 0 || s.layout.chunk_elements % k.w == 0)
          expect_device_is_predicted(got, s, sim, ranks, rank, budget, steps);
        if (budget == low) {
          EXPECT_GT(s.uploads, s.layout.chunks());  // evictions inside the step (parts included)
        }
        std::printf(
            "interleaved d=%d w=%d m=%d %s%s%s budget=%lld rank %d: n=%d K=%d uploads=%d "
            "(parts %d) downloads=%d peak=%lld at %s\n",
            k.d, k.w, k.m, k.untied ? "untied" : "tied", rc_name(k.recompute).c_str(),
            k.shard ? " sharded" : "", (long long)budget, rank, s.layout.chunks(),
            s.device_adam_chunks, s.uploads, s.part_uploads, s.downloads,
            (long long)got.peak_memory_bytes,
            s.moments[std::size_t(s.peak_moment)].label(s.layout).c_str());
      }
    }
  }
}

// Interleaved chunks resume bit-identically: each rank's shard holds each model chunk's gathered
// weights and Adam state under the names a run without chunks uses (tied and untied, d = 2).
TEST(ChunksExec, InterleavedResumeIsBitIdentical) {
  for (bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const models::ModelSpec model = tied ? testing::gpt_tiny(8) : untied(testing::gpt_tiny(8));
    const Plan p = make_plan(model, Schedule::interleaved, 1, 2, 65536, 2, false, 1, 1, false, 2);
    testing::expect_resume_is_bit_identical(
        model, p, adamw_options(4, pipeline_budget(model, p) + 100000),
        fmt::format("chunkexec_il_{}", tied ? "tied" : "untied"));
  }
}

}  // namespace
}  // namespace pw::exec
