// planner/cost_model: the closed forms of PipeDream-2BW (Appendix A) and the pipeline formulas,
// checked against hand derivations on a synthetic trace with uniform stages.
#include <gtest/gtest.h>

#include "tests/test_util.hpp"

#include "planner/checker.hpp"
#include "planner/cost_model.hpp"
#include "planner/unit_timeline.hpp"
#include "traces/analytic.hpp"

namespace pw::planner {
namespace {

using pw::testing::plan_of;
using pw::testing::uniform_trace;

using pw::testing::grid;

using models::LayerKind;

// dgx-a100 with free links (infinite bandwidth, zero latency), so only compute counts.
clusters::Cluster free_links(int nodes = 1) {
  return clusters::load_cluster("dgx-a100", nodes,
                                {"intra_node.latency_s=0", "intra_node.bandwidth_bytes_per_s=1e30",
                                 "network.latency_s=0", "network.bandwidth_bytes_per_s=1e30"});
}

struct Fixture : ::testing::Test {
  models::ModelSpec model = models::load_model("gpt2-124m");  // 12 blocks
  traces::Trace trace = uniform_trace(model, 2);
  clusters::Cluster cluster = free_links();
  double t(int blocks_per_stage) { return blocks_per_stage * 3e-3; }  // t_f + t_b of a stage
};

using PipelineTime = Fixture;

// Flush schedules with uniform stages and free communication: (m + d - 1)(t_f + t_b).
TEST_F(PipelineTime, FlushSchedulesTakeMPlusDMinusOneStageTimes) {
  for (Schedule s : {Schedule::gpipe, Schedule::one_f_one_b}) {
    Plan p = plan_of(s, 2, 4, 2, 8, 1, 12, grid(cluster));
    Estimate e = estimate(model, trace, cluster, p);
    EXPECT_NEAR(e.pipeline_s, (8 + 4 - 1) * t(3), 1e-12) << to_string(s);
    // Busy time per step is m(t_f + t_b): the bubble is (d-1)/(m+d-1) without all-reduce.
    EXPECT_NEAR(e.report.devices[0].busy_s / e.pipeline_s, 8.0 / 11.0, 1e-12);
  }
}

// 2BW steady state: m(t_f + t_b) per step, no bubble.
TEST_F(PipelineTime, TwoBwSteadyStateHasNoBubble) {
  Plan p = plan_of(Schedule::two_bw, 2, 4, 2, 8, 1, 12, grid(cluster));
  EXPECT_NEAR(estimate(model, trace, cluster, p).pipeline_s, 8 * t(3), 1e-12);
}

// Megatron interleaved: (m + (d-1)/v)(t_f + t_b), i.e. bubble/compute = (1/v)(d-1)/m.
TEST_F(PipelineTime, InterleavedShrinksTheBubbleByV) {
  Plan p = plan_of(Schedule::interleaved, 2, 4, 2, 8, 3, 12, grid(cluster));
  EXPECT_NEAR(estimate(model, trace, cluster, p).pipeline_s, (8 + 3.0 / 3) * t(3), 1e-12);
}

// Communication c per hop adds 2(d-1)c to GPipe's fill and drain; 1F1B also waits for a round
// trip to its neighbour each microbatch in steady state: + (2(d-1)m/d - 2)c (the simulator test
// checks the same figure against an event-by-event reference).
TEST_F(PipelineTime, CommunicationAddsTwoHopsPerStageBoundary) {
  clusters::Cluster c = clusters::load_cluster(
      "dgx-a100", 1, {"intra_node.latency_s=1e-4", "intra_node.bandwidth_bytes_per_s=1e30"});
  const double hop = 1e-4;
  Plan g = plan_of(Schedule::gpipe, 2, 4, 2, 8, 1, 12, grid(c));
  EXPECT_NEAR(estimate(model, trace, c, g).pipeline_s, 11 * t(3) + 2 * 3 * hop, 1e-12);
  Plan p = plan_of(Schedule::one_f_one_b, 2, 4, 2, 8, 1, 12, grid(c));
  EXPECT_NEAR(estimate(model, trace, c, p).pipeline_s,
              11 * t(3) + 2 * 3 * hop + (2.0 * 3 * 8 / 4 - 2) * hop, 1e-12);
  Plan q = plan_of(Schedule::two_bw, 2, 4, 2, 8, 1, 12, grid(c));
  EXPECT_NEAR(estimate(model, trace, c, q).pipeline_s, 8 * (t(3) + 2 * hop * 3 / 4), 1e-12);
}

// Hops that differ: 4 stages on 2 nodes of 2 GPUs (stages 0, 1 on node 0; 2, 3 on node 1), free
// links inside a node, a network of latency c and unlimited bandwidth, so only boundary 1 -> 2
// costs c. The largest cycle mean (docs/formulas.md 5) is the span of stages 1..2: two stages and
// one round trip, (2T + 2c)/2 = T + c; the whole pipeline gives (4T + 2c)/4 = T + c/2, any single
// stage T. 2BW's step is m(T + c) (the former term charged the slowest hop on every boundary:
// m(T + 2c(d - 1)/d) = m(T + 1.5c)); 1F1B's exposed round trip per microbatch is P - T = c.
TEST_F(PipelineTime, SteadyStateIsTheSlowestCycleOfStages) {
  const double c = 2e-3;
  clusters::Cluster two = clusters::load_cluster(
      "dgx-a100", 2,
      {"gpus_per_node=2", "intra_node.latency_s=0", "intra_node.bandwidth_bytes_per_s=1e30",
       "network.latency_s=" + std::to_string(c), "network.bandwidth_bytes_per_s=1e30"});
  Plan q = plan_of(Schedule::two_bw, 1, 4, 2, 8, 1, 12, grid(two));
  for (int s = 0; s < 4; ++s)
    ASSERT_EQ(q.placement[std::size_t(q.rank_of(s, 0))].node, s / 2);
  const Estimate e = estimate(model, trace, two, q);
  EXPECT_NEAR(e.stages[0].send_s, 0, 1e-15);
  EXPECT_NEAR(e.stages[1].send_s, c, 1e-15);
  EXPECT_NEAR(e.stages[2].send_s, 0, 1e-15);
  EXPECT_NEAR(e.pipeline_s, 8 * (t(3) + c), 1e-12);
  // 1F1B: (m - 1)T + 4T + 2c (fill and drain) + m(P - T) - 2c.
  Plan p = plan_of(Schedule::one_f_one_b, 1, 4, 2, 8, 1, 12, grid(two));
  EXPECT_NEAR(estimate(model, trace, two, p).pipeline_s,
              7 * t(3) + 4 * t(3) + 2 * c + 8 * c - 2 * c, 1e-12);
  // A heavier stage in the span raises it: stage 1 with 4 blocks, stage 3 with 2 (12 in all).
  q.stage_blocks = {3, 4, 3, 2};
  EXPECT_NEAR(estimate(model, trace, two, q).pipeline_s, 8 * (t(4) + t(3) + 2 * c) / 2, 1e-12);
}

// Replicas of a stage that leave their node through one shared NIC divide its bandwidth: on
// p3.16xlarge (one 25 Gb/s NIC per node) the 8 replicas of each stage of a w=8 d=8 plan all
// send to the next node at once.
TEST_F(PipelineTime, PipelinesSharingANicDivideIt) {
  clusters::Cluster c = clusters::load_cluster("p3.16xlarge", 8);
  models::ModelSpec big = models::load_model("pd2bw-gpt-3.9b");
  traces::Trace tr = uniform_trace(big, 1);
  Plan p = plan_of(Schedule::two_bw, 8, 8, 1, 64, 1, big.layers, grid(c));
  const clusters::Link nic = clusters::p2p_link(c, 0, 0, 1, 0);
  const double bytes = double(models::derive_costs(big).block.output_bytes);
  EXPECT_NEAR(estimate(big, tr, c, p).stages[0].send_s,
              nic.latency_s + 8 * bytes / nic.bandwidth_bytes_per_s, 1e-15);
}

// A 4-stage plan on one GPU: the ranks share its compute, so a step is at least m x sum of all
// stages' t_f + t_b, and their memory adds up.
TEST_F(PipelineTime, RanksOnOneGpuShareItsCompute) {
  clusters::Cluster one = clusters::load_cluster("h100-x1");
  Plan p = plan_of(Schedule::one_f_one_b, 1, 4, 2, 8, 1, 12, grid(one), 4);
  Estimate e = estimate(model, trace, one, p);
  EXPECT_NEAR(e.pipeline_s, 8 * t(12), 1e-12);
  std::int64_t sum = 0;
  for (const auto& st : e.stages)
    sum += st.memory.total();
  EXPECT_EQ(e.report.devices[0].peak_memory_bytes, sum);
}

// Ring all-reduce of S bytes over n GPUs: 2(n-1)(alpha + S/(n beta)).
TEST(AllReduce, RingFormula) {
  clusters::Link l{1e11, 5e-6, "test"};
  EXPECT_DOUBLE_EQ(ring_allreduce_s(8e9, 8, l), 2 * 7 * (5e-6 + 8e9 / (8 * 1e11)));
  EXPECT_EQ(ring_allreduce_s(8e9, 1, l), 0);
}

using Memory = Fixture;

// Paper (Appendix A), per stage with |W|/d the stage's weights and |A_total(b)|/d its activations
// for one microbatch, |A_input(b)| its input activation; n = d - s microbatches in flight. Beside
// the paper's terms the activations hold the stage's message buffers (M below, the next test).
TEST_F(Memory, TwoBwWithRecomputeMatchesThePaper) {
  // 2|W|/d + |A_total(b)|/d + d|A_input(b)|, here for a middle stage s with n = d - s.
  Plan p = plan_of(Schedule::two_bw, 2, 4, 2, 8, 1, 12, grid(cluster));
  p.recompute.assign(4, pw::planner::Recompute::full);
  Estimate e = estimate(model, trace, cluster, p);
  const models::ModelCosts mc = models::derive_costs(model);
  const int s = 1;
  const auto& st = e.stages[s];
  const std::int64_t W = 3 * mc.block.parameters * 2;        // fp16 weights of the stage
  const std::int64_t A = 2 * 3 * mc.block.activation_bytes;  // b = 2, 3 blocks
  const std::int64_t I = 2 * mc.block.input_bytes;
  EXPECT_EQ(st.memory.weights + st.memory.weight_versions, 2 * W);
  EXPECT_EQ(st.memory.activations, A + (4 - s) * I + message_buffer_bytes(p, trace, s));
  // Mixed-precision AdamW: 16 bytes per parameter with weights and gradients.
  EXPECT_EQ(st.memory.weights + st.memory.gradients + st.memory.optimizer,
            16 * 3 * mc.block.parameters);
}

TEST_F(Memory, TwoBwWithoutRecomputeStashesDMicrobatches) {
  // Paper: 2|W|/d + d|A_total(b)|/d + d|A_input(b)|. Our per-microbatch stash already holds the
  // stage input (it is the first block's x), so the last term is inside the first.
  Plan p = plan_of(Schedule::two_bw, 2, 4, 2, 8, 1, 12, grid(cluster));
  Estimate e = estimate(model, trace, cluster, p);
  const models::ModelCosts mc = models::derive_costs(model);
  for (int s = 1; s < 3; ++s)
    EXPECT_EQ(e.stages[s].memory.activations,
              (4 - s) * 2 * 3 * mc.block.activation_bytes + message_buffer_bytes(p, trace, s));
  // Stage 0 stashes d microbatches, plus the embedding's token ids.
  EXPECT_EQ(e.stages[0].memory.activations,
            4 * 2 * (3 * mc.block.activation_bytes + mc.embedding.activation_bytes) +
                message_buffer_bytes(p, trace, 0));
}

// The message buffers beside the stashes (docs/formulas.md section 4): received, produced and the
// previous op's sent one, each a block's output at b; none with one stage.
TEST_F(Memory, MessageBuffersReceivedProducedAndSent) {
  const models::ModelCosts mc = models::derive_costs(model);
  Plan p = plan_of(Schedule::one_f_one_b, 2, 4, 2, 8, 1, 12, grid(cluster));
  const int want[] = {2, 3, 3, 2};
  for (int s = 0; s < 4; ++s) {
    EXPECT_EQ(message_buffers(p, s), want[s]) << "stage " << s;
    EXPECT_EQ(message_buffer_bytes(p, trace, s), want[s] * 2 * mc.block.output_bytes);
  }
  // Interleaved: every device receives and sends (its chunks are virtual middle stages).
  Plan q = plan_of(Schedule::interleaved, 2, 4, 2, 8, 3, 12, grid(cluster));
  EXPECT_EQ(message_buffers(q, 0), 3);
  EXPECT_EQ(message_buffers(q, 3), 3);
  // GPipe's last stage peaks after a forward, which sends nothing there: no sent one held.
  Plan g = plan_of(Schedule::gpipe, 2, 4, 2, 8, 1, 12, grid(cluster));
  EXPECT_EQ(message_buffers(g, 0), 2);
  EXPECT_EQ(message_buffers(g, 2), 3);
  EXPECT_EQ(message_buffers(g, 3), 1);
  Plan one = plan_of(Schedule::one_f_one_b, 2, 1, 2, 8, 1, 12, grid(cluster));
  EXPECT_EQ(message_buffers(one, 0), 0);
}

TEST_F(Memory, GPipeWithRecomputeKeepsMInputs) {
  // Paper: |W|/d + |A_total(b)|/d + m|A_input(b)|; one weight version.
  Plan p = plan_of(Schedule::gpipe, 2, 4, 2, 8, 1, 12, grid(cluster));
  p.recompute.assign(4, pw::planner::Recompute::full);
  Estimate e = estimate(model, trace, cluster, p);
  const models::ModelCosts mc = models::derive_costs(model);
  const auto& st = e.stages[2];
  EXPECT_EQ(st.memory.weight_versions, 0);
  EXPECT_EQ(st.memory.activations, 2 * 3 * mc.block.activation_bytes +
                                       8 * 2 * mc.block.input_bytes +
                                       message_buffer_bytes(p, trace, 2));
}

// Block recompute (Korthikanti et al. 2022's full recomputation): each microbatch in flight keeps
// every layer's input, and the one being re-made adds one layer's stash; the time is full
// recompute's. With 3 blocks a stage, a middle 1f1b stage holds (d - s) x 3 inputs + one block
// where full recompute holds (d - s) inputs + the three blocks' stash.
TEST_F(Memory, BlockRecomputeKeepsEachLayersInputAndReMakesOneLayer) {
  const models::ModelCosts mc = models::derive_costs(model);
  Plan p = plan_of(Schedule::one_f_one_b, 2, 4, 2, 8, 1, 12, grid(cluster));
  p.recompute.assign(4, Recompute::full);
  const Estimate full = estimate(model, trace, cluster, p);
  p.recompute.assign(4, Recompute::block);
  const Estimate block = estimate(model, trace, cluster, p);
  const std::int64_t I = 2 * mc.block.input_bytes, A = 2 * mc.block.activation_bytes;
  const int s = 1;
  EXPECT_EQ(block.stages[s].memory.activations,
            (4 - s) * 3 * I + A + message_buffer_bytes(p, trace, s));
  EXPECT_EQ(full.stages[s].memory.activations,
            (4 - s) * I + 3 * A + message_buffer_bytes(p, trace, s));
  EXPECT_EQ(block.stages[s].layer_inputs_bytes, 3 * I);
  // Stage 0 keeps the embedding's stash (its "input"), the last stage the head's input.
  EXPECT_EQ(block.stages[0].layer_inputs_bytes, 3 * I + 2 * mc.embedding.activation_bytes);
  EXPECT_EQ(block.stages[3].layer_inputs_bytes, 3 * I + 2 * mc.head.input_bytes);
  EXPECT_DOUBLE_EQ(block.report.iteration_time_s, full.report.iteration_time_s);
  EXPECT_EQ(to_string(Recompute::block), "block");
  EXPECT_EQ(parse_recompute("block"), Recompute::block);
}

TEST_F(Memory, OneFOneBStashesAtMostDMinusS) {
  Plan p = plan_of(Schedule::one_f_one_b, 2, 4, 2, 8, 1, 12, grid(cluster));
  Estimate e = estimate(model, trace, cluster, p);
  for (int s = 0; s < 4; ++s)
    EXPECT_EQ(e.stages[s].in_flight, 4 - s);
  EXPECT_EQ(e.stages[0].memory.weight_versions, 0);
}

TEST_F(Memory, LastStageHoldsTheTiedEmbeddingCopy) {
  Plan p = plan_of(Schedule::one_f_one_b, 2, 4, 2, 8, 1, 12, grid(cluster));
  Estimate e = estimate(model, trace, cluster, p);
  const models::ModelCosts mc = models::derive_costs(model);
  EXPECT_EQ(e.stages[3].parameters,
            3 * mc.block.parameters + mc.head.parameters + mc.tied_copy_parameters);
  EXPECT_EQ(e.stages[0].parameters, 3 * mc.block.parameters + mc.embedding.parameters);
}

// The closed form's stash count n_s is what the generated programs really hold: the checker's
// measured maximum of forwarded-but-not-backwarded microbatch(-chunk)s on each device.
TEST_F(Memory, InFlightCountEqualsTheProgramsStash) {
  const std::pair<Schedule, int> cases[] = {{Schedule::gpipe, 1},
                                            {Schedule::one_f_one_b, 1},
                                            {Schedule::two_bw, 1},
                                            {Schedule::interleaved, 3}};
  for (auto [schedule, v] : cases) {
    Plan p = plan_of(schedule, 2, 4, 2, 8, v, 12, grid(cluster));
    Estimate e = estimate(model, trace, cluster, p);
    CheckReport c = check_programs(generate_programs(p, 3));
    for (const auto& dev : c.devices)
      EXPECT_EQ(dev.max_stash, e.stages[p.stage_of(dev.rank)].in_flight)
          << to_string(schedule) << " rank " << dev.rank;
  }
}

// The closed-form pipeline time equals the unit-time timeline of the same programs when every
// stage takes t_f = 1 and t_b = 2 units and communication is free.
TEST_F(PipelineTime, ClosedFormEqualsTheProgramsTimeline) {
  for (Schedule s : {Schedule::gpipe, Schedule::one_f_one_b, Schedule::interleaved}) {
    Plan p = plan_of(s, 2, 4, 2, 8, s == Schedule::interleaved ? 3 : 1, 12, grid(cluster));
    Programs programs = generate_programs(p, 1);
    StepTiming st = step_timing(programs, run_unit_timeline(programs), 0);
    // One unit = t(3) / 3: a stage of 3 blocks takes 1 ms forward and 2 ms backward per block.
    EXPECT_NEAR(estimate(model, trace, cluster, p).pipeline_s, st.time * t(3) / 3, 1e-12)
        << to_string(s);
  }
  Plan p = plan_of(Schedule::two_bw, 2, 4, 2, 8, 1, 12, grid(cluster));
  Programs programs = generate_programs(p, 4);
  std::vector<double> opt = optimizer_times(programs, run_unit_timeline(programs), 0);
  EXPECT_NEAR(estimate(model, trace, cluster, p).pipeline_s, (opt[2] - opt[1]) * t(3) / 3, 1e-12);
}

TEST(Fits, AModelTooBigForTheGpuIsFlagged) {
  models::ModelSpec big = models::load_model("gpt3-175b");
  clusters::Cluster one = clusters::load_cluster("h100-x1");
  Plan p = plan_of(Schedule::dp, 1, 1, 1, 1, 1, big.layers, grid(one));
  traces::Trace t = traces::analytic_trace(big, one.device, {1});
  Estimate e = estimate(big, t, one, p);
  EXPECT_FALSE(e.report.fits());
  EXPECT_FALSE(e.report.devices[0].fits);
  EXPECT_GT(e.report.devices[0].peak_memory_bytes, one.device.memory_bytes);
}

TEST(Estimate, MissingMicrobatchSizeIsAnInputError) {
  models::ModelSpec m = models::load_model("gpt-tiny");
  clusters::Cluster one = clusters::load_cluster("h100-x1");
  Plan p = plan_of(Schedule::dp, 1, 1, 4, 1, 1, m.layers, grid(one));
  traces::Trace t = traces::analytic_trace(m, one.device, {1, 2});
  try {
    estimate(m, t, one, p);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("microbatch size 4"), std::string::npos) << e.what();
  }
}

TEST(Estimate, ReportIsDeterministicAndRoundTrips) {
  models::ModelSpec m = models::load_model("pd2bw-gpt-1.3b");
  clusters::Cluster c = clusters::load_cluster("p3.16xlarge", 2);
  Plan p = plan_of(Schedule::two_bw, 4, 4, 2, 8, 1, m.layers, grid(c));
  traces::Trace t = traces::analytic_trace(m, c.device, {2});
  std::string a = to_json(estimate(m, t, c, p).report).dump();
  std::string b = to_json(estimate(m, t, c, p).report).dump();
  EXPECT_EQ(a, b);
  RunReport r = parse_report(common::Json::parse(a), "report");
  EXPECT_EQ(r.devices.size(), 16u);
  EXPECT_EQ(r.source, "analytic");
}

// A rank, node, GPU, stage or replica at or above the plan's cap on GPUs is refused, not wrapped
// to int (2^32 + 1 was read as rank 1; 2^31 became a negative index in validate). Found by
// fuzz_validation.
TEST(Report, IndicesAreNeverWrapped) {
  auto m = models::load_model("gpt2-124m");
  auto c = clusters::load_cluster("dgx-a100");
  Plan p = plan_of(Schedule::one_f_one_b, 2, 4, 1, 8, 1, m.layers, grid(c));
  traces::Trace t = traces::analytic_trace(m, c.device, {1});
  const common::Json good = to_json(estimate(m, t, c, p).report);
  for (const char* key : {"rank", "node", "gpu", "stage", "replica"})
    for (std::int64_t v : {std::int64_t(1) << 31, (std::int64_t(1) << 32) + 1, kMaxGpus}) {
      common::Json j = good;
      j["devices"][1][key] = v;
      try {
        parse_report(j, "r.json");
        ADD_FAILURE() << key << " = " << v << " was accepted";
      } catch (const InputError& e) {
        EXPECT_NE(std::string(e.what()).find(std::string("r.json: /devices/1/") + key),
                  std::string::npos)
            << e.what();
      }
    }
}

}  // namespace
}  // namespace pw::planner
