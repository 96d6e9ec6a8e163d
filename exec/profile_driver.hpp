// What the profilers of every backend share (profile_cpu, exec/cuda's profile_cuda): the
// round-robin timing of the three profiled stages, the statistic over the timed runs, and the
// trace's statics and entries built from the timed stages and the model's exact sizes. Each backend
// brings its stage and its clock.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "exec/profile.hpp"
#include "exec/stage_compute.hpp"
#include "models/model.hpp"
#include "traces/trace.hpp"

namespace pw::exec::profiling {

struct StageTimes {
  double forward_s = 0, backward_s = 0, recompute_s = 0;
};

// The median (the upper middle of an even count) or the mean of `samples` (at least one).
double summarize(std::vector<double> samples, ProfileStatistic statistic);
const char* statistic_name(ProfileStatistic statistic);  // "median", "mean"

// The microbatch sizes ascending, each once.
std::vector<std::int64_t> distinct_sorted(std::vector<std::int64_t> sizes);

// Today in UTC, ISO 8601 ("2025-01-31"): a measured trace's source.date.
std::string today_utc();

// A profiled stage: one block, with the embedding (block 0) or the head (the last block) or
// neither; with `sharding.t` > 1 TP rank 0's shard of it (the CPU stage only).
StageSpec single_block_stage(const models::ModelSpec& model, bool embedding, bool head,
                             const models::Sharding& sharding = {});

// The inputs and targets of samples 0..b-1 of the synthetic corpus (exec/data.hpp, seed 1).
struct Batch {
  std::vector<std::int32_t> tokens, targets;  // b x seq_len each
};
Batch synthetic_batch(const models::ModelSpec& model, int b);

// The lone block, embedding + block and block + head (single-block stages that each backend
// builds), timed round-robin: each repeat runs every stage's forward, backward and recompute once,
// so a slow spell of the machine falls on all three alike and the differences (the embedding's and
// the head's times) stay unbiased. Each stage first gets what it gets in training: the activation
// the embedding stage sends on, the gradient the head stage sends back. Then one warm-up of each
// op, then `repeats` timed runs, summarised by `statistic`.
//
// `Stage` has forward(), backward(), recompute(), keep() (a forward with recomputation, keeping
// what recompute() reads), output() and d_input() (what the next and the previous stage get), and
// feed(an output) and feed_gradient(a d_input). `seconds_of(op)` runs op() and returns how long it
// took on the backend's clock. Returns the block's, embedding + block's and block + head's times.
template <class Stage, class SecondsOf>
std::array<StageTimes, 3> time_round_robin(Stage& block, Stage& embedding, Stage& head, int repeats,
                                           ProfileStatistic statistic, SecondsOf&& seconds_of,
                                           double warm_up_s = 0) {
  embedding.forward();
  block.feed(embedding.output());
  head.feed(embedding.output());
  head.forward();
  head.backward();
  block.feed_gradient(head.d_input());
  embedding.feed_gradient(head.d_input());
  const std::array<Stage*, 3> stages = {&block, &embedding, &head};
  std::array<std::array<std::vector<double>, 3>, 3> t;  // [stage][forward, backward, recompute]
  for (Stage* s : stages)
    s->keep();
  double warmed = 0;
  for (int round = 0; round < 200 && (round == 0 || warmed < warm_up_s); ++round)
    for (Stage* s : stages) {
      warmed += seconds_of([&] { s->forward(); });
      warmed += seconds_of([&] { s->backward(); });
      warmed += seconds_of([&] { s->recompute(); });
    }
  for (int i = 0; i < repeats; ++i)
    for (std::size_t k = 0; k < stages.size(); ++k) {
      Stage& s = *stages[k];
      t[k][0].push_back(seconds_of([&] { s.forward(); }));
      t[k][1].push_back(seconds_of([&] { s.backward(); }));
      t[k][2].push_back(seconds_of([&] { s.recompute(); }));
    }
  std::array<StageTimes, 3> out;
  for (std::size_t k = 0; k < stages.size(); ++k)
    out[k] = {summarize(t[k][0], statistic), summarize(t[k][1], statistic),
              summarize(t[k][2], statistic)};
  return out;
}

// A measured trace's header and statics: model, device, dtype, source (kind "measured", today's
// date), its sharding (one GPU of a TP group of that shape) and, per layer kind, its parameters
// on one GPU, their bytes at `bytes_per_parameter` and `optimizer_step_s(parameters)` (called
// embedding, block, head, in that order).
traces::Trace measured_trace(const models::ModelSpec& model, const std::string& device,
                             models::DType dtype, const std::string& device_name,
                             const std::string& driver, const std::string& tool,
                             int bytes_per_parameter,
                             const std::function<double(std::int64_t)>& optimizer_step_s,
                             const models::Sharding& sharding = {});

// The entry for microbatch size b from the timed stages (time_round_robin's order): the block's
// times as measured, the embedding's and the head's as the differences with the lone block (never
// below 0); memory fields b x the per-sample sizes of `costs` (derive_costs of the model in the
// backend's compute dtype), which are the backend stages' exact sizes. backward_input_s and
// backward_weight_s are not separated (0). `selective_s` >= 0: a selective block's extra backward
// time was measured (the block's selective_recompute_s; activation_selective_bytes the stages'
// selective stash); < 0: nothing dropped, nothing re-run.
traces::Entry measured_entry(const models::ModelCosts& costs, std::int64_t b,
                             const std::array<StageTimes, 3>& timed, double selective_s = -1);

}  // namespace pw::exec::profiling
