// profile_cpu: measured per-layer times and sizes on the CPU backend (see profile.hpp).
#include "exec/profile.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <fstream>
#include <functional>
#include <memory>

#include <fmt/format.h>

#include "exec/optimizer.hpp"
#include "exec/profile_driver.hpp"
#include "exec/run_common.hpp"
#include "exec/stage_compute.hpp"

namespace pw::exec {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_of(const std::function<void()>& f) {
  const auto a = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - a).count();
}

// One single-block stage (with the embedding, the head, or neither) and the buffers to run it.
class ProfiledStage {
 public:
  ProfiledStage(const models::ModelSpec& model, bool embedding, bool head, int b,
                const models::Sharding& sharding, bool selective = false)
      : embedding_(embedding), head_(head), b_(b) {
    StageSpec spec = profiling::single_block_stage(model, embedding, head, sharding);
    spec.selective = selective;
    stage_ = make_cpu_stage(spec);
    sizes_ = stage_->sizes(b);
    const auto& z = sizes_;
    params_.resize(std::size_t(z.parameters));
    grads_.resize(params_.size());
    stash_.resize(std::size_t(z.stash));
    kept_.resize(std::size_t(z.stash_recompute));
    full_.resize(std::size_t(z.stash));
    out_.resize(std::size_t(z.output));
    din_.resize(std::size_t(z.input));
    dout_.assign(std::size_t(std::max<std::int64_t>(z.output, 1)), 1e-3f);
    input_.assign(std::size_t(z.input), 0.01f);
    work_.resize(std::size_t(z.workspace));
    scratch_.resize(std::size_t(z.scratch));
    if (sharding.t > 1 || selective) {
      // One TP rank alone: its collectives do nothing (a sum of one; a gather leaves the other
      // ranks' rows as they were, zeros or an earlier op's finite values), so only its compute
      // is timed. SP gathers into the workspace, as the executor's ranks do, and a selective
      // forward makes its attention probabilities there.
      TpComm alone;
      alone.all_reduce = alone.all_gather = alone.reduce_scatter = [](float*, std::int64_t) {};
      alone.scratch = work_.data();
      alone.scratch_floats = std::int64_t(work_.size());
      stage_->set_tp(alone);
    }
    stage_->init_parameters(params_.data(), 1);
    profiling::Batch batch = profiling::synthetic_batch(model, b);
    tokens_ = std::move(batch.tokens);
    targets_ = std::move(batch.targets);
  }
  const std::vector<float>& output() const { return out_; }
  const std::vector<float>& d_input() const { return din_; }
  // Real data in place of the constant fill: the time of the attention softmax, GELU and
  // cross-entropy depends on the values (a constant input ran about 15% faster on the CPU).
  void feed(const std::vector<float>& input) { input_.assign(input.begin(), input.end()); }
  void feed_gradient(const std::vector<float>& d_output) {
    dout_.assign(d_output.begin(), d_output.end());
  }
  // What the recompute reads: the stage input kept by a forward with recomputation.
  void keep() {
    stage_->forward(params_.data(), tok(), in(), tgt(), b_, true, kept_.data(),
                    head_ ? nullptr : out_.data(), scratch_.data());
  }
  void forward() {
    stage_->forward(params_.data(), tok(), in(), tgt(), b_, false, stash_.data(),
                    head_ ? nullptr : out_.data());
  }
  void backward() {
    stage_->backward(params_.data(), stash_.data(), head_ ? nullptr : dout_.data(), b_, 1e-3f,
                     grads_.data(), embedding_ ? nullptr : din_.data(), work_.data());
  }
  void recompute() {
    stage_->recompute(params_.data(), tok(), tgt(), b_, kept_.data(), full_.data());
  }

 private:
  const std::int32_t* tok() const { return embedding_ ? tokens_.data() : nullptr; }
  const float* in() const { return embedding_ ? nullptr : input_.data(); }
  const std::int32_t* tgt() const { return head_ ? targets_.data() : nullptr; }
  bool embedding_, head_;
  int b_;
  std::unique_ptr<StageCompute> stage_;
  StageSizes sizes_;
  std::vector<float> params_, grads_, stash_, kept_, full_, out_, din_, dout_, input_, work_,
      scratch_;
  std::vector<std::int32_t> tokens_, targets_;
};

// The lone block, embedding + block and block + head, timed round-robin on the host clock; with
// `selective` (else -1 there) the extra time of a selective block's backward over the plain one's.
std::array<profiling::StageTimes, 3> time_stages(const models::ModelSpec& model, int b, int repeats,
                                                 ProfileStatistic statistic,
                                                 const models::Sharding& sharding, bool selective,
                                                 double& selective_s) {
  ProfiledStage block(model, false, false, b, sharding), embedding(model, true, false, b, sharding),
      head(model, false, true, b, sharding);
  const auto times = profiling::time_round_robin(block, embedding, head, repeats, statistic,
                                                 [](const auto& op) { return seconds_of(op); });
  selective_s = -1;
  if (!selective) return times;
  // The same input and output gradient as the plain block (the softmax's time depends on the
  // values); pairs alternate, so a slow spell of the machine falls on both.
  ProfiledStage sel(model, false, false, b, sharding, true);
  sel.feed(embedding.output());
  sel.feed_gradient(head.d_input());
  std::vector<double> extra;
  for (int i = 0; i <= repeats; ++i) {  // the first pair warms the selective stage up
    block.forward();
    const double plain = seconds_of([&] { block.backward(); });
    sel.forward();
    const double again = seconds_of([&] { sel.backward(); });
    if (i > 0) extra.push_back(again - plain);
  }
  selective_s = std::max(0.0, profiling::summarize(extra, statistic));
  return times;
}

double optimizer_time(std::int64_t parameters, int repeats, ProfileStatistic statistic) {
  if (parameters == 0) return 0;
  std::vector<float> w(std::size_t(parameters), 0.01f), g(w.size(), 1e-3f), m(w.size()),
      v(w.size());
  TrainOptions o;
  auto update = [&] {
    optimizer_update(o, 1, w.data(), w.data(), g.data(), m.data(), v.data(), parameters);
  };
  update();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i)
    t.push_back(seconds_of(update));
  return profiling::summarize(t, statistic);
}

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "cpu";
}

}  // namespace

traces::Trace profile_cpu(const models::ModelSpec& model,
                          const std::vector<std::int64_t>& microbatch_sizes, int repeats,
                          ProfileStatistic statistic, const models::Sharding& sharding,
                          bool selective) {
  detail::keep_freed_memory();  // as in training: its buffers are reused, not mapped anew
  if (model.dtype != models::DType::fp32)
    throw InputError(fmt::format("model {}: the CPU backend runs fp32 (the model says {})",
                                 model.name, models::to_string(model.dtype)));
  const models::ModelCosts mc = models::derive_costs(model, sharding);  // checks t against it
  traces::Trace t = profiling::measured_trace(
      model, "cpu", models::DType::fp32, cpu_name(), "OpenBLAS, one thread",
      fmt::format(
          "pipewright {} profile --backend cpu{}{} ({} of {} round-robin runs)", PW_VERSION,
          sharding.t > 1 ? fmt::format(" --tp {}{}", sharding.t, sharding.sp ? " --sp" : "") : "",
          selective ? " --selective" : "", profiling::statistic_name(statistic), repeats),
      4, [&](std::int64_t parameters) { return optimizer_time(parameters, repeats, statistic); },
      sharding);
  for (std::int64_t b : profiling::distinct_sorted(microbatch_sizes)) {
    double selective_s = -1;
    const auto times =
        time_stages(model, int(b), repeats, statistic, sharding, selective, selective_s);
    t.entries.push_back(profiling::measured_entry(mc, b, times, selective_s));
  }
  return t;
}

}  // namespace pw::exec
