// planner/search: the planner's pick against simulating every candidate, the closed-form ranking
// against the simulated one, and the memory filter against the simulator's ledger.
#include <set>

#include <gtest/gtest.h>

#include "planner/search.hpp"
#include "sim/simulator.hpp"
#include "traces/analytic.hpp"

namespace pw::planner {
namespace {

struct Scenario {
  const char* model;
  const char* cluster;
  int nodes;
  std::int64_t batch;
};

// Small fixed scenarios (at most 16 devices) where every candidate can be simulated.
const Scenario kScenarios[] = {
    {"gpt2-124m", "dgx-a100", 1, 32},
    {"gpt2-355m", "dgx-a100", 1, 64},
    {"pd2bw-gpt-1.3b", "p3.16xlarge", 2, 64},
};

struct Searched {
  models::ModelSpec model;
  clusters::Cluster cluster;
  traces::Trace trace;
  SearchResult result;
};

Searched search(const Scenario& s) {
  Searched out{models::load_model(s.model), clusters::load_cluster(s.cluster, s.nodes), {}, {}};
  out.trace = traces::analytic_trace(out.model, out.cluster.device, {1, 2, 4, 8, 16});
  SearchOptions o;
  o.global_batch = s.batch;
  o.max_microbatch = 16;
  o.schedules = {Schedule::two_bw, Schedule::one_f_one_b, Schedule::gpipe};
  out.result = search_plans(out.model, out.trace, out.cluster, o);
  return out;
}

SimulateFn simulator(const Searched& s) {
  return [&s](const std::vector<Plan>& plans) {
    std::vector<sim::SimJob> jobs;
    for (const auto& p : plans)
      jobs.push_back({s.model, s.trace, s.cluster, p, {.steps = 3}});
    std::vector<Simulated> out;
    for (const auto& o : sim::simulate_batch(jobs, 2)) {
      Simulated x;
      x.ok = o.ok;
      x.error = o.error;
      if (o.ok) {
        x.samples_per_s = o.result.report.samples_per_s;
        for (const auto& d : o.result.report.devices)
          x.peak_memory_bytes = std::max(x.peak_memory_bytes, d.peak_memory_bytes);
        x.fits = x.peak_memory_bytes <= s.cluster.device.memory_bytes;
      }
      out.push_back(x);
    }
    return out;
  };
}

std::string describe(const Plan& p) {
  return to_string(p.schedule) + " w=" + std::to_string(p.w) + " d=" + std::to_string(p.d) +
         " b=" + std::to_string(p.b) + (p.recomputes(0) ? " rc" : "");
}

class EveryCandidate : public ::testing::TestWithParam<Scenario> {};

// The planner simulates only its closed-form top 8; its pick must equal the best plan found by
// simulating every candidate that fits, and the memory filter must never admit a plan the
// simulator finds over capacity.
TEST_P(EveryCandidate, PlannerPickEqualsBestSimulated) {
  const Searched s = search(GetParam());
  ASSERT_FALSE(s.result.fitting.empty());
  const std::vector<Ranked> all =
      rank_by_simulation(s.result, int(s.result.fitting.size()), simulator(s));
  for (const auto& r : all) {
    ASSERT_TRUE(r.simulated && r.simulated->ok) << describe(r.candidate.plan);
    EXPECT_TRUE(r.simulated->fits) << describe(r.candidate.plan) << " admitted but over capacity";
  }
  const std::vector<Ranked> top8 = rank_by_simulation(s.result, 8, simulator(s));
  EXPECT_EQ(describe(top8.front().candidate.plan), describe(all.front().candidate.plan));

  // Closed-form and simulated rankings agree (Spearman's rho over every fitting candidate).
  std::vector<double> closed, simulated;
  for (const auto& r : all) {
    closed.push_back(r.candidate.samples_per_s());
    simulated.push_back(r.simulated->samples_per_s);
  }
  const double rho = spearman(closed, simulated);
  RecordProperty("spearman", std::to_string(rho));
  EXPECT_GE(rho, 0.9) << GetParam().model << " on " << GetParam().cluster;
}

INSTANTIATE_TEST_SUITE_P(Scenarios, EveryCandidate, ::testing::ValuesIn(kScenarios),
                         [](const auto& info) {
                           std::string n = std::string(info.param.model) + "_" + info.param.cluster;
                           for (char& c : n)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return n;
                         });

TEST(Search, EnumeratesOnlyValidPlans) {
  const Searched s = search({"gpt2-124m", "dgx-a100", 1, 32});
  for (const auto* list : {&s.result.fitting, &s.result.rejected})
    for (const auto& c : *list) {
      const Plan& p = c.plan;
      EXPECT_EQ(p.w * p.d, 8);
      EXPECT_EQ(p.global_batch(), 32);
      if (p.schedule == Schedule::two_bw) {
        EXPECT_GE(p.m, p.d);
      }
    }
  EXPECT_EQ(s.result.considered, std::int64_t(s.result.fitting.size() + s.result.rejected.size()));
}

// Selective recompute drops the attention cores, which fused attention does not stash: for a
// fused model it is none in every figure, so it is no candidate of its own beside none (the
// list would show each plan twice and simulate it twice); an unfused model keeps it, and asked
// for alone it stays.
TEST(Search, SelectiveIsACandidateWhereItDiffersFromNone) {
  const auto modes = [](const models::ModelSpec& m, std::vector<Recompute> recompute) {
    const clusters::Cluster c = clusters::load_cluster("dgx-a100");
    const traces::Trace t = traces::analytic_trace(m, c.device, {1, 2, 4});
    SearchOptions o;
    o.global_batch = 32;
    o.recompute = std::move(recompute);
    const SearchResult r = search_plans(m, t, c, o);
    std::set<Recompute> seen;
    for (const auto* list : {&r.fitting, &r.rejected})
      for (const auto& cand : *list)
        seen.insert(cand.plan.recompute.empty() ? Recompute::none : cand.plan.recompute[0]);
    return seen;
  };
  models::ModelSpec fused = models::load_model("gpt2-124m");
  ASSERT_EQ(fused.attention, models::Attention::fused);
  EXPECT_EQ(modes(fused, {Recompute::none, Recompute::selective, Recompute::full}),
            (std::set<Recompute>{Recompute::none, Recompute::full}));
  EXPECT_EQ(modes(fused, {Recompute::selective}), std::set<Recompute>{Recompute::selective});
  models::ModelSpec unfused = fused;
  unfused.attention = models::Attention::unfused;
  EXPECT_EQ(modes(unfused, {Recompute::none, Recompute::selective}),
            (std::set<Recompute>{Recompute::none, Recompute::selective}));
}

TEST(Search, NothingFitsExplainsTheBiggestTerm) {
  models::ModelSpec m = models::load_model("gpt3-175b");
  clusters::Cluster c = clusters::load_cluster("h100-x1");
  traces::Trace t = traces::analytic_trace(m, c.device, {1});
  SearchOptions o;
  o.global_batch = 8;
  SearchResult r = search_plans(m, t, c, o);
  EXPECT_TRUE(r.fitting.empty());
  const std::string why = explain_no_fit(r);
  EXPECT_NE(why.find("largest term: optimizer"), std::string::npos) << why;
}

TEST(Search, ImpossibleBatchIsAnInputError) {
  models::ModelSpec m = models::load_model("gpt-tiny");
  clusters::Cluster c = clusters::load_cluster("dgx-a100");
  traces::Trace t = traces::analytic_trace(m, c.device, {1, 2});
  SearchOptions o;
  o.global_batch = 3;  // no w dividing 8 and power-of-two b give w*b | 3 except w = 1 (d = 8 > 2)
  EXPECT_THROW(search_plans(m, t, c, o), InputError);
}

// The simulated count: at least `top`, then every candidate within `within` of the best closed
// form, at most max(top, cap); none with top = 0.
TEST(Search, SimulatesEveryCandidateCloseToTheBest) {
  SearchResult r;
  for (double x : {100.0, 97.0, 95.0, 91.0, 89.9, 80.0}) {
    Candidate c;
    c.estimate.report.samples_per_s = x;
    r.fitting.push_back(c);
  }
  EXPECT_EQ(simulated_count(r, 2, 0.10, 16), 4);  // 100, 97, 95, 91 are within 10%; 89.9 is not
  EXPECT_EQ(simulated_count(r, 5, 0.10, 16), 5);  // the top 5 whatever their figures
  EXPECT_EQ(simulated_count(r, 1, 0.04, 16), 2);
  EXPECT_EQ(simulated_count(r, 1, 0.10, 3), 3);   // capped
  EXPECT_EQ(simulated_count(r, 8, 0.50, 16), 6);  // no more than there are
  EXPECT_EQ(simulated_count(r, 0, 0.10, 16), 0);
  EXPECT_EQ(simulated_count(SearchResult{}, 8, 0.10, 16), 0);
}

TEST(Spearman, KnownValues) {
  EXPECT_DOUBLE_EQ(spearman({1, 2, 3, 4}, {10, 20, 30, 40}), 1.0);
  EXPECT_DOUBLE_EQ(spearman({1, 2, 3, 4}, {40, 30, 20, 10}), -1.0);
  EXPECT_NEAR(spearman({1, 2, 3, 4, 5}, {2, 1, 4, 3, 5}), 0.8, 1e-12);
}

}  // namespace
}  // namespace pw::planner
