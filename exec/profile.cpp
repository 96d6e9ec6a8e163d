// profile_cpu: measured per-layer times and sizes on the CPU backend (see profile.hpp).
#include "exec/profile.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>

#include <fmt/format.h>

#include "exec/data.hpp"
#include "exec/optimizer.hpp"
#include "exec/stage_compute.hpp"

namespace pw::exec {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_of(const std::function<void()>& f) {
  const auto a = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - a).count();
}

double summary(std::vector<double> t, ProfileStatistic statistic) {
  if (statistic == ProfileStatistic::mean)
    return std::accumulate(t.begin(), t.end(), 0.0) / double(t.size());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Timed {
  double forward = 0, backward = 0, recompute = 0;
  StageSizes sizes;
};

// One single-block stage (with the embedding, the head, or neither) and the buffers to run it.
class ProfiledStage {
 public:
  ProfiledStage(const models::ModelSpec& model, bool embedding, bool head, int b)
      : embedding_(embedding), head_(head), b_(b) {
    StageSpec spec;
    spec.model = model;
    spec.blocks = 1;
    spec.has_embedding = embedding;
    spec.has_head = head;
    spec.first_block = head ? model.layers - 1 : 0;  // the head's stage ends the model
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
    stage_->init_parameters(params_.data(), 1);
    const int T = int(model.seq_len);
    tokens_.resize(std::size_t(b) * T);
    targets_.resize(tokens_.size());
    const TokenSource data("", model.vocab, 1);
    for (int i = 0; i < b; ++i)
      data.sample(i, T, tokens_.data() + std::size_t(i) * T, targets_.data() + std::size_t(i) * T);
  }
  const StageSizes& sizes() const { return sizes_; }
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

// The lone block, embedding + block and block + head, timed round-robin (each repeat runs every
// stage's forward, backward and recompute once), so a slow spell of the machine falls on all three
// alike and the differences (the embedding's and the head's times) stay unbiased.
std::array<Timed, 3> time_stages(const models::ModelSpec& model, int b, int repeats,
                                 ProfileStatistic statistic) {
  std::array<ProfiledStage, 3> stages = {ProfiledStage(model, false, false, b),
                                         ProfiledStage(model, true, false, b),
                                         ProfiledStage(model, false, true, b)};
  // Each stage gets what it gets in training: the activation the embedding stage sends on, the
  // gradient the head stage sends back.
  ProfiledStage &block = stages[0], &embedding = stages[1], &head = stages[2];
  embedding.forward();
  block.feed(embedding.output());
  head.feed(embedding.output());
  head.forward();
  head.backward();
  block.feed_gradient(head.d_input());
  embedding.feed_gradient(head.d_input());
  std::array<std::array<std::vector<double>, 3>, 3> t;  // [stage][forward, backward, recompute]
  for (auto& s : stages) {
    s.keep();
    s.forward();  // warm-up
    s.backward();
    s.recompute();
  }
  for (int i = 0; i < repeats; ++i)
    for (std::size_t k = 0; k < stages.size(); ++k) {
      ProfiledStage& s = stages[k];
      t[k][0].push_back(seconds_of([&] { s.forward(); }));
      t[k][1].push_back(seconds_of([&] { s.backward(); }));
      t[k][2].push_back(seconds_of([&] { s.recompute(); }));
    }
  std::array<Timed, 3> out;
  for (std::size_t k = 0; k < stages.size(); ++k)
    out[k] = {summary(t[k][0], statistic), summary(t[k][1], statistic), summary(t[k][2], statistic),
              stages[k].sizes()};
  return out;
}

traces::LayerTimes difference(const Timed& with, const Timed& block) {
  traces::LayerTimes l;
  l.forward_s = std::max(0.0, with.forward - block.forward);
  l.backward_s = std::max(0.0, with.backward - block.backward);
  l.recompute_s = std::max(0.0, with.recompute - block.recompute);
  return l;
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
  return summary(t, statistic);
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
                          ProfileStatistic statistic) {
  if (model.dtype != models::DType::fp32)
    throw InputError(fmt::format("model {}: the CPU backend runs fp32 (the model says {})",
                                 model.name, models::to_string(model.dtype)));
  const models::ModelCosts mc = models::derive_costs(model);
  traces::Trace t;
  t.model = model.name;
  t.device = "cpu";
  t.dtype = models::DType::fp32;
  t.source.kind = "measured";
  t.source.device_name = cpu_name();
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  t.source.date = date;
  t.source.driver = "OpenBLAS, one thread";
  t.source.tool =
      fmt::format("pipewright {} profile --backend cpu ({} of {} round-robin runs)", PW_VERSION,
                  statistic == ProfileStatistic::mean ? "mean" : "median", repeats);
  for (models::LayerKind k : traces::kLayerKinds) {
    t.statics[k].parameters = mc.layer(k).parameters;
    t.statics[k].parameter_bytes = 4 * mc.layer(k).parameters;
    t.statics[k].optimizer_step_s = optimizer_time(mc.layer(k).parameters, repeats, statistic);
  }
  std::vector<std::int64_t> sizes = microbatch_sizes;
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  for (std::int64_t b : sizes) {
    const auto [block, emb, head] = time_stages(model, int(b), repeats, statistic);
    traces::Entry e;
    e.microbatch_size = b;
    auto& bl = e.layers[models::LayerKind::block];
    bl.forward_s = block.forward;
    bl.backward_s = block.backward;
    bl.recompute_s = block.recompute;
    e.layers[models::LayerKind::embedding] = difference(emb, block);
    e.layers[models::LayerKind::head] = difference(head, block);
    for (models::LayerKind k : traces::kLayerKinds) {
      const auto& l = mc.layer(k);
      auto& x = e.layers[k];
      x.activation_bytes = b * l.activation_bytes;
      x.activation_recompute_bytes = b * l.activation_recompute_bytes;
      x.output_bytes = b * l.output_bytes;
      x.workspace_bytes = b * l.workspace_bytes;
    }
    t.entries.push_back(e);
  }
  return t;
}

}  // namespace pw::exec
