// Schedule checker: hand-broken programs are rejected with a message naming the rank.
#include <gtest/gtest.h>

#include <string>

#include "common/error.hpp"
#include "planner/checker.hpp"

namespace pw::planner {
namespace {

Plan make_plan(Schedule schedule, int d, int m, int w = 1, bool recompute = false) {
  Plan plan;
  plan.schedule = schedule;
  plan.d = d;
  plan.m = m;
  plan.w = w;
  if (recompute) plan.recompute.assign(std::size_t(d), pw::planner::Recompute::full);
  return plan;
}

// Index of the first op of `device` matching kind (and microbatch when >= 0, and step).
std::size_t find(const Program& device, OpKind kind, int microbatch = -1, int step = 0) {
  for (std::size_t i = 0; i < device.ops.size(); ++i) {
    const Op& op = device.ops[i];
    if (op.kind == kind && op.step == step && (microbatch < 0 || op.microbatch == microbatch)) {
      return i;
    }
  }
  ADD_FAILURE() << "no " << to_string(kind) << " in rank " << device.rank;
  return 0;
}

void erase(Program& device, std::size_t index) {
  device.ops.erase(device.ops.begin() + std::ptrdiff_t(index));
}

// Runs `fn` and returns the ScheduleError message ("" if nothing was thrown).
template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const ScheduleError& e) {
    return e.what();
  }
  return "";
}

std::string check_error(const Programs& p) {
  return error_of([&] { check_programs(p); });
}

TEST(Checker, ReportsStashVersionsAndCounts) {
  // PipeDream-Flush stage s stashes d - s microbatches; one weight version; one message per
  // stage boundary per microbatch in each direction; one all-reduce group per stage and bucket.
  const int d = 4, m = 8, w = 2, steps = 3, buckets = 2;
  const Programs p = generate_programs(make_plan(Schedule::one_f_one_b, d, m, w), steps, buckets);
  const CheckReport r = check_programs(p);
  ASSERT_EQ(r.devices.size(), std::size_t(w * d));
  for (const DeviceCheck& dev : r.devices) {
    EXPECT_EQ(dev.max_stash, d - p.plan.stage_of(dev.rank));
    EXPECT_EQ(dev.max_live_versions, 1);
  }
  EXPECT_EQ(r.max_stash, d);
  EXPECT_EQ(r.messages, std::int64_t(2) * (d - 1) * m * steps * w);
  EXPECT_EQ(r.collectives, std::int64_t(d) * steps * buckets);
  EXPECT_EQ(r.ops, total_ops(p));
}

TEST(Checker, RejectsMissingReceive) {
  Programs p = generate_programs(make_plan(Schedule::gpipe, 3, 2), 1);
  erase(p.devices[1], find(p.devices[1], OpKind::recv_activation, 1));
  const std::string msg = check_error(p);
  EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("activation is received"), std::string::npos) << msg;
}

TEST(Checker, ExecutionRejectsUnreceivedMessage) {
  Programs p = generate_programs(make_plan(Schedule::gpipe, 2, 2), 1);
  erase(p.devices[1], find(p.devices[1], OpKind::recv_activation, 1));
  const std::string msg = error_of([&] { execute(p); });
  EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("never received by rank 1"), std::string::npos) << msg;
}

TEST(Checker, RejectsBackwardBeforeForward) {
  Programs p = generate_programs(make_plan(Schedule::one_f_one_b, 2, 2), 1);
  Program& last = p.devices[1];
  std::swap(last.ops[find(last, OpKind::forward, 0)], last.ops[find(last, OpKind::backward, 0)]);
  const std::string msg = check_error(p);
  EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("backward before its forward"), std::string::npos) << msg;
  EXPECT_NE(msg.find("microbatch 0"), std::string::npos) << msg;
}

TEST(Checker, RejectsThirdWeightVersionIn2bw) {
  // 2BW holds at most 2 versions: keeping the shadow version 0 alive past step 1 makes 3.
  Programs p = generate_programs(make_plan(Schedule::two_bw, 2, 2), 3);
  erase(p.devices[0], find(p.devices[0], OpKind::free_version, -1, 1));
  const std::string msg = check_error(p);
  EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("3 weight versions live (limit 2)"), std::string::npos) << msg;
}

TEST(Checker, RejectsSecondVersionInFlushSchedule) {
  Programs p = generate_programs(make_plan(Schedule::one_f_one_b, 2, 2), 2);
  erase(p.devices[1], find(p.devices[1], OpKind::free_version));
  const std::string msg = check_error(p);
  EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("2 weight versions live (limit 1)"), std::string::npos) << msg;
}

TEST(Checker, Rejects2bwVersionRule) {
  // Microbatch k = 5 with m = 2 must use version max(floor(4/2) - 1, 0) = 1.
  Programs p = generate_programs(make_plan(Schedule::two_bw, 2, 2), 3);
  Program& dev = p.devices[1];
  dev.ops[find(dev, OpKind::forward, 0, 2)].version = 0;
  const std::string msg = check_error(p);
  EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rule gives 1"), std::string::npos) << msg;
}

TEST(Checker, RejectsBackwardWithOtherVersionThanForward) {
  Programs p = generate_programs(make_plan(Schedule::two_bw, 2, 2), 3);
  Program& dev = p.devices[0];
  dev.ops[find(dev, OpKind::backward, 1, 1)].version = 1;
  const std::string msg = check_error(p);
  EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("its forward used 0"), std::string::npos) << msg;
}

TEST(Checker, RejectsReceiveCycle) {
  // Stage 0 waits for the gradient of microbatch 1 before sending its activation: 0 -> 1 -> 0.
  Programs p = generate_programs(make_plan(Schedule::one_f_one_b, 2, 1), 1);
  Program& dev = p.devices[0];
  std::swap(dev.ops[find(dev, OpKind::send_activation)], dev.ops[find(dev, OpKind::recv_gradient)]);
  const std::string msg = check_error(p);
  EXPECT_NE(msg.find("deadlock"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 0 op 1 recvG1<-1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 1 op 0 recvA1<-0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("wait cycle 0 -> 1 -> 0"), std::string::npos) << msg;
}

TEST(Checker, RejectsWrongFifoOrder) {
  // Stage 0 sends microbatch 2 before microbatch 1; stage 1 receives 1 first.
  Programs p = generate_programs(make_plan(Schedule::gpipe, 2, 2), 1);
  Program& dev = p.devices[0];
  const std::size_t a = find(dev, OpKind::send_activation, 0);
  const std::size_t f = find(dev, OpKind::forward, 1);
  std::swap(dev.ops[a], dev.ops[f]);      // F1 F2 sendA1 sendA2
  std::swap(dev.ops[f], dev.ops[f + 1]);  // F1 F2 sendA2 sendA1
  const std::string msg = check_error(p);
  EXPECT_NE(msg.find("rank 1 op 0 recvA1<-0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("FIFO channel from rank 0 delivers rank 0 op 2 sendA2->1"), std::string::npos)
      << msg;
}

TEST(Checker, RejectsMissingAllReduce) {
  Programs p = generate_programs(make_plan(Schedule::one_f_one_b, 2, 2, 2), 1);
  erase(p.devices[3], find(p.devices[3], OpKind::all_reduce));
  EXPECT_NE(check_error(p).find("rank 3"), std::string::npos) << check_error(p);
  // The bare execution sees rank 1 wait at an all_reduce rank 3 never joins.
  const std::string msg = error_of([&] { execute(p); });
  EXPECT_NE(msg.find("deadlock"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 3 has finished its program"), std::string::npos) << msg;
}

TEST(Checker, RejectsStashBeyondDepth) {
  // A GPipe order under a 1F1B plan stashes m = 4 microbatches on stage 0; the limit is d = 2.
  Programs p = generate_programs(make_plan(Schedule::gpipe, 2, 4), 1);
  p.plan.schedule = Schedule::one_f_one_b;
  const std::string msg = check_error(p);
  EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("stashes 3 microbatches (limit 2)"), std::string::npos) << msg;
}

TEST(Checker, RejectsMissingRecompute) {
  Programs p = generate_programs(make_plan(Schedule::one_f_one_b, 2, 2, 1, true), 1);
  erase(p.devices[1], find(p.devices[1], OpKind::recompute, 1));
  const std::string msg = check_error(p);
  EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("backward without a recompute"), std::string::npos) << msg;
}

TEST(Checker, RejectsDoubleForwardAndMissingBackward) {
  Programs p = generate_programs(make_plan(Schedule::one_f_one_b, 1, 2), 1);
  Program& dev = p.devices[0];
  dev.ops[find(dev, OpKind::forward, 1)].microbatch = 0;
  EXPECT_NE(check_error(p).find("forward twice"), std::string::npos) << check_error(p);

  p = generate_programs(make_plan(Schedule::one_f_one_b, 1, 2), 1);
  erase(p.devices[0], find(p.devices[0], OpKind::backward, 1));
  const std::string msg = check_error(p);
  EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
}

TEST(Checker, RejectsFreeingAVersionInUse) {
  Programs p = generate_programs(make_plan(Schedule::two_bw, 2, 2), 3);
  Program& dev = p.devices[0];
  // Move step 1's free(v0) before the backwards of step 1, which still use version 0.
  const std::size_t free_at = find(dev, OpKind::free_version, -1, 1);
  const Op freed = dev.ops[free_at];
  erase(dev, free_at);
  dev.ops.insert(dev.ops.begin() + std::ptrdiff_t(find(dev, OpKind::backward, 0, 1)), freed);
  const std::string msg = check_error(p);
  EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("still used by"), std::string::npos) << msg;
}

TEST(Checker, RejectsBadPeer) {
  Programs p = generate_programs(make_plan(Schedule::gpipe, 2, 1), 1);
  p.devices[0].ops[find(p.devices[0], OpKind::send_activation)].peer = 7;
  const std::string msg = check_error(p);
  EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("peer out of range"), std::string::npos) << msg;
}

Programs tied(const Plan& plan, int steps) {
  ProgramOptions o;
  o.steps = steps;
  o.tied_embeddings = true;
  return generate_programs(plan, o);
}

TEST(Checker, AcceptsTheTiedExchange) {
  const Programs p = tied(make_plan(Schedule::two_bw, 2, 2, 2), 3);
  EXPECT_EQ(check_error(p), "");
  // Per replica and step: one tied gradient and one tied weights message.
  EXPECT_EQ(check_programs(p).messages, std::int64_t(2) * 2 * 2 * 3 + 2 * 2 * 3);
}

TEST(Checker, RejectsTiedWeightsReceivedAfterTheirFirstUse) {
  // 2BW d = 2, m = 2: version 1 serves step 2's microbatches; receiving it after the first of
  // their forwards on the last stage would run that forward on a stale head.
  Programs p = tied(make_plan(Schedule::two_bw, 2, 2), 3);
  Program& last = p.devices[1];
  const std::size_t recv = find(last, OpKind::recv_tied_weights, -1, 2);
  ASSERT_EQ(last.ops[recv + 1].kind, OpKind::forward);
  std::swap(last.ops[recv], last.ops[recv + 1]);
  const std::string msg = check_error(p);
  EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("before its tied weights are received"), std::string::npos) << msg;
}

TEST(Checker, RejectsATiedGradientNeverReceived) {
  Programs p = tied(make_plan(Schedule::one_f_one_b, 2, 2), 2);
  erase(p.devices[0], find(p.devices[0], OpKind::recv_tied_gradient, -1, 1));
  const std::string msg = check_error(p);
  EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tied gradient is received"), std::string::npos) << msg;
}

TEST(Checker, RejectsTiedOpsOutOfPlace) {
  // The tied gradient is sent after the step's backwards, not before.
  Programs p = tied(make_plan(Schedule::gpipe, 2, 2), 1);
  Program& last = p.devices[1];
  const Op op = last.ops[find(last, OpKind::send_tied_gradient)];
  erase(last, find(last, OpKind::send_tied_gradient));
  last.ops.insert(last.ops.begin(), op);
  EXPECT_NE(check_error(p).find("send_tied_gradient before the step's backwards"),
            std::string::npos)
      << check_error(p);
  // A middle stage holds no tied tensor.
  p = tied(make_plan(Schedule::gpipe, 3, 2), 1);
  p.devices[1].ops.push_back(Op{OpKind::send_tied_weights, 0, -1, 0, 2, 1, -1});
  EXPECT_NE(check_error(p).find("not its tied end"), std::string::npos) << check_error(p);
  // An untied program has no tied ops.
  p = generate_programs(make_plan(Schedule::gpipe, 2, 2), 1);
  p.devices[0].ops.push_back(Op{OpKind::send_tied_weights, 0, -1, 0, 1, 1, -1});
  EXPECT_NE(check_error(p).find("untied program"), std::string::npos) << check_error(p);
}

TEST(Checker, AcceptsTheShardedTiedExchangeOfReplicas) {
  for (Schedule s : {Schedule::gpipe, Schedule::one_f_one_b, Schedule::two_bw})
    for (int w : {2, 4}) {
      const Programs p = tied(make_plan(s, 3, 3, w), 3);
      EXPECT_EQ(check_error(p), "") << to_string(s) << " w=" << w;
      // Messages as with w = 1 (a shard each); collectives: per step the all_reduce of every
      // stage, stage 0's gradient gather and the last stage's weights gather.
      const CheckReport r = check_programs(p);
      EXPECT_EQ(r.messages, std::int64_t(w) * (2 * 2 * 3 * 3 + 2 * 3));
      EXPECT_EQ(r.collectives, std::int64_t(3) * 3 + 3 + 3);
    }
}

TEST(Checker, RejectsTiedGathersOutOfPlace) {
  // Stage 0 without its gradient gather: its optimizer step would miss the other shards.
  Programs p = tied(make_plan(Schedule::one_f_one_b, 2, 2, 2), 2);
  erase(p.devices[0], find(p.devices[0], OpKind::gather_tied_gradient, -1, 1));
  std::string msg = check_error(p);
  EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tied gradient is received and gathered"), std::string::npos) << msg;
  // The gather before the shard is received.
  p = tied(make_plan(Schedule::one_f_one_b, 2, 2, 2), 2);
  {
    Program& first = p.devices[0];
    const std::size_t recv = find(first, OpKind::recv_tied_gradient);
    ASSERT_EQ(first.ops[recv + 1].kind, OpKind::gather_tied_gradient);
    std::swap(first.ops[recv], first.ops[recv + 1]);
  }
  msg = check_error(p);
  EXPECT_NE(msg.find("gather_tied_gradient before recv_tied_gradient"), std::string::npos) << msg;
  // The last stage's forward on a version whose shards are not gathered yet.
  p = tied(make_plan(Schedule::two_bw, 2, 2, 2), 3);
  {
    Program& last = p.devices[1];
    const std::size_t gather = find(last, OpKind::gather_tied_weights, -1, 2);
    ASSERT_EQ(last.ops[gather + 1].kind, OpKind::forward);
    std::swap(last.ops[gather], last.ops[gather + 1]);
  }
  msg = check_error(p);
  EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("gather_tied_weights)"), std::string::npos) << msg;
  // One replica has nothing to gather.
  p = tied(make_plan(Schedule::gpipe, 2, 2), 1);
  p.devices[0].ops.push_back(Op{OpKind::gather_tied_gradient, 0, -1, 0, -1, -1, -1});
  msg = check_error(p);
  EXPECT_NE(msg.find("gather_tied_gradient with one replica"), std::string::npos) << msg;
}

TEST(Checker, ExecutionMatchesTiedGathersOverReplicas) {
  // Replica 1's last stage gathers version 2 where replica 0 gathers version 1: neither
  // collective completes.
  Programs p = tied(make_plan(Schedule::two_bw, 2, 2, 2), 3);
  Program& last = p.devices[3];
  std::vector<std::size_t> gathers;
  for (std::size_t i = 0; i < last.ops.size(); ++i)
    if (last.ops[i].kind == OpKind::gather_tied_weights) gathers.push_back(i);
  ASSERT_EQ(gathers.size(), 3u);
  std::swap(last.ops[gathers[0]].version, last.ops[gathers[1]].version);
  const std::string msg = error_of([&] { execute(p); });
  EXPECT_NE(msg.find("deadlock"), std::string::npos) << msg;
}

TEST(Checker, ExecutionMatchesTiedWeightsByVersion) {
  // The last stage receives versions 1 and 2 in swapped order: FIFO delivers version 1 first.
  Programs p = tied(make_plan(Schedule::two_bw, 2, 2), 3);
  Program& last = p.devices[1];
  std::vector<std::size_t> recvs;
  for (std::size_t i = 0; i < last.ops.size(); ++i)
    if (last.ops[i].kind == OpKind::recv_tied_weights) recvs.push_back(i);
  ASSERT_EQ(recvs.size(), 3u);
  std::swap(last.ops[recvs[1]].version, last.ops[recvs[2]].version);
  const std::string msg = error_of([&] { execute(p); });
  EXPECT_NE(msg.find("FIFO channel from rank 0 delivers"), std::string::npos) << msg;
}

}  // namespace
}  // namespace pw::planner
