// Schedule generators: op counts, orderings, the papers' bubble and memory formulas.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <tuple>

#include "common/error.hpp"
#include "planner/checker.hpp"
#include "planner/unit_timeline.hpp"

namespace pw::planner {
namespace {

Plan make_plan(Schedule schedule, int d, int m, int v = 1, int w = 1, bool recompute = false) {
  Plan plan;
  plan.schedule = schedule;
  plan.d = d;
  plan.m = m;
  plan.v = v;
  plan.w = w;
  if (recompute) plan.recompute.assign(std::size_t(d), pw::planner::Recompute::full);
  return plan;
}

bool valid(const Plan& p) {
  switch (p.schedule) {
    case Schedule::two_bw:
      return p.m >= p.d && p.v == 1;
    case Schedule::interleaved:
      return p.m % p.d == 0;
    case Schedule::dp:
      return p.d == 1 && p.v == 1;
    default:
      return p.v == 1;
  }
}

// Every valid plan of the grid d in 1..8, m in 1..16, v in 1..4, w in 1..2, recompute on/off.
void for_each_plan(Schedule schedule, const std::function<void(const Plan&)>& fn) {
  for (int d = 1; d <= 8; ++d) {
    for (int m = 1; m <= 16; ++m) {
      for (int v = 1; v <= 4; ++v) {
        for (int w = 1; w <= 2; ++w) {
          for (bool recompute : {false, true}) {
            const Plan plan = make_plan(schedule, d, m, v, w, recompute);
            if (valid(plan)) fn(plan);
          }
        }
      }
    }
  }
}

int count(const Program& device, OpKind kind) {
  int n = 0;
  for (const Op& op : device.ops)
    n += op.kind == kind;
  return n;
}

std::string name(const Plan& p) {
  return to_string(p.schedule) + " d=" + std::to_string(p.d) + " m=" + std::to_string(p.m) +
         " v=" + std::to_string(p.v) + " w=" + std::to_string(p.w) +
         (p.recompute.empty() ? "" : " recompute");
}

// Counts per device: every (microbatch, chunk) of every step forwarded and backwarded once, one
// message per virtual-stage boundary crossed, buckets*v all-reduces per step when w > 1.
void expect_counts(const Programs& p) {
  const Plan& plan = p.plan;
  const int steps = p.steps, mv = plan.m * plan.v;
  for (const Program& dev : p.devices) {
    const int first = dev.stage == 0, last = dev.stage == plan.d - 1;
    EXPECT_EQ(count(dev, OpKind::forward), steps * mv);
    EXPECT_EQ(count(dev, OpKind::backward), steps * mv);
    EXPECT_EQ(count(dev, OpKind::recompute), plan.recomputes(dev.stage) ? steps * mv : 0);
    // Chunk 0 of stage 0 has no predecessor; chunk v-1 of stage d-1 no successor.
    EXPECT_EQ(count(dev, OpKind::recv_activation), steps * (mv - first * plan.m));
    EXPECT_EQ(count(dev, OpKind::send_activation), steps * (mv - last * plan.m));
    EXPECT_EQ(count(dev, OpKind::recv_gradient), steps * (mv - last * plan.m));
    EXPECT_EQ(count(dev, OpKind::send_gradient), steps * (mv - first * plan.m));
    EXPECT_EQ(count(dev, OpKind::all_reduce), plan.w > 1 ? steps * p.buckets * plan.v : 0);
    EXPECT_EQ(count(dev, OpKind::optimizer_step), steps);
    EXPECT_EQ(count(dev, OpKind::free_version),
              plan.schedule == Schedule::two_bw ? steps - 1 : steps);
  }
}

// Forward before backward; a recompute, when present, immediately before its backward; peers on
// the same replica.
void expect_order(const Programs& p) {
  for (const Program& dev : p.devices) {
    std::map<std::tuple<int, int, int>, std::size_t> forward_at;
    for (std::size_t i = 0; i < dev.ops.size(); ++i) {
      const Op& op = dev.ops[i];
      const auto key = std::make_tuple(op.step, op.microbatch, op.chunk);
      if (op.kind == OpKind::forward) forward_at[key] = i;
      if (op.kind == OpKind::backward) {
        ASSERT_TRUE(forward_at.count(key)) << "rank " << dev.rank << " op " << i;
        EXPECT_LT(forward_at[key], i);
        if (p.plan.recomputes(dev.stage)) {
          ASSERT_GT(i, 0u);
          EXPECT_EQ(dev.ops[i - 1].kind, OpKind::recompute);
          EXPECT_EQ(dev.ops[i - 1].microbatch, op.microbatch);
          EXPECT_EQ(dev.ops[i - 1].chunk, op.chunk);
        }
      }
      if (op.peer >= 0) {
        EXPECT_EQ(p.plan.replica_of(op.peer), dev.replica);
      }
    }
  }
}

void check_grid(Schedule schedule) {
  int plans = 0;
  for_each_plan(schedule, [&](const Plan& plan) {
    SCOPED_TRACE(name(plan));
    const Programs p = generate_programs(plan, 3, plan.w > 1 ? 2 : 1);
    expect_counts(p);
    expect_order(p);
    CheckReport report;
    ASSERT_NO_THROW(report = check_programs(p));
    EXPECT_EQ(report.max_live_versions, version_limit(plan));
    EXPECT_LE(report.max_stash, stash_limit(plan));
    ++plans;
  });
  EXPECT_GT(plans, 0);
}

TEST(Schedules, GpipeGridPassesChecker) {
  check_grid(Schedule::gpipe);
}
TEST(Schedules, OneFOneBGridPassesChecker) {
  check_grid(Schedule::one_f_one_b);
}
TEST(Schedules, TwoBwGridPassesChecker) {
  check_grid(Schedule::two_bw);
}
TEST(Schedules, InterleavedGridPassesChecker) {
  check_grid(Schedule::interleaved);
}
TEST(Schedules, DpGridPassesChecker) {
  check_grid(Schedule::dp);
}

// Stash (design.md): GPipe stashes all m microbatches; PipeDream-Flush and 2BW stage s stash
// min(d - s, m) (d at stage 0 when m >= d).
TEST(Schedules, StashPerStage) {
  for (int d = 1; d <= 8; ++d) {
    for (int m = d; m <= 16; ++m) {
      for (Schedule s : {Schedule::gpipe, Schedule::one_f_one_b, Schedule::two_bw}) {
        const CheckReport r = check_programs(generate_programs(make_plan(s, d, m), 3));
        for (const DeviceCheck& dev : r.devices) {
          const int want = s == Schedule::gpipe ? m : std::min(d - dev.rank, m);
          EXPECT_EQ(dev.max_stash, want) << to_string(s) << " d=" << d << " m=" << m;
        }
      }
    }
  }
}

// 2BW: microbatch k uses version max(floor((k-1)/m) - 1, 0); version t+1 is created after the
// last backward of step t, after the shadow version t-1 is freed; at most 2 live.
TEST(Schedules, TwoBwVersionRule) {
  const Plan plan = make_plan(Schedule::two_bw, 4, 4);
  const Programs p = generate_programs(plan, 5);
  for (const Program& dev : p.devices) {
    for (std::size_t i = 0; i < dev.ops.size(); ++i) {
      const Op& op = dev.ops[i];
      if (is_compute(op.kind)) {
        const int k = op.step * plan.m + op.microbatch + 1;
        EXPECT_EQ(op.version, std::max((k - 1) / plan.m - 1, 0));
      }
      if (op.kind == OpKind::optimizer_step) {
        EXPECT_EQ(op.version, op.step + 1);
        if (op.step >= 1) {
          EXPECT_EQ(dev.ops[i - 1].kind, OpKind::free_version);
          EXPECT_EQ(dev.ops[i - 1].version, op.step - 1);
        }
      }
    }
  }
  EXPECT_EQ(check_programs(p).max_live_versions, 2);
}

// A resumed segment (first_step > 0) carries global steps, passes the checker starting from the
// versions a run holds after first_step updates, and gives every compute op the version it has in
// the unbroken run.
TEST(Schedules, ResumedSegmentKeepsTheGlobalVersions) {
  for (Schedule s :
       {Schedule::gpipe, Schedule::one_f_one_b, Schedule::two_bw, Schedule::interleaved}) {
    const Plan plan = make_plan(s, 4, 8, s == Schedule::interleaved ? 2 : 1, 2);
    const Programs whole = generate_programs(plan, 5, 2);
    for (int first = 1; first <= 3; ++first) {
      SCOPED_TRACE(to_string(s) + " first_step " + std::to_string(first));
      const Programs part = generate_programs(plan, 5 - first, 2, first);
      EXPECT_EQ(part.first_step, first);
      CheckReport report;
      ASSERT_NO_THROW(report = check_programs(part));
      EXPECT_EQ(report.max_live_versions, version_limit(plan));
      std::map<std::tuple<int, int, int, int, int>, int> versions;  // (rank, kind, step, mb, chunk)
      for (const Program& dev : whole.devices)
        for (const Op& op : dev.ops)
          if (is_compute(op.kind))
            versions[{dev.rank, int(op.kind), op.step, op.microbatch, op.chunk}] = op.version;
      int computes = 0;
      for (const Program& dev : part.devices)
        for (const Op& op : dev.ops) {
          EXPECT_GE(op.step, first);
          if (!is_compute(op.kind)) continue;
          ++computes;
          EXPECT_EQ(op.version,
                    versions.at({dev.rank, int(op.kind), op.step, op.microbatch, op.chunk}));
        }
      EXPECT_EQ(computes, (5 - first) * plan.m * plan.v * 2 * plan.ranks());
    }
  }
  EXPECT_EQ(initial_versions(make_plan(Schedule::two_bw, 2, 2), 3), (std::vector<int>{2, 3}));
  EXPECT_EQ(initial_versions(make_plan(Schedule::two_bw, 2, 2), 0), (std::vector<int>{0}));
  EXPECT_EQ(initial_versions(make_plan(Schedule::gpipe, 2, 2), 3), (std::vector<int>{3}));
  EXPECT_THROW(generate_programs(make_plan(Schedule::gpipe, 2, 2), 1, 1, -1), PlanError);
}

// 2BW has no flush: the first step's warm-up is the only one (the last stage never waits for a
// forward between steps, so forwards of step t+1 run before the backwards of step t end).
TEST(Schedules, TwoBwHasNoFlushBetweenSteps) {
  const Programs p = generate_programs(make_plan(Schedule::two_bw, 4, 4), 3);
  const Program& stage0 = p.devices[0];
  std::size_t first_opt = 0;
  while (stage0.ops[first_opt].kind != OpKind::optimizer_step)
    ++first_opt;
  int step1_forwards_before = 0;
  for (std::size_t i = 0; i < first_opt; ++i) {
    const Op& op = stage0.ops[i];
    step1_forwards_before += op.kind == OpKind::forward && op.step == 1;
  }
  EXPECT_EQ(step1_forwards_before, 3);  // d - 1 microbatches of step 1 already in flight
}

// Megatron's order: the i-th forward runs chunk (i/d)%v of microbatch (i/(dv))d + i%d; warm-up
// min(2(d-s-1) + (v-1)d, mv) forwards, then forward/backward pairs.
TEST(Schedules, InterleavedOrder) {
  const int d = 2, v = 2, m = 4;
  const Programs p = generate_programs(make_plan(Schedule::interleaved, d, m, v), 1);
  for (const Program& dev : p.devices) {
    int f = 0, b = 0, forwards_before_backward = -1;
    for (const Op& op : dev.ops) {
      if (op.kind == OpKind::forward) {
        EXPECT_EQ(op.chunk, (f / d) % v);
        EXPECT_EQ(op.microbatch, (f / (d * v)) * d + f % d);
        ++f;
      } else if (op.kind == OpKind::backward) {
        if (forwards_before_backward < 0) forwards_before_backward = f;
        EXPECT_EQ(op.chunk, v - 1 - (b / d) % v);
        EXPECT_EQ(op.microbatch, (b / (d * v)) * d + b % d);
        ++b;
      }
    }
    const int warmup = std::min(2 * (d - dev.stage - 1) + (v - 1) * d, m * v);
    EXPECT_EQ(forwards_before_backward, std::min(warmup + 1, m * v));
  }
}

// Interleaved peers: virtual stage c*d+s receives from c*d+s-1 (rank s-1, or rank d-1 chunk c-1
// at s = 0) and sends to c*d+s+1.
TEST(Schedules, InterleavedPeersWrapAround) {
  const Programs p = generate_programs(make_plan(Schedule::interleaved, 4, 4, 2, 2), 1);
  const Program& r4 = p.devices[4];  // replica 1, stage 0
  for (const Op& op : r4.ops) {
    if (op.kind == OpKind::recv_activation) {
      EXPECT_EQ(op.chunk, 1);
      EXPECT_EQ(op.peer, 7);
    }
    if (op.kind == OpKind::send_activation) {
      EXPECT_EQ(op.peer, 5);
    }
  }
}

TEST(Schedules, RejectsBadArguments) {
  EXPECT_THROW(generate_programs(make_plan(Schedule::two_bw, 4, 2)), PlanError);
  EXPECT_THROW(generate_programs(make_plan(Schedule::interleaved, 4, 6, 2)), PlanError);
  EXPECT_THROW(generate_programs(make_plan(Schedule::one_f_one_b, 2, 2), 0), PlanError);
  EXPECT_THROW(generate_programs(make_plan(Schedule::one_f_one_b, 2, 2), 1, 0), PlanError);
}

// GPipe and PipeDream-Flush, uniform stages, free communication: the bubble is (d-1)/(m+d-1) of
// the step (the pipeline fills for d-1 forward slots and drains for d-1 backward slots).
TEST(UnitTimeline, FlushBubbleFraction) {
  for (Schedule s : {Schedule::gpipe, Schedule::one_f_one_b}) {
    for (int d = 1; d <= 8; ++d) {
      for (int m = 1; m <= 16; ++m) {
        const Programs p = generate_programs(make_plan(s, d, m), 1);
        const Timeline tl = run_unit_timeline(p);
        EXPECT_NEAR(bubble_fraction(p, tl, 0), double(d - 1) / (m + d - 1), 1e-12)
            << to_string(s) << " d=" << d << " m=" << m;
        EXPECT_DOUBLE_EQ(tl.makespan, 3.0 * (m + d - 1));
      }
    }
  }
}

// Megatron (Narayanan et al. 2021, eq. for interleaving): bubble time / ideal time = (1/v)(d-1)/m
// when each chunk op takes 1/v of a stage op.
TEST(UnitTimeline, InterleavedBubbleOverhead) {
  for (int d = 1; d <= 8; ++d) {
    for (int v = 1; v <= 4; ++v) {
      for (int m = d; m <= 16; m += d) {
        const Programs p = generate_programs(make_plan(Schedule::interleaved, d, m, v), 1);
        const Timeline tl = run_unit_timeline(p);
        const StepTiming st = step_timing(p, tl, 0);
        EXPECT_NEAR(st.compute, 3.0 * m, 1e-9);
        EXPECT_NEAR(st.overhead(), double(d - 1) / (v * m), 1e-9)
            << "d=" << d << " v=" << v << " m=" << m;
      }
    }
  }
}

// PipeDream-2BW: no flush, so after the warm-up each step takes exactly m(t_f + t_b) on every
// stage: the steady state has no bubble.
TEST(UnitTimeline, TwoBwSteadyStateHasNoBubble) {
  for (int d = 1; d <= 8; ++d) {
    for (int m = d; m <= 16; ++m) {
      const Programs p = generate_programs(make_plan(Schedule::two_bw, d, m), 4);
      const Timeline tl = run_unit_timeline(p);
      for (int rank = 0; rank < d; ++rank) {
        const std::vector<double> opt = optimizer_times(p, tl, rank);
        ASSERT_EQ(opt.size(), 4u);
        for (int t = 1; t < 3; ++t) {
          EXPECT_DOUBLE_EQ(opt[t + 1] - opt[t], 3.0 * m) << "d=" << d << " m=" << m;
        }
      }
    }
  }
}

// A receive never starts before its send ends; communication time lengthens the step.
TEST(UnitTimeline, ReceivesWaitForSends) {
  const Programs p = generate_programs(make_plan(Schedule::one_f_one_b, 4, 8), 2);
  Durations t;
  t.comm = 0.25;
  const Timeline tl = run_unit_timeline(p, t);
  const Execution ex = execute(p);
  for (std::size_t r = 0; r < p.devices.size(); ++r) {
    for (std::size_t i = 0; i < p.devices[r].ops.size(); ++i) {
      if (!is_recv(p.devices[r].ops[i].kind)) continue;
      const std::int64_t send = ex.match[std::size_t(ex.offset[r]) + i];
      int src = 0;
      while (ex.offset[std::size_t(src) + 1] <= send)
        ++src;
      EXPECT_GE(tl.ops[r][i].start,
                tl.ops[std::size_t(src)][std::size_t(send - ex.offset[src])].end);
    }
  }
  EXPECT_GT(tl.makespan, run_unit_timeline(p).makespan);
}

// The renderer's exact output for GPipe d=2, m=2 (one step): forwards of 1 unit, backwards of 2.
TEST(Render, GpipeGolden) {
  const Programs p = generate_programs(make_plan(Schedule::gpipe, 2, 2), 1);
  const std::string text = render_timeline(p, run_unit_timeline(p));
  const std::string want =
      "time       0     2     4     6     8\n"
      "rank 0 s0 |F1 F2 .  .  .  B1--- B2---\n"
      "rank 1 s1 |.  F1 F2 B1--- B2--- .  .\n"
      "F<k>/B<k>/R<k>: forward/backward/recompute of microbatch k (1-based over all steps); '.' "
      "idle, one per 1 time units; makespan 9\n";
  EXPECT_EQ(text, want);
}

TEST(Render, ProgramListing) {
  const Programs p = generate_programs(make_plan(Schedule::two_bw, 2, 2), 2);
  const std::string text = print_programs(p);
  EXPECT_NE(text.find("rank 0 (stage 0, replica 0): F1@0 sendA1->1 F2@0 sendA2->1"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("opt(v1)"), std::string::npos);
  EXPECT_NE(text.find("free(v0) opt(v2)"), std::string::npos);
}

Programs tied_programs(const Plan& plan, int steps, int first_step = 0, int buckets = 1) {
  ProgramOptions o;
  o.steps = steps;
  o.first_step = first_step;
  o.gradient_buckets = buckets;
  o.tied_embeddings = true;
  return generate_programs(plan, o);
}

// Tied embeddings add four ops per step on the two tied ends of each replica (six with w > 1: the
// two gathers) and none elsewhere; every schedule of the grid, from the start and resumed, still
// passes the checker.
TEST(TiedEmbeddings, GridPassesCheckerWithTheExchange) {
  for (Schedule s : {Schedule::gpipe, Schedule::one_f_one_b, Schedule::two_bw,
                     Schedule::interleaved, Schedule::dp}) {
    int plans = 0;
    for_each_plan(s, [&](const Plan& plan) {
      if (plan.m > 8) return;  // the grid's shape, at half the cost
      SCOPED_TRACE(name(plan));
      for (int first : {0, 2}) {
        const Programs p = tied_programs(plan, 3, first, plan.w > 1 ? 2 : 1);
        CheckReport report;
        ASSERT_NO_THROW(report = check_programs(p)) << "first_step " << first;
        EXPECT_EQ(report.max_live_versions, version_limit(plan));
        for (const Program& dev : p.devices) {
          const bool first_end = plan.d > 1 && dev.stage == 0;
          const bool last_end = plan.d > 1 && dev.stage == plan.d - 1;
          EXPECT_EQ(count(dev, OpKind::recv_tied_gradient), first_end ? 3 : 0);
          EXPECT_EQ(count(dev, OpKind::send_tied_weights), first_end ? 3 : 0);
          EXPECT_EQ(count(dev, OpKind::send_tied_gradient), last_end ? 3 : 0);
          EXPECT_EQ(count(dev, OpKind::recv_tied_weights), last_end ? 3 : 0);
          EXPECT_EQ(count(dev, OpKind::gather_tied_gradient), first_end && plan.w > 1 ? 3 : 0);
          EXPECT_EQ(count(dev, OpKind::gather_tied_weights), last_end && plan.w > 1 ? 3 : 0);
        }
      }
      ++plans;
    });
    EXPECT_GT(plans, 0);
  }
}

// 2BW, d = 4, m = 4, 3 steps: where the four ops sit. Stage 0 receives the head's gradient after
// its last backward of the step (just before its optimizer step) and sends the new weights right
// after it; the last stage sends its gradient right after its last backward of the step and
// receives version v just before its first forward that uses v (step v + 1 by the 2BW rule
// max(floor((k-1)/m) - 1, 0)); versions 2 and 3, used by no op of these steps, arrive at the end.
TEST(TiedEmbeddings, TwoBwPlacesTheFourOps) {
  const Plan plan = make_plan(Schedule::two_bw, 4, 4);
  const Programs p = tied_programs(plan, 3);
  const Program& first = p.devices[0];
  const Program& last = p.devices[3];
  const auto text = [&](const Program& dev) {
    std::string out;
    for (const Op& op : dev.ops)
      out += format_op(op, plan) + " ";
    return out;
  };
  for (int step = 0; step < 3; ++step) {
    const std::string v = std::to_string(step + 1), k = std::to_string(4 * step + 4);
    const std::string free = step > 0 ? "free(v" + std::to_string(step - 1) + ") " : "";
    EXPECT_NE(
        text(first).find("B" + k + " recvTG<-3 " + free + "opt(v" + v + ") sendTW(v" + v + ")->3 "),
        std::string::npos)
        << text(first);
    EXPECT_NE(text(last).find("B" + k + " sendG" + k + "->2 sendTG->0 " + free + "opt(v" + v + ")"),
              std::string::npos)
        << text(last);
  }
  // Version 1 first serves microbatch 9 (step 2): its forward waits for the weights, not earlier.
  EXPECT_NE(text(last).find("recvA9<-2 recvTW(v1)<-0 F9 "), std::string::npos) << text(last);
  EXPECT_EQ(text(last).find("recvTW(v1)"), text(last).find("recvTW"));
  const std::string tail = text(last).substr(text(last).rfind("opt(v3)"));
  EXPECT_EQ(tail, "opt(v3) recvTW(v2)<-0 recvTW(v3)<-0 ");
  // Nothing between the stages' steady-state compute: the middle stages carry no tied op.
  EXPECT_EQ(text(p.devices[1]).find("TG"), std::string::npos);
  EXPECT_EQ(text(p.devices[2]).find("TW"), std::string::npos);
  EXPECT_EQ(check_programs(p).messages, std::int64_t(2) * 3 * 4 * 3 + 2 * 3);
}

// Flush schedules: version t+1 is received just before the last stage's first forward of step
// t+1, the final version after the last optimizer step.
TEST(TiedEmbeddings, FlushReceivesBeforeTheNextStepsFirstForward) {
  const Plan plan = make_plan(Schedule::one_f_one_b, 2, 2);
  const Programs p = tied_programs(plan, 2);
  std::string last;
  for (const Op& op : p.devices[1].ops)
    last += format_op(op, plan) + " ";
  EXPECT_EQ(last,
            "recvA1<-0 F1 B1 sendG1->0 recvA2<-0 F2 B2 sendG2->0 sendTG->0 free(v0) opt(v1) "
            "recvA3<-0 recvTW(v1)<-0 F3 B3 sendG3->0 recvA4<-0 F4 B4 sendG4->0 sendTG->0 free(v1) "
            "opt(v2) recvTW(v2)<-0 ");
}

// With w replicas each tied message carries the replica's 1/w shard and a gather over the stage's
// replicas follows the receive: stage 0 gathers the head's gradient before its optimizer step, the
// last stage the new weights before the first forward that uses them.
TEST(TiedEmbeddings, ReplicasSendShardsAndGatherThem) {
  const Plan plan = make_plan(Schedule::two_bw, 2, 2, 1, 3);
  const Programs p = tied_programs(plan, 3);
  for (int replica = 0; replica < 3; ++replica) {
    std::string first, last;
    for (const Op& op : p.devices[std::size_t(plan.rank_of(0, replica))].ops)
      first += format_op(op, plan) + " ";
    for (const Op& op : p.devices[std::size_t(plan.rank_of(1, replica))].ops)
      last += format_op(op, plan) + " ";
    const std::string head = std::to_string(plan.rank_of(1, replica)),
                      embedding = std::to_string(plan.rank_of(0, replica));
    EXPECT_NE(first.find("AR0 recvTG<-" + head + " AGTG free(v0) opt(v2) sendTW(v2)->" + head),
              std::string::npos)
        << first;
    EXPECT_NE(last.find("recvA5<-" + embedding + " recvTW(v1)<-" + embedding + " AGTW(v1) F5 "),
              std::string::npos)
        << last;
    EXPECT_NE(last.find("opt(v3) recvTW(v2)<-" + embedding + " AGTW(v2) recvTW(v3)<-" + embedding +
                        " AGTW(v3) "),
              std::string::npos)
        << last;
  }
  // Every shard's message is matched; the gathers are collectives over the three replicas.
  const CheckReport report = check_programs(p);
  EXPECT_EQ(report.messages, std::int64_t(3) * (2 * 2 * 3 + 2 * 3));
  EXPECT_EQ(report.collectives, std::int64_t(2) * 3 + 3 + 3);  // all_reduce per stage and step
}

TEST(TiedEmbeddings, ShardsCoverTheTensorOnce) {
  for (std::int64_t n : {0, 1, 7, 12, 38'597'376})
    for (int w : {1, 2, 3, 8, 13}) {
      std::int64_t next = 0;
      for (int r = 0; r < w; ++r) {
        const TiedShard sh = tied_shard(n, w, r);
        EXPECT_EQ(sh.begin, next) << n << " " << w << " " << r;
        EXPECT_LE(sh.end - sh.begin, (n + w - 1) / w);
        next = sh.end;
      }
      EXPECT_EQ(next, n) << n << " " << w;
    }
}

}  // namespace
}  // namespace pw::planner
