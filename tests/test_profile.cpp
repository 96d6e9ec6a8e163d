// What every backend's profiler shares (exec/profile_driver.hpp): host-only, so it runs on every
// build, with or without CUDA.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/error.hpp"
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
      "emb forward",   "head forward",   "head backward",                       // wiring
      "block keep",    "block forward",  "block backward",  "block recompute",  // warm-up
      "emb keep",      "emb forward",    "emb backward",    "emb recompute",    //
      "head keep",     "head forward",   "head backward",   "head recompute",   //
      "block forward", "block backward", "block recompute",                     // repeat 1
      "emb forward",   "emb backward",   "emb recompute",                       //
      "head forward",  "head backward",  "head recompute",                      //
      "block forward", "block backward", "block recompute",                     // repeat 2
      "emb forward",   "emb backward",   "emb recompute",                       //
      "head forward",  "head backward",  "head recompute"};
  EXPECT_EQ(log, want);
  // Timed ops 1..18: the block's forwards are the 1st and 10th, the head's recomputes 9th, 18th.
  EXPECT_DOUBLE_EQ(t[0].forward_s, (1 + 10) / 2.0);
  EXPECT_DOUBLE_EQ(t[1].backward_s, (5 + 14) / 2.0);
  EXPECT_DOUBLE_EQ(t[2].recompute_s, (9 + 18) / 2.0);
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

}  // namespace
}  // namespace pw
