// planner/plan: structural checks name the field, balanced and uneven splits, placement as in the
// PipeDream-2BW paper, co-located ranks, and the plan JSON format.
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "planner/plan.hpp"

namespace pw::planner {
namespace {

Plan make(Schedule s, int w, int d, int b, int m, int v = 1) {
  Plan p;
  p.schedule = s;
  p.w = w;
  p.d = d;
  p.b = b;
  p.m = m;
  p.v = v;
  return p;
}

// Expects a PlanError whose one-line message names `field`.
void expect_rejected(const Plan& p, const std::string& field) {
  try {
    check(p);
    ADD_FAILURE() << "accepted a plan that should name " << field;
  } catch (const PlanError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(field), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

TEST(PlanCheck, RejectsImpossiblePlansNamingTheField) {
  expect_rejected(make(Schedule::two_bw, 1, 4, 1, 3), "m");          // m < d for 2bw
  expect_rejected(make(Schedule::interleaved, 1, 4, 1, 6, 2), "m");  // m % d != 0
  expect_rejected(make(Schedule::one_f_one_b, 1, 4, 1, 8, 2), "v");  // v without interleaved
  expect_rejected(make(Schedule::dp, 2, 2, 1, 2), "d");              // dp needs d = 1
  expect_rejected(make(Schedule::gpipe, 0, 2, 1, 2), "w");
  expect_rejected(make(Schedule::gpipe, 1, 2, 0, 2), "b");
  Plan empty_stage = make(Schedule::gpipe, 1, 2, 1, 2);
  empty_stage.stage_blocks = {4, 0};
  expect_rejected(empty_stage, "stage_blocks[1]");
  Plan wrong_rc = make(Schedule::gpipe, 1, 2, 1, 2);
  wrong_rc.recompute = {Recompute::full};
  expect_rejected(wrong_rc, "recompute");
  EXPECT_NO_THROW(check(make(Schedule::two_bw, 2, 4, 2, 4)));
  EXPECT_NO_THROW(check(make(Schedule::interleaved, 1, 4, 1, 8, 3)));
}

TEST(PlanStages, BalancedAndUnevenSplits) {
  EXPECT_EQ(balanced_split(12, 4), (std::vector<std::int64_t>{3, 3, 3, 3}));
  EXPECT_EQ(balanced_split(14, 4), (std::vector<std::int64_t>{4, 4, 3, 3}));
  Plan p = make(Schedule::one_f_one_b, 1, 3, 1, 3);
  resolve_stages(p, 10);
  EXPECT_EQ(p.stage_blocks, (std::vector<std::int64_t>{4, 3, 3}));
  Plan uneven = make(Schedule::one_f_one_b, 1, 2, 1, 2);
  uneven.stage_blocks = {7, 3};
  EXPECT_NO_THROW(resolve_stages(uneven, 10));
  uneven.stage_blocks = {7, 4};
  EXPECT_THROW(resolve_stages(uneven, 10), PlanError);
  Plan too_deep = make(Schedule::one_f_one_b, 1, 16, 1, 16);
  EXPECT_THROW(resolve_stages(too_deep, 12), PlanError);
  Plan inter = make(Schedule::interleaved, 1, 2, 1, 4, 2);
  resolve_stages(inter, 12);
  EXPECT_EQ(inter.stage_blocks.size(), 4u);  // d*v virtual stages
}

TEST(PlanPlacement, ReplicasInsideANodeWhenWidthFits) {
  // w = 4 <= 8 GPUs per node: the 4 replicas of each stage share a node (all-reduce on NVLink).
  Plan p = make(Schedule::two_bw, 4, 4, 1, 4);
  place(p, {2, 8});
  for (int s = 0; s < p.d; ++s)
    for (int r = 1; r < p.w; ++r)
      EXPECT_EQ(p.placement[p.rank_of(s, r)].node, p.placement[p.rank_of(s, 0)].node);
  EXPECT_EQ(p.placement[p.rank_of(1, 0)], (Placement{0, 4}));
}

TEST(PlanPlacement, PipelinesInsideNodesWhenWidthExceedsNode) {
  // w = 16 > 8 GPUs per node: each 4-stage pipeline sits inside one node.
  Plan p = make(Schedule::two_bw, 16, 4, 1, 4);
  place(p, {8, 8});
  for (int r = 0; r < p.w; ++r)
    for (int s = 1; s < p.d; ++s)
      EXPECT_EQ(p.placement[p.rank_of(s, r)].node, p.placement[p.rank_of(0, r)].node);
}

TEST(PlanPlacement, SeveralRanksOnOneGpu) {
  Plan p = make(Schedule::one_f_one_b, 1, 4, 1, 8);
  place(p, {1, 1}, 4);
  for (const auto& pl : p.placement)
    EXPECT_EQ(pl, (Placement{0, 0}));
  Plan q = make(Schedule::one_f_one_b, 1, 4, 1, 8);
  EXPECT_THROW(place(q, {1, 1}), PlanError);  // 4 ranks, 1 device, 1 rank per GPU
  try {
    place(q, {1, 8});
    FAIL();
  } catch (const PlanError& e) {
    EXPECT_NE(std::string(e.what()).find("w*d"), std::string::npos) << e.what();
  }
}

TEST(PlanPlacement, ExplicitPlacementOutsideClusterNamesTheRank) {
  Plan p = make(Schedule::one_f_one_b, 1, 2, 1, 2);
  p.placement = {{0, 0}, {0, 9}};
  try {
    place(p, {1, 8});
    FAIL();
  } catch (const PlanError& e) {
    EXPECT_NE(std::string(e.what()).find("placement[1]"), std::string::npos) << e.what();
  }
}

TEST(PlanJson, RoundTripAndErrors) {
  Plan p = make(Schedule::two_bw, 2, 4, 2, 8);
  p.recompute = {Recompute::full, Recompute::none, Recompute::none, Recompute::full};
  resolve_stages(p, 12);
  place(p, {1, 8});
  Plan q = parse_plan(to_json(p), "test");
  EXPECT_EQ(to_json(p), to_json(q));
  common::Json bad = to_json(p);
  bad["schedule"] = "pipedream";
  EXPECT_THROW(parse_plan(bad, "bad.json"), InputError);
  bad = to_json(p);
  bad["m"] = 2;  // m < d for 2bw
  try {
    parse_plan(bad, "bad.json");
    FAIL();
  } catch (const PlanError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.json"), std::string::npos);
  }
  bad = to_json(p);
  bad.erase("d");
  try {
    parse_plan(bad, "bad.json");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.json: /d"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace pw::planner
