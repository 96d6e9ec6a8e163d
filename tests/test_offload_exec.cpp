// The CPU executor with offload (issue 15, docs/formulas.md section 9): optimizer offload
// (gradients streamed to a host accumulator layer by layer, CPU Adam on the host, parameters back)
// and activation offload (stashes swapped to the host and back) train bit-identically to the same
// plan without offload; the measured device peak equals the planner's and stays inside
// --device-memory; the bytes the copy engines moved per step are the planner's exactly.
#include <algorithm>
#include <cmath>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "clusters/cluster.hpp"
#include "exec/chunk_book.hpp"
#include "exec/offload.hpp"
#include "exec/optimizer_offload.hpp"
#include "exec/run_common.hpp"
#include "exec/runtime.hpp"
#include "exec/tied_exchange.hpp"
#include "exec/weight_slots.hpp"
#include "planner/cost_model.hpp"
#include "planner/plan.hpp"
#include "sim/simulator.hpp"
#include "test_util.hpp"
#include "traces/analytic.hpp"

namespace pw::exec {
namespace {

using planner::ActivationChoice;
using planner::Offload;
using planner::Plan;
using planner::Schedule;
using testing::adamw_options;
using testing::expect_identical;
using testing::largest_peak;

enum Mode { kNone = 0, kOptimizer = 1, kActivations = 2, kBoth = 3 };

std::string mode_name(int mode) {
  const char* names[] = {"none", "optimizer", "activations", "optimizer,activations"};
  return names[mode];
}

Plan make_plan(const models::ModelSpec& model, Schedule s, int d, int b, int m, int mode) {
  Plan p;
  p.schedule = s;
  p.d = d;
  p.b = b;
  p.m = m;
  planner::resolve_stages(p, model.layers);
  if (mode & kOptimizer) p.offload = Offload::optimizer;
  if (mode & kActivations) {
    p.offload_activations = true;
    planner::set_activations(p,
                             std::vector<ActivationChoice>(std::size_t(d), ActivationChoice::swap));
  }
  planner::check(p);
  return p;
}

// The planner's figures for the plan (fp32, the CPU executor's dtype) on a node with a host link
// and a CPU Adam rate; one GPU holds every rank, as every thread is its own emulated device.
planner::Estimate predicted(const models::ModelSpec& model, const Plan& p) {
  return testing::estimate_on(model, p, clusters::load_cluster("v100-32gb-ws"));
}

// The simulator's report of the same programs over `steps` steps (its bytes: the run's / steps).
planner::RunReport simulated(const models::ModelSpec& model, const Plan& p, int steps) {
  return testing::simulate_on(model, p, clusters::load_cluster("v100-32gb-ws"), steps);
}

std::string describe(const planner::MemoryBreakdown& m) {
  return "weights " + std::to_string(m.weights) + " versions " + std::to_string(m.weight_versions) +
         " gradients " + std::to_string(m.gradients) + " optimizer " + std::to_string(m.optimizer) +
         " activations " + std::to_string(m.activations) + " workspace " +
         std::to_string(m.workspace);
}

// ZeRO-Offload's sharded form (w > 1, docs/formulas.md section 9, data parallelism): a plan of
// w replicas and d stages, distributed optimizer on, optionally with optimizer offload.
Plan sharded_plan(const models::ModelSpec& model, Schedule s, int w, int d, bool offload) {
  Plan p = make_plan(model, s, d, 1, 2, kNone);
  p.w = w;
  p.distributed_optimizer = true;
  if (offload) p.offload = Offload::optimizer;
  planner::check(p);
  return p;
}

struct ShardedCase {
  Schedule schedule;
  int w, d;
};

std::vector<ShardedCase> sharded_cases() {
  std::vector<ShardedCase> cases;
  for (Schedule s : {Schedule::one_f_one_b, Schedule::two_bw, Schedule::gpipe})
    for (int w : {2, 3})
      for (int d : {1, 2})
        cases.push_back({s, w, d});
  return cases;
}

std::string describe(const ShardedCase& c) {
  return to_string(c.schedule) + " w=" + std::to_string(c.w) + " d=" + std::to_string(c.d);
}

struct Case {
  Schedule schedule;
  int d, b, m;
};

// Every mode, 1f1b and 2bw (and gpipe), against the same plan without offload: the same losses
// and final weights, bit for bit. Activation offload swaps only where a stash waits 3 compute ops
// (kSwapGap): 1f1b and 2bw at d = 4 on their first stages, gpipe at d = 2.
TEST(OffloadExec, TrainsBitIdenticallyToNoOffload) {
  const models::ModelSpec model = testing::gpt_tiny(4);
  for (const Case& k : {Case{Schedule::one_f_one_b, 2, 2, 4}, Case{Schedule::two_bw, 2, 2, 4},
                        Case{Schedule::one_f_one_b, 4, 1, 4}, Case{Schedule::two_bw, 4, 1, 4},
                        Case{Schedule::gpipe, 2, 2, 4}}) {
    const TrainResult plain =
        train_cpu(model, make_plan(model, k.schedule, k.d, k.b, k.m, kNone), adamw_options(3));
    for (int mode : {kOptimizer, kActivations, kBoth}) {
      SCOPED_TRACE(to_string(k.schedule) + " d=" + std::to_string(k.d) + " " + mode_name(mode));
      const Plan p = make_plan(model, k.schedule, k.d, k.b, k.m, mode);
      const TrainResult r = train_cpu(model, p, adamw_options(3));
      expect_identical(r, plain);
      if (mode & kActivations) {  // the first stage's stashes really went out and came back
        if (k.d == 4 || k.schedule == Schedule::gpipe) {
          EXPECT_GT(r.ranks[0].activation_out_bytes, 0);
        }
        EXPECT_EQ(r.ranks[0].activation_out_bytes, r.ranks[0].activation_in_bytes);
      }
      if (mode & kOptimizer) {
        EXPECT_EQ(r.ranks[0].memory.optimizer, 0);  // on the host
        EXPECT_GT(r.ranks[0].host_peak_memory_bytes, 0);
      }
    }
  }
}

// Beside recomputation, interleaving, data parallelism (activations) and SGD: the same bits.
TEST(OffloadExec, OtherShapesAreBitIdentical) {
  const models::ModelSpec model = testing::gpt_tiny(4);
  struct Variant {
    const char* name;
    std::function<void(Plan&)> edit;
    int modes;  // the offload modes it combines with (bit mask of kOptimizer, kActivations)
    std::string optimizer = "adamw";
  };
  const std::vector<Variant> variants = {
      {"recompute full",
       [](Plan& p) { p.recompute.assign(std::size_t(p.d), planner::Recompute::full); }, kOptimizer},
      {"recompute block",
       [](Plan& p) { p.recompute.assign(std::size_t(p.d), planner::Recompute::block); },
       kOptimizer},
      {"interleaved v=2",
       [](Plan& p) {
         p.schedule = Schedule::interleaved;
         p.v = 2;
       },
       kOptimizer | kActivations},
      {"w=2", [](Plan& p) { p.w = 2; }, kActivations},
      {"sgd", [](Plan&) {}, kOptimizer | kActivations, "sgd"},
  };
  for (const Variant& var : variants)
    for (int mode : {kOptimizer, kActivations, kBoth}) {
      if ((mode & var.modes) != mode) continue;
      SCOPED_TRACE(std::string(var.name) + " " + mode_name(mode));
      Plan plain;
      plain.schedule = Schedule::one_f_one_b;
      plain.d = 2;
      plain.b = 1;
      plain.m = 4;
      var.edit(plain);
      plain.stage_blocks.clear();
      planner::resolve_stages(plain, model.layers);
      Plan off = plain;
      if (mode & kOptimizer) off.offload = Offload::optimizer;
      if (mode & kActivations) {
        off.offload_activations = true;
        // Stage 1 recomputes instead of swapping: the plain plan recomputes there too.
        planner::set_activations(off, {ActivationChoice::swap, ActivationChoice::recompute});
        plain.recompute = off.recompute;
      }
      planner::check(off);
      TrainOptions o = adamw_options(3);
      o.optimizer = var.optimizer;
      expect_identical(train_cpu(model, off, o), train_cpu(model, plain, o));
    }
}

// An untied model on one stage: every layer's gradients stream (the head's too).
TEST(OffloadExec, UntiedSingleStageIsBitIdentical) {
  models::ModelSpec model = testing::gpt_tiny(2);
  model.tied_embeddings = false;
  const TrainResult plain =
      train_cpu(model, make_plan(model, Schedule::one_f_one_b, 1, 2, 3, kNone), adamw_options(3));
  const TrainResult off = train_cpu(
      model, make_plan(model, Schedule::one_f_one_b, 1, 2, 3, kOptimizer), adamw_options(3));
  expect_identical(off, plain);
  // A vocabulary large enough that the head's logit gradient takes the stage's whole workspace:
  // the head runs in two row blocks there (the embedding's gradient takes part of it).
  models::ModelSpec wide = model;
  wide.hidden = 128;
  wide.heads = 2;
  wide.kv_heads = 2;
  wide.ffn = 512;
  wide.vocab = 4096;
  wide.layers = 1;
  expect_identical(
      train_cpu(wide, make_plan(wide, Schedule::one_f_one_b, 1, 1, 2, kOptimizer),
                adamw_options(2)),
      train_cpu(wide, make_plan(wide, Schedule::one_f_one_b, 1, 1, 2, kNone), adamw_options(2)));
}

// The measured device peak per rank is the planner's exactly, as without offload (the planner
// counts the activation-sized messages a device holds beside its stashes, docs/formulas.md
// section 4), and the copy engines' bytes are the simulator's exactly (and the closed form's per
// step, flush schedules); run again inside a budget of that peak, the run fits.
TEST(OffloadExec, PeakAndBytesMovedMatchThePlanner) {
  const models::ModelSpec model = testing::gpt_tiny(4);
  for (Schedule s : {Schedule::one_f_one_b, Schedule::two_bw, Schedule::gpipe})
    for (int mode : {kOptimizer, kActivations, kBoth}) {
      const int d = s == Schedule::gpipe ? 2 : 4;
      SCOPED_TRACE(to_string(s) + " " + mode_name(mode));
      const Plan p = make_plan(model, s, d, 2, 4, mode);
      const int steps = 3;
      const TrainResult r = train_cpu(model, p, adamw_options(steps));
      const planner::Estimate e = predicted(model, p);
      const Plan plain_plan = make_plan(model, s, d, 2, 4, kNone);
      const TrainResult plain = train_cpu(model, plain_plan, adamw_options(steps));
      const planner::Estimate plain_e = predicted(model, plain_plan);
      const common::Json& o = e.report.extra["offload"];
      const planner::RunReport sim = simulated(model, p, steps);
      const common::Json& so = sim.extra["offload"];
      for (int rank = 0; rank < p.ranks(); ++rank) {
        const RankResult& got = r.ranks[std::size_t(rank)];
        const planner::DeviceReport& want = e.report.devices[std::size_t(rank)];
        EXPECT_EQ(got.memory.gradients, want.memory.gradients) << "rank " << rank;
        EXPECT_EQ(got.memory.optimizer, want.memory.optimizer) << "rank " << rank;
        EXPECT_EQ(got.memory.weights, want.memory.weights) << "rank " << rank;
        EXPECT_EQ(got.memory.weight_versions, want.memory.weight_versions) << "rank " << rank;
        EXPECT_EQ(got.memory.workspace, want.memory.workspace) << "rank " << rank;
        // The breakdown's total: the device report's peak adds the runtime's reserve of a GPU.
        const std::int64_t total = want.memory.total();
        // As without offload: the same difference from the prediction (none).
        EXPECT_EQ(got.peak_memory_bytes - total,
                  plain.ranks[std::size_t(rank)].peak_memory_bytes -
                      plain_e.report.devices[std::size_t(rank)].memory.total())
            << "rank " << rank;
        EXPECT_EQ(got.peak_memory_bytes, total)
            << "rank " << rank << " " << describe(got.memory) << " vs " << describe(want.memory);
        // Bytes: the simulator's, which runs the same programs (2BW's first step fills the
        // pipeline and swaps fewer stashes than its steady state), exactly; for flush schedules
        // also the closed form's per step.
        const common::Json& sr = so["ranks"][std::size_t(rank)];
        EXPECT_EQ(got.copy_out_bytes % steps, 0);
        EXPECT_EQ(got.copy_out_bytes, steps * sr["copy_out_bytes_per_step"].get<std::int64_t>())
            << "rank " << rank;
        EXPECT_EQ(got.copy_in_bytes, steps * sr["copy_in_bytes_per_step"].get<std::int64_t>())
            << "rank " << rank;
        if (mode & kActivations) {
          EXPECT_EQ(got.activation_out_bytes,
                    steps * sr["activations"]["swapped_bytes_per_step"].get<std::int64_t>())
              << "rank " << rank;
        }
        // The host pool of optimizer offload: master copy, accumulator, m and v, 16 B per
        // host-updated parameter in fp32, the planner's (optimizer state + 4 + e) x P_h.
        if (mode == kOptimizer) {
          EXPECT_EQ(got.host_peak_memory_bytes,
                    o["ranks"][std::size_t(rank)]["host_bytes"].get<std::int64_t>())
              << "rank " << rank;
        }
        if (s != Schedule::two_bw) {
          const common::Json& ro = o["ranks"][std::size_t(rank)];
          EXPECT_EQ(got.copy_out_bytes, steps * ro["copy_out_bytes_per_step"].get<std::int64_t>())
              << "rank " << rank;
          EXPECT_EQ(got.copy_in_bytes, steps * ro["copy_in_bytes_per_step"].get<std::int64_t>())
              << "rank " << rank;
        }
      }
      // Inside a budget of the largest measured peak: the same run fits and stays inside.
      const std::int64_t peak = largest_peak(r);
      TrainOptions o2 = adamw_options(steps);
      o2.device_memory = peak;
      const TrainResult fitted = train_cpu(model, p, o2);
      for (const RankResult& rank : fitted.ranks)
        EXPECT_LE(rank.peak_memory_bytes, peak);
      expect_identical(fitted, r);
    }
}

// Block recompute under optimizer offload (ZeRO-Offload's setting: per-layer checkpoints): the
// layers' gradients stream out while each layer is re-made just before its backward. The same
// bits as without offload; per rank the planner's memory to the byte and the simulator's bytes.
TEST(OffloadExec, BlockRecomputeWithOptimizerOffloadMatchesThePlanner) {
  const models::ModelSpec model = testing::gpt_tiny(4);
  for (Schedule s : {Schedule::one_f_one_b, Schedule::gpipe}) {
    SCOPED_TRACE(to_string(s));
    Plan p = make_plan(model, s, 2, 2, 4, kOptimizer), plain = make_plan(model, s, 2, 2, 4, kNone);
    p.recompute.assign(2, planner::Recompute::block);
    plain.recompute = p.recompute;
    const int steps = 3;
    const TrainResult r = train_cpu(model, p, adamw_options(steps));
    expect_identical(r, train_cpu(model, plain, adamw_options(steps)));
    const planner::Estimate e = predicted(model, p);
    const planner::RunReport sim = simulated(model, p, steps);
    // The CUDA executor refuses it in one line, before anything runs.
    const std::string cuda =
        testing::error_of([&] { detail::prepare_run(model, p, adamw_options(2), "cuda"); });
    EXPECT_NE(cuda.find("plan: recompute: block recompute (stage 0) runs on the cpu backend "
                        "only (this is cuda)"),
              std::string::npos)
        << cuda;
    EXPECT_EQ(cuda.find('\n'), std::string::npos) << cuda;
    for (int rank = 0; rank < p.ranks(); ++rank) {
      const RankResult& got = r.ranks[std::size_t(rank)];
      const planner::DeviceReport& want = e.report.devices[std::size_t(rank)];
      EXPECT_EQ(got.memory.activations, want.memory.activations) << "rank " << rank;
      EXPECT_EQ(got.peak_memory_bytes, want.memory.total()) << "rank " << rank;
      EXPECT_EQ(got.copy_out_bytes,
                steps * sim.extra["offload"]["ranks"][std::size_t(rank)]["copy_out_bytes_per_step"]
                            .get<std::int64_t>())
          << "rank " << rank;
    }
  }
}

// Tensor parallelism (t = 2, and t = 4 with SP): each device of a TP group offloads its own
// shard. The same bits as the same plan without offload; per device the planner's memory (placed
// on an 8-GPU p3.16xlarge, the trace of one GPU of the group), its host pool, and the simulator's
// bytes moved.
TEST(OffloadExec, TensorParallelIsBitIdenticalWithThePlannersPeakAndBytes) {
  const models::ModelSpec model = testing::gpt_tiny(4);
  const clusters::Cluster node = clusters::load_cluster("p3.16xlarge");
  struct TpCase {
    Schedule schedule;
    int t, d;
    bool sp;
  };
  for (const TpCase& k :
       {TpCase{Schedule::one_f_one_b, 2, 4, false}, TpCase{Schedule::two_bw, 2, 4, false},
        TpCase{Schedule::gpipe, 2, 2, false}, TpCase{Schedule::gpipe, 4, 2, true}}) {
    const auto tp_plan = [&](int mode) {
      Plan p = make_plan(model, k.schedule, k.d, 2, 4, kNone);
      p.t = k.t;
      p.sp = k.sp;
      if (mode & kOptimizer) p.offload = Offload::optimizer;
      if (mode & kActivations) {
        p.offload_activations = true;
        planner::set_activations(
            p, std::vector<ActivationChoice>(std::size_t(k.d), ActivationChoice::swap));
      }
      planner::check(p);
      return p;
    };
    const int steps = 3;
    const TrainResult plain = train_cpu(model, tp_plan(kNone), adamw_options(steps));
    for (int mode : {kOptimizer, kActivations, kBoth}) {
      SCOPED_TRACE(to_string(k.schedule) + " t=" + std::to_string(k.t) + (k.sp ? " sp" : "") +
                   " d=" + std::to_string(k.d) + " " + mode_name(mode));
      const Plan p = tp_plan(mode);
      const TrainResult r = train_cpu(model, p, adamw_options(steps));
      expect_identical(r, plain);
      Plan placed = p;
      planner::place(placed, {1, 8});
      const traces::Trace tr =
          traces::analytic_trace(model, node.device, {p.b}, models::Sharding{k.t, k.sp});
      const planner::Estimate e = planner::estimate(model, tr, node, placed);
      const planner::RunReport sim =
          sim::simulate(model, tr, node, placed, {.steps = steps}).report;
      const common::Json& o = e.report.extra["offload"];
      const common::Json& so = sim.extra["offload"];
      ASSERT_EQ(r.ranks.size(), std::size_t(p.ranks() * k.t));
      for (int device = 0; device < p.ranks() * k.t; ++device) {
        const int rank = device / k.t;
        const RankResult& got = r.ranks[std::size_t(device)];
        const planner::MemoryBreakdown& want = e.report.devices[std::size_t(rank)].memory;
        EXPECT_EQ(got.peak_memory_bytes, want.total())
            << "device " << device << " " << describe(got.memory) << " vs " << describe(want);
        EXPECT_EQ(got.memory.gradients, want.gradients) << "device " << device;
        EXPECT_EQ(got.memory.optimizer, want.optimizer) << "device " << device;
        // The simulator's bytes per step are its run's / steps, rounded down (2BW's first step
        // swaps fewer stashes than its steady state).
        const common::Json& sr = so["ranks"][std::size_t(rank)];
        EXPECT_EQ(got.copy_out_bytes / steps, sr["copy_out_bytes_per_step"].get<std::int64_t>())
            << "device " << device;
        EXPECT_EQ(got.copy_in_bytes / steps, sr["copy_in_bytes_per_step"].get<std::int64_t>())
            << "device " << device;
        if (mode & kActivations) {
          EXPECT_EQ(got.activation_out_bytes / steps,
                    sr["activations"]["swapped_bytes_per_step"].get<std::int64_t>())
              << "device " << device;
        }
        if (mode == kOptimizer) {
          EXPECT_EQ(got.host_peak_memory_bytes,
                    o["ranks"][std::size_t(rank)]["host_bytes"].get<std::int64_t>())
              << "device " << device;
        }
      }
      if (mode & kActivations) {
        EXPECT_GT(r.ranks[0].activation_out_bytes, 0);  // the first stage's stashes really moved
      }
      // The node's host memory: every device's, t per rank, in both reports. Not for 2bw's swaps
      // here: gpt-tiny's copies over PCIe do not hide behind its microsecond ops, so in 2BW's
      // stream (no flush) the simulator's uploads end late and more stashes sit on the host than
      // the closed form counts (each from the op after its forward to the op before its
      // backward, as when copies hide; tests/test_offload.cpp checks the two equal where they do).
      ASSERT_EQ(e.report.hosts.size(), 1u);
      ASSERT_EQ(sim.hosts.size(), 1u);
      if (k.schedule != Schedule::two_bw || !(mode & kActivations)) {
        EXPECT_EQ(sim.hosts[0].peak_memory_bytes, e.report.hosts[0].peak_memory_bytes);
      }
      if (mode == kOptimizer) {
        std::int64_t host = 0;
        for (const RankResult& dev : r.ranks)
          host += dev.host_peak_memory_bytes;
        EXPECT_EQ(e.report.hosts[0].peak_memory_bytes, host);
      }
    }
  }
}

// A budget below the run's natural peak, where that peak holds a stash on its way to the host:
// the allocation that would not fit waits for the download and takes its buffer back, and the
// run goes on inside the budget with the same bits.
TEST(OffloadExec, TighterBudgetWaitsForDownloads) {
  const models::ModelSpec model = testing::gpt_tiny(4);
  const Plan p = make_plan(model, Schedule::gpipe, 2, 2, 4, kActivations);
  const TrainResult free_run = train_cpu(model, p, adamw_options(3));
  const std::int64_t peak = largest_peak(free_run);
  TrainOptions o = adamw_options(3);
  o.device_memory = peak - 1;
  const TrainResult tight = train_cpu(model, p, o);
  for (const RankResult& r : tight.ranks)
    EXPECT_LT(r.peak_memory_bytes, peak);
  expect_identical(tight, free_run);
}

// A device smaller than what a rank holds: one line naming the rank, what did not fit and by how
// much; nothing is left running.
TEST(OffloadExec, DeviceTooSmallIsOneLine) {
  const models::ModelSpec model = testing::gpt_tiny(4);
  const Plan p = make_plan(model, Schedule::one_f_one_b, 2, 2, 4, kBoth);
  TrainOptions o = adamw_options(2);
  o.device_memory = 1000;
  std::string msg = testing::error_of([&] { train_cpu(model, p, o); });
  EXPECT_NE(msg.find("rank 0: --device-memory 1000 B: weights of "), std::string::npos) << msg;
  EXPECT_NE(msg.find("short by"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  // Just short of the run's peak: what did not fit, later in the run.
  const TrainResult r = train_cpu(model, p, adamw_options(2));
  o.device_memory = r.ranks[0].peak_memory_bytes - 1;
  msg = testing::error_of([&] { train_cpu(model, p, o); });
  EXPECT_NE(msg.find("rank "), std::string::npos) << msg;
  EXPECT_NE(msg.find("do not fit"), std::string::npos) << msg;
  EXPECT_NE(msg.find("short by "), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  o.device_memory = -1;
  EXPECT_NE(testing::error_of([&] { train_cpu(model, p, o); }).find("--device-memory"),
            std::string::npos);
}

// Checkpoints keep the host's optimizer state: a run stopped and resumed gives the bits of an
// unbroken one.
TEST(OffloadExec, ResumeIsBitIdentical) {
  const models::ModelSpec model = testing::gpt_tiny(4);
  for (Schedule s : {Schedule::one_f_one_b, Schedule::two_bw}) {
    SCOPED_TRACE(to_string(s));
    const Plan p = make_plan(model, s, 4, 1, 4, kBoth);
    testing::expect_resume_is_bit_identical(model, p, adamw_options(4), "offexec_" + to_string(s));
  }
}

// What the executor does not run: offload on a backend other than cpu and cuda, optimizer
// offload with both tied ends on one stage, sharded optimizer offload on cuda. The CUDA
// backend's checks pass every unsharded mode and the distributed optimizer.
TEST(OffloadExec, RefusesWhatItDoesNotRun) {
  const models::ModelSpec model = testing::gpt_tiny(4);
  const Plan p = make_plan(model, Schedule::one_f_one_b, 2, 2, 4, kOptimizer);
  std::string msg =
      testing::error_of([&] { detail::prepare_run(model, p, adamw_options(2), "tpu"); });
  EXPECT_NE(msg.find("the tpu executor does not run --offload yet"), std::string::npos) << msg;
  for (int mode : {kOptimizer, kActivations, kBoth})
    EXPECT_NO_THROW(detail::prepare_run(
        model, make_plan(model, Schedule::one_f_one_b, 4, 1, 4, mode), adamw_options(2), "cuda"))
        << mode_name(mode);
  // The distributed optimizer runs on both backends, and so does optimizer offload sharded over
  // replicas (w > 1, ZeRO-Offload's shards; the cuda backend's compile-checked only); another
  // backend is refused in one line.
  Plan dopt = make_plan(model, Schedule::one_f_one_b, 2, 2, 4, 0);
  dopt.w = 2;
  dopt.distributed_optimizer = true;
  planner::check(dopt);
  EXPECT_NO_THROW(detail::prepare_run(model, dopt, adamw_options(2), "cuda"));
  Plan sharded = dopt;
  sharded.offload = Offload::optimizer;
  planner::check(sharded);
  EXPECT_NO_THROW(detail::prepare_run(model, sharded, adamw_options(2), "cpu"));
  EXPECT_NO_THROW(detail::prepare_run(model, sharded, adamw_options(2), "cuda"));
  msg = testing::error_of([&] { detail::prepare_run(model, sharded, adamw_options(2), "tpu"); });
  EXPECT_NE(msg.find("plan: offload: the tpu executor does not shard optimizer offload over "
                     "replicas yet (w = 2;"),
            std::string::npos)
      << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  // A stage mixing swapped and recomputed blocks (per-layer choices): the cpu backend runs it
  // (MixedStage* below), the cuda backend refuses it in one line naming the field.
  Plan mixed = make_plan(model, Schedule::one_f_one_b, 2, 2, 4, kActivations);
  planner::set_activation_layers(mixed, {{ActivationChoice::swap, ActivationChoice::recompute},
                                         {ActivationChoice::swap, ActivationChoice::swap}});
  planner::check(mixed);
  EXPECT_NO_THROW(detail::prepare_run(model, mixed, adamw_options(2), "cpu"));
  msg = testing::error_of([&] { detail::prepare_run(model, mixed, adamw_options(2), "cuda"); });
  EXPECT_NE(msg.find("plan: activation_layers[0]: the cuda executor swaps or recomputes whole "
                     "stages, not a stage mixing both"),
            std::string::npos)
      << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  // Per-layer lists that are each all one choice are the per-stage choices: they run.
  Plan uniform = mixed;
  planner::set_activation_layers(uniform,
                                 {{ActivationChoice::swap, ActivationChoice::swap},
                                  {ActivationChoice::recompute, ActivationChoice::recompute}});
  EXPECT_NO_THROW(detail::prepare_run(model, uniform, adamw_options(2), "cpu"));
  const Plan one = make_plan(model, Schedule::one_f_one_b, 1, 2, 4, kOptimizer);
  msg = testing::error_of([&] { train_cpu(model, one, adamw_options(2)); });
  EXPECT_NE(msg.find("tied embedding and LM head on different stages"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  // Sharded (w > 1) a tied model runs on one stage (sharded_cases), but not with both ends in two
  // chunks of one device (the head's copy is in no CPU Adam tile).
  Plan two_chunks = sharded_plan(model, Schedule::one_f_one_b, 2, 1, true);
  two_chunks.schedule = Schedule::interleaved;
  two_chunks.v = 2;
  two_chunks.stage_blocks.clear();
  planner::resolve_stages(two_chunks, model.layers);
  planner::check(two_chunks);
  msg = testing::error_of([&] { train_cpu(model, two_chunks, adamw_options(2)); });
  EXPECT_NE(msg.find("plan: offload: the executor's sharded optimizer offload (w = 2) needs the "
                     "tied embedding and LM head on one chunk or on different stages (here d = 1, "
                     "v = 2)"),
            std::string::npos)
      << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

// --- Stages mixing swapped and recomputed blocks (activation_layers, KARMA per layer) ---

constexpr ActivationChoice kS = ActivationChoice::swap, kR = ActivationChoice::recompute;

struct MixedCase {
  const char* name;
  Schedule schedule;
  int d, b, m;
  std::int64_t layers;
  std::vector<std::vector<ActivationChoice>> choices;
  int mode = kActivations;
  int v = 1, w = 1;
};

Plan mixed_plan(const models::ModelSpec& model, const MixedCase& k, bool offload) {
  Plan p;
  p.schedule = k.schedule;
  p.d = k.d;
  p.b = k.b;
  p.m = k.m;
  p.v = k.v;
  p.w = k.w;
  planner::resolve_stages(p, model.layers);
  if (!offload) return p;
  if (k.mode & kOptimizer) p.offload = Offload::optimizer;
  p.offload_activations = true;
  planner::set_activation_layers(p, k.choices);
  planner::check(p);
  return p;
}

// The plan without offload that gives the same bits: recompute where a stage's blocks all
// recompute (bit-identical to keeping the stash anyway, tests/test_runtime.cpp).
const std::vector<MixedCase>& mixed_cases() {
  static const std::vector<MixedCase> cases = {
      // One stage: the embedding swaps with block 0, blocks 1-2 recompute, the head swaps with
      // block 3; and the other way round (a run from the token ids, a run ending at the head).
      {"gpipe d=1 SRRS", Schedule::gpipe, 1, 2, 4, 4, {{kS, kR, kR, kS}}},
      {"gpipe d=1 RSSR", Schedule::gpipe, 1, 2, 4, 4, {{kR, kS, kS, kR}}},
      {"1f1b d=1 RSRS", Schedule::one_f_one_b, 1, 1, 4, 4, {{kR, kS, kR, kS}}},
      // Two stages, both mixed.
      {"gpipe d=2", Schedule::gpipe, 2, 2, 4, 4, {{kS, kR}, {kR, kS}}},
      {"1f1b d=2", Schedule::one_f_one_b, 2, 2, 4, 4, {{kR, kS}, {kS, kR}}},
      {"2bw d=2", Schedule::two_bw, 2, 2, 4, 4, {{kS, kR}, {kS, kR}}},
      // Four stages, where 1f1b and 2bw swap on their first stages; one stage all recompute.
      {"1f1b d=4", Schedule::one_f_one_b, 4, 1, 4, 8, {{kS, kR}, {kR, kS}, {kS, kR}, {kR, kR}}},
      {"2bw d=4", Schedule::two_bw, 4, 1, 4, 8, {{kS, kR}, {kS, kR}, {kR, kS}, {kS, kS}}},
      // With optimizer offload (gradients layer by layer from the two stash pieces).
      {"1f1b d=4 optimizer,activations",
       Schedule::one_f_one_b,
       4,
       1,
       4,
       8,
       {{kS, kR}, {kR, kS}, {kS, kR}, {kR, kS}},
       kBoth},
      {"gpipe d=2 optimizer,activations", Schedule::gpipe, 2, 2, 4, 4, {{kR, kS}, {kS, kR}}, kBoth},
      // Data parallelism; interleaved with a chunk whose blocks all swap and one all recompute.
      {"gpipe d=2 w=2", Schedule::gpipe, 2, 1, 4, 4, {{kS, kR}, {kR, kS}}, kActivations, 1, 2},
      {"interleaved d=2 v=2",
       Schedule::interleaved,
       2,
       1,
       4,
       8,
       {{kS, kS, kR, kS}, {kR, kR, kS, kS}},
       kActivations,
       2},
  };
  return cases;
}

// Training with mixed stages gives the losses and final weights of training without offload,
// bit for bit; the swapped layers' stashes really went out and came back.
TEST(OffloadExec, MixedStagesTrainBitIdentically) {
  for (const MixedCase& k : mixed_cases()) {
    SCOPED_TRACE(k.name);
    const models::ModelSpec model = testing::gpt_tiny(k.layers);
    const Plan p = mixed_plan(model, k, true);
    bool any_mixed = false;
    for (int s = 0; s < p.d; ++s)
      any_mixed |= p.mixed_activations(s);
    ASSERT_TRUE(any_mixed);
    const TrainResult plain = train_cpu(model, mixed_plan(model, k, false), adamw_options(3));
    const TrainResult r = train_cpu(model, p, adamw_options(3));
    expect_identical(r, plain);
    std::int64_t out = 0;
    for (const RankResult& rank : r.ranks) {
      EXPECT_EQ(rank.activation_out_bytes, rank.activation_in_bytes) << rank.rank;
      out += rank.activation_out_bytes;
    }
    if (k.schedule == Schedule::gpipe || k.d == 4) {
      EXPECT_GT(out, 0);
    }
  }
}

// The measured device peak of every rank is the planner's exactly (its breakdown: the stashes'
// swapped pieces, checkpoints and re-made pieces, docs/formulas.md section 9), and the bytes the
// copy engines moved are the simulator's exactly (and the closed form's for flush schedules).
TEST(OffloadExec, MixedStagesPeakAndBytesMatchThePlanner) {
  for (const MixedCase& k : mixed_cases()) {
    SCOPED_TRACE(k.name);
    const models::ModelSpec model = testing::gpt_tiny(k.layers);
    const Plan p = mixed_plan(model, k, true);
    const int steps = 3;
    const TrainResult r = train_cpu(model, p, adamw_options(steps));
    const planner::Estimate e = predicted(model, p);
    const planner::RunReport sim = simulated(model, p, steps);
    const common::Json& so = sim.extra["offload"];
    const common::Json& o = e.report.extra["offload"];
    for (int rank = 0; rank < p.ranks(); ++rank) {
      const RankResult& got = r.ranks[std::size_t(rank)];
      const planner::DeviceReport& want = e.report.devices[std::size_t(rank)];
      // Exact on every stage, also where the peak is a backward with a re-made stash (the last
      // stage of 1F1B and 2BW holds one message buffer fewer there:
      // planner::backward_message_buffers).
      EXPECT_EQ(got.peak_memory_bytes, want.memory.total())
          << "rank " << rank << " " << describe(got.memory) << " vs " << describe(want.memory);
      const common::Json& sr = so["ranks"][std::size_t(rank)];
      EXPECT_EQ(got.activation_out_bytes,
                steps * sr["activations"]["swapped_bytes_per_step"].get<std::int64_t>())
          << "rank " << rank;
      EXPECT_EQ(got.copy_out_bytes, steps * sr["copy_out_bytes_per_step"].get<std::int64_t>())
          << "rank " << rank;
      EXPECT_EQ(got.copy_in_bytes, steps * sr["copy_in_bytes_per_step"].get<std::int64_t>())
          << "rank " << rank;
      if (k.schedule != Schedule::two_bw) {
        const common::Json& ro = o["ranks"][std::size_t(rank)];
        EXPECT_EQ(got.copy_out_bytes, steps * ro["copy_out_bytes_per_step"].get<std::int64_t>())
            << "rank " << rank;
      }
    }
  }
}

// A run with mixed stages stopped and resumed gives the bits of an unbroken one.
TEST(OffloadExec, MixedStagesResumeBitIdentically) {
  for (const MixedCase& k : mixed_cases()) {
    if (k.d != 4 || k.mode != kActivations) continue;  // 1f1b and 2bw where stage 0 swaps
    SCOPED_TRACE(k.name);
    const models::ModelSpec model = testing::gpt_tiny(k.layers);
    testing::expect_resume_is_bit_identical(model, mixed_plan(model, k, true), adamw_options(4),
                                            "offexec_mixed_" + to_string(k.schedule));
  }
}

// Per-layer choices that do not fit the plan reach the executor only from code (plan files are
// checked when read): the executor reports them in one line naming the field.
TEST(OffloadExec, MixedStageBadChoicesAreOneLine) {
  const models::ModelSpec model = testing::gpt_tiny(4);
  const MixedCase k{"", Schedule::gpipe, 2, 1, 4, 4, {{kS, kR}, {kR, kS}}};
  const Plan good = mixed_plan(model, k, true);
  struct Bad {
    std::vector<std::vector<ActivationChoice>> layers;
    std::string want;
  };
  for (const Bad& bad :
       {Bad{{{kS, kR, kR}, {kR, kS}},
            "plan: activation_layers[0]: has 3 entries but stage 0 holds "
            "2 blocks"},
        Bad{{{kS, kR}}, "plan: activation_layers: has 1 entries but the plan has d = 2 stages"},
        Bad{{{}, {kR, kS}}, "plan: activation_layers[0]: needs one choice per block"}}) {
    Plan p = good;
    p.activation_layers = bad.layers;  // past set_activation_layers, as a plan built in code
    const std::string msg = testing::error_of([&] { train_cpu(model, p, adamw_options(1)); });
    EXPECT_NE(msg.find(bad.want), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

// The timeline's host memory track (as the simulator's): the host pool's bytes at every change,
// in time order, peaking at the rank's host peak; swapped stashes come and go, so with
// activation offload it falls again after each rise. No track without offload.
TEST(OffloadExec, HostMemoryOverTimeInTheTimeline) {
  const models::ModelSpec model = testing::gpt_tiny(4);
  for (int mode : {kNone, kOptimizer, kActivations, kBoth}) {
    SCOPED_TRACE(mode_name(mode));
    const TrainResult r =
        train_cpu(model, make_plan(model, Schedule::one_f_one_b, 4, 2, 4, mode), adamw_options(2));
    int tracks = 0;
    for (const RankResult& rank : r.ranks) {
      const auto& host = rank.timeline.host_memory;
      // The last stage of 1F1B runs each backward right after its forward: nothing to swap.
      if (mode == kNone || rank.host_peak_memory_bytes == 0) {
        EXPECT_TRUE(host.empty()) << "rank " << rank.rank;
        continue;
      }
      ++tracks;
      ASSERT_FALSE(host.empty());
      std::int64_t peak = 0;
      for (std::size_t i = 0; i < host.size(); ++i) {
        if (i > 0) {
          EXPECT_GE(host[i].first, host[i - 1].first);
        }
        EXPECT_GE(host[i].second, 0);
        peak = std::max(peak, host[i].second);
      }
      EXPECT_EQ(peak, rank.host_peak_memory_bytes) << "rank " << rank.rank;
      if (rank.activation_out_bytes > 0) {  // a stage that swapped (stages near the end may not)
        const auto falls = std::adjacent_find(host.begin(), host.end(),
                                              [](auto& a, auto& b) { return b.second < a.second; });
        EXPECT_NE(falls, host.end()) << "rank " << rank.rank << ": the swapped stashes never left";
      }
    }
    EXPECT_GE(tracks, mode == kNone ? 0 : 1);
    if (mode & kActivations) {
      EXPECT_GT(r.ranks[0].activation_out_bytes, 0);
    }
  }
}

// Sharded optimizer offload (each replica reduce-scatters, copies its shard of every tile to its
// host, runs CPU Adam there, uploads, all-gathers) trains bit-identically to the distributed
// optimizer without offload (losses and every rank's final weights), and within 1e-6 relative of
// the plain unsharded run, as the distributed optimizer does; tied (d = 1: both ends one tensor;
// d = 2: the tied exchange) and untied, AdamW and SGD, buckets cutting the tiles.
TEST(OffloadExec, ShardedTrainsAsTheDistributedOptimizer) {
  models::ModelSpec untied = testing::gpt_tiny(4);
  untied.tied_embeddings = false;
  for (const models::ModelSpec& model : {testing::gpt_tiny(4), untied})
    for (const ShardedCase& c : sharded_cases())
      for (const char* optimizer : {"adamw", "sgd"}) {
        if (!model.tied_embeddings && (c.d == 1 || std::string(optimizer) == "sgd")) continue;
        SCOPED_TRACE(describe(c) + " " + optimizer + (model.tied_embeddings ? "" : " untied"));
        TrainOptions o = adamw_options(3);
        o.optimizer = optimizer;
        o.gradient_buckets = c.w;  // buckets whose edges fall inside tiles
        const TrainResult off =
            train_cpu(model, sharded_plan(model, c.schedule, c.w, c.d, true), o);
        const TrainResult dopt =
            train_cpu(model, sharded_plan(model, c.schedule, c.w, c.d, false), o);
        expect_identical(off, dopt);
        Plan plain_plan = sharded_plan(model, c.schedule, c.w, c.d, false);
        plain_plan.distributed_optimizer = false;
        const TrainResult plain = train_cpu(model, plain_plan, o);
        ASSERT_EQ(off.ranks.size(), plain.ranks.size());
        for (std::size_t r = 0; r < plain.ranks.size(); ++r) {
          for (std::size_t k = 0; k < plain.ranks[r].weights.size(); ++k)
            EXPECT_LE(
                testing::max_relative_error(off.ranks[r].weights[k], plain.ranks[r].weights[k]),
                1e-6)
                << "rank " << r << " chunk " << k;
          EXPECT_EQ(off.ranks[r].memory.optimizer, 0) << "rank " << r;  // on the host
          EXPECT_GT(off.ranks[r].host_peak_memory_bytes, 0) << "rank " << r;
        }
        for (std::size_t i = 0; i < plain.steps.size(); ++i)
          EXPECT_NEAR(off.steps[i].loss, plain.steps[i].loss, 1e-6 * std::fabs(plain.steps[i].loss))
              << "step " << i;
      }
}

// Sharded: the measured device peak per rank is the planner's exactly (weights, the whole
// gradient for the reduce-scatter, no optimizer state, versions, activations, workspace); the
// host pool per rank is the planner's (16 B per shard parameter in fp32: master, gradient, m, v;
// replica r's shard of each tile by planner::tile_shard, so replicas differ at w = 3); the bytes
// each rank's copy engines moved are the simulator's exactly (out: the shard once per step after
// the reduce-scatter; in: the shard's uploads) and the closed form's per step.
TEST(OffloadExec, ShardedPeakHostAndBytesMatchThePlanner) {
  const models::ModelSpec model = testing::gpt_tiny(4);
  const int steps = 3;
  for (const ShardedCase& c : sharded_cases()) {
    SCOPED_TRACE(describe(c));
    const Plan p = sharded_plan(model, c.schedule, c.w, c.d, true);
    const TrainResult r = train_cpu(model, p, adamw_options(steps));
    const planner::Estimate e = predicted(model, p);
    const planner::RunReport sim = simulated(model, p, steps);
    const common::Json& so = sim.extra["offload"];
    std::set<std::int64_t> host_sizes;
    for (int rank = 0; rank < p.ranks(); ++rank) {
      const RankResult& got = r.ranks[std::size_t(rank)];
      const planner::DeviceReport& want = e.report.devices[std::size_t(rank)];
      EXPECT_EQ(got.memory.gradients, want.memory.gradients) << "rank " << rank;
      EXPECT_EQ(got.memory.optimizer, 0) << "rank " << rank;
      EXPECT_EQ(want.memory.optimizer, 0) << "rank " << rank;
      EXPECT_EQ(got.memory.weight_versions, want.memory.weight_versions) << "rank " << rank;
      EXPECT_EQ(got.peak_memory_bytes, want.memory.total())
          << "rank " << rank << " " << describe(got.memory) << " vs " << describe(want.memory);
      const common::Json& sr = so["ranks"][std::size_t(rank)];
      EXPECT_EQ(got.host_peak_memory_bytes, sr["host_bytes"].get<std::int64_t>())
          << "rank " << rank;
      // The planner's own count for this replica: 16 B per shard parameter of its tiles.
      std::int64_t shard = 0;
      const models::ModelCosts mc = models::derive_costs(model);
      const traces::Trace trace =
          traces::analytic_trace(model, clusters::load_cluster("v100-32gb-ws").device, {p.b});
      for (int k = 0; k < p.v; ++k)
        shard +=
            planner::chunk_offload(mc, p, planner::chunk_cost(mc, trace, p, p.stage_of(rank), k),
                                   p.replica_of(rank))
                .host_parameters();
      EXPECT_EQ(got.host_peak_memory_bytes, 16 * shard) << "rank " << rank;
      host_sizes.insert(got.host_peak_memory_bytes);
      EXPECT_EQ(got.copy_out_bytes, steps * sr["copy_out_bytes_per_step"].get<std::int64_t>())
          << "rank " << rank;
      EXPECT_EQ(got.copy_in_bytes, steps * sr["copy_in_bytes_per_step"].get<std::int64_t>())
          << "rank " << rank;
      EXPECT_EQ(got.copy_out_bytes, steps * 4 * shard) << "rank " << rank;
      EXPECT_EQ(got.copy_in_bytes, steps * 4 * shard) << "rank " << rank;
    }
    // w = 3 splits some tiles unevenly: replica 0 holds more than the last.
    if (c.w == 3) {
      EXPECT_GT(host_sizes.size(), 1u);
    }
    // Inside a budget of the largest measured peak: the same run fits, with the same bits.
    TrainOptions o = adamw_options(steps);
    o.device_memory = largest_peak(r);
    expect_identical(train_cpu(model, p, o), r);
  }
}

// Sharded beside interleaving (tied ends on different stages; untied on one device, v = 2) and
// full recomputation: bit-identical to the distributed optimizer; the breakdown's gradients and
// weights the planner's and its peak off the planner's by what the distributed optimizer's is
// without offload (the planner's interleaved and recomputed activations are not exact); host
// bytes and bytes moved the simulator's.
TEST(OffloadExec, ShardedOtherShapes) {
  models::ModelSpec untied = testing::gpt_tiny(4);
  untied.tied_embeddings = false;
  struct Shape {
    const char* name;
    models::ModelSpec model;
    int w, d, v;
    bool recompute;
  };
  for (const Shape& k : {Shape{"interleaved tied", testing::gpt_tiny(4), 2, 2, 2, false},
                         Shape{"interleaved untied d=1", untied, 3, 1, 2, false},
                         Shape{"recompute full", testing::gpt_tiny(4), 2, 2, 1, true}}) {
    SCOPED_TRACE(k.name);
    Plan dopt = sharded_plan(k.model, Schedule::one_f_one_b, k.w, k.d, false);
    if (k.v > 1) {
      dopt.schedule = Schedule::interleaved;
      dopt.v = k.v;
      dopt.stage_blocks.clear();
      planner::resolve_stages(dopt, k.model.layers);
    }
    if (k.recompute) dopt.recompute.assign(std::size_t(k.d), planner::Recompute::full);
    Plan off = dopt;
    off.offload = Offload::optimizer;
    planner::check(dopt);
    planner::check(off);
    TrainOptions o = adamw_options(3);
    o.gradient_buckets = 2;
    const TrainResult r = train_cpu(k.model, off, o);
    const TrainResult without = train_cpu(k.model, dopt, o);
    expect_identical(r, without);
    const planner::Estimate e = predicted(k.model, off);
    const planner::Estimate e_without = predicted(k.model, dopt);
    const planner::RunReport sim = simulated(k.model, off, 3);
    for (int rank = 0; rank < off.ranks(); ++rank) {
      const RankResult& got = r.ranks[std::size_t(rank)];
      const planner::MemoryBreakdown& want = e.report.devices[std::size_t(rank)].memory;
      EXPECT_EQ(got.memory.gradients, want.gradients) << "rank " << rank;
      EXPECT_EQ(got.memory.optimizer, 0) << "rank " << rank;
      EXPECT_EQ(got.memory.weights, want.weights) << "rank " << rank;
      // The peak: as the distributed optimizer's without offload, the same difference from the
      // planner's (whose interleaved and recomputed activations are not exact, section 4).
      EXPECT_EQ(got.peak_memory_bytes - want.total(),
                without.ranks[std::size_t(rank)].peak_memory_bytes -
                    e_without.report.devices[std::size_t(rank)].memory.total())
          << "rank " << rank;
      const common::Json& sr = sim.extra["offload"]["ranks"][std::size_t(rank)];
      EXPECT_EQ(got.host_peak_memory_bytes, sr["host_bytes"].get<std::int64_t>())
          << "rank " << rank;
      EXPECT_EQ(got.copy_out_bytes, 3 * sr["copy_out_bytes_per_step"].get<std::int64_t>())
          << "rank " << rank;
      EXPECT_EQ(got.copy_in_bytes, 3 * sr["copy_in_bytes_per_step"].get<std::int64_t>())
          << "rank " << rank;
    }
  }
}

// Sharded: checkpoints hold each replica's shard of the host's optimizer state; a run stopped
// and resumed gives the bits of an unbroken one.
TEST(OffloadExec, ShardedResumeIsBitIdentical) {
  const models::ModelSpec model = testing::gpt_tiny(4);
  for (const ShardedCase& c :
       {ShardedCase{Schedule::one_f_one_b, 2, 2}, ShardedCase{Schedule::two_bw, 3, 2},
        ShardedCase{Schedule::one_f_one_b, 3, 1}}) {
    SCOPED_TRACE(describe(c));
    testing::expect_resume_is_bit_identical(
        model, sharded_plan(model, c.schedule, c.w, c.d, true), adamw_options(4),
        "offshard_" + to_string(c.schedule) + std::to_string(c.w));
  }
}

// The rules both workers share (exec/offload.hpp), on a hand-made layout: stage 0 of a tied model
// (wte, wpe, two blocks) and the last stage (a block, the final norm, the tied copy last).
TEST(OffloadRules, TilesRangesSlotsAndReleases) {
  using detail::Tile;
  const std::vector<TensorSlot> first = {{"wte", 0, 40},      {"wpe", 40, 8},
                                         {"h0.ln1_w", 48, 4}, {"h0.qkv_w", 52, 12},
                                         {"h1.ln1_w", 64, 4}, {"h1.qkv_w", 68, 12}};
  detail::HostTiles t = detail::host_tiles(first, 80, false, 0, 40, 3, 0, 0);
  EXPECT_EQ(t.host_n, 80);
  ASSERT_EQ(t.tiles.size(), 3u);
  EXPECT_EQ(t.tiles[0].begin, 0);
  EXPECT_EQ(t.tiles[0].end, 48);  // the embedding: wte and wpe
  EXPECT_EQ(t.tiles[1].begin, 48);
  EXPECT_EQ(t.tiles[1].end, 64);
  EXPECT_EQ(t.tiles[2].size(), 16);
  EXPECT_EQ(detail::tile_of(t.tiles, 52, 12), 1);
  EXPECT_EQ(detail::tile_of(t.tiles, 40, 16), -1);  // across two layers
  // Stage 0's tied wte stays on the device: only wpe streams out of the embedding's tile.
  std::vector<Tile> r = detail::streamed_ranges(t.tiles[0], 0, 40);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].begin, 40);
  EXPECT_EQ(r[0].end, 48);
  r = detail::streamed_ranges(t.tiles[1], 0, 40);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].size(), 16);
  r = detail::streamed_ranges(t.tiles[1], -1, 0);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].size(), 16);
  const std::vector<TensorSlot> last = {{"h2.ln1_w", 0, 4},
                                        {"h2.qkv_w", 4, 12},
                                        {"lnf_w", 16, 4},
                                        {"lnf_b", 20, 4},
                                        {"lm_head", 24, 40}};
  t = detail::host_tiles(last, 64, true, 24, 40, 2, 1, 0);
  EXPECT_EQ(t.host_n, 24);  // the tied copy is not updated on the last stage
  ASSERT_EQ(t.tiles.size(), 2u);
  EXPECT_EQ(t.tiles[1].begin, 16);
  EXPECT_EQ(t.tiles[1].end, 24);
  std::string msg =
      testing::error_of<Error>([&] { detail::host_tiles(last, 64, true, 24, 40, 3, 1, 0); });
  EXPECT_NE(msg.find("rank 1: chunk 0 has 2 layers, the program 3 CPU Adam tiles"),
            std::string::npos)
      << msg;
  msg = testing::error_of<Error>([&] { detail::host_tiles(last, 64, true, 16, 4, 2, 1, 0); });
  EXPECT_NE(msg.find("the tied copy is not the last tensor"), std::string::npos) << msg;

  // ZeRO-Offload's shards of a tile (planner::tile_shard): floor(n / w) + 1 for the first
  // n mod w replicas, in replica order, covering the tile exactly once; empty when n < w.
  const std::int64_t sizes[] = {4, 3, 3};
  std::int64_t next = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const planner::TiedShard sh = planner::tile_shard(10, 3, rep);
    EXPECT_EQ(sh.begin, next) << rep;
    EXPECT_EQ(sh.end - sh.begin, sizes[rep]) << rep;
    next = sh.end;
  }
  EXPECT_EQ(next, 10);
  EXPECT_EQ(planner::tile_shard(2, 3, 2).begin, 2);
  EXPECT_EQ(planner::tile_shard(2, 3, 2).end, 2);
  EXPECT_EQ(planner::tile_shard(9, 3, 1).begin, 3);
  EXPECT_EQ(planner::tile_shard(9, 3, 1).end, 6);

  const models::ModelSpec model = testing::gpt_tiny(4);
  EXPECT_EQ(detail::upload_slot(make_plan(model, Schedule::one_f_one_b, 2, 1, 4, kOptimizer), 0),
            0);
  EXPECT_EQ(detail::upload_slot(make_plan(model, Schedule::two_bw, 2, 1, 4, kOptimizer), 0), 1);
  EXPECT_EQ(detail::upload_slot(make_plan(model, Schedule::two_bw, 2, 1, 4, kOptimizer), 1), 0);

  std::vector<planner::Op> ops(4);
  ops[0].kind = planner::OpKind::backward;
  ops[1].kind = planner::OpKind::send_gradient;
  ops[2].kind = planner::OpKind::copy_gradient_to_host;
  ops[3].kind = planner::OpKind::forward;
  EXPECT_EQ(detail::gradient_copy_op(ops, 0), 2);
  EXPECT_EQ(detail::gradient_copy_op(ops, 3), 3);

  // A download after compute op 4 is due when compute slot 6 begins, not before.
  detail::HeldDownloads<int> held;
  EXPECT_FALSE(held.due(100));
  held.push(4, 7);
  held.push(5, 8);
  EXPECT_FALSE(held.due(5));
  EXPECT_TRUE(held.due(6));
  EXPECT_TRUE(held.holds(8));
  EXPECT_EQ(held.pop(), 7);
  EXPECT_FALSE(held.due(6));
  EXPECT_TRUE(held.due(7));
  EXPECT_EQ(held.pop(), 8);
  EXPECT_TRUE(held.empty());
  EXPECT_FALSE(held.holds(8));
}

// A device for Swaps that records what it is asked to do, in order: the life of a swapped stash
// (the rule both workers run) checked call by call.
struct SwapLog {
  struct Swap {
    int key = -1;
    bool up = false;
  };
  std::vector<std::string> calls;
  void swap_out(Swap& sw, const int& key, int op) {
    sw.key = key;
    calls.push_back(fmt::format("out {} op {}", key, op));
  }
  void swap_done(Swap& sw) { calls.push_back(fmt::format("done {}", sw.key)); }
  void swap_in(const std::shared_ptr<Swap>& sw, int op) {
    sw->up = true;
    calls.push_back(fmt::format("in {} op {}", sw->key, op));
  }
  bool swapped_in(const Swap& sw) const { return sw.up; }
  void swap_back(Swap& sw, const int& key) {
    EXPECT_EQ(sw.key, key);
    calls.push_back(fmt::format("back {}", key));
  }
};

TEST(OffloadRules, SwapsReleaseAtTheSecondSlotReclaimOldestFirstAndUploadAfterTheirDownload) {
  SwapLog log;
  detail::Swaps<SwapLog, SwapLog::Swap, int> swaps(log);
  swaps.to_host(10, 0, 1);  // microbatch 10's forward was compute op 0; its copy is program op 1
  swaps.to_host(11, 1, 3);
  swaps.release_due(1);  // the slot after the forward: the download overlaps it, nothing goes
  EXPECT_EQ(log.calls, (std::vector<std::string>{"out 10 op 1", "out 11 op 3"}));
  swaps.release_due(2);  // the second slot after forward 0
  EXPECT_EQ(log.calls.back(), "done 10");
  EXPECT_TRUE(swaps.reclaim());  // a budget's early release: the oldest held
  EXPECT_EQ(log.calls.back(), "done 11");
  EXPECT_FALSE(swaps.reclaim());  // none held
  // An upload whose download's buffer is still held (not yet due) releases it first.
  swaps.to_host(12, 4, 7);
  swaps.to_device(12, 5, 8, 3);
  EXPECT_EQ(log.calls, (std::vector<std::string>{"out 10 op 1", "out 11 op 3", "done 10", "done 11",
                                                 "out 12 op 7", "done 12", "in 12 op 8"}));
  // The backward takes it back once, and only after its upload was issued.
  EXPECT_TRUE(swaps.back(12, 3));
  EXPECT_EQ(log.calls.back(), "back 12");
  EXPECT_FALSE(swaps.back(12, 3));  // not swapped (any more): the stash stayed on the device
  try {
    swaps.back(11, 3);
    ADD_FAILURE() << "a backward before its upload was taken";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rank 3: backward before its stash is back on the device");
  }
  try {
    swaps.to_device(99, 6, 9, 3);
    ADD_FAILURE() << "an upload of a stash that never went down was taken";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "rank 3: copy_activation_to_device of a stash that never went to the host");
  }
  // Uploads due by the slot release their downloads at the slot, before their own.
  swaps.to_host(20, 10, 20);
  swaps.to_host(21, 11, 22);
  swaps.to_device(21, 12, 24, 3);  // slot 12: download 20 due; 21 held until its upload
  EXPECT_EQ(std::vector<std::string>(log.calls.end() - 5, log.calls.end()),
            (std::vector<std::string>{"out 20 op 20", "out 21 op 22", "done 20", "done 21",
                                      "in 21 op 24"}));
}

// A device that records what the weight slots' rule asks of it; its events are numbers (0: none).
struct SlotLog {
  std::vector<std::string> calls;
  void allocate_slot(int slot) { calls.push_back(fmt::format("allocate {}", slot)); }
  void before_slot_write(int slot, detail::SlotWriter writer, int last_send) {
    calls.push_back(fmt::format("{} slot {} after send {}",
                                writer == detail::SlotWriter::update ? "update" : "upload", slot,
                                last_send));
  }
  void retire_reader(int sent) {  // 0: no send read the slot since its last write
    if (sent) calls.push_back(fmt::format("retire {}", sent));
  }
};

TEST(OffloadRules, WeightSlotsAreWrittenAfterTheirLastTiedSendAndAllocatedOnFirstUse) {
  planner::Plan flush;
  flush.schedule = Schedule::one_f_one_b;
  planner::Plan two_bw;
  two_bw.schedule = Schedule::two_bw;
  {  // A flush schedule updates in place: slot 0, after the last send that read it.
    SlotLog log;
    detail::WeightSlots<SlotLog, int> slots(log);
    slots.set_rank(2);
    slots.read_by(0, 7);  // send_tied_weights of version 0 out of slot 0, event 7
    slots.read_by(0, 8);  // a later one on the same engine supersedes it
    slots.free_version(0);
    const int target = slots.begin_update(1);
    EXPECT_EQ(target, 0);
    slots.end_update(1, target);
    EXPECT_EQ(slots.slot_of(1), 0);
    EXPECT_EQ(log.calls, (std::vector<std::string>{"retire 7", "update slot 0 after send 8"}));
    slots.free_version(1);
    slots.begin_update(2);  // no send read it since: nothing to wait for
    EXPECT_EQ(log.calls.back(), "update slot 0 after send 0");
  }
  {  // 2BW: the second version takes slot 1, allocated then; afterwards the slots alternate.
    SlotLog log;
    detail::WeightSlots<SlotLog, int> slots(log);
    slots.read_by(0, 3);
    EXPECT_EQ(slots.begin_update(1), 1);
    slots.end_update(1, 1);
    slots.read_by(1, 4);
    slots.free_version(0);
    EXPECT_EQ(slots.begin_update(2), 0);
    slots.end_update(2, 0);
    slots.free_version(1);
    EXPECT_EQ(slots.begin_update(3), 1);
    EXPECT_EQ(log.calls, (std::vector<std::string>{"update slot 1 after send 0", "allocate 1",
                                                   "update slot 0 after send 3",
                                                   "update slot 1 after send 4"}));
    try {  // versions 2 and 3 live, nothing freed: no slot for a fourth
      slots.end_update(3, 1);
      slots.begin_update(4);
      ADD_FAILURE() << "an update without a free slot was taken";
    } catch (const Error& e) {
      EXPECT_STREQ(e.what(), "rank 0: no free weight slot for version 4");
    }
  }
  {  // Optimizer offload's uploads, 2BW: the first upload of a step picks and readies the slot
     // the shadow leaves; the others of the step write the same one.
    SlotLog log;
    detail::WeightSlots<SlotLog, int> slots(log);
    slots.set_rank(5);
    slots.read_by(0, 9);
    EXPECT_EQ(slots.upload_target(two_bw), 1);
    EXPECT_EQ(slots.upload_target(two_bw), 1);
    EXPECT_EQ(slots.end_upload(1), 1);
    slots.free_version(0);
    EXPECT_EQ(slots.upload_target(two_bw), 0);
    EXPECT_EQ(slots.end_upload(2), 0);
    EXPECT_EQ(slots.newest(), 0);
    EXPECT_EQ(log.calls, (std::vector<std::string>{"upload slot 1 after send 0", "allocate 1",
                                                   "upload slot 0 after send 9"}));
    try {
      slots.end_upload(3);
      ADD_FAILURE() << "an optimizer step without uploads was taken";
    } catch (const Error& e) {
      EXPECT_STREQ(e.what(), "rank 5: optimizer step of version 3 without its uploads");
    }
  }
  {  // Flush schedules' uploads write in place, after the slot's last send.
    SlotLog log;
    detail::WeightSlots<SlotLog, int> slots(log);
    slots.read_by(0, 6);
    EXPECT_EQ(slots.upload_target(flush), 0);
    slots.free_version(0);
    slots.end_upload(1);
    EXPECT_EQ(slots.slot_of(1), 0);
    EXPECT_EQ(log.calls, (std::vector<std::string>{"upload slot 0 after send 6"}));
  }
  {  // Offload chunks: the newest version moves, nothing is written or allocated.
    SlotLog log;
    detail::WeightSlots<SlotLog, int> slots(log);
    slots.free_version(0);
    slots.advance(1);
    EXPECT_EQ(slots.slot_of(1), 0);
    EXPECT_TRUE(log.calls.empty());
  }
}

// A device that records what the tied exchange's rule asks of it.
struct TiedLog {
  std::vector<std::string> calls;
  void note(const char* what, const planner::Op& op, planner::TiedShard sh, int hold = -1) {
    calls.push_back(fmt::format("{} peer {} [{}, {}){}", what, op.peer, sh.begin, sh.end,
                                hold < 0 ? "" : (hold ? " held" : " now")));
  }
  void tied_gradient_out(const planner::Op& op, planner::TiedShard sh) { note("grad out", op, sh); }
  void tied_gradient_in(const planner::Op& op, planner::TiedShard sh, bool hold) {
    note("grad in", op, sh, hold);
  }
  void tied_gradient_gather(const planner::Op& op, planner::TiedShard sh) {
    note("grad gather", op, sh);
  }
  void tied_weights_out(const planner::Op& op, planner::TiedShard sh) {
    note("weights out", op, sh);
  }
  void tied_weights_in(const planner::Op& op, planner::TiedShard sh, bool hold) {
    note("weights in", op, sh, hold);
  }
  void tied_weights_gather(const planner::Op& op, planner::TiedShard sh) {
    note("weights gather", op, sh);
  }
};

planner::Op tied_op(planner::OpKind kind, int peer) {
  planner::Op op;
  op.kind = kind;
  op.peer = peer;
  op.chunk = 0;
  return op;
}

TEST(OffloadRules, TiedExchangeMovesEachReplicasShardAndGathersWhatItHeld) {
  using planner::OpKind;
  {  // w = 1: the whole tensor, the gradient added as it arrives, no gathers.
    TiedLog log;
    detail::TiedExchange<TiedLog> tied(log);
    tied.run(tied_op(OpKind::send_tied_gradient, 3), 40, 10, 1, 0, 3);
    tied.run(tied_op(OpKind::recv_tied_gradient, 3), 0, 10, 1, 0, 0);
    tied.run(tied_op(OpKind::send_tied_weights, 3), 0, 10, 1, 0, 0);
    tied.run(tied_op(OpKind::recv_tied_weights, 0), 40, 10, 1, 0, 3);
    EXPECT_EQ(log.calls, (std::vector<std::string>{
                             "grad out peer 3 [0, 10)", "grad in peer 3 [0, 10) now",
                             "weights out peer 3 [0, 10)", "weights in peer 0 [0, 10) now"}));
  }
  {  // w = 3, replica 2 of a 10-element tensor: its shard [8, 10), held until gathered.
    TiedLog log;
    detail::TiedExchange<TiedLog> tied(log);
    tied.run(tied_op(OpKind::recv_tied_gradient, 5), 0, 10, 3, 2, 1);
    tied.run(tied_op(OpKind::gather_tied_gradient, -1), 0, 10, 3, 2, 1);
    tied.run(tied_op(OpKind::recv_tied_weights, 1), 0, 10, 3, 2, 5);
    tied.run(tied_op(OpKind::gather_tied_weights, -1), 0, 10, 3, 2, 5);
    EXPECT_EQ(log.calls, (std::vector<std::string>{
                             "grad in peer 5 [8, 10) held", "grad gather peer -1 [8, 10)",
                             "weights in peer 1 [8, 10) held", "weights gather peer -1 [8, 10)"}));
    // A gather with nothing received, a second receive before the gather, a chunk without the
    // tied tensor: one line each, naming the rank.
    const auto error = [&](planner::OpKind kind, std::int64_t offset) {
      try {
        tied.run(tied_op(kind, 1), offset, 10, 3, 2, 5);
      } catch (const Error& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    EXPECT_EQ(error(OpKind::gather_tied_gradient, 0),
              "rank 5: gather_tied_gradient without a received shard to gather");
    tied.run(tied_op(OpKind::recv_tied_weights, 1), 0, 10, 3, 2, 5);
    EXPECT_EQ(error(OpKind::recv_tied_weights, 0),
              "rank 5: recv_tied_weights before the last received shard was gathered");
    EXPECT_EQ(error(OpKind::send_tied_weights, -1),
              "rank 5: send_tied_weights on chunk 0, which holds no tied tensor");
  }
  {  // d = 1, v > 1: the model chunks holding the embedding and the head, found on one device.
    struct FakeChunk {
      bool first;
      std::int64_t tied_offset;
    };
    std::vector<FakeChunk> chunks{{true, 0}, {false, -1}, {false, 300}};
    const auto [embedding, head] = detail::tied_ends_on_one_device(chunks);
    EXPECT_EQ(embedding, &chunks[0]);
    EXPECT_EQ(head, &chunks[2]);
    std::vector<FakeChunk> one{{true, 0}, {false, -1}};  // untied, or the head elsewhere
    EXPECT_EQ(detail::tied_ends_on_one_device(one).first, nullptr);
    // The head's sink: its tied tensor [300, 310) into the embedding's gradient, the rest in place.
    struct Sink {
      virtual ~Sink() = default;
      virtual float* at(std::int64_t offset, std::int64_t size) = 0;
      virtual void layer_done(std::int64_t begin, std::int64_t end) = 0;
    };
    std::vector<float> head_grads(310), embedding_grads(40);
    detail::TiedEndsSink<Sink, float> sink(head_grads.data(), 300, 10, embedding_grads.data() + 4);
    Sink& base = sink;
    EXPECT_EQ(base.at(300, 10), embedding_grads.data() + 4);
    EXPECT_EQ(base.at(305, 5), embedding_grads.data() + 9);
    EXPECT_EQ(base.at(0, 300), head_grads.data());
    EXPECT_EQ(base.at(299, 1), head_grads.data() + 299);
  }
}

// A device that records what optimizer offload's rule asks of it. A mark is a number, given in
// order by every engine (0: none).
struct OffloadLog {
  using Mark = int;
  using Engine = detail::Engine;
  std::vector<std::string> calls;
  int marks = 0;
  float tiles[2][64] = {};
  float tied[16] = {};
  static const char* name(Engine e) {
    switch (e) {
      case Engine::compute:
        return "compute";
      case Engine::d2h:
        return "d2h";
      case Engine::h2d:
        return "h2d";
      case Engine::host:
        return "host";
    }
    return "?";
  }
  int mark(Engine e) {
    calls.push_back(fmt::format("mark {} {}", name(e), ++marks));
    return marks;
  }
  void after(Engine e, int m) {
    if (m) calls.push_back(fmt::format("{} after {}", name(e), m));
  }
  void drop(int m) {
    if (m) calls.push_back(fmt::format("drop {}", m));
  }
  float* zero_tile(int buffer, std::int64_t n) {
    calls.push_back(fmt::format("zero buffer {} x {}", buffer, n));
    return tiles[buffer];
  }
  float* tile_at(int buffer) { return tiles[buffer]; }
  void stream_tile(std::size_t chunk, int buffer, detail::Tile t,
                   const std::vector<detail::Tile>& ranges, int op) {
    std::string r;
    for (const detail::Tile& x : ranges)
      r += fmt::format(" [{}, {})", x.begin, x.end);
    calls.push_back(fmt::format("stream chunk {} buffer {} tile [{}, {}):{} op {}", chunk, buffer,
                                t.begin, t.end, r, op));
  }
  void gradient_sums_done(std::size_t chunk) { calls.push_back(fmt::format("sums {}", chunk)); }
  bool keeps_tied_gradient(std::size_t chunk) const { return chunk == 0; }
  void download_tied_gradient(std::size_t chunk, int op) {
    calls.push_back(fmt::format("tied down {} op {}", chunk, op));
  }
  void download_gradient_shards(std::size_t chunk, int op) {
    calls.push_back(fmt::format("shards down {} op {}", chunk, op));
  }
  void host_adam(std::size_t chunk, int tile, int update, int op) {
    calls.push_back(fmt::format("adam {}.{} update {} op {}", chunk, tile, update, op));
  }
  void upload_tile(std::size_t chunk, int tile, int slot, int op) {
    calls.push_back(fmt::format("upload {}.{} slot {} op {}", chunk, tile, slot, op));
  }
  // The weight slots' device calls.
  void allocate_slot(int slot) { calls.push_back(fmt::format("allocate {}", slot)); }
  void before_slot_write(int slot, detail::SlotWriter, int) {
    calls.push_back(fmt::format("ready slot {}", slot));
  }
  void retire_reader(int) {}
};

planner::Op offload_op(planner::OpKind kind, int chunk, int microbatch = -1, int tile = -1) {
  planner::Op op;
  op.kind = kind;
  op.chunk = chunk;
  op.microbatch = microbatch;
  op.bucket = tile;
  return op;
}

TEST(OffloadRules, OptimizerOffloadOrdersCopiesAdamAndUploads) {
  using planner::OpKind;
  Plan flush;
  flush.schedule = Schedule::one_f_one_b;
  // Stage 0's chunk 0: tiles embedding [0, 16) (the tied wte [0, 10) and wpe), a block [16, 30),
  // the final norm [30, 40); chunk 1 keeps no tied gradient.
  const std::vector<detail::Tile> tiles{{0, 16}, {16, 30}, {30, 40}};
  OffloadLog log;
  detail::WeightSlots<OffloadLog, int> slots(log);
  slots.set_rank(3);
  detail::OptimizerOffload<OffloadLog, detail::WeightSlots<OffloadLog, int>> off(log, slots);
  off.setup(3, flush, false, {3, 1});
  detail::StreamedBackward<float> b(0, 7, tiles, 0, 10, log.tied);
  // The backward, last layer first: each layer in the free tile buffer, zeroed once its previous
  // layer's copy is done; the tied tensor's gradient on the device; the rest streamed after the
  // compute that wrote it.
  EXPECT_EQ(off.gradient_at(b, 30, 10), log.tiles[0]);
  EXPECT_EQ(off.gradient_at(b, 34, 6), log.tiles[0] + 4);
  off.layer_done(b);
  EXPECT_EQ(off.gradient_at(b, 16, 14), log.tiles[1]);
  off.layer_done(b);
  EXPECT_EQ(off.gradient_at(b, 0, 10), log.tied);
  EXPECT_EQ(off.gradient_at(b, 10, 6), log.tiles[0] + 10);
  off.layer_done(b);
  EXPECT_EQ(log.calls,
            (std::vector<std::string>{"zero buffer 0 x 10",
                                      "mark compute 1",
                                      "d2h after 1",
                                      "drop 1",
                                      "stream chunk 0 buffer 0 tile [30, 40): [30, 40) op 7",
                                      "mark d2h 2",
                                      "zero buffer 1 x 14",
                                      "mark compute 3",
                                      "d2h after 3",
                                      "drop 3",
                                      "stream chunk 0 buffer 1 tile [16, 30): [16, 30) op 7",
                                      "mark d2h 4",
                                      "compute after 2",
                                      "zero buffer 0 x 16",
                                      "mark compute 5",
                                      "d2h after 5",
                                      "drop 5",
                                      "stream chunk 0 buffer 0 tile [0, 16): [10, 16) op 7",
                                      "drop 2",
                                      "mark d2h 6"}));
  // The step: the next compute after the backward's last copy; the tied gradient down after its
  // sums; CPU Adam after every download; the upload after its tile's Adam; the device's step
  // after the last upload and the last download.
  log.calls.clear();
  off.run(offload_op(OpKind::copy_gradient_to_host, 0, 3), 19);
  off.run(offload_op(OpKind::copy_gradient_to_host, 0), 20);
  off.run(offload_op(OpKind::host_optimizer_step, 0, -1, 1), 21);
  off.run(offload_op(OpKind::copy_parameters_to_device, 0, -1, 1), 22);
  EXPECT_EQ(off.finish(1), 0);
  EXPECT_EQ(log.calls, (std::vector<std::string>{
                           "compute after 6", "sums 0", "mark compute 7", "d2h after 7", "drop 7",
                           "tied down 0 op 20", "mark d2h 8", "host after 8", "drop 8",
                           "adam 0.1 update 1 op 21", "mark host 9", "ready slot 0", "h2d after 9",
                           "upload 0.1 slot 0 op 22", "mark h2d 10", "compute after 10",
                           "mark d2h 11", "compute after 11", "drop 11"}));
  // Bad programs: one line each, naming the rank.
  const auto error = [&](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error([&] { off.gradient_at(b, 40, 5); }),
            "rank 3: gradients [40, 45) of chunk 0 are in no layer");
  off.gradient_at(b, 30, 10);
  EXPECT_EQ(error([&] { off.gradient_at(b, 16, 4); }),
            "rank 3: a layer's gradients began before the previous layer's were done");
  EXPECT_EQ(error([&] { off.run(offload_op(OpKind::copy_gradient_to_host, 1), 0); }),
            "rank 3: tied gradient copy on chunk 1, which keeps none");
  EXPECT_EQ(error([&] { off.run(offload_op(OpKind::host_optimizer_step, 0, -1, 5), 0); }),
            "rank 3: host_optimizer_step of tile 5 of chunk 0, which has 3");
  EXPECT_EQ(error([&] { off.run(offload_op(OpKind::copy_parameters_to_device, 4, -1, 0), 0); }),
            "rank 3: copy_parameters_to_device of chunk 4, which the rank does not hold");
  EXPECT_EQ(error([&] { off.run(offload_op(OpKind::copy_activation_to_host, 0, 0), 0); }),
            "rank 3: copy_activation_to_host is not an optimizer offload op");
  EXPECT_EQ(error([&] { off.finish(2); }),
            "rank 3: optimizer step of version 2 without its uploads");
  // Sharded (w > 1): every tile's shard goes down once, after the chunk's reduce-scatter.
  log.calls.clear();
  log.marks = 0;
  off.setup(3, flush, true, {3, 1});
  off.run(offload_op(OpKind::copy_gradient_to_host, 1), 30);
  EXPECT_EQ(log.calls, (std::vector<std::string>{"sums 1", "mark compute 1", "d2h after 1",
                                                 "drop 1", "shards down 1 op 30"}));
}

}  // namespace
// A device that records what the chunk ops' rule (route_chunk_op) asks of it: two chunks of
// `parts` units each, which units are on the device.
struct ChunkLog {
  int parts = 1;
  std::vector<std::vector<bool>> on;  // per chunk, per unit
  std::vector<std::string> calls;
  int chunk_parts() const { return parts; }
  int chunk_count() const { return int(on.size()); }
  bool unit_on_device(int chunk, int unit) const {
    return on[std::size_t(chunk)][std::size_t(unit)];
  }
  void download_for_adam(const planner::Op& op) {
    calls.push_back(fmt::format("down {}{}", op.bucket, op.part ? " part" : ""));
  }
  void step_host(const planner::Op& op, int chunk) {
    calls.push_back(fmt::format("host adam {} step {}", chunk, op.step));
  }
  void step_device(const planner::Op& op, int chunk) {
    calls.push_back(fmt::format("device adam {} step {}", chunk, op.step));
  }
};

// A device that records what a layer's moment (run_chunk_moment) asks of it.
struct MomentLog {
  std::vector<std::string> calls;
  std::vector<int> gathered;  // the units whose part needs the other replicas'
  void drop_chunk(int u) { calls.push_back(fmt::format("drop {}", u)); }
  void download_chunk(int u, int at) { calls.push_back(fmt::format("down {} op {}", u, at)); }
  void evictions_done(bool any) { calls.push_back(any ? "evicted" : "nothing evicted"); }
  void upload_part(int u, int at) { calls.push_back(fmt::format("part up {} op {}", u, at)); }
  void upload_chunk(int u, int at) { calls.push_back(fmt::format("up {} op {}", u, at)); }
  void uploads_done() { calls.push_back("uploaded"); }
  bool part_gathered(int u) const {
    return std::find(gathered.begin(), gathered.end(), u) != gathered.end();
  }
  void gather_parts(const std::vector<std::pair<int, int>>& units) {
    for (const auto& [u, at] : units)
      calls.push_back(fmt::format("gather {} op {}", u, at));
  }
};

planner::Op chunk_op(planner::OpKind kind, int bucket, int layer = -1) {
  planner::Op op;
  op.kind = kind;
  op.bucket = bucket;
  op.layer = layer;
  op.step = 4;
  return op;
}

// The chunk ops' rule both workers run: a copy tagged with a layer is held for it, an untagged one
// is the step's download for CPU Adam; Adam on the host needs every unit of the chunk there, on
// the device every unit on the device; a unit index is chunk * parts + unit (2bw: three parts).
TEST(OffloadRules, ChunkOpsAreHeldRoutedOrRefusedInOneLine) {
  using planner::OpKind;
  detail::ChunkBook book;
  ChunkLog log;
  log.parts = 3;
  log.on = {{true, true, true}, {false, false, false}};
  detail::route_chunk_op(log, book, chunk_op(OpKind::copy_chunk_to_host, 4, 2), 7, 0);
  EXPECT_TRUE(log.calls.empty());
  EXPECT_TRUE(book.pending());
  detail::route_chunk_op(log, book, chunk_op(OpKind::copy_chunk_to_host, 5), 8, 0);
  detail::route_chunk_op(log, book, chunk_op(OpKind::chunk_step_device, 0), 9, 0);
  detail::route_chunk_op(log, book, chunk_op(OpKind::chunk_step_host, 1), 10, 0);
  EXPECT_EQ(log.calls,
            (std::vector<std::string>{"down 5", "device adam 0 step 4", "host adam 1 step 4"}));
  const detail::ChunkBook::Moment held = book.take(2);
  ASSERT_EQ(held.out.size(), 1u);
  EXPECT_EQ(held.out[0].first.bucket, 4);
  EXPECT_EQ(held.out[0].second, 7);
  EXPECT_FALSE(book.pending());
  const auto error = [&](const planner::Op& op) {
    try {
      detail::route_chunk_op(log, book, op, 11, 3);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  log.on[1][2] = true;  // one unit of chunk 1 on the device
  EXPECT_EQ(error(chunk_op(OpKind::chunk_step_host, 1)),
            "rank 3: CPU Adam of chunk 1, which is on the device");
  EXPECT_EQ(error(chunk_op(OpKind::chunk_step_device, 1)),
            "rank 3: Adam on the device of chunk 1, which is on the host");
  EXPECT_EQ(error(chunk_op(OpKind::copy_chunk_to_device, 2)),
            "rank 3: an upload of chunk 0 at the optimizer step");
  EXPECT_EQ(error(chunk_op(OpKind::copy_chunk_to_host, 6)),
            "rank 3: copy_chunk_to_host of chunk 2, which does not exist");
  EXPECT_EQ(error(chunk_op(OpKind::chunk_step_host, -1)),
            "rank 3: chunk_step_host of chunk -1, which does not exist");
  EXPECT_EQ(error(chunk_op(OpKind::forward, 0)), "rank 3: forward is not a chunk op");
  // More pipeline messages held than the plan counts (the book's, here none): one line.
  try {
    book.check_messages(1, 5, OpKind::forward, 2);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "rank 0: op 5 (forward) holds 1 pipeline messages, more than the 0 the plan counts "
              "on stage 2 (planner::message_buffers)");
  }
  EXPECT_NO_THROW(book.check_messages(0, 5, OpKind::forward, 2));
}

// The unit rules both workers' copies use: which parts a unit moves, 2bw's edge segments, and a
// unit moved to where it is already, in one line.
TEST(OffloadRules, UnitPartsEdgeSegmentsAndMovesToWhereItIs) {
  EXPECT_EQ(detail::unit_parts(1, 0), (std::vector<int>{0, 2}));
  EXPECT_EQ(detail::unit_parts(3, 2), (std::vector<int>{2}));
  EXPECT_FALSE(detail::edge_segment(1, 0, 0, 4));
  EXPECT_TRUE(detail::edge_segment(3, 2, 2, 4));   // the first step of a run resumed at 2
  EXPECT_TRUE(detail::edge_segment(3, 5, 2, 4));   // its last
  EXPECT_FALSE(detail::edge_segment(3, 3, 2, 4));  // between them
  EXPECT_NO_THROW(detail::check_unit_move(0, 3, 7, true, false));
  EXPECT_NO_THROW(detail::check_unit_move(0, 1, 2, false, true));
  const auto error = [](int parts, int u, bool on, bool to) {
    try {
      detail::check_unit_move(4, parts, u, on, to);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error(3, 7, true, true), "rank 4: chunk 2 (part 1) to the device, where it is already");
  EXPECT_EQ(error(1, 2, false, false), "rank 4: chunk 2 to the host, where it is already");
  // A stage's chunk schedule, or one line when the programs have none for it.
  planner::Programs programs;
  try {
    detail::stage_chunk_schedule(programs, 0, 5);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "rank 5: offload chunks without a chunk schedule");
  }
  auto schedules = std::make_shared<std::vector<planner::ChunkSchedule>>(2);
  programs.chunks = schedules;
  EXPECT_EQ(detail::stage_chunk_schedule(programs, 1, 0).get(), &(*schedules)[1]);
  EXPECT_THROW(detail::stage_chunk_schedule(programs, 2, 0), Error);
}

// A layer's moment, the order both workers run its copies in: evictions (drops of sharded units,
// downloads of the rest) in program order, then the wait for them, then the uploads (parts and
// whole units) in program order, their wait, then the parts that need the other replicas'
// gathered; a later layer's copies stay held; an empty moment still waits.
TEST(OffloadRules, AMomentEvictsThenUploadsThenGathers) {
  using planner::OpKind;
  detail::ChunkBook book;
  const auto held = [](OpKind kind, int unit, int layer, bool part) {
    planner::Op op = chunk_op(kind, unit, layer);
    op.part = part;
    return op;
  };
  book.hold(held(OpKind::copy_chunk_to_host, 3, 2, false), 10);
  book.hold(held(OpKind::copy_chunk_to_device, 1, 2, true), 11);
  book.hold(held(OpKind::copy_chunk_to_host, 4, 2, true), 12);
  book.hold(held(OpKind::copy_chunk_to_device, 5, 2, false), 13);
  book.hold(held(OpKind::copy_chunk_to_device, 7, 2, true), 14);
  book.hold(held(OpKind::copy_chunk_to_host, 6, 3, false), 15);
  MomentLog log;
  log.gathered = {1};
  detail::run_chunk_moment(log, book, 2);
  EXPECT_EQ(log.calls, (std::vector<std::string>{"down 3 op 10", "drop 4", "evicted",
                                                 "part up 1 op 11", "up 5 op 13", "part up 7 op 14",
                                                 "uploaded", "gather 1 op 11"}));
  EXPECT_TRUE(book.pending());
  log.calls.clear();
  detail::run_chunk_moment(log, book, 3);
  EXPECT_EQ(log.calls, (std::vector<std::string>{"down 6 op 15", "evicted", "uploaded"}));
  EXPECT_FALSE(book.pending());
  log.calls.clear();
  detail::run_chunk_moment(log, book, 4);
  EXPECT_EQ(log.calls, (std::vector<std::string>{"nothing evicted", "uploaded"}));
}

}  // namespace pw::exec
