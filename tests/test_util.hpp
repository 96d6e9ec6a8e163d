// Helpers shared by the test suites: catching an error's message, a scratch folder, and the
// executor suites' runs and comparisons.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <unistd.h>

#include "clusters/cluster.hpp"
#include "common/error.hpp"
#include "common/json_reader.hpp"
#include "exec/runtime.hpp"
#include "exec/stage_compute.hpp"
#include "models/model.hpp"
#include "planner/cost_model.hpp"
#include "planner/plan.hpp"
#include "sim/simulator.hpp"
#include "traces/analytic.hpp"
#include "traces/trace.hpp"

namespace pw::testing {

// Runs `f`, expects it to throw E, and returns the message ("" and a test failure otherwise).
template <class E = InputError, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error thrown";
  return "";
}

// A scratch folder under the system temp dir, removed with everything in it.
class TempDir {
 public:
  explicit TempDir(const std::string& tag)
      : path_(std::filesystem::temp_directory_path() /
              ("pw_test_" + tag + "_" + std::to_string(::getpid()))) {
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name) << text;
    return file(name);
  }
  std::string write(const std::string& name, const common::Json& j) const {
    return write(name, j.dump(2));
  }

 private:
  std::filesystem::path path_;
};

// A trace with exact times: a block takes t_f = 1 ms forward, t_b = 2 ms backward and 1 ms to
// recompute; embedding, head and optimizer take no time, so stages with equal blocks are uniform.
// Memory figures are the model's per-sample bytes x b.
inline traces::Trace uniform_trace(const models::ModelSpec& model, std::int64_t b) {
  traces::Trace t;
  t.model = model.name;
  t.device = "test";
  t.dtype = model.dtype;
  t.source.kind = "analytic";
  const models::ModelCosts mc = models::derive_costs(model);
  traces::Entry e;
  e.microbatch_size = b;
  for (models::LayerKind k : traces::kLayerKinds) {
    const auto& l = mc.layer(k);
    auto& x = e.layers[k];
    const bool block = k == models::LayerKind::block;
    x.forward_s = block ? 1e-3 : 0;
    x.backward_s = block ? 2e-3 : 0;
    x.recompute_s = x.forward_s;
    x.activation_bytes = b * l.activation_bytes;
    x.activation_recompute_bytes = b * l.activation_recompute_bytes;
    x.output_bytes = b * l.output_bytes;
    x.workspace_bytes = b * l.workspace_bytes;
    t.statics[k].parameters = l.parameters;
  }
  t.entries.push_back(e);
  return t;
}

// The device grid of a cluster, for place().
inline planner::DeviceGrid grid(const clusters::Cluster& c) {
  return {c.nodes, c.gpus_per_node};
}

// A plan with balanced stages over `layers` blocks, placed on a grid.
inline planner::Plan plan_of(planner::Schedule s, int w, int d, int b, int m, int v,
                             std::int64_t layers, const planner::DeviceGrid& grid,
                             int ranks_per_gpu = 1) {
  planner::Plan p;
  p.schedule = s;
  p.w = w;
  p.d = d;
  p.b = b;
  p.m = m;
  p.v = v;
  planner::resolve_stages(p, layers);
  planner::place(p, grid, ranks_per_gpu);
  return p;
}

// gpt-tiny with `layers` blocks, named "gpt-tiny<layers>" (3: a middle stage; 4: plans up to d = 4
// with a block per stage), in `dtype` (the preset's fp32 for the CPU, bf16 for the GPU).
inline models::ModelSpec gpt_tiny(std::int64_t layers, models::DType dtype = models::DType::fp32) {
  models::ModelSpec s = models::load_model("gpt-tiny");
  s.name = "gpt-tiny" + std::to_string(layers);
  s.layers = layers;
  s.dtype = dtype;
  return s;
}

// The stage holding blocks [first, first + blocks), with the embedding and/or the head.
inline exec::StageSpec stage_spec(const models::ModelSpec& m, bool embedding, std::int64_t first,
                                  std::int64_t blocks, bool head) {
  return exec::StageSpec{m, embedding, first, blocks, head};
}

// --- The executor suites (test_offload_exec, test_chunks_exec): a run, its bits, its peaks. ---

// AdamW (lr 3e-3, weight decay 0.01, seed 11) over `steps` steps, on an emulated device of
// `device_memory` bytes (0: unbounded).
inline exec::TrainOptions adamw_options(int steps, std::int64_t device_memory = 0) {
  exec::TrainOptions o;
  o.steps = steps;
  o.optimizer = "adamw";
  o.lr = 3e-3f;
  o.weight_decay = 0.01f;
  o.seed = 11;
  o.device_memory = device_memory;
  return o;
}

// The same losses and every rank's final weights, bit for bit.
// The largest difference between a and b relative to b's largest magnitude (at least 1e-6).
inline double max_relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0, scale = 1e-6;  // relative to the largest weight of the tensor
  for (float x : b)
    scale = std::max(scale, double(std::fabs(x)));
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::fabs(double(a[i]) - double(b[i])) / scale);
  return worst;
}

inline void expect_identical(const exec::TrainResult& got, const exec::TrainResult& want) {
  ASSERT_EQ(got.steps.size(), want.steps.size());
  for (std::size_t i = 0; i < want.steps.size(); ++i)
    EXPECT_EQ(got.steps[i].loss, want.steps[i].loss) << "step " << i;
  ASSERT_EQ(got.ranks.size(), want.ranks.size());
  for (std::size_t r = 0; r < want.ranks.size(); ++r) {
    ASSERT_EQ(got.ranks[r].weights.size(), want.ranks[r].weights.size());
    for (std::size_t c = 0; c < want.ranks[r].weights.size(); ++c) {
      const auto& a = got.ranks[r].weights[c];
      const auto& b = want.ranks[r].weights[c];
      ASSERT_EQ(a.size(), b.size());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
          << "rank " << r << " chunk " << c << ": weights differ";
    }
  }
}

// The plan with every rank on one GPU: the CPU executor's threads are each their own emulated
// device.
inline planner::Plan on_one_gpu(const planner::Plan& p) {
  planner::Plan q = p;
  planner::place(q, {1, 1}, p.ranks());
  return q;
}

// The planner's estimate of the plan on `cluster` (every rank on one GPU; the analytic trace of
// the model at b on the cluster's device).
inline planner::Estimate estimate_on(const models::ModelSpec& model, const planner::Plan& p,
                                     const clusters::Cluster& cluster) {
  const traces::Trace t = traces::analytic_trace(model, cluster.device, {p.b});
  return planner::estimate(model, t, cluster, on_one_gpu(p));
}

// The simulator's report of the same programs over `steps` steps (its bytes: the run's / steps).
inline planner::RunReport simulate_on(const models::ModelSpec& model, const planner::Plan& p,
                                      const clusters::Cluster& cluster, int steps) {
  const traces::Trace t = traces::analytic_trace(model, cluster.device, {p.b});
  return sim::simulate(model, t, cluster, on_one_gpu(p), {.steps = steps}).report;
}

// The largest measured device peak over a run's ranks.
inline std::int64_t largest_peak(const exec::TrainResult& r) {
  std::int64_t peak = 0;
  for (const exec::RankResult& rank : r.ranks)
    peak = std::max(peak, rank.peak_memory_bytes);
  return peak;
}

// A backend's training entry (exec::train_cpu, exec::cuda::train_cuda) with its defaults.
using Trainer = std::function<exec::TrainResult(const models::ModelSpec&, const planner::Plan&,
                                                const exec::TrainOptions&)>;

// Trains options.steps (even) steps unbroken, then again in two halves through a checkpoint in a
// scratch folder named after `tag`: the resumed half's losses and every rank's final weights are
// the unbroken run's, bit for bit. `train`: the CPU backend unless given.
inline void expect_resume_is_bit_identical(const models::ModelSpec& model, const planner::Plan& p,
                                           const exec::TrainOptions& options,
                                           const std::string& tag, const Trainer& given = {}) {
  const Trainer train = given ? given : [](const auto& m, const auto& plan, const auto& o) {
    return exec::train_cpu(m, plan, o);
  };
  const exec::TrainResult whole = train(model, p, options);
  const int half = options.steps / 2;
  TempDir dir(tag);
  exec::TrainOptions o = options;
  o.steps = half;
  o.checkpoint_dir = dir.file("ckpt");
  train(model, p, o);
  o.steps = options.steps;
  o.resume = true;
  const exec::TrainResult resumed = train(model, p, o);
  ASSERT_EQ(resumed.first_step, half);
  ASSERT_EQ(resumed.steps.size(), std::size_t(options.steps - half));
  for (std::size_t i = 0; i < resumed.steps.size(); ++i)
    EXPECT_EQ(resumed.steps[i].loss, whole.steps[i + std::size_t(half)].loss);
  for (std::size_t r = 0; r < whole.ranks.size(); ++r)
    EXPECT_EQ(resumed.ranks[r].weights, whole.ranks[r].weights) << "rank " << r;
}

}  // namespace pw::testing
