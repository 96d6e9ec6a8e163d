// The CPU executor running PatrickStar's chunks (issue 15, --offload chunks; docs/formulas.md
// section 9, chunks): the model data in fixed-size chunks really moved between the budgeted
// emulated device and the host pool by the copy engines as the program's ops say, Adam per chunk
// on the device or on the host CPU engine. Losses and final weights bit-identical to the same
// plan without offload; the measured device peak equals the planner's and the simulator's and
// stays inside --device-memory; the bytes moved are the simulator's exactly; bad input is one
// line; resume is bit-identical.
#include <cstdio>
#include <functional>

#include <gtest/gtest.h>

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

Plan make_plan(const models::ModelSpec& model, Schedule s, int b, int m, std::int64_t chunk_bytes) {
  Plan p;
  p.schedule = s;
  p.b = b;
  p.m = m;
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

// The schedule the executor plans on (chunk_cluster: the emulated device's budget).
planner::ChunkSchedule schedule_of(const models::ModelSpec& model, const Plan& p,
                                   std::int64_t budget) {
  const clusters::Cluster node = chunk_cluster(budget);
  const traces::Trace t = traces::analytic_trace(model, node.device, {p.b});
  return planner::chunk_schedule(model, t, node, testing::on_one_gpu(p));
}

planner::RunReport simulated(const models::ModelSpec& model, const Plan& p, std::int64_t budget,
                             int steps) {
  return testing::simulate_on(model, p, chunk_cluster(budget), steps);
}

planner::Estimate estimated(const models::ModelSpec& model, const Plan& p, std::int64_t budget) {
  return testing::estimate_on(model, p, chunk_cluster(budget));
}

// The smallest device the plan's chunks fit (the planner's refusal below it).
std::int64_t smallest_budget(const models::ModelSpec& model, const Plan& p) {
  std::int64_t lo = 1, hi = std::int64_t(1) << 40;  // lo refused, hi fits
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    try {
      schedule_of(model, p, mid);
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
  msg = testing::error_of([&] { detail::prepare_run(model, p, adamw_options(2, low), "cuda"); });
  EXPECT_NE(msg.find("the cuda executor does not run offload chunks"), std::string::npos) << msg;
  // Pipelines with chunks are planned and simulated, not run yet: one line.
  Plan piped = p;
  piped.d = 2;
  piped.m = 2;
  piped.stage_blocks.clear();
  planner::resolve_stages(piped, model.layers);
  planner::check(piped);
  msg = testing::error_of([&] { train_cpu(model, piped, adamw_options(2, low)); });
  EXPECT_NE(msg.find("plan: d: the cpu executor runs offload chunks on one stage only yet (d = 1, "
                     "found d = 2)"),
            std::string::npos)
      << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

// Checkpoints hold the same tensors as without chunks (the stage's weights, m and v, gathered
// from the chunks): a run stopped and resumed gives the bits of an unbroken one.
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

}  // namespace
}  // namespace pw::exec
