// Checkpoints: a run stopped after any step, or killed at any point (here: half-way through a
// shard), resumes from the newest complete checkpoint to bit-identical weights, optimizer state
// and losses; mismatched or damaged checkpoints are one-line errors naming the file and field.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>

#include <gtest/gtest.h>
#include <zlib.h>

#include "exec/checkpoint.hpp"
#include "exec/run_common.hpp"
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
  bool distributed_optimizer = false;  // each replica's shard holds its 1/w of m and v
};

TEST(Checkpoint, ResumeIsBitIdenticalForEverySchedule) {
  const std::vector<Case> cases = {{Schedule::gpipe, 2, 2, 2, 1, "adamw"},
                                   {Schedule::one_f_one_b, 1, 4, 4, 1, "adamw"},
                                   {Schedule::two_bw, 2, 2, 4, 1, "adamw"},
                                   {Schedule::two_bw, 1, 4, 4, 1, "sgd"},
                                   {Schedule::interleaved, 1, 2, 2, 2, "adamw"},
                                   {Schedule::gpipe, 2, 2, 2, 1, "adamw", true},
                                   {Schedule::two_bw, 3, 2, 2, 1, "sgd", true},
                                   {Schedule::two_bw, 2, 2, 4, 1, "adamw", true},
                                   {Schedule::interleaved, 2, 2, 2, 2, "adamw", true}};
  for (const Case& c : cases) {
    Plan p = make_plan(c.schedule, c.w, c.d, c.m, c.v);
    p.distributed_optimizer = c.distributed_optimizer;
    SCOPED_TRACE(planner::to_string(c.schedule) + " w=" + std::to_string(c.w) +
                 " d=" + std::to_string(c.d) + " " + c.optimizer +
                 (c.distributed_optimizer ? " distributed optimizer" : ""));
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
// Both workers' shard rule: per model chunk its weight versions, then its state, named and sized
// as the file holds them; the tied copy zeroed on copies (the live weights untouched) or in
// place, and read back from another shard's "c0.w{v}".
TEST(ShardLayout, OrderNamesTiedCopyAndBounds) {
  ShardLayout shard({6, 4}, {3, 4}, {"master", "m", "v"}, {5, 2});
  std::vector<std::string> names;
  std::vector<std::int64_t> sizes;
  for (const ShardTensor& t : shard.tensors()) {
    names.push_back(t.name);
    sizes.push_back(t.size);
    EXPECT_EQ(t.data, nullptr);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"c0.w3", "c0.w4", "c0.master", "c0.m", "c0.v", "c1.w3",
                                             "c1.w4", "c1.master", "c1.m", "c1.v"}));
  EXPECT_EQ(sizes, (std::vector<std::int64_t>{6, 6, 5, 5, 5, 4, 4, 2, 2, 2}));
  EXPECT_EQ(shard.weights(1, 1).name, "c1.w4");
  EXPECT_EQ(shard.state(1, 2).name, "c1.v");
  EXPECT_THROW(shard.weights(2, 0), Error);
  EXPECT_THROW(shard.weights(0, 2), Error);
  EXPECT_THROW(shard.state(0, 3), Error);
  EXPECT_THROW(ShardLayout({6}, {0}, {"m"}, {6, 6}), Error);

  // Zeroed on copies: what the worker holds stays.
  std::vector<float> w3 = {1, 2, 3, 4}, w4 = {5, 6, 7, 8};
  shard.weights(1, 0).data = w3.data();
  shard.weights(1, 1).data = w4.data();
  std::vector<std::vector<float>> copies;
  shard.zero_tied_copy(1, 1, 2, &copies);
  EXPECT_EQ(w3, (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(std::vector<float>(shard.weights(1, 0).data, shard.weights(1, 0).data + 4),
            (std::vector<float>{1, 0, 0, 4}));
  EXPECT_EQ(std::vector<float>(shard.weights(1, 1).data, shard.weights(1, 1).data + 4),
            (std::vector<float>{5, 0, 0, 8}));
  EXPECT_THROW(shard.zero_tied_copy(1, 3, 2, &copies), Error);  // past the tensor
  // In place, and back from a shard's c0.w3 / c0.w4 (floats 2 and 3 of each).
  ShardLayout in_place({4}, {3, 4}, {"m"}, {4});
  in_place.weights(0, 0).data = w3.data();
  in_place.weights(0, 1).data = w4.data();
  std::vector<float> m = {0, 0, 0, 0};
  in_place.state(0, 0).data = m.data();
  in_place.zero_tied_copy(0, 2, 2, nullptr);
  EXPECT_EQ(w3, (std::vector<float>{1, 2, 0, 0}));
  TempDir dir("shard_layout");
  std::vector<float> s3 = {10, 11, 12, 13, 14}, s4 = {20, 21, 22, 23, 24}, sm = {0};
  write_shard(dir.file("source.bin"), {{"step", 1}, {"rank", 0}},
              {{"c0.w3", s3.data(), 5}, {"c0.w4", s4.data(), 5}, {"c0.m", sm.data(), 1}});
  in_place.read_tied_copy(0, 2, 2, dir.file("source.bin"), 3);
  EXPECT_EQ(w3, (std::vector<float>{1, 2, 13, 14}));
  EXPECT_EQ(w4, (std::vector<float>{5, 6, 23, 24}));
  EXPECT_THROW(in_place.read_tied_copy(0, 2, 2, dir.file("source.bin"), 4), Error);  // past c0.w3
}

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
  // Nothing left to run: before the end, an error; at the end, the finished run's record.
  EXPECT_NE(error_of([&] {
              train_cpu(testing::gpt_tiny(4), p, options(1, dir, true));
            }).find("nothing to run"),
            std::string::npos);
  EXPECT_TRUE(train_cpu(testing::gpt_tiny(4), p, options(2, dir, true)).from_checkpoint);
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
  // A truncated shard (written by something else than pipewright's atomic writer): read directly,
  // a named error; on --resume, a warning, and (no older checkpoint) a run from step 0.
  const std::string shard = shard_path(checkpoint_path(dir, 2), 1);
  const std::string whole = bytes_of(shard);
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << whole.substr(0, whole.size() / 2);
  const std::string e = *verify_checkpoint(dir, 2);
  EXPECT_NE(e.find(shard), std::string::npos) << e;
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << "not a shard";
  EXPECT_NE(verify_checkpoint(dir, 2)->find("not a pipewright checkpoint shard"),
            std::string::npos);
  std::vector<std::string> warnings;
  TrainOptions o = options(4, dir, true);
  o.on_resume = [&](const ResumeInfo& info) { warnings = info.warnings; };
  const TrainResult r = train_cpu(testing::gpt_tiny(4), p, o);
  EXPECT_EQ(r.first_step, 0);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find(shard), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("starting from step 0"), std::string::npos) << warnings[0];
  EXPECT_TRUE(fs::exists(checkpoint_path(dir, 2) + ".damaged"));
}

// A model small enough that every byte of its checkpoint can be flipped in a test.
models::ModelSpec gpt_micro() {
  models::ModelSpec s = testing::gpt_tiny(2);
  s.name = "gpt-micro";
  s.hidden = 4;
  s.heads = 1;
  s.kv_heads = 1;
  s.ffn = 8;
  s.seq_len = 2;
  s.max_positions = 2;
  s.vocab = 8;
  return s;
}

std::vector<std::string> files_of(const std::string& checkpoint) {
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(checkpoint))
    files.push_back(entry.path().string());
  std::sort(files.begin(), files.end());
  return files;
}

void flip_bit(const std::string& path, std::size_t byte, int bit) {
  std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
  f.seekg(std::streamoff(byte));
  char c = 0;
  f.read(&c, 1);
  c = char(c ^ (1 << bit));
  f.seekp(std::streamoff(byte));
  f.write(&c, 1);
}

// Every bit of a real (small) training checkpoint, flipped one at a time: the shards' prefixes,
// headers, tensor values and the manifest. Each flip is found by verify_checkpoint, and the
// checkpoint is intact again once the bit is flipped back. The sanitized build (ASan + UBSan,
// scripts/sanitize.sh) flips every bit of every 13th byte only: all 78,000 flips took over 25
// minutes there, most of CI's sanitized suite; the normal suite flips them all.
TEST(Checkpoint, EveryFlippedBitIsDetected) {
#ifdef PW_SANITIZED_BUILD
  constexpr std::size_t stride = 13;
#else
  constexpr std::size_t stride = 1;
#endif
  const Plan p = [] {
    Plan q;
    q.schedule = Schedule::two_bw;
    q.w = 1;
    q.d = 2;
    q.b = 1;
    q.m = 2;
    planner::resolve_stages(q, 2);
    return q;
  }();
  TempDir tmp("ckpt_flip");
  const std::string dir = tmp.file("c");
  TrainOptions o = options(2, dir, false);
  o.checkpoint_every = 2;
  train_cpu(gpt_micro(), p, o);
  ASSERT_FALSE(verify_checkpoint(dir, 2).has_value());
  std::int64_t flips = 0, bytes = 0;
  for (const std::string& file : files_of(checkpoint_path(dir, 2))) {
    const std::size_t n = fs::file_size(file);
    bytes += std::int64_t(n);
    for (std::size_t byte = 0; byte < n; byte += stride)
      for (int bit = 0; bit < 8; ++bit) {
        flip_bit(file, byte, bit);
        const auto problem = verify_checkpoint(dir, 2);
        flip_bit(file, byte, bit);
        ++flips;
        if (!problem) {
          ADD_FAILURE() << file << ": bit " << bit << " of byte " << byte << " flipped unnoticed";
          return;
        }
      }
  }
  EXPECT_FALSE(verify_checkpoint(dir, 2).has_value());
  if (stride == 1) {
    EXPECT_EQ(flips, 8 * bytes);
  }
  EXPECT_GT(flips, 8 * bytes / std::int64_t(stride) - 8 * 3);
  EXPECT_GT(bytes, 2000);  // three files: two shards and the manifest
  std::cout << "flipped " << flips << " bits one at a time (byte stride " << stride << ") of a "
            << bytes << "-byte checkpoint: all detected\n";
}

// The newest checkpoint damaged (a tensor bit, a manifest byte): --resume warns once, names the
// file, resumes from the older intact one and still ends bit-identical to an unbroken run.
TEST(Checkpoint, DamagedNewestFallsBackToTheNewestIntactOne) {
  const Plan p = make_plan(Schedule::two_bw, 1, 2, 4);
  TempDir tmp("ckpt_fallback");
  const std::string a = tmp.file("a");
  const TrainResult unbroken = train_cpu(testing::gpt_tiny(4), p, options(6, a, false));
  for (const char* damage : {"tensor", "manifest"}) {
    SCOPED_TRACE(damage);
    const std::string b = tmp.file(std::string("b-") + damage);
    TrainOptions first = options(6, b, false);
    first.steps = 4;  // checkpoints 2 and 4
    train_cpu(testing::gpt_tiny(4), p, first);
    const std::string victim = std::string(damage) == "tensor"
                                   ? shard_path(checkpoint_path(b, 4), 1)
                                   : (fs::path(checkpoint_path(b, 4)) / "manifest.json").string();
    flip_bit(victim, fs::file_size(victim) - 40, 2);
    std::vector<std::string> warnings;
    TrainOptions o = options(6, b, true);
    o.on_resume = [&](const ResumeInfo& info) {
      warnings = info.warnings;
      EXPECT_EQ(info.step, 2);
    };
    const TrainResult resumed = train_cpu(testing::gpt_tiny(4), p, o);
    EXPECT_EQ(resumed.first_step, 2);
    ASSERT_EQ(warnings.size(), 1u);
    EXPECT_NE(warnings[0].find(victim), std::string::npos) << warnings[0];
    EXPECT_NE(warnings[0].find("damaged"), std::string::npos) << warnings[0];
    EXPECT_NE(warnings[0].find("resuming from " + checkpoint_path(b, 2)), std::string::npos)
        << warnings[0];
    EXPECT_EQ(warnings[0].find('\n'), std::string::npos);
    EXPECT_TRUE(fs::exists(checkpoint_path(b, 4) + ".damaged"));
    expect_identical(resumed, unbroken, b, a, 6, p.ranks());
  }
}

// A finished run's final checkpoint keeps its record: --resume with nothing left to run gives
// back the steps and ranks' figures the run measured, bit for bit, without running anything.
TEST(Checkpoint, FinishedRunGivesItsRecordBack) {
  const Plan p = make_plan(Schedule::one_f_one_b, 1, 2, 2);
  TempDir tmp("ckpt_finished");
  const std::string dir = tmp.file("c");
  const TrainResult done = train_cpu(testing::gpt_tiny(4), p, options(3, dir, false));
  const std::string before = bytes_of(shard_path(checkpoint_path(dir, 3), 0));
  bool finished = false;
  TrainOptions o = options(3, dir, true);
  o.on_resume = [&](const ResumeInfo& info) { finished = info.finished; };
  const TrainResult again = train_cpu(testing::gpt_tiny(4), p, o);
  EXPECT_TRUE(finished);
  EXPECT_TRUE(again.from_checkpoint);
  EXPECT_EQ(again.first_step, done.first_step);
  EXPECT_EQ(again.wall_s, done.wall_s);
  ASSERT_EQ(again.steps.size(), done.steps.size());
  for (std::size_t i = 0; i < done.steps.size(); ++i) {
    EXPECT_EQ(again.steps[i].step, done.steps[i].step);
    EXPECT_EQ(again.steps[i].loss, done.steps[i].loss);
    EXPECT_EQ(again.steps[i].seconds, done.steps[i].seconds);
    EXPECT_EQ(again.steps[i].tokens_per_s, done.steps[i].tokens_per_s);
  }
  ASSERT_EQ(again.ranks.size(), done.ranks.size());
  for (std::size_t r = 0; r < done.ranks.size(); ++r) {
    EXPECT_EQ(again.ranks[r].rank, done.ranks[r].rank);
    EXPECT_EQ(again.ranks[r].peak_memory_bytes, done.ranks[r].peak_memory_bytes);
    EXPECT_EQ(again.ranks[r].busy_s, done.ranks[r].busy_s);
    EXPECT_EQ(again.ranks[r].memory.total(), done.ranks[r].memory.total());
    EXPECT_EQ(again.ranks[r].memory.activations, done.ranks[r].memory.activations);
  }
  EXPECT_EQ(bytes_of(shard_path(checkpoint_path(dir, 3), 0)), before);  // nothing was written
  // The middle checkpoint of a longer run keeps no record: nothing to run, and no report.
  const std::string longer = tmp.file("longer");
  train_cpu(testing::gpt_tiny(4), p, options(4, longer, false));
  EXPECT_NE(error_of([&] {
              train_cpu(testing::gpt_tiny(4), p, options(2, longer, true));
            }).find("nothing to run"),
            std::string::npos);
}

std::string hex_crc(const std::string& bytes) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08lx",
                ::crc32(0, reinterpret_cast<const Bytef*>(bytes.data()), uInt(bytes.size())));
  return buf;
}

// A manifest with an intact checksum (as a hand-edited one would be given) but a wrong JSON type.
void write_manifest_text(const std::string& path, const std::string& body) {
  const std::string prefix = "{\n" + body;
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      << prefix << ",\n  \"crc32\": \"" << hex_crc(prefix) << "\"\n}\n";
}

// A shard with intact checksums around a header of wrong types.
void write_shard_text(const std::string& path, const std::string& header) {
  std::string prefix = "PWCKPT02";
  for (int i = 0; i < 8; ++i)
    prefix += char((header.size() >> (8 * i)) & 0xff);
  const auto le32 = [](const std::string& crc_hex) {
    const unsigned long v = std::stoul(crc_hex, nullptr, 16);
    std::string out;
    for (int i = 0; i < 4; ++i)
      out += char((v >> (8 * i)) & 0xff);
    return out;
  };
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      << prefix << le32(hex_crc(prefix)) << header << le32(hex_crc(header));
}

TEST(Checkpoint, WrongTypesInManifestAndHeaderNameFileAndField) {
  TempDir tmp("ckpt_types");
  const std::string dir = tmp.file("c");
  const std::string ck = checkpoint_path(dir, 2);
  fs::create_directories(ck);
  const std::string manifest = (fs::path(ck) / "manifest.json").string();
  const auto manifest_error = [&](const std::string& body) {
    write_manifest_text(manifest, body);
    return error_of([&] { read_manifest(dir, 2); });
  };
  const std::string head = "  \"format\": \"pipewright.checkpoint/2\",\n";
  EXPECT_NE(manifest_error(head + "  \"step\": \"two\", \"ranks\": 1, \"run\": {}")
                .find(manifest + ": /step: expected a number"),
            std::string::npos);
  EXPECT_NE(manifest_error(head + "  \"step\": 2, \"ranks\": [1], \"run\": {}")
                .find(manifest + ": /ranks: expected a number"),
            std::string::npos);
  EXPECT_NE(manifest_error(head + "  \"step\": 2, \"ranks\": 1, \"run\": 3")
                .find(manifest + ": /run: expected an object"),
            std::string::npos);
  EXPECT_NE(manifest_error(head + "  \"step\": 2, \"ranks\": 1, \"run\": {}, \"result\": []")
                .find(manifest + ": /result: expected an object"),
            std::string::npos);
  EXPECT_NE(manifest_error(head + "  \"step\": 3, \"ranks\": 1, \"run\": {}").find("/step: 3, but"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              detail::result_from_record(common::Json::parse(R"({"first_step": 0, "wall_s": 1,
                  "steps": [{"step": 0, "loss": "high", "seconds": 1, "tokens_per_s": 1}],
                  "ranks": []})"),
                                         manifest);
            }).find(manifest + ": /result/steps/0/loss: expected a number"),
            std::string::npos);
  // An old (format 1) manifest: refused with a line saying why.
  std::ofstream(manifest, std::ios::trunc)
      << R"({"format": "pipewright.checkpoint/1", "step": 2, "ranks": 1, "run": {}})";
  EXPECT_NE(error_of([&] { find_resume_point(dir); }).find("older format"), std::string::npos);

  const std::string shard = shard_path(ck, 0);
  const auto shard_error = [&](const std::string& header) {
    write_shard_text(shard, header);
    std::vector<ShardTensor> none;
    return error_of([&] { read_shard(shard, none); });
  };
  const std::string fmt_ = R"("format": "pipewright.checkpoint-shard/2")";
  EXPECT_NE(shard_error("{" + fmt_ + R"(, "step": 2, "rank": "0", "tensors": []})")
                .find(shard + ": /rank: expected a number"),
            std::string::npos);
  EXPECT_NE(shard_error("{" + fmt_ + R"(, "step": 2, "rank": 0, "tensors": {}})")
                .find(shard + ": /tensors: expected an array"),
            std::string::npos);
  EXPECT_NE(shard_error("{" + fmt_ +
                        R"(, "step": 2, "rank": 0, "tensors": [{"name": "a", "floats": "1",
                           "crc32": "00000000"}]})")
                .find(shard + ": /tensors/0/floats: expected a number"),
            std::string::npos);
  EXPECT_NE(shard_error("{" + fmt_ +
                        R"(, "step": 2, "rank": 0, "tensors": [{"name": "a", "floats": 0,
                           "crc32": 0}]})")
                .find(shard + ": /tensors/0/crc32: expected a string"),
            std::string::npos);
  EXPECT_NE(shard_error("{" + fmt_ +
                        R"(, "step": 2, "rank": 0, "tensors": [{"name": "a", "floats": 4,
                           "crc32": "00000000"}]})")
                .find("truncated in tensor a"),
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
