// Megatron tensor (and sequence) parallelism in the CPU executor (one thread per device): t = 2
// and 4 train like t = 1 (the same per-step losses within 1e-5 relative over 20 steps, each
// shard's final weights its slice of t = 1's within 1e-5 of the tensor's largest) for every
// schedule, with pipeline depth and data parallelism, tied and untied embeddings and Megatron's
// vocabulary padding; the measured memory per device is the planner's; bad t is one line naming
// the field.
#include <cmath>
#include <filesystem>
#include <string>
#include <tuple>

#include <gtest/gtest.h>

#include "common/error.hpp"
#include "exec/checkpoint.hpp"
#include "exec/run_common.hpp"
#include "exec/runtime.hpp"
#include "planner/cost_model.hpp"
#include "planner/plan.hpp"
#include "test_util.hpp"
#include "traces/analytic.hpp"

namespace pw::exec {
namespace {

using planner::Plan;
using planner::Schedule;

Plan make_plan(Schedule s, int t, int w, int d, int m, int layers) {
  Plan p;
  p.schedule = s;
  p.t = t;
  p.w = w;
  p.d = d;
  p.b = 2;
  p.m = m;
  p.v = s == Schedule::interleaved ? 2 : 1;
  planner::resolve_stages(p, layers);
  return p;
}

TrainOptions options(int steps, const std::string& optimizer = "sgd") {
  TrainOptions o;
  o.steps = steps;
  o.optimizer = optimizer;
  o.lr = optimizer == "sgd" ? 0.05f : 1e-3f;
  // AdamW steps by about lr even where a gradient is rounding noise: a large eps keeps the
  // comparison about the gradients (as tests/test_runtime.cpp does).
  o.eps = 1e-3f;
  o.seed = 7;
  return o;
}

// gpt-tiny's shape (4 heads, ffn 256) with its own untied head and a vocabulary of 250 padded to a
// multiple of 4t: 252 rows at t = 1, 256 at t = 2 and t = 4 (logits of the padding masked).
models::ModelSpec untied_padded(std::int64_t layers) {
  models::ModelSpec m = testing::gpt_tiny(layers);
  m.name = "tiny-untied-padded";
  m.vocab = 250;
  m.vocab_multiple = 4;
  m.tied_embeddings = false;
  return m;
}

// The largest difference between every device's final weights and the slices of the t = 1 run's
// weights its shard holds (heads of qkv, FFN rows and columns, input columns of the projections,
// vocabulary rows below V; norms, biases of the projections and positions whole), relative to the
// largest weight of the tensor.
double worst_shard_difference(const models::ModelSpec& model, const Plan& p, const TrainResult& one,
                              const TrainResult& many) {
  double worst = 0;
  for (std::size_t device = 0; device < many.ranks.size(); ++device) {
    const int rank = int(device) / p.t, tp = int(device) % p.t;
    for (int c = 0; c < p.v; ++c) {
      StageSpec whole = detail::chunk_spec(model, p, p.stage_of(rank), c), shard = whole;
      shard.t = p.t;
      shard.tp_rank = tp;
      shard.sp = p.sp;
      const auto a = make_cpu_stage(whole), z = make_cpu_stage(shard);
      const std::vector<float>& w1 = one.ranks[std::size_t(rank)].weights[std::size_t(c)];
      const std::vector<float>& wt = many.ranks[device].weights[std::size_t(c)];
      for (std::size_t k = 0; k < z->layout().size(); ++k) {
        const TensorSlot& sz = z->layout()[k];
        const TensorSlot& s1 = a->layout()[k];
        const std::string& n = sz.name;
        const std::int64_t C = model.hidden, F = model.ffn, Ct = C / p.t, Ft = F / p.t;
        double scale = 1e-6;
        for (std::int64_t i = 0; i < s1.size; ++i)
          scale = std::max(scale, double(std::fabs(w1[std::size_t(s1.offset + i)])));
        const auto cmp = [&](std::int64_t at_shard, std::int64_t at_whole, std::int64_t count) {
          for (std::int64_t i = 0; i < count; ++i)
            worst = std::max(worst, std::fabs(double(wt[std::size_t(sz.offset + at_shard + i)]) -
                                              double(w1[std::size_t(s1.offset + at_whole + i)])) /
                                        scale);
        };
        const auto ends = [&](const std::string& suffix) {
          return n.size() >= suffix.size() &&
                 n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0;
        };
        if (n == "wte" || n == "lm_head") {
          const std::int64_t first = tp * (sz.size / C);
          const std::int64_t rows = std::clamp(model.vocab - first, std::int64_t(0), sz.size / C);
          cmp(0, first * C, rows * C);
        } else if (ends("qkv_w")) {
          for (std::int64_t part = 0; part < 3; ++part)
            cmp(part * Ct * C, (part * C + tp * Ct) * C, Ct * C);
        } else if (ends("qkv_b")) {
          for (std::int64_t part = 0; part < 3; ++part)
            cmp(part * Ct, part * C + tp * Ct, Ct);
        } else if (ends("fc_w") || ends("fc_b")) {
          const std::int64_t cols = ends("fc_w") ? C : 1;
          cmp(0, tp * Ft * cols, Ft * cols);
        } else if (ends("attproj_w") || ends("fcproj_w")) {
          const std::int64_t in = ends("attproj_w") ? C : F, in_t = in / p.t;
          for (std::int64_t row = 0; row < C; ++row)
            cmp(row * in_t, row * in + tp * in_t, in_t);
        } else {
          EXPECT_EQ(sz.size, s1.size) << n;
          cmp(0, 0, sz.size);
        }
      }
    }
  }
  return worst;
}

// Per-step losses of t > 1 against t = 1 on the same plan otherwise.
double worst_loss_difference(const models::ModelSpec& model, Plan p, int t, int steps,
                             const std::string& optimizer = "sgd") {
  const bool sp = p.sp;
  p.t = 1;
  p.sp = false;  // the reference: one device, nothing split
  const TrainResult one = train_cpu(model, p, options(steps, optimizer));
  p.t = t;
  p.sp = sp;
  const TrainResult many = train_cpu(model, p, options(steps, optimizer));
  EXPECT_EQ(many.ranks.size(), std::size_t(p.ranks() * t));
  double worst = 0;
  EXPECT_EQ(one.steps.size(), many.steps.size());
  for (std::size_t i = 0; i < one.steps.size() && i < many.steps.size(); ++i) {
    const double rel =
        std::fabs(many.steps[i].loss - one.steps[i].loss) / std::fabs(one.steps[i].loss);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, 1e-5) << "step " << i << ": t = 1 " << one.steps[i].loss << ", t = " << t << " "
                         << many.steps[i].loss;
  }
  // And the weights: each shard is its slice of the t = 1 weights.
  const double weights = worst_shard_difference(model, p, one, many);
  EXPECT_LE(weights, 1e-5);
  std::printf("[ tp ]   final weights: worst difference to the t = 1 slices %.3g\n", weights);
  return worst;
}

struct Case {
  Schedule schedule;
  int t, w, d, m;
  bool sp = false;
};

void run_cases(const models::ModelSpec& model, const std::vector<Case>& cases, int steps = 20) {
  for (const Case& c : cases) {
    Plan p = make_plan(c.schedule, c.t, c.w, c.d, c.m, int(model.layers));
    p.sp = c.sp;
    const std::string what = model.name + " " + planner::to_string(c.schedule) +
                             " t=" + std::to_string(c.t) + (c.sp ? " sp" : "") +
                             " w=" + std::to_string(c.w) + " d=" + std::to_string(c.d);
    SCOPED_TRACE(what);
    const double worst = worst_loss_difference(model, p, c.t, steps);
    std::printf("[ tp ] %s: worst per-step relative loss difference to t = 1: %.3g\n", what.c_str(),
                worst);
  }
}

TEST(TensorParallel, GptTinyLossesEqualTOneForEverySchedule) {
  // The gpt-tiny preset (2 layers, tied embeddings, 256 tokens: no padding at t = 2 or 4).
  run_cases(models::load_model("gpt-tiny"), {{Schedule::gpipe, 2, 1, 1, 2},
                                             {Schedule::gpipe, 2, 2, 2, 2},
                                             {Schedule::one_f_one_b, 2, 2, 2, 4},
                                             {Schedule::two_bw, 2, 2, 2, 2},
                                             {Schedule::one_f_one_b, 4, 1, 2, 2}});
  // Four layers for the interleaved schedule (two chunks per stage).
  run_cases(testing::gpt_tiny(4),
            {{Schedule::interleaved, 2, 2, 2, 2}, {Schedule::interleaved, 4, 1, 2, 2}});
}

TEST(TensorParallel, UntiedPaddedVocabularyLossesEqualTOne) {
  const models::ModelSpec m = untied_padded(4);
  run_cases(m, {{Schedule::gpipe, 4, 1, 1, 2},
                {Schedule::gpipe, 4, 2, 2, 2},
                {Schedule::one_f_one_b, 2, 2, 2, 4},
                {Schedule::two_bw, 4, 1, 2, 2},
                {Schedule::interleaved, 4, 2, 2, 2}});
}

// gpt-tiny with the padding a Megatron model file asks for: 256 tokens padded to 258 (t = 1, 2)
// or 264 (t = 4); the padded rows never change the loss.
TEST(TensorParallel, GptTinyWithVocabularyPaddingLossesEqualTOne) {
  models::ModelSpec m = models::load_model("gpt-tiny");
  m.name = "gpt-tiny-padded";
  m.vocab_multiple = 3;
  run_cases(m, {{Schedule::gpipe, 4, 1, 2, 2}, {Schedule::two_bw, 2, 1, 2, 2}});
}

// Sequence parallelism: the norms, residuals and pipeline messages on 1/t of the tokens,
// all-gathers and reduce-scatters instead of the all-reduces.
TEST(TensorParallel, SequenceParallelLossesEqualTOne) {
  run_cases(models::load_model("gpt-tiny"), {{Schedule::gpipe, 2, 1, 1, 2, true},
                                             {Schedule::one_f_one_b, 2, 2, 2, 4, true},
                                             {Schedule::two_bw, 4, 2, 2, 2, true}});
  run_cases(untied_padded(4), {{Schedule::gpipe, 4, 2, 2, 2, true},
                               {Schedule::two_bw, 2, 1, 2, 2, true},
                               {Schedule::interleaved, 4, 2, 2, 2, true},
                               {Schedule::interleaved, 2, 1, 2, 2, true}});
}

TEST(TensorParallel, DistributedOptimizerComposes) {
  Plan p = make_plan(Schedule::one_f_one_b, 2, 2, 2, 2, 4);
  p.distributed_optimizer = true;
  worst_loss_difference(testing::gpt_tiny(4), p, 2, 10, "adamw");
  worst_loss_difference(untied_padded(4), p, 2, 10, "adamw");
  p.sp = true;
  worst_loss_difference(untied_padded(4), p, 2, 10, "adamw");
}

TEST(TensorParallel, BucketsAndRecomputeCompose) {
  for (const bool sp : {false, true}) {
    Plan p = make_plan(Schedule::gpipe, 2, 2, 2, 2, 4);
    p.recompute.assign(2, planner::Recompute::full);
    TrainOptions o = options(10);
    o.gradient_buckets = 3;
    p.t = 1;
    const TrainResult one = train_cpu(testing::gpt_tiny(4), p, o);
    p.t = 2;
    p.sp = sp;
    const TrainResult two = train_cpu(testing::gpt_tiny(4), p, o);
    ASSERT_EQ(one.steps.size(), two.steps.size());
    for (std::size_t i = 0; i < one.steps.size(); ++i)
      EXPECT_NEAR(two.steps[i].loss, one.steps[i].loss, 1e-5 * std::fabs(one.steps[i].loss))
          << (sp ? "sp " : "") << "step " << i;
  }
}

// Block recompute with and without SP: each layer re-made alone inside its backward (with SP its
// all-gathers into the scratch's own full-width rows, not the workspace the backward is using)
// gives the same losses and weights as no recompute, bit for bit, and the same losses as t = 1.
TEST(TensorParallel, BlockRecomputeIsBitIdenticalWithAndWithoutSequenceParallelism) {
  for (const models::ModelSpec& model : {testing::gpt_tiny(4), untied_padded(4)})
    for (Schedule s : {Schedule::gpipe, Schedule::one_f_one_b, Schedule::two_bw})
      for (const auto& [t, sp] : {std::pair{2, true}, std::pair{4, true}, std::pair{2, false}}) {
        Plan p = make_plan(s, t, 1, 2, 4, 4);
        p.sp = sp;
        Plan q = p;
        q.recompute.assign(2, planner::Recompute::block);
        SCOPED_TRACE(model.name + " " + planner::to_string(s) + " t=" + std::to_string(t) +
                     (sp ? " sp" : ""));
        testing::expect_identical(train_cpu(model, q, options(3, "adamw")),
                                  train_cpu(model, p, options(3, "adamw")));
      }
  Plan p = make_plan(Schedule::one_f_one_b, 2, 2, 2, 2, 4);
  p.sp = true;
  p.recompute.assign(2, planner::Recompute::block);
  worst_loss_difference(untied_padded(4), p, 2, 10, "adamw");
}

// Selective recompute with and without SP (the forward's probabilities in the workspace after the
// gathers' rows): bit-identical to no recompute.
TEST(TensorParallel, SelectiveRecomputeIsBitIdenticalWithAndWithoutSequenceParallelism) {
  for (Schedule s : {Schedule::gpipe, Schedule::two_bw})
    for (const auto& [t, sp] : {std::pair{2, true}, std::pair{4, false}}) {
      Plan p = make_plan(s, t, 1, 2, 4, 4);
      p.sp = sp;
      Plan q = p;
      q.recompute.assign(2, planner::Recompute::selective);
      SCOPED_TRACE(planner::to_string(s) + " t=" + std::to_string(t) + (sp ? " sp" : ""));
      testing::expect_identical(train_cpu(untied_padded(4), q, options(3, "adamw")),
                                train_cpu(untied_padded(4), p, options(3, "adamw")));
    }
}

// Runs are deterministic: the TP sums are in group order.
TEST(TensorParallel, BitIdenticalAcrossRuns) {
  const Plan p = make_plan(Schedule::one_f_one_b, 2, 2, 2, 2, 4);
  const TrainResult a = train_cpu(untied_padded(4), p, options(3));
  const TrainResult b = train_cpu(untied_padded(4), p, options(3));
  for (std::size_t i = 0; i < a.steps.size(); ++i)
    EXPECT_EQ(a.steps[i].loss, b.steps[i].loss);
  for (std::size_t r = 0; r < a.ranks.size(); ++r)
    EXPECT_TRUE(a.ranks[r].weights == b.ranks[r].weights) << "device " << r;
}

TEST(TensorParallel, CheckpointResumeIsBitIdenticalAndRefusesAnotherT) {
  testing::TempDir tmp("tp_ckpt");
  const std::string a = tmp.file("a"), b = tmp.file("b");
  Plan p = make_plan(Schedule::two_bw, 2, 2, 2, 2, 4);
  p.sp = true;
  const auto with_dir = [](int steps, const std::string& dir, bool resume) {
    TrainOptions o = options(steps, "adamw");
    o.checkpoint_dir = dir;
    o.checkpoint_every = 2;
    o.resume = resume;
    return o;
  };
  const TrainResult unbroken = train_cpu(testing::gpt_tiny(4), p, with_dir(5, a, false));
  train_cpu(testing::gpt_tiny(4), p, with_dir(3, b, false));
  const TrainResult resumed = train_cpu(testing::gpt_tiny(4), p, with_dir(5, b, true));
  EXPECT_EQ(resumed.first_step, 3);
  ASSERT_EQ(resumed.ranks.size(), unbroken.ranks.size());
  for (std::size_t r = 0; r < unbroken.ranks.size(); ++r)
    EXPECT_TRUE(resumed.ranks[r].weights == unbroken.ranks[r].weights) << "device " << r;
  for (const StepLog& log : resumed.steps)
    EXPECT_EQ(log.loss, unbroken.steps[std::size_t(log.step)].loss) << "step " << log.step;
  // One shard per device (t per pipeline rank): resuming with another t is one line.
  const std::string c = tmp.file("c");
  train_cpu(testing::gpt_tiny(4), p, with_dir(2, c, false));
  Plan other = p;
  other.t = 1;
  other.sp = false;
  try {
    train_cpu(testing::gpt_tiny(4), other, with_dir(4, c, true));
    ADD_FAILURE() << "resumed t = 2 shards with t = 1";
  } catch (const InputError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("t = 2"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

// The executor's bytes per category on every device equal the planner's closed form for the TP
// plan, activations too: the planner counts the message buffers held beside the stashes
// (docs/formulas.md section 4), and with full recomputation a forward's scratch and a backward's
// re-made stash with its buffers; with block recomputation every layer's input and one layer's
// scratch (with SP, and its all-gathers' full-width rows).
TEST(TensorParallel, MeasuredMemoryMatchesThePlanner) {
  const clusters::Cluster node = clusters::load_cluster("dgx-h100");
  for (const models::ModelSpec& model : {testing::gpt_tiny(4), untied_padded(4)})
    for (Schedule s : {Schedule::gpipe, Schedule::one_f_one_b, Schedule::two_bw})
      for (const auto& [t, sp, rc] : {std::tuple{2, false, planner::Recompute::none},
                                      std::tuple{4, false, planner::Recompute::none},
                                      std::tuple{2, true, planner::Recompute::none},
                                      std::tuple{4, true, planner::Recompute::none},
                                      std::tuple{2, false, planner::Recompute::full},
                                      std::tuple{4, true, planner::Recompute::full},
                                      std::tuple{4, false, planner::Recompute::block},
                                      std::tuple{2, true, planner::Recompute::block},
                                      std::tuple{4, true, planner::Recompute::block},
                                      std::tuple{2, false, planner::Recompute::selective},
                                      std::tuple{4, true, planner::Recompute::selective}}) {
        Plan p = make_plan(s, t, 1, 2, 4, 4);
        p.sp = sp;
        if (rc != planner::Recompute::none) p.recompute.assign(2, rc);
        SCOPED_TRACE(model.name + " " + planner::to_string(s) + " t=" + std::to_string(t) +
                     (sp ? " sp" : "") + " recompute " + planner::to_string(rc));
        const TrainResult r = train_cpu(model, p, options(2, "adamw"));
        Plan placed = p;
        planner::place(placed, {1, 8});
        const traces::Trace tr =
            traces::analytic_trace(model, node.device, {p.b}, models::Sharding{t, sp});
        const planner::Estimate e = planner::estimate(model, tr, node, placed);
        ASSERT_EQ(r.ranks.size(), std::size_t(p.ranks() * t));
        for (int device = 0; device < p.ranks() * t; ++device) {
          const planner::MemoryBreakdown& want = e.report.devices[std::size_t(device / t)].memory;
          const planner::MemoryBreakdown& got = r.ranks[std::size_t(device)].memory;
          EXPECT_EQ(got.weights, want.weights) << "device " << device;
          EXPECT_EQ(got.weight_versions, want.weight_versions) << "device " << device;
          EXPECT_EQ(got.gradients, want.gradients) << "device " << device;
          EXPECT_EQ(got.optimizer, want.optimizer) << "device " << device;
          EXPECT_EQ(got.workspace, want.workspace) << "device " << device;
          // With the activation-sized messages (b T C floats, / t with SP) a device holds beside
          // its stashes: received, produced and the last one sent, held while the next compute
          // op runs (exec/worker.hpp).
          EXPECT_EQ(got.activations, want.activations) << "device " << device;
        }
      }
}

// t not dividing a field of the model: one line naming it, before anything runs.
TEST(TensorParallel, BadTIsOneLineNamingTheField) {
  const auto expect_refused = [](const models::ModelSpec& m, int t, const std::string& field) {
    const Plan p = make_plan(Schedule::gpipe, t, 1, 1, 2, int(m.layers));
    try {
      train_cpu(m, p, options(1));
      ADD_FAILURE() << "t = " << t << " accepted";
    } catch (const InputError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(field), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  };
  expect_refused(models::load_model("gpt-tiny"), 3, "/heads");
  models::ModelSpec m = models::load_model("gpt-tiny");
  m.heads = 8;
  m.kv_heads = 2;
  expect_refused(m, 4, "/kv_heads");
  m = models::load_model("gpt-tiny");
  m.ffn = 250;
  expect_refused(m, 4, "/ffn");
}

}  // namespace
}  // namespace pw::exec
