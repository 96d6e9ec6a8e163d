// exec/ runtime on the CPU backend: the schedules' numerics. Flush schedules (GPipe, 1F1B) train
// exactly like single-device mini-batch training on the same global batch; 2BW follows
// W(t+1) = W(t) - lr * step(grad f(W(t-1))) and never holds more than two versions.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <thread>

#include <gtest/gtest.h>

#include "exec/data.hpp"
#include "exec/machine_load.hpp"
#include "exec/optimizer.hpp"
#include "exec/runtime.hpp"
#include "exec/stage_compute.hpp"
#include "exec/transport.hpp"
#include "planner/cost_model.hpp"
#include "planner/plan.hpp"
#include "test_util.hpp"
#include "traces/analytic.hpp"

namespace pw::exec {
namespace {

using planner::Plan;
using planner::Schedule;
using testing::max_relative_error;

Plan make_plan(Schedule s, int w, int d, int b, int m) {
  Plan p;
  p.schedule = s;
  p.w = w;
  p.d = d;
  p.b = b;
  p.m = m;
  planner::resolve_stages(p, testing::gpt_tiny(4).layers);
  return p;
}

// SGD with momentum is linear in the gradients, so summation-order differences between a split
// and an unsplit run stay at float rounding. AdamW divides by sqrt(v): for a parameter whose
// gradient is rounding noise it still steps by about lr, so AdamW comparisons use a large eps.
TrainOptions options(int steps, const std::string& optimizer = "sgd") {
  TrainOptions o;
  o.steps = steps;
  o.optimizer = optimizer;
  o.lr = optimizer == "sgd" ? 0.05f : 3e-3f;
  o.eps = 1e-3f;
  o.seed = 7;
  return o;
}

// Replica 0's weights by tensor name over all stages; the LM head's copy must equal the embedding.
std::map<std::string, std::vector<float>> weights_by_name(const TrainResult& r, const Plan& p) {
  std::map<std::string, std::vector<float>> out;
  for (int s = 0; s < p.d; ++s) {
    const RankResult& rank = r.ranks[std::size_t(p.rank_of(s, 0))];
    const int vs = s;
    StageSpec spec;
    spec.model = testing::gpt_tiny(4);
    for (int i = 0; i < vs; ++i)
      spec.first_block += p.stage_blocks[std::size_t(i)];
    spec.blocks = p.stage_blocks[std::size_t(vs)];
    spec.has_embedding = vs == 0;
    spec.has_head = vs == p.d - 1;
    auto stage = make_cpu_stage(spec);
    for (const auto& slot : stage->layout())
      out[slot.name].assign(rank.weights[0].begin() + slot.offset,
                            rank.weights[0].begin() + slot.offset + slot.size);
  }
  return out;
}

void expect_same_weights(const TrainResult& got, const Plan& p, const TrainResult& want,
                         const Plan& q, double tolerance) {
  const auto a = weights_by_name(got, p), b = weights_by_name(want, q);
  for (const auto& [name, values] : b) {
    ASSERT_TRUE(a.count(name)) << name;
    EXPECT_LT(max_relative_error(a.at(name), values), tolerance) << name;
  }
  if (a.count("lm_head")) {
    EXPECT_EQ(a.at("lm_head"), a.at("wte"));  // tied copies stay equal
  }
}

// GPipe and 1F1B over d in {1, 2, 4} and w in {1, 2}: the same weights as one device processing
// the whole global batch B = w*m*b as a single microbatch.
TEST(FlushSchedules, EqualSingleDeviceMiniBatchTraining) {
  const int B = 8;
  const Plan single = make_plan(Schedule::one_f_one_b, 1, 1, B, 1);
  const TrainResult ref = train_cpu(testing::gpt_tiny(4), single, options(3));
  for (Schedule s : {Schedule::gpipe, Schedule::one_f_one_b})
    for (int d : {1, 2, 4})
      for (int w : {1, 2}) {
        const int b = 2, m = B / (w * b);
        const Plan p = make_plan(s, w, d, b, m);
        SCOPED_TRACE(to_string(s) + " d=" + std::to_string(d) + " w=" + std::to_string(w));
        expect_same_weights(train_cpu(testing::gpt_tiny(4), p, options(3)), p, ref, single, 1e-5);
      }
  // Recomputation changes when activations exist, not what is computed. Interleaved: d = 2 and
  // d = 1 (both tied ends on one device), v = 2, one block a model chunk.
  for (Schedule s :
       {Schedule::gpipe, Schedule::one_f_one_b, Schedule::two_bw, Schedule::interleaved})
    for (int d : {1, 2})
      for (auto mode : {pw::planner::Recompute::full, pw::planner::Recompute::block,
                        pw::planner::Recompute::selective}) {
        if (d == 1 && s != Schedule::interleaved) continue;
        Plan p = make_plan(s, 1, d, 2, 4);
        if (s == Schedule::interleaved) {
          p.v = 2;
          p.stage_blocks.clear();
          planner::resolve_stages(p, testing::gpt_tiny(4).layers);
        }
        Plan q = p;
        q.recompute.assign(std::size_t(d), mode);
        SCOPED_TRACE(to_string(s) + " d=" + std::to_string(d) + " with recompute " +
                     to_string(mode));
        // Bit-identical: the recomputed stash is the forward's, bit for bit (block: each layer
        // re-made alone from its kept input just before its backward; selective: each block's
        // attention probabilities made again inside its backward).
        testing::expect_identical(train_cpu(testing::gpt_tiny(4), q, options(3)),
                                  train_cpu(testing::gpt_tiny(4), p, options(3)));
      }
}

// 2BW's reference, one device, sequentially: the gradient of step t is taken at W(t-1) (W(0) for
// the first two steps) and applied to W(t) by the same optimizer.
std::vector<float> two_bw_reference(const Plan& p, const TrainOptions& o) {
  const models::ModelSpec model = testing::gpt_tiny(4);
  StageSpec spec;
  spec.model = model;
  spec.blocks = model.layers;
  spec.has_embedding = spec.has_head = true;
  auto stage = make_cpu_stage(spec);
  const int B = int(p.global_batch()), T = int(model.seq_len);
  const StageSizes z = stage->sizes(B);
  std::vector<float> now(std::size_t(z.parameters)), previous, grads(now.size()), m(now.size()),
      v(now.size()), stash(std::size_t(z.stash)), workspace(std::size_t(z.workspace));
  stage->init_parameters(now.data(), o.seed);
  previous = now;
  const TokenSource data(o.data, model.vocab, o.seed);
  std::vector<std::int32_t> tokens(std::size_t(B) * T), targets(tokens.size());
  for (int t = 0; t < o.steps; ++t) {
    for (int i = 0; i < B; ++i)
      data.sample(std::int64_t(t) * B + i, T, tokens.data() + std::size_t(i) * T,
                  targets.data() + std::size_t(i) * T);
    stage->forward(previous.data(), tokens.data(), nullptr, targets.data(), B, false, stash.data(),
                   nullptr);
    stage->backward(previous.data(), stash.data(), nullptr, B, 1.0f / float(B * T), grads.data(),
                    nullptr, workspace.data());
    std::vector<float> next(now.size());
    optimizer_update(o, t + 1, now.data(), next.data(), grads.data(), m.data(), v.data(),
                     std::int64_t(now.size()));
    previous = now;
    now = next;
  }
  return now;
}

TEST(TwoBw, EqualsTheDelayedUpdateReference) {
  for (const char* optimizer : {"sgd", "adamw"})
    for (int d : {2, 4})
      for (int w : {1, 2}) {
        const Plan p = make_plan(Schedule::two_bw, w, d, 1, 8 / w);
        const TrainOptions o = options(4, optimizer);
        SCOPED_TRACE(std::string(optimizer) + " 2bw d=" + std::to_string(d) +
                     " w=" + std::to_string(w));
        const TrainResult r = train_cpu(testing::gpt_tiny(4), p, o);
        const std::vector<float> ref = two_bw_reference(p, o);
        // The single stage's layout concatenates the same named tensors in the same order.
        std::vector<float> got;
        const auto by_name = weights_by_name(r, p);
        StageSpec spec;
        spec.model = testing::gpt_tiny(4);
        spec.blocks = 4;
        spec.has_embedding = spec.has_head = true;
        const auto whole = make_cpu_stage(spec);
        for (const auto& slot : whole->layout())
          got.insert(got.end(), by_name.at(slot.name).begin(), by_name.at(slot.name).end());
        EXPECT_LT(max_relative_error(got, ref), 1e-5);
        // Stage 0 updated the tied tensor; the last stage holds the weights it sent, bit for bit.
        EXPECT_EQ(by_name.at("lm_head"), by_name.at("wte"));
      }
}

// Three replicas: each sends a third of the tied tensor (its rows do not divide evenly, so the
// shards differ in size) and the stages' replicas gather them; still the delayed-update reference,
// and both copies equal bit for bit.
TEST(TwoBw, ShardedTiedExchangeEqualsTheReference) {
  for (const char* optimizer : {"sgd", "adamw"}) {
    const Plan p = make_plan(Schedule::two_bw, 3, 2, 1, 2);
    const TrainOptions o = options(4, optimizer);
    SCOPED_TRACE(optimizer);
    const TrainResult r = train_cpu(testing::gpt_tiny(4), p, o);
    const std::vector<float> ref = two_bw_reference(p, o);
    std::vector<float> got;
    const auto by_name = weights_by_name(r, p);
    StageSpec spec;
    spec.model = testing::gpt_tiny(4);
    spec.blocks = 4;
    spec.has_embedding = spec.has_head = true;
    const auto whole = make_cpu_stage(spec);
    for (const auto& slot : whole->layout())
      got.insert(got.end(), by_name.at(slot.name).begin(), by_name.at(slot.name).end());
    EXPECT_LT(max_relative_error(got, ref), 1e-5);
    EXPECT_EQ(by_name.at("lm_head"), by_name.at("wte"));
    EXPECT_NE(by_name.at("wte").size() % 3, 0u);  // uneven shards
  }
}

// Both tied ends on one device (interleaved, d = 1, v = 2: the embedding in chunk 0, the head's
// copy in chunk 1): no messages, the same sum on both, and single-device training's weights.
TEST(FlushSchedules, TiedEndsOnOneDeviceEqualSingleDeviceTraining) {
  const Plan single = make_plan(Schedule::one_f_one_b, 1, 1, 8, 1);
  Plan p = make_plan(Schedule::one_f_one_b, 1, 1, 2, 4);
  p.schedule = Schedule::interleaved;
  p.v = 2;
  p.stage_blocks.clear();
  planner::resolve_stages(p, testing::gpt_tiny(4).layers);
  const TrainResult got = train_cpu(testing::gpt_tiny(4), p, options(3));
  const auto want = weights_by_name(train_cpu(testing::gpt_tiny(4), single, options(3)), single);
  std::map<std::string, std::vector<float>> by_name;
  for (int chunk = 0; chunk < 2; ++chunk) {
    StageSpec spec;
    spec.model = testing::gpt_tiny(4);
    spec.first_block = chunk == 0 ? 0 : p.stage_blocks[0];
    spec.blocks = p.stage_blocks[std::size_t(chunk)];
    spec.has_embedding = chunk == 0;
    spec.has_head = chunk == 1;
    const std::vector<float>& w = got.ranks[0].weights[std::size_t(chunk)];
    const auto stage = make_cpu_stage(spec);  // alive for the loop: layout() is a reference
    for (const auto& slot : stage->layout())
      by_name[slot.name].assign(w.begin() + slot.offset, w.begin() + slot.offset + slot.size);
  }
  for (const auto& [name, values] : want) {
    ASSERT_TRUE(by_name.count(name)) << name;
    EXPECT_LT(max_relative_error(by_name.at(name), values), 1e-5) << name;
  }
  EXPECT_EQ(by_name.at("lm_head"), by_name.at("wte"));
}

// The distributed optimizer (ZeRO-1) against the plain one on the same plan, every rank's weights
// and every step's loss. Each element's reduce-scatter sum is the all-reduce's (same order, from
// zero) and the update is elementwise, so they should agree bit for bit; issue 14's target is
// 1e-6 relative. Buckets that cut shards and the tied tensor, uneven shards (w = 3), 2BW's second
// version and both tied ends on one device (interleaved, d = 1) included.
TEST(DistributedOptimizer, SameWeightsAndLossesAsThePlainOne) {
  struct Case {
    Schedule schedule;
    int w, d, m, buckets;
  };
  std::vector<Case> cases;
  for (Schedule s : {Schedule::gpipe, Schedule::one_f_one_b, Schedule::two_bw})
    for (int w : {2, 4})
      for (int d : {1, 2})
        cases.push_back({s, w, d, 2, w == 2 ? 1 : 3});
  cases.push_back({Schedule::two_bw, 3, 2, 2, 2});
  cases.push_back({Schedule::interleaved, 2, 1, 2, 2});
  cases.push_back({Schedule::interleaved, 2, 2, 2, 1});
  for (const char* optimizer : {"sgd", "adamw"})
    for (const Case& c : cases) {
      Plan plain = make_plan(c.schedule, c.w, c.d, 1, c.m);
      if (c.schedule == Schedule::interleaved) {
        plain.v = 2;
        plain.stage_blocks.clear();
        planner::resolve_stages(plain, testing::gpt_tiny(4).layers);
      }
      Plan sharded = plain;
      sharded.distributed_optimizer = true;
      TrainOptions o = options(4, optimizer);
      o.gradient_buckets = c.buckets;
      SCOPED_TRACE(std::string(optimizer) + " " + to_string(c.schedule) +
                   " w=" + std::to_string(c.w) + " d=" + std::to_string(c.d) +
                   " buckets=" + std::to_string(c.buckets));
      const TrainResult want = train_cpu(testing::gpt_tiny(4), plain, o);
      const TrainResult got = train_cpu(testing::gpt_tiny(4), sharded, o);
      ASSERT_EQ(got.ranks.size(), want.ranks.size());
      for (std::size_t r = 0; r < want.ranks.size(); ++r) {
        ASSERT_EQ(got.ranks[r].weights.size(), want.ranks[r].weights.size());
        for (std::size_t chunk = 0; chunk < want.ranks[r].weights.size(); ++chunk)
          EXPECT_LE(max_relative_error(got.ranks[r].weights[chunk], want.ranks[r].weights[chunk]),
                    1e-6)
              << "rank " << r << " chunk " << chunk;
        // Only the optimizer state is sharded: ceil(P / w) parameters' of it on every replica.
        std::int64_t parameters = 0;
        for (const auto& chunk : want.ranks[r].weights)
          parameters += std::int64_t(chunk.size());
        const std::int64_t per = std::string(optimizer) == "adamw" ? 8 : 4;
        EXPECT_EQ(want.ranks[r].memory.optimizer, per * parameters);
        EXPECT_EQ(got.ranks[r].memory.optimizer, per * ((parameters + c.w - 1) / c.w));
        EXPECT_EQ(got.ranks[r].memory.weights, want.ranks[r].memory.weights);
        EXPECT_EQ(got.ranks[r].memory.gradients, want.ranks[r].memory.gradients);
      }
      ASSERT_EQ(got.steps.size(), want.steps.size());
      for (std::size_t i = 0; i < want.steps.size(); ++i)
        EXPECT_NEAR(got.steps[i].loss, want.steps[i].loss, 1e-6 * std::fabs(want.steps[i].loss))
            << "step " << i;
    }
}

// Sends and data-parallel gradient sums on each rank's communication engines (the default with
// threads) give the bits of running them inline on the rank's thread (as under MPI): losses and
// every rank's final weights identical, for the schedules, the tied exchange (d = 2), buckets,
// the distributed optimizer and interleaving; the same device peaks; and the collectives are on
// the timeline.
TEST(AsyncComm, SameBitsAsInlineCommunication) {
  struct Case {
    Schedule schedule;
    int w, d, m, buckets;
    bool sharded;
  };
  const std::vector<Case> cases = {
      {Schedule::one_f_one_b, 2, 2, 4, 3, false}, {Schedule::two_bw, 2, 2, 4, 2, false},
      {Schedule::two_bw, 2, 2, 2, 2, true},       {Schedule::gpipe, 1, 2, 4, 1, false},
      {Schedule::interleaved, 2, 2, 2, 2, false}, {Schedule::one_f_one_b, 3, 1, 2, 2, true}};
  for (const Case& c : cases) {
    Plan p = make_plan(c.schedule, c.w, c.d, 1, c.m);
    if (c.schedule == Schedule::interleaved) {
      p.v = 2;
      p.stage_blocks.clear();
      planner::resolve_stages(p, testing::gpt_tiny(4).layers);
    }
    p.distributed_optimizer = c.sharded;
    SCOPED_TRACE(to_string(c.schedule) + " w=" + std::to_string(c.w) + " d=" + std::to_string(c.d) +
                 " buckets=" + std::to_string(c.buckets) +
                 (c.sharded ? " distributed optimizer" : ""));
    TrainOptions o = options(3, "adamw");
    o.gradient_buckets = c.buckets;
    o.async_comm = false;
    const TrainResult want = train_cpu(testing::gpt_tiny(4), p, o);
    o.async_comm = true;
    const TrainResult got = train_cpu(testing::gpt_tiny(4), p, o);
    ASSERT_EQ(got.steps.size(), want.steps.size());
    for (std::size_t i = 0; i < want.steps.size(); ++i)
      EXPECT_EQ(got.steps[i].loss, want.steps[i].loss) << "step " << i;
    ASSERT_EQ(got.ranks.size(), want.ranks.size());
    for (std::size_t r = 0; r < want.ranks.size(); ++r) {
      EXPECT_EQ(got.ranks[r].weights, want.ranks[r].weights) << "rank " << r;
      // An inline send keeps its buffer to the engine's release point: the same device peak.
      EXPECT_EQ(got.ranks[r].peak_memory_bytes, want.ranks[r].peak_memory_bytes) << "rank " << r;
      if (c.w > 1) {
        // Each all-reduce bucket (reduce-scatter: each bucket too) per step is on the timeline.
        int collectives = 0;
        for (const planner::TimedOp& t : got.ranks[r].timeline.ops)
          collectives += t.stream == planner::kCollectiveStream;
        EXPECT_GE(collectives, o.steps * c.buckets) << "rank " << r;
      }
    }
  }
}

// A rank that fails while the others' communication engines have sends and gradient sums in
// flight (w = 2, d = 2, 4 buckets): the job ends with the failing rank's one line, no hang (the
// transport's abort wakes the engines' waits; the workers' waits on them rethrow).
TEST(AsyncComm, AFailingRankEndsTheJobWithOneLine) {
  Plan p = make_plan(Schedule::one_f_one_b, 2, 2, 1, 4);
  TrainOptions o = options(3, "adamw");
  o.gradient_buckets = 4;
  const TrainResult free_run = train_cpu(testing::gpt_tiny(4), p, o);
  std::int64_t peak = 0;
  for (const RankResult& r : free_run.ranks)
    peak = std::max(peak, r.peak_memory_bytes);
  for (std::int64_t short_by : {std::int64_t(1), std::int64_t(4096)}) {
    o.device_memory = peak - short_by;  // some rank's largest allocation does not fit, mid-run
    const std::string msg = testing::error_of([&] { train_cpu(testing::gpt_tiny(4), p, o); });
    EXPECT_NE(msg.find("short by"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("transport aborted"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

// Ranks pinned to one core take turns on it (--core-turns): the same bits as when the OS
// interleaves them, and no two ranks' compute ops overlap in time; a rank that fails while the
// others wait for the core ends the job with its own one line (the queue's abort wakes them).
TEST(CoreTurns, OneOpAtATimeOnASharedCoreWithTheSameBits) {
  const std::vector<int> allowed = allowed_cores();
  ASSERT_FALSE(allowed.empty());
  struct Case {
    Schedule schedule;
    int w, d, m;
  };
  for (const Case& c : {Case{Schedule::two_bw, 1, 4, 4}, Case{Schedule::one_f_one_b, 2, 2, 4}}) {
    SCOPED_TRACE(to_string(c.schedule) + " w=" + std::to_string(c.w));
    const Plan p = make_plan(c.schedule, c.w, c.d, 1, c.m);
    TrainOptions o = options(3, "adamw");
    o.gradient_buckets = 2;
    o.cores.assign(std::size_t(p.ranks()), allowed.front());
    o.core_turns = false;
    const TrainResult os = train_cpu(testing::gpt_tiny(4), p, o);
    o.core_turns = true;
    const TrainResult turns = train_cpu(testing::gpt_tiny(4), p, o);
    ASSERT_EQ(turns.steps.size(), os.steps.size());
    for (std::size_t i = 0; i < os.steps.size(); ++i)
      EXPECT_EQ(turns.steps[i].loss, os.steps[i].loss) << "step " << i;
    std::vector<std::pair<double, double>> compute;
    for (std::size_t r = 0; r < os.ranks.size(); ++r) {
      EXPECT_EQ(turns.ranks[r].weights, os.ranks[r].weights) << "rank " << r;
      for (const planner::TimedOp& t : turns.ranks[r].timeline.ops)
        if (t.stream == planner::kComputeStream) compute.emplace_back(t.start_s, t.end_s);
    }
    std::sort(compute.begin(), compute.end());
    ASSERT_GT(compute.size(), std::size_t(p.ranks() * c.m));
    for (std::size_t i = 1; i < compute.size(); ++i)
      EXPECT_LE(compute[i - 1].second, compute[i].first) << "compute op " << i << " overlaps";
  }
  Plan p = make_plan(Schedule::two_bw, 1, 4, 1, 4);
  TrainOptions o = options(3, "adamw");
  o.cores.assign(4, allowed.front());
  std::int64_t peak = 0;
  for (const RankResult& r : train_cpu(testing::gpt_tiny(4), p, o).ranks)
    peak = std::max(peak, r.peak_memory_bytes);
  o.device_memory = peak - 1;  // the rank with the largest peak fails mid-run
  const std::string msg = testing::error_of([&] { train_cpu(testing::gpt_tiny(4), p, o); });
  EXPECT_NE(msg.find("short by"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("aborted"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

// The in-process transport's reduce-scatter and all-gather over three threads with uneven parts
// and an empty one: each member's part of the reduce-scatter is all_reduce_sum's result bit for
// bit and the rest of its buffer is untouched; the all-gather hands every member every part; an
// abort wakes a member left waiting.
TEST(Transport, ReduceScatterAndAllGatherInProcess) {
  const std::vector<int> group = {4, 1, 7};  // ranks, in group order
  const std::vector<std::int64_t> bounds = {0, 5, 5, 11};
  const auto value = [](int member, std::int64_t i) {
    return std::sin(float(member * 31 + i)) * std::pow(10.0f, float(i % 7) - 3);
  };
  std::vector<std::vector<float>> data(3), summed(3), gathered(3);
  for (int k = 0; k < 3; ++k)
    for (std::int64_t i = 0; i < 11; ++i)
      data[std::size_t(k)].push_back(value(k, i));
  InProcessTransport t;
  std::vector<std::thread> threads;
  for (int k = 0; k < 3; ++k)
    threads.emplace_back([&, k] {
      std::vector<float>& rs = summed[std::size_t(k)];
      std::vector<float> ar = data[std::size_t(k)];
      rs = ar;
      t.reduce_scatter_sum("rs", group, group[std::size_t(k)], rs.data(), bounds);
      t.all_reduce_sum("ar", group, group[std::size_t(k)], ar.data(), 11);
      for (std::int64_t i = 0; i < 11; ++i) {
        const bool mine = i >= bounds[std::size_t(k)] && i < bounds[std::size_t(k) + 1];
        const float want = mine ? ar[std::size_t(i)] : data[std::size_t(k)][std::size_t(i)];
        EXPECT_EQ(std::memcmp(&rs[std::size_t(i)], &want, sizeof(float)), 0)
            << "member " << k << " element " << i;
      }
      // All-gather: member k's part holds k + 1, the rest garbage until gathered.
      std::vector<float>& ag = gathered[std::size_t(k)];
      ag.assign(11, -1.0f);
      std::fill(ag.begin() + bounds[std::size_t(k)], ag.begin() + bounds[std::size_t(k) + 1],
                float(k + 1));
      t.all_gather("ag", group, group[std::size_t(k)], ag.data(), bounds);
    });
  for (auto& th : threads)
    th.join();
  for (int k = 0; k < 3; ++k)
    EXPECT_EQ(gathered[std::size_t(k)], std::vector<float>({1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3}));
  // One member alone in a collective of three waits until the transport is aborted.
  std::vector<float> lone(11, 0.0f);
  std::thread waiter(
      [&] { EXPECT_THROW(t.reduce_scatter_sum("lone", group, 4, lone.data(), bounds), Error); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  t.abort();
  waiter.join();
}

TEST(Training, LossFallsOnTheSyntheticCorpus) {
  const Plan p = make_plan(Schedule::two_bw, 1, 2, 4, 4);
  TrainOptions o = options(30, "adamw");
  o.lr = 3e-3f;
  o.eps = 1e-8f;
  const TrainResult r = train_cpu(testing::gpt_tiny(4), p, o);
  ASSERT_EQ(r.steps.size(), 30u);
  // From ln(256) = 5.55 at init; 30 steps of 2bw reach about 4.5 (1f1b on one stage: 3.6).
  EXPECT_LT(r.steps.back().loss, 0.9 * r.steps.front().loss);
}

TEST(Training, FlushSchedulesHoldOneWeightVersionAndTwoBwTwo) {
  const TrainResult flush =
      train_cpu(testing::gpt_tiny(4), make_plan(Schedule::one_f_one_b, 1, 2, 1, 4), options(3));
  const TrainResult two =
      train_cpu(testing::gpt_tiny(4), make_plan(Schedule::two_bw, 1, 2, 1, 4), options(3));
  for (const auto& r : flush.ranks)
    EXPECT_EQ(r.memory.weight_versions, 0);
  for (const auto& r : two.ranks)
    EXPECT_EQ(r.memory.weight_versions, r.memory.weights);
}

}  // namespace
}  // namespace pw::exec

namespace pw::exec {
namespace {

// The executor's byte count per category against the planner's closed form for the same plan
// (gpt-tiny4 in fp32: AdamW keeps m and v, 8 bytes per parameter). The planner counts the message
// buffers a device holds beside its stashes (docs/formulas.md section 4, "messages"): without
// recomputation the measured activations are the prediction exactly, with sends on the
// communication engines and inline alike; with full recomputation too (a forward's scratch, a
// backward's re-made stash and its buffers: docs/formulas.md section 4), and with block
// recomputation (every layer's input kept, one layer's scratch from the recompute op on).
TEST(Memory, MeasuredPeakMatchesTheClosedForm) {
  const models::ModelSpec model = testing::gpt_tiny(4);
  const clusters::Cluster one = clusters::load_cluster("h100-x1");
  for (Schedule s : {Schedule::gpipe, Schedule::one_f_one_b, Schedule::two_bw})
    for (int variant = 0; variant < 6; ++variant) {
      // Plain, full recomputation, the distributed optimizer over w = 3 (uneven shards) and
      // w = 2, block recomputation and selective recomputation (the stash without the scores).
      const bool rc = variant == 1 || variant == 4 || variant == 5,
                 sharded = variant == 2 || variant == 3;
      const int w = variant == 2 ? 3 : variant == 3 ? 2 : 1;
      Plan p = make_plan(s, w, 2, 2, variant == 2 ? 2 : 4);
      if (rc)
        p.recompute.assign(2, variant == 4   ? pw::planner::Recompute::block
                              : variant == 5 ? pw::planner::Recompute::selective
                                             : pw::planner::Recompute::full);
      p.distributed_optimizer = sharded;
      SCOPED_TRACE(to_string(s) + (rc ? " recompute " + to_string(p.recompute[0]) : "") +
                   (sharded ? " distributed optimizer w=" + std::to_string(w) : ""));
      Plan placed = p;
      planner::place(placed, {1, 1}, p.ranks());
      const traces::Trace t = traces::analytic_trace(model, one.device, {p.b});
      const planner::Estimate e = planner::estimate(model, t, one, placed);
      for (bool async : {true, false}) {
        TrainOptions o = options(2, "adamw");
        o.async_comm = async;
        const TrainResult r = train_cpu(model, p, o);
        for (int rank = 0; rank < p.ranks(); ++rank) {
          const planner::MemoryBreakdown& want = e.report.devices[std::size_t(rank)].memory;
          const planner::MemoryBreakdown& got = r.ranks[std::size_t(rank)].memory;
          EXPECT_EQ(got.weights, want.weights);
          EXPECT_EQ(got.weight_versions, want.weight_versions);
          EXPECT_EQ(got.gradients, want.gradients);
          EXPECT_EQ(got.optimizer, want.optimizer);
          EXPECT_EQ(got.workspace, want.workspace);
          EXPECT_EQ(got.activations, want.activations) << "rank " << rank << " async " << async;
          EXPECT_EQ(got.total(), want.total()) << "rank " << rank << " async " << async;
        }
      }
    }
}

}  // namespace
}  // namespace pw::exec
