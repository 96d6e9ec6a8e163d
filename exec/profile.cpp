// profile_cpu: measured per-layer times and sizes on the CPU backend (see profile.hpp).
#include "exec/profile.hpp"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <fstream>
#include <functional>

#include <fmt/format.h>

#include "exec/data.hpp"
#include "exec/optimizer.hpp"
#include "exec/stage_compute.hpp"

namespace pw::exec {

namespace {

using Clock = std::chrono::steady_clock;

double median_time(int repeats, const std::function<void()>& f) {
  f();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    const auto a = Clock::now();
    f();
    t.push_back(std::chrono::duration<double>(Clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Timed {
  double forward = 0, backward = 0, recompute = 0;
  StageSizes sizes;
};

Timed time_stage(const models::ModelSpec& model, bool embedding, bool head, int b, int repeats) {
  StageSpec spec;
  spec.model = model;
  spec.blocks = 1;
  spec.has_embedding = embedding;
  spec.has_head = head;
  spec.first_block = head ? model.layers - 1 : 0;  // the head's stage ends the model
  auto stage = make_cpu_stage(spec);
  Timed t;
  t.sizes = stage->sizes(b);
  const auto& z = t.sizes;
  std::vector<float> params(std::size_t(z.parameters)), grads(params.size()),
      stash(std::size_t(z.stash)), kept(std::size_t(z.stash_recompute)), full(std::size_t(z.stash)),
      out(std::size_t(z.output)), din(std::size_t(z.input)),
      dout(std::size_t(std::max<std::int64_t>(z.output, 1)), 1e-3f),
      input(std::size_t(z.input), 0.01f), work(std::size_t(z.workspace)),
      scratch(std::size_t(z.scratch));
  stage->init_parameters(params.data(), 1);
  const int T = int(model.seq_len);
  std::vector<std::int32_t> tokens(std::size_t(b) * T), targets(tokens.size());
  const TokenSource data("", model.vocab, 1);
  for (int i = 0; i < b; ++i)
    data.sample(i, T, tokens.data() + std::size_t(i) * T, targets.data() + std::size_t(i) * T);
  const std::int32_t* tok = embedding ? tokens.data() : nullptr;
  const float* in = embedding ? nullptr : input.data();
  const std::int32_t* tgt = head ? targets.data() : nullptr;
  t.forward = median_time(repeats, [&] {
    stage->forward(params.data(), tok, in, tgt, b, false, stash.data(),
                   head ? nullptr : out.data());
  });
  t.backward = median_time(repeats, [&] {
    stage->backward(params.data(), stash.data(), head ? nullptr : dout.data(), b, 1e-3f,
                    grads.data(), embedding ? nullptr : din.data(), work.data());
  });
  stage->forward(params.data(), tok, in, tgt, b, true, kept.data(), head ? nullptr : out.data(),
                 scratch.data());
  t.recompute = median_time(
      repeats, [&] { stage->recompute(params.data(), tok, tgt, b, kept.data(), full.data()); });
  return t;
}

traces::LayerTimes difference(const Timed& with, const Timed& block) {
  traces::LayerTimes l;
  l.forward_s = std::max(0.0, with.forward - block.forward);
  l.backward_s = std::max(0.0, with.backward - block.backward);
  l.recompute_s = std::max(0.0, with.recompute - block.recompute);
  return l;
}

double optimizer_time(std::int64_t parameters, int repeats) {
  if (parameters == 0) return 0;
  std::vector<float> w(std::size_t(parameters), 0.01f), g(w.size(), 1e-3f), m(w.size()),
      v(w.size());
  TrainOptions o;
  return median_time(repeats, [&] {
    optimizer_update(o, 1, w.data(), w.data(), g.data(), m.data(), v.data(), parameters);
  });
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
                          const std::vector<std::int64_t>& microbatch_sizes, int repeats) {
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
  t.source.tool = fmt::format("pipewright {} profile --backend cpu", PW_VERSION);
  for (models::LayerKind k : traces::kLayerKinds) {
    t.statics[k].parameters = mc.layer(k).parameters;
    t.statics[k].parameter_bytes = 4 * mc.layer(k).parameters;
    t.statics[k].optimizer_step_s = optimizer_time(mc.layer(k).parameters, repeats);
  }
  std::vector<std::int64_t> sizes = microbatch_sizes;
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  for (std::int64_t b : sizes) {
    const Timed block = time_stage(model, false, false, int(b), repeats);
    const Timed emb = time_stage(model, true, false, int(b), repeats);
    const Timed head = time_stage(model, false, true, int(b), repeats);
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
