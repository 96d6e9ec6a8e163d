// Checkpoints: a run stopped after any step, or killed at any point (here: half-way through a
// shard), resumes from the newest complete checkpoint to bit-identical weights, optimizer state
// and losses; mismatched or damaged checkpoints are one-line errors naming the file and field.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <gtest/gtest.h>

#include "exec/checkpoint.hpp"
#include "exec/runtime.hpp"
#include "exec/stage_compute.hpp"
#include "planner/plan.hpp"
#include "test_util.hpp"

namespace pw::exec {
namespace {

namespace fs = std::filesystem;
using planner::Plan;
using planner::Schedule;
using pw::testing::error_of;
using pw::testing::TempDir;

Plan make_plan(Schedule s, int w, int d, int m, int v = 1) {
  Plan p;
  p.schedule = s;
  p.w = w;
  p.d = d;
  p.b = 2;
  p.m = m;
  p.v = v;
  planner::resolve_stages(p, testing::gpt_tiny(4).layers);
  return p;
}

TrainOptions options(int steps, const std::string& dir, bool resume,
                     const std::string& optimizer = "adamw") {
  TrainOptions o;
  o.steps = steps;
  o.optimizer = optimizer;
  o.lr = 3e-3f;
  o.seed = 11;
  o.checkpoint_dir = dir;
  o.checkpoint_every = 2;
  o.resume = resume;
  return o;
}

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The resumed run's final weights, losses and last checkpoint equal the unbroken run's, bit for
// bit.
void expect_identical(const TrainResult& resumed, const TrainResult& unbroken,
                      const std::string& resumed_dir, const std::string& unbroken_dir, int steps,
                      int ranks) {
  ASSERT_EQ(resumed.ranks.size(), unbroken.ranks.size());
  for (std::size_t r = 0; r < unbroken.ranks.size(); ++r)
    EXPECT_TRUE(resumed.ranks[r].weights == unbroken.ranks[r].weights) << "weights of rank " << r;
  for (const StepLog& log : resumed.steps) {
    ASSERT_LT(std::size_t(log.step), unbroken.steps.size());
    EXPECT_EQ(log.loss, unbroken.steps[std::size_t(log.step)].loss) << "step " << log.step;
  }
  for (int r = 0; r < ranks; ++r) {
    const std::string a = shard_path(checkpoint_path(resumed_dir, steps), r);
    const std::string b = shard_path(checkpoint_path(unbroken_dir, steps), r);
    EXPECT_TRUE(bytes_of(a) == bytes_of(b)) << a << " differs from " << b;
  }
}

struct Case {
  Schedule schedule;
  int w, d, m, v;
  std::string optimizer;
};

TEST(Checkpoint, ResumeIsBitIdenticalForEverySchedule) {
  const std::vector<Case> cases = {{Schedule::gpipe, 2, 2, 2, 1, "adamw"},
                                   {Schedule::one_f_one_b, 1, 4, 4, 1, "adamw"},
                                   {Schedule::two_bw, 2, 2, 4, 1, "adamw"},
                                   {Schedule::two_bw, 1, 4, 4, 1, "sgd"},
                                   {Schedule::interleaved, 1, 2, 2, 2, "adamw"}};
  for (const Case& c : cases) {
    const Plan p = make_plan(c.schedule, c.w, c.d, c.m, c.v);
    SCOPED_TRACE(planner::to_string(c.schedule) + " w=" + std::to_string(c.w) +
                 " d=" + std::to_string(c.d) + " " + c.optimizer);
    TempDir tmp("ckpt_resume");
    const std::string a = tmp.file("a"), b = tmp.file("b");
    const TrainResult unbroken =
        train_cpu(testing::gpt_tiny(4), p, options(5, a, false, c.optimizer));
    // Stopped after step 3 (a checkpoint at 2, and the one after the last step at 3) ...
    const TrainResult first = train_cpu(testing::gpt_tiny(4), p, options(3, b, false, c.optimizer));
    EXPECT_EQ(latest_checkpoint(b), 3);
    // ... then resumed to the end.
    const TrainResult resumed =
        train_cpu(testing::gpt_tiny(4), p, options(5, b, true, c.optimizer));
    EXPECT_EQ(resumed.first_step, 3);
    ASSERT_EQ(resumed.steps.size(), 2u);
    EXPECT_EQ(resumed.steps.front().step, 3);
    expect_identical(resumed, unbroken, b, a, 5, p.ranks());
    // The two newest complete checkpoints are kept.
    EXPECT_FALSE(fs::exists(checkpoint_path(a, 2)));
    EXPECT_TRUE(fs::exists(checkpoint_path(a, 4)));
    EXPECT_TRUE(fs::exists(checkpoint_path(a, 5)));
    // Resumed from the last checkpoint before the end (a kill during the last step): the final
    // shards hold versions whose tied copy the last stage had not received yet; still the same.
    const std::string c2 = tmp.file("c");
    train_cpu(testing::gpt_tiny(4), p, options(4, c2, false, c.optimizer));
    const TrainResult late = train_cpu(testing::gpt_tiny(4), p, options(5, c2, true, c.optimizer));
    EXPECT_EQ(late.first_step, 4);
    expect_identical(late, unbroken, c2, a, 5, p.ranks());
  }
}

// The tied head's copy (last stage) of a version whose weights had not arrived when the shard was
// written is stale there; resuming takes it from stage 0's shard, and the run stays bit-identical.
TEST(Checkpoint, TiedCopyOfTheLastStageComesFromStageZerosShard) {
  const Plan p = make_plan(Schedule::two_bw, 1, 2, 4);
  TempDir tmp("ckpt_tied");
  const std::string a = tmp.file("a"), b = tmp.file("b");
  const TrainResult unbroken = train_cpu(testing::gpt_tiny(4), p, options(5, a, false));
  train_cpu(testing::gpt_tiny(4), p, options(3, b, false));
  const auto offset_of = [&](int stage, const char* name) {
    StageSpec spec;
    spec.model = testing::gpt_tiny(4);
    spec.first_block = stage == 0 ? 0 : p.stage_blocks[0];
    spec.blocks = p.stage_blocks[std::size_t(stage)];
    spec.has_embedding = stage == 0;
    spec.has_head = stage == 1;
    const auto compute = make_cpu_stage(spec);
    for (const auto& slot : compute->layout())
      if (slot.name == name) return std::make_pair(slot.offset, slot.size);
    ADD_FAILURE() << "no " << name;
    return std::make_pair(std::int64_t(0), std::int64_t(0));
  };
  const auto [wte, n] = offset_of(0, "wte");
  const auto [head, n_head] = offset_of(1, "lm_head");
  ASSERT_EQ(n, n_head);
  std::vector<float> embedding(static_cast<std::size_t>(n)), copy(embedding.size());
  // Version 3 was created by step 2, the last before the checkpoint: its weights arrive later.
  read_shard_slice(shard_path(checkpoint_path(b, 3), 0), "c0.w3", wte, embedding.data(), n);
  read_shard_slice(shard_path(checkpoint_path(b, 3), 1), "c0.w3", head, copy.data(), n);
  EXPECT_NE(embedding, copy);
  const TrainResult resumed = train_cpu(testing::gpt_tiny(4), p, options(5, b, true));
  expect_identical(resumed, unbroken, b, a, 5, p.ranks());
  const std::vector<float>& first = resumed.ranks[0].weights[0];
  const std::vector<float>& last = resumed.ranks[1].weights[0];
  EXPECT_TRUE(std::equal(first.begin() + wte, first.begin() + wte + n, last.begin() + head));
}

// A SIGKILL half-way through rank 0's shard of step 4 (a forked child, as a preempted job): the
// step-4 checkpoint has no manifest, so resuming starts from step 2 and still ends bit-identical.
TEST(Checkpoint, KillWhileWritingLeavesThePreviousCheckpointUsable) {
  const Plan p = make_plan(Schedule::two_bw, 1, 2, 4);
  TempDir tmp("ckpt_kill");
  const std::string a = tmp.file("a"), b = tmp.file("b");
  const TrainResult unbroken = train_cpu(testing::gpt_tiny(4), p, options(6, a, false));
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::setenv("PIPEWRIGHT_TEST_KILL_IN_CHECKPOINT", "4", 1);
    try {
      train_cpu(testing::gpt_tiny(4), p, options(6, b, false));
    } catch (...) {
    }
    std::_Exit(0);  // not reached: the hook kills the process
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(WTERMSIG(status), SIGKILL);
  ASSERT_TRUE(fs::exists(checkpoint_path(b, 4)));  // the partial one
  EXPECT_FALSE(fs::exists(fs::path(checkpoint_path(b, 4)) / "manifest.json"));
  EXPECT_EQ(latest_checkpoint(b), 2);
  const TrainResult resumed = train_cpu(testing::gpt_tiny(4), p, options(6, b, true));
  EXPECT_EQ(resumed.first_step, 2);
  expect_identical(resumed, unbroken, b, a, 6, p.ranks());
}

TEST(Checkpoint, ResumeWithoutACheckpointStartsFromStepZero) {
  const Plan p = make_plan(Schedule::one_f_one_b, 1, 2, 2);
  TempDir tmp("ckpt_empty");
  const std::string dir = tmp.file("none");
  const TrainResult r = train_cpu(testing::gpt_tiny(4), p, options(2, dir, true));
  EXPECT_EQ(r.first_step, 0);
  EXPECT_EQ(r.steps.size(), 2u);
  EXPECT_EQ(latest_checkpoint(dir), 2);
}

TEST(Checkpoint, MismatchesAndDamageAreNamedErrors) {
  const Plan p = make_plan(Schedule::two_bw, 1, 2, 4);
  TempDir tmp("ckpt_errors");
  const std::string dir = tmp.file("c");
  train_cpu(testing::gpt_tiny(4), p, options(2, dir, false));
  // A fresh run must not mix with an earlier run's checkpoints.
  EXPECT_NE(error_of([&] {
              train_cpu(testing::gpt_tiny(4), p, options(4, dir, false));
            }).find("--resume"),
            std::string::npos);
  // Nothing left to run.
  EXPECT_NE(error_of([&] {
              train_cpu(testing::gpt_tiny(4), p, options(2, dir, true));
            }).find("nothing to run"),
            std::string::npos);
  // Another plan or optimizer setting: the field is named.
  EXPECT_NE(error_of([&] {
              train_cpu(testing::gpt_tiny(4), make_plan(Schedule::two_bw, 1, 2, 2),
                        options(4, dir, true));
            }).find("field run.plan.m"),
            std::string::npos);
  TrainOptions lr = options(4, dir, true);
  lr.lr = 0.1f;
  EXPECT_NE(
      error_of([&] { train_cpu(testing::gpt_tiny(4), p, lr); }).find("field run.optimizer.lr"),
      std::string::npos);
  EXPECT_NE(error_of([&] {
              train_cpu(testing::gpt_tiny(4), make_plan(Schedule::two_bw, 2, 2, 4),
                        options(4, dir, true));
            }).find("field ranks"),
            std::string::npos);
  // A truncated shard (written by something else than pipewright's atomic writer).
  const std::string shard = shard_path(checkpoint_path(dir, 2), 1);
  const std::string whole = bytes_of(shard);
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << whole.substr(0, whole.size() / 2);
  const std::string e =
      error_of([&] { train_cpu(testing::gpt_tiny(4), p, options(4, dir, true)); });
  EXPECT_NE(e.find(shard), std::string::npos) << e;
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << "not a shard";
  EXPECT_NE(error_of([&] {
              train_cpu(testing::gpt_tiny(4), p, options(4, dir, true));
            }).find("not a pipewright checkpoint shard"),
            std::string::npos);
}

// Wrong JSON types in a manifest or a shard header are named errors, not nlohmann's type_error
// (an internal error): found by fuzz_ckpt_manifest and fuzz_ckpt_shard.
TEST(Checkpoint, WrongTypesInManifestsAndShardHeadersAreNamedErrors) {
  TempDir tmp("ckpt_types");
  const std::string dir = tmp.file("c");
  const common::Json identity = {{"model", "gpt-tiny"}};
  fs::create_directories(checkpoint_path(dir, 3));
  const std::string manifest = checkpoint_path(dir, 3) + "/manifest.json";
  for (const char* text : {R"({"format": 1, "ranks": 2, "run": {"model": "gpt-tiny"}})",
                           R"({"format": "pipewright.checkpoint/1", "ranks": "2"})", "[1, 2]"}) {
    std::ofstream(manifest, std::ios::trunc) << text;
    EXPECT_NE(error_of([&] { check_manifest(dir, 3, 2, identity); }).find(manifest),
              std::string::npos)
        << text;
  }
  // A shard whose tensor list holds a number for a name, or an entry that is not an object.
  std::vector<float> a(4, 1.0f);
  const std::string shard = shard_path(checkpoint_path(dir, 3), 0);
  for (const char* list : {R"([{"name": 7, "floats": 4}])", R"([3])",
                           R"([{"name": "x", "floats": 9223372036854775807},
                               {"name": "a", "floats": 4}])"}) {
    const std::string header = std::string(R"({"tensors": )") + list + "}";
    std::string bytes = "PWCKPT01";
    for (int i = 0; i < 8; ++i)
      bytes.push_back(char(i == 0 ? header.size() : 0));
    bytes += header + std::string(16, '\0');
    std::ofstream(shard, std::ios::binary | std::ios::trunc) << bytes;
    EXPECT_NE(error_of([&] {
                read_shard(shard, {{"a", a.data(), 4}});
              }).find(shard),
              std::string::npos)
        << list;
    EXPECT_NE(error_of([&] { read_shard_slice(shard, "a", 0, a.data(), 4); }).find(shard),
              std::string::npos)
        << list;
  }
}

}  // namespace
}  // namespace pw::exec
